"""Logits parity with transformers' PyTorch models (float32), and conversion errors that name the tensor."""

from __future__ import annotations

import json
import os
import shutil

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.convert.rules import CheckpointMismatch
from tests.fixtures import hf_models

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}

CASES = {
    "llama-gqa-untied": ("llama", {}),
    "llama-mha-tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "llama-llama3-rope": ("llama", dict(rope_parameters=LLAMA3_ROPE)),
    "llama-attention-bias": ("llama", dict(attention_bias=True)),
    "llama-head-dim": ("llama", dict(head_dim=16)),
    "qwen2-gqa-bias": ("qwen2", {}),
    "qwen2-tied": ("qwen2", dict(tie_word_embeddings=True, num_key_value_heads=1)),
}


def jax_logits(model: jaxspec.Model, ids: np.ndarray) -> np.ndarray:
    batch, length = ids.shape
    positions = jnp.broadcast_to(jnp.arange(length), (batch, length))
    logits, _, _ = model.module(jnp.asarray(ids), positions, model.module.init_cache(batch, length))
    return np.asarray(logits)


def hf_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    family, overrides = CASES[case]
    folder = hf_models.save_tiny(family, tmp_path, seed=3, **overrides)
    ids = np.random.RandomState(0).randint(0, 128, (2, 48))
    expected = hf_logits(hf_models.load_hf(folder), ids)
    got = jax_logits(jaxspec.load(folder), ids)
    np.testing.assert_allclose(got, expected, atol=2e-4, rtol=1e-4)


def test_gguf_logits_match_transformers(tmp_path):
    from tests.fixtures.gguf import write_gguf

    model = hf_models.build_tiny("llama", seed=4, vocab_size=64, num_hidden_layers=2, hidden_size=32,
                                 num_attention_heads=4, num_key_value_heads=2)
    path = os.path.join(tmp_path, "tiny.gguf")
    write_gguf(model, path)
    ids = np.random.RandomState(1).randint(0, 64, (2, 20))
    got = jax_logits(jaxspec.load(path), ids)
    np.testing.assert_allclose(got, hf_logits(model, ids), atol=2e-4, rtol=1e-4)


def test_sharded_safetensors_index_loads(tmp_path):
    model = hf_models.build_tiny("llama", seed=5)
    model.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    ids = np.random.RandomState(2).randint(0, 128, (1, 12))
    np.testing.assert_allclose(jax_logits(jaxspec.load(tmp_path), ids), hf_logits(model, ids), atol=2e-4)


# -- errors, each naming what is wrong -------------------------------------------------------------------------


def test_missing_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        jaxspec.load(tmp_path)


def test_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        jaxspec.load(tmp_path / "nothing-here")


def test_unknown_model_type(tmp_path, tiny_llama_dir):
    shutil.copytree(tiny_llama_dir, tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["model_type"] = "mamba"
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unknown model_type 'mamba'"):
        jaxspec.load(tmp_path / "m")


def _rewrite_tensors(src: str, dst, edit) -> None:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    save_file(edit(tensors), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path, tiny_llama_dir):
    name = "model.layers.1.self_attn.k_proj.weight"
    _rewrite_tensors(tiny_llama_dir, tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointMismatch, match=name.replace(".", r"\.")):
        jaxspec.load(tmp_path / "m")


def test_extra_tensor_is_named(tmp_path, tiny_llama_dir):
    _rewrite_tensors(tiny_llama_dir, tmp_path / "m", lambda t: t | {"model.surprise.weight": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointMismatch, match=r"model\.surprise\.weight"):
        jaxspec.load(tmp_path / "m")


def test_misshaped_tensor_is_named(tmp_path, tiny_llama_dir):
    name = "model.layers.0.mlp.up_proj.weight"
    _rewrite_tensors(tiny_llama_dir, tmp_path / "m", lambda t: t | {name: t[name][:10]})
    with pytest.raises(CheckpointMismatch, match=r"mis-shaped.*up_proj"):
        jaxspec.load(tmp_path / "m")
