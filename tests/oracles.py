"""Oracles shared by the strategy tests: exact output distributions and per-round replays, from transformers.

- `exact_marginals`: the exact law of each of the first generated tokens under sampling, by enumerating every
  prefix with the PyTorch model (a tiny vocabulary makes that cheap). End-to-end sampling tests compare what a
  strategy produced against it over the whole vocabulary.
- `replay_rounds`: jaxspec's round structure (the prefill makes the first token, then each round drafts, verifies
  and commits) driven by transformers' models and candidate generators, greedy. It yields each round's accepted
  count, so a test can check what a strategy did, not only what it output: a drafter that ignored its assistant
  would give the same greedy text but other counts.
"""

from __future__ import annotations

import numpy as np
import torch
from scipy import stats


@torch.no_grad()
def exact_marginals(model, prompt: list[int], positions: int, temperature: float = 1.0,
                    processors=None) -> np.ndarray:
    """[positions, V]: P(the i-th new token = v) when sampling from softmax(logits / temperature), no other warper,
    or from `processors` (a transformers LogitsProcessorList, applied to every prefix, warpers included) when given.

    `model`: a transformers model, or a function from a batch of equal-length token lists to last-position logits.
    """
    last_logits = model if callable(model) and not isinstance(model, torch.nn.Module) else (
        lambda batch: model(torch.tensor(batch)).logits[:, -1].numpy())
    marginals, prefix_probs = [], np.ones(1)
    prefixes = [tuple()]
    for _ in range(positions):
        batch = [prompt + list(p) for p in prefixes]
        logits = np.asarray(last_logits(batch), np.float32)
        if processors is not None:
            logits = processors(torch.tensor(batch), torch.tensor(logits)).numpy()
        logits = logits.astype(np.float64) / (1.0 if processors is not None else temperature)
        conditional = np.exp(logits - logits.max(-1, keepdims=True))  # removed tokens: exp(-inf) = 0
        conditional /= conditional.sum(-1, keepdims=True)  # [prefixes, V]
        joint = prefix_probs[:, None] * conditional
        marginals.append(joint.sum(0))
        prefixes = [p + (v,) for p in prefixes for v in range(conditional.shape[-1])]
        prefix_probs = joint.reshape(-1)
    return np.array(marginals)


def goodness_of_fit(tokens: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Chi-square p-value of `tokens` against the exact law `probs` [V]. Cells whose expected count is below
    `min_expected` are merged into one (decided by the exact law, not by the data)."""
    counts = np.bincount(tokens, minlength=len(probs)).astype(float)
    expected = probs * len(tokens)
    big = expected >= min_expected
    observed_cells = np.append(counts[big], counts[~big].sum())
    expected_cells = np.append(expected[big], expected[~big].sum())
    keep = expected_cells > 0
    assert observed_cells[~keep].sum() == 0, "a token with probability 0 was produced"
    return float(stats.chisquare(observed_cells[keep], expected_cells[keep]).pvalue)


@torch.no_grad()
def _argmax(hf_model, sequence: list[int]) -> np.ndarray:
    """Greedy choice after every position of `sequence`: [len(sequence)]."""
    return hf_model(torch.tensor([sequence])).logits[0].argmax(-1).numpy()


def replay_rounds(hf_target, draft_fn, prompt: list[int], max_new_tokens: int, eos: int | None = None) -> list[int]:
    """Accepted drafts per round (jaxspec's structure, greedy), with `draft_fn(sequence, room) -> list[int]` the
    oracle's drafts for a round that may propose at most `room` tokens."""
    sequence = prompt + [int(_argmax(hf_target, prompt)[-1])]
    accepted = []
    while len(sequence) - len(prompt) < max_new_tokens and sequence[-1] != eos:
        room = max_new_tokens - (len(sequence) - len(prompt)) - 1
        drafts = draft_fn(sequence, room)[:room]
        choice = _argmax(hf_target, sequence + drafts)[len(sequence) - 1:]
        n = next((i for i, (d, c) in enumerate(zip(drafts, choice)) if d != c), len(drafts))
        new = drafts[:n] + [int(choice[n])]
        if eos in new:
            new = new[: new.index(eos) + 1]
        sequence += new[: max_new_tokens - (len(sequence) - len(prompt))]
        accepted.append(n)
    return accepted


def assistant_drafts(hf_assistant, k: int):
    """The assistant's greedy drafts, K per round (constant schedule, no confidence stop)."""

    @torch.no_grad()
    def draft(sequence, room):
        out = hf_assistant.generate(torch.tensor([sequence]), max_new_tokens=max(min(k, room), 1), do_sample=False)
        return out[0, len(sequence):].tolist() if room > 0 else []

    return draft


def early_exit_drafts(hf_model, exit_layer: int, k: int):
    """HF's early-exit drafts: lm_head(final_norm(hidden state after layer E)), greedy, K per round."""

    @torch.no_grad()
    def draft(sequence, room):
        drafts = []
        for _ in range(min(k, room)):
            hidden = hf_model(torch.tensor([sequence + drafts]), output_hidden_states=True).hidden_states[exit_layer]
            logits = hf_model.lm_head(hf_model.model.norm(hidden[:, -1]))
            drafts.append(int(logits.argmax(-1)))
        return drafts

    return draft


def prompt_lookup_drafts(k: int, ngram: int):
    """transformers' own PromptLookupCandidateGenerator (its constant K)."""
    from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

    generator = PromptLookupCandidateGenerator(num_output_tokens=k, max_matching_ngram_size=ngram, max_length=10_000)

    def draft(sequence, room):
        out, _ = generator.get_candidates(torch.tensor([sequence]))
        return out[0, len(sequence):].tolist()

    return draft


def histogram(accepted: list[int], k: int) -> list[int]:
    return np.bincount(np.array(accepted, int), minlength=k + 1).tolist()
