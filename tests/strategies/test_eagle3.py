"""EAGLE-3 drafting in the compiled loop: greedy output equals plain greedy (ragged batches too), every round's
draft distribution equals SpecForge's reference head recomputed from scratch over the committed sequence (so the
head's cache, its rollback and the feature taps are right after accepted and rejected drafts alike), and sampling is
exact by chi-square, with a lossy-q negative control through the same check."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.strategies import eagle3 as eagle3_strategy
from tests.fixtures import eagle3 as eagle3_fixtures
from tests.fixtures import hf_models, oracles
from tests.fixtures.patching import patched

PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4], [20, 21, 22]]
LAYERS = eagle3_fixtures.HEAD["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
# A high temperature flattens the target's and the random head's distributions, so that drafts are often accepted
# (acceptance is 1 - TV(p, q)) and rounds after accepted drafts are common.
TEMPERATURE = 3.0


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    """The tiny Llama target and a random head that shares its embedding, with their transformers/SpecForge twins
    (the reference head holds the target's table, as SpecForge's `load_embedding` puts it there)."""
    hf_target = hf_models.load_hf(tiny_llama_dir)
    reference = eagle3_fixtures.reference(seed=3)
    with torch.no_grad():
        reference.embed_tokens.weight.copy_(hf_target.model.embed_tokens.weight)
    folder = eagle3_fixtures.save(reference, tmp_path_factory.mktemp("eagle3"))
    return jaxspec.load(tiny_llama_dir), jaxspec.load(folder), hf_target, reference


@pytest.mark.parametrize("schedule", [pytest.param("adaptive", marks=pytest.mark.slow), "constant"])
def test_greedy_equals_plain_greedy_and_rows_alone(pair, schedule):
    target, head, *_ = pair
    plain = jaxspec.generate(target, PROMPTS, max_new_tokens=20, eos_token_id=[])
    out = jaxspec.generate(target, PROMPTS, max_new_tokens=20, eos_token_id=[], assistant_model=head,
                           num_assistant_tokens=3, num_assistant_tokens_schedule=schedule)
    assert out.strategy == "eagle3"
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert (out.drafted > 0).all() or schedule == "adaptive"
    if schedule == "adaptive":  # the slow variant also runs a row alone
        alone = jaxspec.generate(target, PROMPTS[1:2], max_new_tokens=20, eos_token_id=[], assistant_model=head,
                                 num_assistant_tokens=3, num_assistant_tokens_schedule=schedule)
        np.testing.assert_array_equal(alone.sequences[0], out.sequences[1, -alone.sequences.shape[1]:])  # left-padded


@torch.no_grad()
def _reference_q(hf_target, reference, sequence: list[int], drafts: list[int]) -> np.ndarray:
    """SpecForge's head over `sequence` (the committed tokens) from scratch: the target's hidden states at the head's
    layers, then len(drafts) chained steps reading the drafts, -> q [len(drafts), V] at TEMPERATURE over the
    target's vocabulary (zero outside the draft vocabulary)."""
    states = hf_target(torch.tensor([sequence]), output_hidden_states=True).hidden_states
    features = torch.cat([states[layer + 1][:, :-1] for layer in LAYERS], dim=-1)  # entries 0 .. L-2
    tokens = torch.tensor([sequence + drafts[:-1]])
    steps = eagle3_fixtures.chained_logits(reference, features, tokens, len(drafts))
    ids = (torch.arange(reference.draft_vocab_size) + reference.d2t).numpy()
    q = np.zeros((len(drafts), hf_target.config.vocab_size))
    for i, logits in enumerate(steps):
        q[i, ids] = torch.softmax(logits[0, -1] / TEMPERATURE, -1).numpy()
    return q


def test_every_round_drafts_what_the_reference_drafts_from_scratch(pair):
    """Sampled, ragged batch: each round's q equals the reference head's distribution recomputed from the committed
    sequence alone, in rounds after accepted drafts (the cache rolled back) and after rejections."""
    target, head, hf_target, reference = pair
    rounds = []

    def record(tokens, lengths, drafts, count, probs):
        rounds.append((np.array(tokens), np.array(lengths), np.array(drafts), np.array(count), np.array(probs)))

    real_draft = eagle3_strategy.Eagle3Drafter.draft

    def draft(self, ctx, loop_state, state, rng):
        step = real_draft(self, ctx, loop_state, state, rng)
        jax.debug.callback(record, loop_state.tokens, loop_state.lengths, step.draft.tokens, step.draft.count,
                           step.draft.probs, ordered=True)
        return step

    with patched(eagle3_strategy.Eagle3Drafter, jax_caches=False, draft=draft):
        out = jaxspec.generate(target, PROMPTS, max_new_tokens=16, eos_token_id=[], assistant_model=head,
                               do_sample=True, temperature=TEMPERATURE, top_k=0, seed=4, num_assistant_tokens=3,
                               num_assistant_tokens_schedule="constant")
    jax.effects_barrier()
    assert out.accepted_hist[:, 1:].sum() >= 5, out.accepted_hist  # rounds after accepted drafts are checked too
    checked = 0
    for tokens, lengths, drafts, count, probs in rounds:
        for row in range(len(PROMPTS)):
            if count[row] == 0:
                continue
            n = int(count[row])
            expected = _reference_q(hf_target, reference, tokens[row, : lengths[row]].tolist(),
                                    drafts[row, :n].tolist())
            np.testing.assert_allclose(probs[row, :n], expected, atol=2e-5)
            checked += 1
    assert checked >= 15


def _sampled_first_tokens(target, head, rows: int):
    prompt = PROMPTS[2]
    out = jaxspec.generate(target, [prompt] * rows, max_new_tokens=4, do_sample=True, temperature=TEMPERATURE,
                           top_k=0, seed=11, eos_token_id=[], assistant_model=head, num_assistant_tokens=3,
                           num_assistant_tokens_schedule="constant")
    return out, out.sequences[:, len(prompt):]


@pytest.mark.slow  # ~22 s; the default suite checks every round's q against the reference head instead
def test_sampling_is_exact_and_a_lossy_q_is_caught(pair):
    """4000 rows: the first three tokens follow the target's processed law. The control takes q at temperature 1
    (the head's raw distribution, not the processed one it drew from) and must fail the same check."""
    target, head, hf_target, _ = pair
    exact = oracles.exact_marginals(hf_target, PROMPTS[2], positions=3, temperature=TEMPERATURE)
    out, new = _sampled_first_tokens(target, head, 4000)
    multi = int(out.accepted_hist[:, 2:].sum())
    assert multi > 300, f"only {multi} rounds accepted two or more drafts"
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i

    def raw_q(processed):
        return jax.nn.softmax(processed * TEMPERATURE, axis=-1)

    with patched(eagle3_strategy, draft_distribution=raw_q):
        _, lossy = _sampled_first_tokens(target, head, 4000)
    p_values = [oracles.goodness_of_fit(lossy[:, i], exact[i]) for i in range(3)]
    assert min(p_values) < 1e-6, p_values


def test_a_head_for_another_target_is_refused_before_compiling(pair, tmp_path):
    target, *_ = pair
    wide = eagle3_fixtures.reference({"hidden_size": 48, "num_attention_heads": 4, "head_dim": 12}, seed=1)
    head = jaxspec.load(eagle3_fixtures.save(wide, tmp_path))
    with pytest.raises(ValueError, match="fc reads target hidden states of width 48, but the target.s hidden_size "
                                         "is 32"):
        jaxspec.generate(target, PROMPTS[:1], max_new_tokens=4, assistant_model=head)
