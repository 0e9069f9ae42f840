"""Speculative decoding with an assistant model: greedy invariance, HF parity, extremes, exact sampling."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import jaxspec
from tests import hf_models
from tests.test_generate import PROMPTS, left_padded

N = 40


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return jaxspec.load(tiny_llama_dir)


@pytest.fixture(scope="module")
def draft(tiny_llama_draft_dir):
    return jaxspec.load(tiny_llama_draft_dir)


@pytest.fixture(scope="module")
def plain(target):
    ids, mask = left_padded(PROMPTS)
    return jaxspec.generate(target, ids, mask, max_new_tokens=N).sequences


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("schedule, threshold", [("constant", 0.0), ("constant", 0.4), ("heuristic", 0.0),
                                                 ("heuristic_transient", 0.4)])
def test_greedy_equals_plain_greedy(target, draft, plain, k, schedule, threshold):
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=draft, num_assistant_tokens=k,
                           num_assistant_tokens_schedule=schedule, assistant_confidence_threshold=threshold)
    np.testing.assert_array_equal(out.sequences, plain)
    assert out.drafted.sum() > 0


@pytest.mark.parametrize("k, schedule, threshold", [(3, "constant", 0.0), (5, "constant", 0.4),
                                                    (2, "heuristic_transient", 0.0)])
def test_greedy_equals_transformers_assisted_generate(tiny_llama_dir, tiny_llama_draft_dir, target, draft, k,
                                                      schedule, threshold):
    hf_target, hf_draft = hf_models.load_hf(tiny_llama_dir), hf_models.load_hf(tiny_llama_draft_dir)
    hf_draft.generation_config.num_assistant_tokens = k
    hf_draft.generation_config.num_assistant_tokens_schedule = schedule
    hf_draft.generation_config.assistant_confidence_threshold = threshold
    for prompt in PROMPTS:
        expected = hf_target.generate(torch.tensor([prompt]), assistant_model=hf_draft, max_new_tokens=N,
                                      do_sample=False).numpy()
        out = jaxspec.generate(target, [prompt], max_new_tokens=N, assistant_model=draft, num_assistant_tokens=k,
                               num_assistant_tokens_schedule=schedule, assistant_confidence_threshold=threshold)
        np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)


def test_settings_come_from_the_assistant_generation_config(tiny_llama_draft_dir, target, plain):
    draft = jaxspec.load(tiny_llama_draft_dir)
    draft.generation_config.update(num_assistant_tokens=3, assistant_confidence_threshold=0.0)
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=draft)
    assert out.accepted_hist.shape[1] == 4  # K = 3 from the assistant's generation_config
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=draft, num_assistant_tokens=5)
    assert out.accepted_hist.shape[1] == 6  # an argument passed to generate wins
    np.testing.assert_array_equal(out.sequences, plain)


@pytest.mark.parametrize("k", [1, 4])
def test_identical_assistant_accepts_every_draft(target, k):
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=target, num_assistant_tokens=k,
                           assistant_confidence_threshold=0.0, eos_token_id=[])
    plain = jaxspec.generate(target, ids, mask, max_new_tokens=N, eos_token_id=[])
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert (out.accepted == out.drafted).all()
    # One prefill makes the first token; each round then commits K drafts + 1 bonus token.
    assert out.target_forwards == 1 + math.ceil((N - 1) / (k + 1))


def test_always_wrong_assistant_accepts_nothing(tiny_llama_dir, target, plain):
    wrong = jaxspec.load(tiny_llama_dir)
    wrong.module.lm_head[...] = -wrong.module.lm_head[...]  # drafts the target's least likely token
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=wrong, num_assistant_tokens=4,
                           assistant_confidence_threshold=0.0)
    np.testing.assert_array_equal(out.sequences, plain)
    assert out.accepted.sum() == 0 and out.drafted.sum() > 0


def test_heuristic_schedule_persists_on_the_assistant(tiny_llama_dir, target):
    same = jaxspec.load(tiny_llama_dir)
    jaxspec.generate(target, [[5, 6, 7]], max_new_tokens=20, assistant_model=same, num_assistant_tokens=2,
                     num_assistant_tokens_schedule="heuristic", assistant_confidence_threshold=0.0, eos_token_id=[])
    assert same.generation_config["num_assistant_tokens"] > 2  # grew, as HF's "heuristic" does across calls


def test_first_two_tokens_follow_plain_sampling(target, draft):
    """End to end: the joint law of the first two sampled tokens equals the target's (chi-square, fixed seed)."""
    from scipy import stats

    rows = 3000
    prompts = [[5, 6, 7, 8]] * rows
    # With 3 new tokens the prefill samples the first and one verified round (one draft) gives the second.
    kwargs = dict(max_new_tokens=3, do_sample=True, temperature=1.5, eos_token_id=[])
    plain = jaxspec.generate(target, prompts, seed=1, **kwargs).sequences[:, 4:6]
    spec = jaxspec.generate(target, prompts, seed=2, assistant_model=draft, num_assistant_tokens=2,
                            assistant_confidence_threshold=0.0, **kwargs)
    assert spec.drafted.sum() > 0 and spec.accepted.sum() > 0
    first_two = spec.sequences[:, 4:6]
    pairs_plain = plain[:, 0] * 128 + plain[:, 1]
    pairs_spec = first_two[:, 0] * 128 + first_two[:, 1]
    cells, counts = np.unique(np.concatenate([pairs_plain, pairs_spec]), return_counts=True)
    common = cells[counts >= 20]  # pool rare cells so the chi-square approximation holds
    table = np.array([[np.sum(p == c) for c in common] + [np.sum(~np.isin(p, common))]
                      for p in (pairs_plain, pairs_spec)])
    table = table[:, table.sum(0) > 0]
    assert stats.chi2_contingency(table).pvalue > 0.001


# -- errors ---------------------------------------------------------------------------------------------------


def test_vocabulary_mismatch_points_to_universal_decoding(tmp_path, target):
    other = jaxspec.load(hf_models.save_tiny("llama", tmp_path, seed=2, vocab_size=100))
    with pytest.raises(ValueError, match="universal assisted decoding"):
        jaxspec.generate(target, [[5, 6]], max_new_tokens=4, assistant_model=other)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_assistant_tokens=0), "num_assistant_tokens must be an integer >= 1"),
    (dict(num_assistant_tokens_schedule="fast"), "Unknown num_assistant_tokens_schedule 'fast'"),
    (dict(assistant_ensemble_weight=1.0), "None for standard"),
    (dict(assistant_ensemble_weight=0.0), "open interval"),
    (dict(assistant_confidence_threshold=1.5), "assistant_confidence_threshold"),
])
def test_bad_settings(target, draft, kwargs, message):
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(target, [[5, 6]], max_new_tokens=4, assistant_model=draft, **kwargs)


def test_ensemble_greedy_runs_and_sampling_ensemble_runs(target, draft):
    out = jaxspec.generate(target, PROMPTS, max_new_tokens=16, assistant_model=draft, num_assistant_tokens=3,
                           assistant_confidence_threshold=0.0, assistant_ensemble_weight=0.7)
    assert out.num_new_tokens.tolist() == [16, 16, 16] or (out.num_new_tokens <= 16).all()
    out = jaxspec.generate(target, PROMPTS, max_new_tokens=16, assistant_model=draft, num_assistant_tokens=3,
                           assistant_confidence_threshold=0.0, assistant_ensemble_weight=0.7, do_sample=True)
    assert out.accepted.sum() > 0
