"""The CPU verify head (jaxspec/head.py): a contiguous copy of the head in the other layout ([D, V] of a tied head,
[V, D] of an untied one), made once per model, that every verifying forward uses; outputs stay transformers' and
plain greedy's."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import Mesh

import jaxspec
from jaxspec import costs
from jaxspec.head import COLUMNS, ROWS, HeadRows, verify_heads
from tests import hf_models

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25, 20, 21, 22]]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    folder = hf_models.save_tiny("llama", tmp_path_factory.mktemp("tied"), seed=3, tie_word_embeddings=True)
    return folder, jaxspec.load(folder)


def test_the_copy_is_the_transposed_head_made_once(tied, tiny_llama_dir):
    _, model = tied
    embed = model.module.embed[...]
    state = nnx.state(model.module)
    assert verify_heads(model, state, None) == (None, None)  # no layout asked for: the model's own head
    assert verify_heads(model, state, None, ROWS) == (None, None)  # a tied head is stored [V, D] already
    one, block = verify_heads(model, state, None, COLUMNS)
    assert one is block and block.shape == embed.shape[::-1]  # a [D, V] copy serves every width
    np.testing.assert_array_equal(np.asarray(block), np.asarray(embed).T)
    assert verify_heads(model, state, None, COLUMNS)[1] is block  # cached on the model
    untied = jaxspec.load(tiny_llama_dir)
    state = nnx.state(untied.module)
    assert verify_heads(untied, state, None, COLUMNS) == (None, None)  # an untied head is stored [D, V] already
    one, block = verify_heads(untied, state, None, ROWS)
    assert one is None and isinstance(block, HeadRows)  # one position keeps the [D, V] head it reads fastest
    np.testing.assert_array_equal(np.asarray(block.rows), np.asarray(untied.module.lm_head[...]).T)
    with pytest.raises(ValueError, match="layout 'dvd' is not one of"):
        verify_heads(untied, state, None, "dvd")


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
    assert model.head_cache is not None  # the default layout on CPU: a [D, V] copy
    for strategy in (dict(prompt_lookup_num_tokens=4), dict(assistant_early_exit=2, num_assistant_tokens=3)):
        out = jaxspec.generate(model, ids, mask, max_new_tokens=32, **strategy)
        np.testing.assert_array_equal(out.sequences, expected)


def test_sharded_tied_model_equals_single_device(tied):
    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    _, model = tied
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    single = jaxspec.generate(model, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3)
    sharded = jaxspec.generate(model, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3, mesh=mesh)
    np.testing.assert_array_equal(sharded.sequences, single.sequences)


def test_an_untied_model_verifying_with_a_row_copy_decodes_as_transformers_does(tiny_llama_dir, tmp_path,
                                                                                 monkeypatch):
    """Where the measured costs say a [V, D] copy verifies faster, generate uses it, and nothing else changes."""
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measure")
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setattr(costs, "time_forwards", lambda model, widths, heads=None: {
        w: (8.0 if heads is not None and isinstance(heads[1], HeadRows) else 10.0) * (1 + w) for w in widths})
    model = jaxspec.load(tiny_llama_dir)
    width = max(map(len, PROMPTS))
    ids = np.array([[0] * (width - len(p)) + p for p in PROMPTS])
    mask = (np.arange(width)[None] >= width - np.array([len(p) for p in PROMPTS])[:, None]).astype(np.int64)
    expected = hf_models.load_hf(tiny_llama_dir).generate(torch.tensor(ids), attention_mask=torch.tensor(mask),
                                                          max_new_tokens=24, do_sample=False).numpy()
    out = jaxspec.generate(model, ids, mask, max_new_tokens=24, prompt_lookup_num_tokens=4)
    np.testing.assert_array_equal(out.sequences, expected)
    assert isinstance(model.head_cache[2], HeadRows)
