"""Logits processing against HF's own processors and warpers, per verify position, and exactness of the sampler.

The oracle is transformers' `LogitsProcessor` classes applied to each position's own prefix, which is what HF's
assisted loop does one position at a time; jaxspec processes a whole verify block at once.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

from jaxspec import settings as settings_lib
from jaxspec.processors import History, process
from jaxspec.sampling import sample

V = 40


class _Model:
    """Just what settings.resolve reads."""

    class config:
        vocab_size = V
        eos_token_id = (2,)
        pad_token_id = 0

    generation_config: dict = {}


def processing(**kwargs):
    resolved = settings_lib.resolve(_Model(), max_new_tokens=8, **kwargs)
    return resolved, jax.tree.map(jnp.asarray, resolved.processing(V))


def hf_processors(resolved, prompt_length: int):
    """The list HF's `_get_logits_processor` builds for these settings, in its order."""
    out = []
    if resolved.repetition_penalty != 1.0:
        out.append(hf.RepetitionPenaltyLogitsProcessor(resolved.repetition_penalty))
    if resolved.no_repeat_ngram_size:
        out.append(hf.NoRepeatNGramLogitsProcessor(resolved.no_repeat_ngram_size))
    if resolved.bad_words_ids:
        out.append(hf.NoBadWordsLogitsProcessor([list(s) for s in resolved.bad_words_ids], eos_token_id=2))
    if resolved.min_new_tokens:
        out.append(hf.MinNewTokensLengthLogitsProcessor(prompt_length, resolved.min_new_tokens, 2))
    if resolved.suppress_tokens:
        out.append(hf.SuppressTokensLogitsProcessor(list(resolved.suppress_tokens)))
    if resolved.do_sample:
        if resolved.temperature != 1.0:
            out.append(hf.TemperatureLogitsWarper(resolved.temperature))
        if resolved.top_k:
            out.append(hf.TopKLogitsWarper(resolved.top_k))
        if resolved.top_p < 1.0:
            out.append(hf.TopPLogitsWarper(resolved.top_p))
        if resolved.min_p:
            out.append(hf.MinPLogitsWarper(resolved.min_p))
    return hf.LogitsProcessorList(out)


CASES = [
    dict(do_sample=True, temperature=0.7, top_k=0),
    dict(do_sample=True, top_k=3),
    dict(do_sample=True, temperature=1.3, top_k=0, top_p=0.8),
    dict(do_sample=True, temperature=0.5, top_k=20, top_p=0.9, min_p=0.05),
    dict(do_sample=True, top_k=0, min_p=0.2),
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7, do_sample=True, temperature=0.9),
    dict(no_repeat_ngram_size=2),
    dict(no_repeat_ngram_size=3, repetition_penalty=1.2),
    dict(bad_words_ids=[[5], [7, 9], [3, 4, 6]]),
    dict(min_new_tokens=4),
    dict(suppress_tokens=[1, 11, 12]),
    dict(no_repeat_ngram_size=6),  # past the default n-gram slots: a wider static table
]


@pytest.mark.parametrize("kwargs", CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()))
def test_every_block_position_is_processed_like_hf_with_its_own_prefix(kwargs):
    """Batch of 2 rows with different prompt and committed lengths, a block of W = 5 positions with drafts written
    after the committed tokens: position j must equal HF's processors applied to the prefix of length start + j."""
    resolved, p = processing(**kwargs)
    rng = np.random.RandomState(0)
    size, width = 48, 5
    # Few distinct tokens, so n-grams, bad-word prefixes and repeated tokens really occur.
    tokens = rng.randint(3, 12, size=(2, size)).astype(np.int32)
    tokens[0, 10:13] = [7, 9, 7]
    start = np.array([20, 13], np.int32)  # committed lengths; the block's drafts sit at start .. start + W - 2
    prompts = np.array([9, 12], np.int32)
    logits = (rng.randn(2, width, V) * 3).astype(np.float32)
    logits[:, :, 5] = 4.0  # a tie-prone, positive, often-banned token
    history = History(tokens=jnp.asarray(tokens), start=jnp.asarray(start), prompt_lengths=jnp.asarray(prompts))
    got = np.asarray(process(jnp.asarray(logits), history, p, resolved.do_sample, resolved.ngram_slots))
    for b in range(2):
        for j in range(width):
            prefix = torch.tensor(tokens[b, : start[b] + j][None].astype(np.int64))
            expected = hf_processors(resolved, int(prompts[b]))(prefix, torch.tensor(logits[b, j][None]))[0].numpy()
            np.testing.assert_array_equal(np.isinf(got[b, j]), np.isinf(expected), err_msg=f"row {b} position {j}")
            finite = ~np.isinf(expected)
            np.testing.assert_allclose(got[b, j][finite], expected[finite], rtol=1e-5, err_msg=f"row {b} pos {j}")


def test_a_broken_history_fails_the_same_check():
    """Negative control: processing every position with the block's first prefix (ignoring the drafts before it)
    differs from HF, so the test above would catch a verifier that did so."""
    resolved, p = processing(repetition_penalty=1.5)
    tokens = np.arange(3, 3 + 30, dtype=np.int32)[None] % V  # all distinct: each draft is new to the prefix
    logits = np.ones((1, 4, V), np.float32)
    stale = History(tokens=jnp.asarray(tokens), start=jnp.asarray([10]), prompt_lengths=jnp.asarray([5]))
    got = np.asarray(process(jnp.asarray(logits), stale, p, False, resolved.ngram_slots))
    first_prefix_only = np.asarray(process(jnp.asarray(logits[:, :1]), stale, p, False, resolved.ngram_slots))
    assert (got[0, 3] != first_prefix_only[0, 0]).any()


def empirical(tokens: np.ndarray, vocab: int) -> np.ndarray:
    return np.bincount(tokens.ravel(), minlength=vocab) / tokens.size


def test_sampled_distribution_matches_processed_softmax():
    resolved, p = processing(do_sample=True, temperature=0.8, top_k=4, top_p=0.9)
    logits = jnp.zeros((1, 1, V)).at[0, 0, :6].set(jnp.asarray([2.0, 1.0, 0.5, 0.0, -1.0, 1.5]))
    history = History(tokens=jnp.zeros((1, 8), jnp.int32), start=jnp.asarray([4]), prompt_lengths=jnp.asarray([4]))
    processed = process(logits, history, p, True, resolved.ngram_slots)[0, 0]
    draws = jax.vmap(lambda key: sample(key, processed))(jax.random.split(jax.random.key(0), 100_000))
    target = np.asarray(jax.nn.softmax(processed, -1))
    tv = 0.5 * np.abs(empirical(np.asarray(draws), V) - target).sum()
    assert tv < 0.01, tv
    assert set(np.unique(np.asarray(draws))) <= set(np.flatnonzero(target > 0))
