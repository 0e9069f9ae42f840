"""Plain decoding in the shared loop: HF parity, batches, buckets, sampling, sharding, and input errors."""

from __future__ import annotations

import sys

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

import jaxspec
from tests import hf_models

loop = sys.modules["jaxspec.generate"]

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25]]


def left_padded(rows, pad=0):
    width = max(map(len, rows))
    ids = np.full((len(rows), width), pad, np.int64)
    mask = np.zeros((len(rows), width), np.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row):] = row
        mask[i, width - len(row):] = 1
    return ids, mask


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return jaxspec.load(tiny_llama_dir)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_batch_equals_transformers(tmp_path, family):
    folder = hf_models.save_tiny(family, tmp_path, seed=7)
    ids, mask = left_padded(PROMPTS)
    expected = hf_models.load_hf(folder).generate(
        torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=40, do_sample=False
    ).numpy()
    out = jaxspec.generate(jaxspec.load(folder), ids, mask, max_new_tokens=40)
    np.testing.assert_array_equal(out.sequences, expected)
    assert out.sequences.dtype == np.int32


def test_eos_ends_a_row_and_pads_after_it(llama):
    ids, mask = left_padded(PROMPTS)
    free = jaxspec.generate(llama, ids, mask, max_new_tokens=30, eos_token_id=[])
    eos = int(free.sequences[1, ids.shape[1] + 4])  # make row 1's fifth new token the EOS
    out = jaxspec.generate(llama, ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    first_eos = [int(np.argmax(row[ids.shape[1]:] == eos)) for row in free.sequences]
    for row in range(len(PROMPTS)):
        stop = first_eos[row] + 1 if eos in free.sequences[row, ids.shape[1]:] else 30
        assert out.num_new_tokens[row] == stop
        np.testing.assert_array_equal(out.sequences[row, ids.shape[1]:][:stop], free.sequences[row, ids.shape[1]:][:stop])
        assert (out.sequences[row, ids.shape[1] + stop:] == 0).all()


def test_counters_of_plain_decoding(llama):
    out = jaxspec.generate(llama, [[5, 6, 7]], max_new_tokens=12, eos_token_id=[])
    assert out.target_forwards == 12  # one prefill + one forward per further token
    assert out.num_new_tokens.tolist() == [12]
    assert out.draft_forwards == 0


def test_same_bucket_does_not_retrace(llama):
    jaxspec.generate(llama, [[5, 6, 7, 8, 9]], max_new_tokens=8)
    before = loop.trace_count()
    jaxspec.generate(llama, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], max_new_tokens=8)
    jaxspec.generate(llama, [[9, 8]], max_new_tokens=8, seed=3)
    assert loop.trace_count() == before
    jaxspec.generate(llama, [list(range(1, 40))], max_new_tokens=8)  # a longer bucket compiles once more
    assert loop.trace_count() == before + 1


def test_ragged_list_equals_padded_batch(llama):
    ids, mask = left_padded(PROMPTS)
    padded = jaxspec.generate(llama, ids, mask, max_new_tokens=10)
    ragged = jaxspec.generate(llama, PROMPTS, max_new_tokens=10)
    np.testing.assert_array_equal(ragged.sequences, padded.sequences)


# -- sampling ---------------------------------------------------------------------------------------------------


def test_sampling_is_reproducible_for_a_seed(llama):
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=1.3, top_p=0.9)
    a = jaxspec.generate(llama, PROMPTS, seed=11, **kwargs).sequences
    b = jaxspec.generate(llama, PROMPTS, seed=11, **kwargs).sequences
    c = jaxspec.generate(llama, PROMPTS, seed=12, **kwargs).sequences
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_top_k_one_is_greedy(llama):
    greedy = jaxspec.generate(llama, PROMPTS, max_new_tokens=20).sequences
    sampled = jaxspec.generate(llama, PROMPTS, max_new_tokens=20, do_sample=True, top_k=1, temperature=2.0, seed=5)
    np.testing.assert_array_equal(sampled.sequences, greedy)


# -- several devices --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, 4), (2, 2)])
def test_sharded_equals_single_device(llama, shape):
    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("data", "model"))
    prompts = PROMPTS + [[7, 7, 7, 1]]
    single = jaxspec.generate(llama, prompts, max_new_tokens=24)
    sharded = jaxspec.generate(llama, prompts, max_new_tokens=24, mesh=mesh)
    np.testing.assert_array_equal(sharded.sequences, single.sequences)
    sampled_single = jaxspec.generate(llama, prompts, max_new_tokens=24, do_sample=True, seed=2)
    sampled_sharded = jaxspec.generate(llama, prompts, max_new_tokens=24, do_sample=True, seed=2, mesh=mesh)
    np.testing.assert_array_equal(sampled_sharded.sequences, sampled_single.sequences)


# -- bad input: one clear error each, before anything compiles ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=[[]]), "row 0 is empty"),
        (dict(input_ids=np.zeros((1, 0), np.int32)), "row 0 is empty"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=300), "exceeds the model's max_position_embeddings"),
        (dict(input_ids=[[5, 999]]), "outside the vocabulary"),
        (dict(attention_mask=[[1, 0, 1]]), "padding between real tokens"),
        (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in"),
        (dict(do_sample=True, top_k=0), "top_k must be >= 1"),
    ],
)
def test_bad_input_raises_before_compiling(llama, kwargs, message):
    call = dict(input_ids=[[5, 6, 7]], max_new_tokens=8) | kwargs
    before = loop.trace_count()
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(llama, call.pop("input_ids"), **call)
    assert loop.trace_count() == before
