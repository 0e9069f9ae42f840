"""Attention reads only the cache prefix that holds live keys (`jaxspec.models.layers.attend_live`): the same
attention as over the whole cache, and decoding across prefix boundaries equals transformers."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec import loop
from jaxspec.models import layers as L
from tests.fixtures import hf_models
from tests.fixtures.patching import drop_compiled


def test_key_extents_double_from_the_minimum_to_the_cache_size():
    assert L.key_extents(1024) == (1024,)  # one row: shorter than PREFIX_FROM, read whole
    assert L.key_extents(2048) == (512, 1024, 2048)
    assert L.key_extents(2560) == (512, 1024, 2048, 2560)
    assert L.key_extents(2048, batch=3) == L.key_extents(2048)


def test_a_batch_chooses_shorter_prefixes_in_shorter_caches():
    """Four rows or more: prefixes from 128 entries once the cache holds 8192 entries over the rows, and at least
    512."""
    assert L.key_extents(1024, batch=4) == (1024,)
    assert L.key_extents(2048, batch=4) == (128, 256, 512, 1024, 2048)
    assert L.key_extents(512, batch=8) == (512,)
    assert L.key_extents(1024, batch=8) == (128, 256, 512, 1024)
    assert L.key_extents(512, batch=16) == (128, 256, 512)
    assert L.key_extents(256, batch=64) == (256,)


@pytest.fixture
def small_prefixes(monkeypatch):
    """One row's prefixes from 128 entries in caches from 256: tiny models exercise the switch at sizes that run
    fast."""
    monkeypatch.setattr(L, "PREFIX_FROM", 256)
    monkeypatch.setattr(L, "MIN_KEY_EXTENT", 128)


@pytest.fixture
def fresh_executables():
    """Compiled loops are dropped before and after, so no executable crosses a change of the prefixes."""
    drop_compiled()
    yield
    drop_compiled()


ATTENTIONS = {
    "causal": (L.cached_attention, ()),
    "from position 3": (L.cached_attention_window, (3,)),
    "window 40, soft-capped": (L.windowed_attention, (40, 5.0)),
}


@pytest.mark.parametrize("name", list(ATTENTIONS))
@pytest.mark.parametrize("last", [[9, 100], [120, 200], [300, 599], [599, 700]], ids=lambda p: f"to{max(p)}")
def test_attention_over_the_live_prefix_equals_attention_over_the_whole_cache(small_prefixes, name, last):
    """Rows at different positions, three queries each, a stacked cache read at a layer and a single one; the last
    case has a padding row past the cache (its writes are dropped), which takes the whole cache."""
    attend, args = ATTENTIONS[name]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 3, 4, 8))  # [B, T, H, Dh]
    k_cache = jax.random.normal(keys[1], (2, 2, 2, 600, 8))  # [L, B, K, S, Dh]
    v_cache = jax.random.normal(keys[2], (2, 2, 2, 600, 8))
    positions = jnp.asarray(last)[:, None] + jnp.arange(-2, 1)[None, :]  # [B, T]
    expected = attend(q, k_cache[1], v_cache[1], positions, 0.3, *args)
    stacked = jax.jit(functools.partial(L.attend_live, attend, layer=1))(q, k_cache, v_cache, positions, 0.3, *args)
    single = jax.jit(functools.partial(L.attend_live, attend))(q, k_cache[1], v_cache[1], positions, 0.3, *args)
    np.testing.assert_allclose(stacked, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(single, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("last, extent", [(100, 128), (128, 128), (129, 256), (300, 512)])
def test_entries_past_the_chosen_prefix_are_not_read(small_prefixes, last, extent):
    """NaNs past the prefix would poison attention over the whole cache (masked weights are 0, and 0 * NaN is NaN);
    attention over the prefix never sees them."""
    keys = jax.random.split(jax.random.key(1), 3)
    q = jax.random.normal(keys[0], (1, 2, 4, 8))
    k_cache = jax.random.normal(keys[1], (1, 2, 600, 8)).at[:, :, extent:].set(jnp.nan)  # [B, K, S, Dh]
    v_cache = jax.random.normal(keys[2], (1, 2, 600, 8)).at[:, :, extent:].set(jnp.nan)
    positions = jnp.asarray([[last - 2, last - 1]])
    assert np.isnan(L.cached_attention(q, k_cache, v_cache, positions, 0.3)).all()
    out = jax.jit(functools.partial(L.attend_live, L.cached_attention))(q, k_cache, v_cache, positions, 0.3)
    expected = L.cached_attention(q, k_cache[:, :, :extent], v_cache[:, :, :extent], positions, 0.3)
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-6)


def ragged(rows):
    width = max(map(len, rows))
    ids = np.zeros((len(rows), width), np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):], mask[i, width - len(row):] = row, 1
    return ids, mask


@pytest.mark.parametrize("family", [pytest.param("llama", marks=pytest.mark.slow), "gemma3_text"])
def test_decoding_across_prefix_boundaries_equals_transformers(fresh_executables, tmp_path, family):
    """Sixteen rows (four prompts, each four times) decode from 100, 20, 60 and 5 tokens to 260 positions in a
    512-entry cache, which a batch of sixteen reads in prefixes at the users' settings: attention moves from a 128-
    to a 256- to a 512-entry prefix; a sliding-window family checks windowed layers too. Prompt lookup equals plain
    greedy."""
    assert L.key_extents(512, batch=16) == (128, 256, 512)
    save = hf_models.save_tiny_gemma if family.startswith("gemma") else hf_models.save_tiny
    folder = save(family, tmp_path, seed=5, max_position_embeddings=1024)
    ids, mask = ragged([[3 + (11 * i) % 90 for i in range(100)], list(range(30, 50)),
                        [7 + (13 * i) % 80 for i in range(60)], [9, 8, 7, 6, 5]] * 4)
    expected = hf_models.load_hf(folder).generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                                  max_new_tokens=160, do_sample=False).numpy()
    model = jaxspec.load(folder)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=160)
    np.testing.assert_array_equal(out.sequences, expected)
    (rounds,) = loop.compiled("rounds")
    assert re.search(r"f32\[16,\d+,128,\d+\]", rounds.as_text())  # the rows' keys or values, 128 entries of them
    lookup = jaxspec.generate(model, ids, mask, max_new_tokens=160, prompt_lookup_num_tokens=4)
    np.testing.assert_array_equal(lookup.sequences, expected)
