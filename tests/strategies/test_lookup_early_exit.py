"""Prompt lookup and early exit: the same match as HF, greedy invariance, exact sampling, shared-cache exit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

import jaxspec
from jaxspec.strategies.prompt_lookup import find_continuation
from tests.fixtures import hf_models, oracles
from tests.fixtures.patching import patched
from tests.fixtures.prompts import left_padded

REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4], [20, 21, 22, 23, 24, 20, 21]]
N = 40


def jax_candidates(sequence, k, ngram, eos=None):
    tokens = jnp.asarray(sequence + [0] * 8, jnp.int32)
    start, found = find_continuation(tokens, jnp.int32(len(sequence)), ngram)
    if not bool(found):
        return []
    out = sequence[int(start): int(start) + k]
    if eos is not None and eos in out:
        out = out[: out.index(eos)]
    return out


def hf_candidates(sequence, k, ngram, eos=None):
    generator = PromptLookupCandidateGenerator(
        eos_token_id=torch.tensor([eos]) if eos is not None else None, num_output_tokens=k,
        max_matching_ngram_size=ngram, max_length=100)
    ids = torch.tensor([sequence])
    out, _ = generator.get_candidates(ids)
    return out[0, len(sequence):].tolist()


@pytest.mark.parametrize("sequence, k, ngram, eos", [
    ([1, 2, 3, 4, 1, 2, 5, 6, 1, 2], 3, 2, None),  # leftmost match wins
    ([7, 2, 9, 8, 1, 2, 6, 5, 8, 1, 2], 3, 3, None),  # a larger n-gram wins
    ([1, 2, 3, 1, 2], 10, 2, None),  # truncated at the end of the sequence
    ([4, 1, 2, 3, 9, 5, 1, 2], 4, 2, 9),  # never proposes the EOS
    ([4, 1, 2, 9, 3, 5, 1, 2], 4, 2, 9),  # continuation starting with EOS: nothing, no fallback
    ([5, 6, 7, 8], 3, 2, None),  # no match
    ([3, 3, 3, 3], 2, 2, None),  # overlapping matches
    ([8, 1, 8, 2, 8], 2, 1, None),  # unigram
])
def test_prompt_lookup_picks_the_same_match_as_transformers(sequence, k, ngram, eos):
    assert jax_candidates(sequence, k, ngram, eos) == hf_candidates(sequence, k, ngram, eos)


def test_prompt_lookup_random_sequences_match_transformers():
    rng = np.random.RandomState(0)
    for _ in range(200):
        sequence = rng.randint(0, 4, rng.randint(2, 14)).tolist()
        k, ngram = int(rng.randint(1, 5)), int(rng.randint(1, 4))
        assert jax_candidates(sequence, k, ngram) == hf_candidates(sequence, k, ngram), (sequence, k, ngram)


@pytest.mark.parametrize("kwargs", [
    dict(prompt_lookup_num_tokens=3),
    pytest.param(dict(prompt_lookup_num_tokens=6, max_matching_ngram_size=3, num_assistant_tokens_schedule="constant"),
                 marks=pytest.mark.slow),
    pytest.param(dict(assistant_early_exit=2, num_assistant_tokens=4, assistant_confidence_threshold=0.0),
                 marks=pytest.mark.slow),
    # the default suite has E=3; a constant schedule, as transformers', since the adaptive one would probe these
    # random drafts in the shadow and verify none
    pytest.param(dict(assistant_early_exit=1, num_assistant_tokens_schedule="constant"), marks=pytest.mark.slow),
    dict(assistant_early_exit=3, num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic",
         assistant_confidence_threshold=0.0),
])
def test_greedy_equals_plain_greedy_and_transformers(tiny_llama_dir, target, kwargs):
    ids, mask = left_padded(REPETITIVE)
    plain = jaxspec.generate(target, ids, mask, max_new_tokens=N)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, **kwargs)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.drafted.sum() > 0
    hf = hf_models.load_hf(tiny_llama_dir)
    hf_kwargs = {name: value for name, value in kwargs.items() if name != "num_assistant_tokens_schedule"}
    for name in ("num_assistant_tokens", "assistant_confidence_threshold"):
        if name in hf_kwargs:  # HF reads these from the model's generation_config only
            setattr(hf.generation_config, name, hf_kwargs.pop(name))
    if kwargs.get("num_assistant_tokens_schedule", "constant") != "constant" and "assistant_early_exit" in kwargs:
        hf.generation_config.num_assistant_tokens_schedule = kwargs["num_assistant_tokens_schedule"]
    row = REPETITIVE[0]
    expected = hf.generate(torch.tensor([row]), max_new_tokens=N, do_sample=False, **hf_kwargs).numpy()
    single = jaxspec.generate(target, [row], max_new_tokens=N, **kwargs)
    np.testing.assert_array_equal(single.sequences[:, : expected.shape[1]], expected)


@pytest.mark.parametrize("strategy", ["prompt_lookup", pytest.param("early_exit", marks=pytest.mark.slow)])
def test_rounds_equal_a_replay_with_transformers(tiny_llama_dir, target, strategy):
    """Each round's accepted count equals what HF's own candidate generator (prompt lookup) or HF's early-exit
    drafts (layers [0, E), final norm, LM head) and HF's target give from the same committed sequence."""
    hf = hf_models.load_hf(tiny_llama_dir)
    k = 4
    if strategy == "prompt_lookup":
        drafts = oracles.prompt_lookup_drafts(k, 2)
        kwargs = dict(prompt_lookup_num_tokens=k, num_assistant_tokens_schedule="constant")
    else:
        drafts = oracles.early_exit_drafts(hf, 2, k)
        kwargs = dict(assistant_early_exit=2, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
    for prompt in REPETITIVE:
        accepted = oracles.replay_rounds(hf, drafts, prompt, N, eos=2)
        out = jaxspec.generate(target, [prompt], max_new_tokens=N, **kwargs)
        assert out.target_forwards == 1 + len(accepted)
        assert out.accepted_hist.sum(0).tolist() == oracles.histogram(accepted, k)
        assert out.drafted.sum() > 0


def test_prompt_lookup_backs_off_where_nothing_copies(target):
    """Adaptive: after repeated misses a row stops proposing; HF's constant K keeps proposing."""
    prompt = [[3 + (5 * i) % 120 for i in range(60)]]  # every token recurs, so lookups always find a match
    constant = jaxspec.generate(target, prompt, max_new_tokens=N, prompt_lookup_num_tokens=8,
                                num_assistant_tokens_schedule="constant", eos_token_id=[])
    adaptive = jaxspec.generate(target, prompt, max_new_tokens=N, prompt_lookup_num_tokens=8, eos_token_id=[])
    np.testing.assert_array_equal(adaptive.sequences, constant.sequences)
    assert constant.acceptance_rate < 0.2  # the random model does not copy its prompt
    assert adaptive.drafted.sum() < constant.drafted.sum() / 4


# Slow: a knob for accelerator A/Bs, not the users' default (docs/design.md, 'On a GPU'). The default suite decodes
# at the ends in most modules (tests/conftest.py), against plain greedy; this compares the two rules directly.
@pytest.mark.slow
def test_verify_widths_at_the_ends_decode_the_same_tokens(target):
    """JAXSPEC_VERIFY_WIDTHS=ends, an A/B for accelerators: blocks of 1 and K + 1 only, from a loop that compiled
    those two, and the same greedy tokens as the default widths (1, the powers of two, K + 1)."""
    from jaxspec import loop, schedule

    widths, sequences = {}, {}
    for rule in schedule.WIDTH_RULES:
        with patched(schedule, jax_caches=False, WIDTH_RULE=rule):
            out = jaxspec.generate(target, REPETITIVE, max_new_tokens=N, prompt_lookup_num_tokens=10, eos_token_id=[])
            (widths[rule],) = [key[0].verify_widths for key in loop._compiled if key[1] == "rounds"]
        sequences[rule] = out.sequences
        assert out.drafted.sum() > 0
    assert widths == {"powers": (1, 2, 4, 8, 11), "ends": (1, 11)}
    np.testing.assert_array_equal(sequences["ends"], sequences["powers"])


def test_min_matching_ngram_size_ignores_shorter_matches(target):
    """A sequence whose last token recurs but whose last two tokens never do has a 1-gram match only: with
    min_matching_ngram_size=2 it proposes nothing. On a prompt where single tokens recur and pairs do not, fewer
    drafts are proposed; the output stays plain greedy either way, and the CLI takes the option from the table."""
    tokens = jnp.asarray([5, 9, 7, 5, 0, 0], jnp.int32)
    assert bool(find_continuation(tokens, jnp.int32(4), 2)[1])
    assert not bool(find_continuation(tokens, jnp.int32(4), 2, 2)[1])
    assert int(find_continuation(jnp.asarray([7, 5, 9, 7, 5, 0], jnp.int32), jnp.int32(5), 2, 2)[0]) == 2
    prompt = [list(range(3, 33)) + list(range(31, 2, -1))]  # every token recurs, no pair of tokens does
    kwargs = dict(max_new_tokens=N, prompt_lookup_num_tokens=4, num_assistant_tokens_schedule="constant",
                  eos_token_id=[])
    any_match = jaxspec.generate(target, prompt, **kwargs)
    pairs_only = jaxspec.generate(target, prompt, min_matching_ngram_size=2, **kwargs)
    np.testing.assert_array_equal(pairs_only.sequences, any_match.sequences)
    assert any_match.drafted.sum() > 0 and pairs_only.drafted.sum() < any_match.drafted.sum()
    from jaxspec.cli import generate as cli

    args = cli.parse_args(["--strategy", "prompt_lookup", "--min-matching-ngram-size", "2"])
    assert cli.drafting_config(args).min_matching_ngram_size == 2


def test_early_exit_over_a_zeroed_last_layer_accepts_everything(tiny_llama_dir):
    model = jaxspec.load(tiny_llama_dir)
    last = model.config.num_layers - 1
    for name in ("wo", "w_down"):  # the last layer adds nothing to the residual stream
        param = getattr(model.module.layers[last], name)
        param[...] = jaxspec.layout.logical(param[...]) * 0.0  # the array, whatever its CPU layout
    out = jaxspec.generate(model, REPETITIVE, max_new_tokens=N, assistant_early_exit=last, num_assistant_tokens=4,
                           assistant_confidence_threshold=0.0, eos_token_id=[])
    assert (out.accepted == out.drafted).all() and out.drafted.sum() > 0
    plain = jaxspec.generate(model, REPETITIVE, max_new_tokens=N, eos_token_id=[])
    np.testing.assert_array_equal(out.sequences, plain.sequences)


# Prompt lookup's one-hot verification is sampled in the default suite by tests/e2e/test_ecosystem.py (with processors,
# and accepted multi-draft rounds).
@pytest.mark.parametrize("strategy", [pytest.param("prompt_lookup", marks=pytest.mark.slow), "early_exit"])
def test_sampling_is_exact(tiny_llama_dir, target, tmp_path, strategy):
    """End to end, 6000 rows, budget K + 2: the first three sampled tokens follow the target's exact law over the
    whole vocabulary, in runs where many rounds accept two drafts or more.

    Early exit: the target's first 2 layers draft, temperature 1 (smallest TV bias caught with power 0.9 at alpha
    1e-3, `oracles.detectable_tv`: 5.6%, 6.0%, 6.0%). Prompt lookup: a copy is accepted only where the target
    predicts what the prompt holds, which a tiny random model with attention never does; so the target is the same
    model without attention (`oracles.without_attention`, a bigram model), the prompt holds its likeliest
    continuation after each of the 20 tokens it most often samples first (`oracles.copyable_prompt`), and the
    temperature is 0.5 (smallest TV bias caught: 4.1%, 5.0%, 5.6%)."""
    k, rows = 3, 6000
    hf_target = hf_models.load_hf(tiny_llama_dir)
    if strategy == "prompt_lookup":
        hf_target = oracles.without_attention(hf_target)
        hf_target.save_pretrained(tmp_path)
        target = jaxspec.load(str(tmp_path))
        prompt, temperature = oracles.copyable_prompt(hf_target, last=9, top=20), 0.5
        kwargs = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=1, num_assistant_tokens_schedule="constant")
    else:
        prompt, temperature = [5, 6, 7], 1.0
        kwargs = dict(assistant_early_exit=2, num_assistant_tokens=k, num_assistant_tokens_schedule="constant",
                      assistant_confidence_threshold=0.0)
    exact = oracles.exact_marginals(hf_target, prompt, positions=3, temperature=temperature)
    out = jaxspec.generate(target, [prompt] * rows, max_new_tokens=k + 2, do_sample=True, temperature=temperature,
                           top_k=0, seed=5, eos_token_id=[], **kwargs)
    assert out.drafted.sum() >= 0.9 * rows * k  # most rows really draft
    multi = int(out.accepted_hist[:, 2:].sum())
    assert multi >= rows // 4, f"only {multi} rounds accepted two drafts or more, in {rows} rows"
    new = out.sequences[:, len(prompt):]
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(prompt_lookup_num_tokens=0), ValueError, "prompt_lookup_num_tokens must be an integer >= 1"),
    (dict(prompt_lookup_num_tokens=3, assistant_ensemble_weight=0.5), ValueError,
     "assistant_ensemble_weight is not used by the prompt_lookup strategy"),
    (dict(prompt_lookup_num_tokens=3, assistant_confidence_threshold=0.5), ValueError,
     "assistant_confidence_threshold is not used by the prompt_lookup strategy"),
    (dict(prompt_lookup_num_tokens=3, max_assistant_tokens=8), ValueError, "max_assistant_tokens is not used"),
    (dict(prompt_lookup_num_tokens=3, num_assistant_tokens_schedule="heuristic"), ValueError,
     "Unknown num_assistant_tokens_schedule 'heuristic' for prompt lookup"),
    (dict(assistant_early_exit=0), ValueError, r"assistant_early_exit must be a layer count in 1\.\.3"),
    (dict(assistant_early_exit=4), ValueError, r"1\.\.3"),
    (dict(assistant_early_exit=2, prompt_lookup_num_tokens=2), ValueError, "Choose one"),
    (dict(assistant_early_exit=2, max_matching_ngram_size=2), ValueError, "max_matching_ngram_size is not used"),
    (dict(prompt_lookup_num_tokens=3, min_matching_ngram_size=3), ValueError,
     r"min_matching_ngram_size \(3\) exceeds max_matching_ngram_size \(2\)"),
    (dict(prompt_lookup_num_tokens=3, min_matching_ngram_size=0), ValueError,
     "min_matching_ngram_size must be an integer >= 1"),
])
def test_bad_settings(target, kwargs, error, message):
    with pytest.raises(error, match=message):
        jaxspec.generate(target, [[5, 6]], max_new_tokens=4, **kwargs)
