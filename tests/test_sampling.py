"""Logits processing against HF's own warpers, and exactness of the sampler on a tiny vocabulary."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from jaxspec.sampling import SamplingParams, process_logits, sample

V = 6


def hf_process(logits: np.ndarray, temperature, top_k, top_p) -> np.ndarray:
    scores = torch.tensor(logits)
    ids = torch.zeros((logits.shape[0], 1), dtype=torch.long)
    if temperature != 1.0:
        scores = TemperatureLogitsWarper(temperature)(ids, scores)
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(ids, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(ids, scores)
    return scores.numpy()


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.7, None, None), (1.0, 3, None), (1.3, None, 0.8),
                                                       (0.5, 20, 0.9), (1.0, 1, 0.5), (2.0, 50, 0.3)])
def test_processing_equals_hf_warpers(temperature, top_k, top_p):
    logits = np.random.RandomState(0).randn(16, 100).astype(np.float32) * 3
    logits[0, :10] = 1.0  # ties at the k-th value are kept by both
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    got = np.asarray(process_logits(jnp.asarray(logits), params))
    expected = hf_process(logits, temperature, top_k, top_p)
    np.testing.assert_array_equal(np.isinf(got), np.isinf(expected))
    np.testing.assert_allclose(got[~np.isinf(got)], expected[~np.isinf(expected)], rtol=1e-6)


def empirical(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(tokens.ravel(), minlength=vocab) / tokens.size


def test_sampled_distribution_matches_processed_softmax():
    logits = jnp.asarray([[2.0, 1.0, 0.5, 0.0, -1.0, 1.5]])
    params = SamplingParams(do_sample=True, temperature=0.8, top_k=4, top_p=0.9)
    processed = process_logits(logits, params)
    draws = jax.vmap(lambda key: sample(key, processed))(jax.random.split(jax.random.key(0), 100_000))
    target = np.asarray(jax.nn.softmax(processed, -1))[0]
    tv = 0.5 * np.abs(empirical(np.asarray(draws), V) - target).sum()
    assert tv < 0.01, tv
    assert set(np.unique(np.asarray(draws))) <= set(np.flatnonzero(target > 0))


def test_top_k_never_emits_outside_the_k_best():
    logits = jax.random.normal(jax.random.key(1), (64, 50)) * 2
    params = SamplingParams(do_sample=True, temperature=1.5, top_k=5)
    draws = jax.vmap(lambda key: sample(key, process_logits(logits, params)))(jax.random.split(jax.random.key(2), 200))
    best = np.argsort(-np.asarray(logits), axis=-1)[:, :5]
    for row in range(64):
        assert set(np.asarray(draws)[:, row]) <= set(best[row])
