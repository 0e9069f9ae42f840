"""Dense Qwen3 (`model_type: "qwen3"`) against transformers' Qwen3ForCausalLM: logits, greedy decoding, drafters.

Qwen3 runs in the Llama family module; what it adds is an RMSNorm over each query and key head before RoPE and an
explicit head_dim. The tiny models here set head_dim=16 while hidden_size / num_heads = 8, so a module that derived
the head width from the model width, or skipped the per-head norms (their weights are random here), would fail.
"""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

import jaxspec
from jaxspec.convert.rules import CheckpointMismatch
from jaxspec.registry import FAMILIES
from tests.fixtures import hf_models
from tests.fixtures.prompts import left_padded
from tests.models.test_models import hf_logits, jax_logits

QWEN3 = dict(head_dim=16)  # hidden_size 32 / 4 heads = 8: the explicit head width differs from the derived one
# A smaller assistant with the target's vocabulary: 2 layers, half the width, its own head width.
ASSISTANT = dict(num_hidden_layers=2, hidden_size=16, intermediate_size=32, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=8)
# Prompts with repeated n-grams, so prompt lookup finds continuations to draft.
REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4], [20, 21, 22, 23, 24, 20, 21]]
N = 8


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The target (untied head) and a smaller, differently seeded assistant, as folders, jaxspec and HF models."""
    target_dir = hf_models.save_tiny("qwen3", tmp_path_factory.mktemp("qwen3"), seed=11, **QWEN3)
    assistant_dir = hf_models.save_tiny("qwen3", tmp_path_factory.mktemp("qwen3_assistant"), seed=12, **ASSISTANT)
    return SimpleNamespace(target_dir=target_dir, target=jaxspec.load(target_dir), hf_target=hf_models.load_hf(target_dir),
                           assistant=jaxspec.load(assistant_dir))


def test_config_reads_qwen3(pair):
    cfg = pair.target.module.cfg
    assert (cfg.model_type, cfg.head_dim, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias) == ("qwen3", 16, True, False, False)
    assert FAMILIES["qwen3"] is FAMILIES["llama"]
    # HF's Qwen3Config defaults head_dim to 128, not hidden_size / num_heads, where config.json lacks it
    hf = transformers.Qwen3Config(**hf_models.BASE).to_dict()
    del hf["head_dim"]
    assert FAMILIES["qwen3"].config_from_hf(hf).head_dim == transformers.Qwen3Config().head_dim == 128


def test_logits_match_transformers_untied(pair):
    ids = np.random.RandomState(0).randint(0, 128, (2, 48))
    np.testing.assert_allclose(jax_logits(pair.target, ids), hf_logits(pair.hf_target, ids), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("overrides", [
    pytest.param(dict(tie_word_embeddings=True, num_key_value_heads=1), id="tied-mqa"),
    pytest.param(dict(attention_bias=True), id="attention-bias"),  # q/k/v and o biases, all four
    # Layers 2 and 3 attend to the last 4 positions only; the 48-token sequence really drops keys there.
    pytest.param(dict(use_sliding_window=True, sliding_window=4, max_window_layers=2), id="sliding-window"),
])
def test_logits_match_transformers(tmp_path, overrides):
    folder = hf_models.save_tiny("qwen3", tmp_path, seed=13, **QWEN3, **overrides)
    ids = np.random.RandomState(1).randint(0, 128, (2, 48))
    model = jaxspec.load(folder)
    if overrides.get("tie_word_embeddings"):
        assert "lm_head" not in vars(model.module)
    if overrides.get("use_sliding_window"):
        assert (model.module.cfg.sliding_window, model.module.cfg.sliding_layers) == (4, (2, 3))
    np.testing.assert_allclose(jax_logits(model, ids), hf_logits(hf_models.load_hf(folder), ids), atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def plain(pair):
    """Plain greedy decoding of the ragged batch REPETITIVE: what every drafter must reproduce."""
    return jaxspec.generate(pair.target, REPETITIVE, max_new_tokens=N)


def test_greedy_ragged_batch_equals_transformers(pair, plain):
    ids, mask = left_padded(REPETITIVE)  # HF pads on the left; jaxspec returns the same layout
    expected = pair.hf_target.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=N,
                                       do_sample=False).numpy()
    np.testing.assert_array_equal(plain.sequences, expected)
    np.testing.assert_array_equal(jaxspec.generate(pair.target, ids, mask, max_new_tokens=N).sequences, expected)


@pytest.mark.parametrize("strategy", ["assistant_model", "prompt_lookup", "early_exit"])
def test_every_drafter_equals_plain_greedy(pair, plain, strategy):
    kwargs = {
        # threshold 0: a random model is rarely confident, and the default 0.4 would stop most drafts at once; a
        # constant schedule: the adaptive one would probe a random drafter in the shadow, verifying none of its drafts
        "assistant_model": dict(assistant_model=pair.assistant, num_assistant_tokens=3,
                                assistant_confidence_threshold=0.0, num_assistant_tokens_schedule="constant"),
        "prompt_lookup": dict(prompt_lookup_num_tokens=3),
        "early_exit": dict(assistant_early_exit=2, num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                           num_assistant_tokens_schedule="constant"),
    }[strategy]
    out = jaxspec.generate(pair.target, REPETITIVE, max_new_tokens=N, **kwargs)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.drafted.sum() > 0, strategy  # the drafter really ran (plain decoding drafts nothing)


def _without(src: str, dst, name: str) -> None:
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(dst, "model.safetensors"))
    assert name in tensors
    save_file({k: v for k, v in tensors.items() if k != name}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})


def test_missing_q_norm_is_named(pair, tmp_path):
    name = "model.layers.1.self_attn.q_norm.weight"
    _without(pair.target_dir, tmp_path / "m", name)
    with pytest.raises(CheckpointMismatch, match=r"missing tensors.*" + name.replace(".", r"\.")):
        jaxspec.load(tmp_path / "m")
