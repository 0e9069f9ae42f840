"""The CPU verify head (jaxspec/head.py): a contiguous [D, V] copy of a tied head, made once per model, that every
verifying forward uses; outputs stay transformers' and plain greedy's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh

import jaxspec
from jaxspec.head import verify_head
from tests.fixtures import hf_models

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25, 20, 21, 22]]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    folder = hf_models.save_tiny("llama", tmp_path_factory.mktemp("tied"), seed=3, tie_word_embeddings=True)
    return folder, jaxspec.load(folder)


def test_the_copy_is_the_transposed_embedding_made_once(tied, tiny_llama_dir):
    _, model = tied
    embed = model.module.embed[...]
    state = nnx.state(model.module)
    head = verify_head(model, state, None)
    assert head.shape == embed.shape[::-1]
    np.testing.assert_array_equal(np.asarray(head), np.asarray(embed).T)
    assert verify_head(model, state, None) is head  # cached on the model
    untied = jaxspec.load(tiny_llama_dir)
    assert verify_head(untied, nnx.state(untied.module), None) is None  # an untied head is stored [D, V] already


def test_a_tied_model_decodes_as_transformers_does_and_uses_the_copy(tied):
    folder, _ = tied
    model = jaxspec.load(folder)
    width = max(map(len, PROMPTS))
    ids = np.array([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (np.arange(width)[None] >= width - np.array([len(p) for p in PROMPTS])[:, None]).astype(np.int64)
    expected = hf_models.load_hf(folder).generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                                  max_new_tokens=32, do_sample=False).numpy()
    plain = jaxspec.generate(model, ids, mask, max_new_tokens=32)
    np.testing.assert_array_equal(plain.sequences, expected)
    assert model.head_cache is not None
    for strategy in (dict(prompt_lookup_num_tokens=4), dict(assistant_early_exit=2, num_assistant_tokens=3)):
        out = jaxspec.generate(model, ids, mask, max_new_tokens=32, **strategy)
        np.testing.assert_array_equal(out.sequences, expected)
    # The copy is what the target's forwards read: negated, it makes each chosen token the argmin of the logits
    # (had generate made a fresh copy instead, the output would still be transformers').
    source, mesh, copy = model.head_cache
    model.head_cache = (source, mesh, -copy)
    try:
        poisoned = jaxspec.generate(model, ids, mask, max_new_tokens=32, prompt_lookup_num_tokens=4)
    finally:
        model.head_cache = (source, mesh, copy)
    assert not np.array_equal(poisoned.sequences, expected)


def test_sharded_tied_model_equals_single_device(tied):
    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    _, model = tied
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    single = jaxspec.generate(model, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3)
    sharded = jaxspec.generate(model, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3, mesh=mesh)
    np.testing.assert_array_equal(sharded.sequences, single.sequences)
