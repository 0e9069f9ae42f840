"""Qwen3-MoE (`model_type: "qwen3_moe"`) against transformers' Qwen3MoeForCausalLM: logits, greedy decoding, every
drafter (public DFlash and EAGLE-3 drafters include Qwen3-MoE targets), and the configs jaxspec refuses.

What it adds to the MoE family is a softmax top-k router with no groups, score bias or shared experts, and HF's
choice of dense layers (`mlp_only_layers`, `decoder_sparse_step`). The tiny models have an explicit head_dim (16,
where hidden_size / heads = 8) and random norms, router and experts; 8 experts, 2 a token.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

import jaxspec
from jaxspec.registry import FAMILIES
from tests.fixtures import dflash as dflash_fixtures
from tests.fixtures import eagle3 as eagle3_fixtures
from tests.fixtures import hf_models
from tests.fixtures.prompts import left_padded
from tests.models.test_models import hf_logits, jax_logits

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16)
CASES = {
    "every-layer-moe": dict(),
    "dense-first-layer-renormalised-tied": dict(mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=True),
    "dense-first-layers-by-step": dict(decoder_sparse_step=2, num_hidden_layers=2),  # layer 0 dense, layer 1 MoE
}
REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4], [20, 21, 22, 23, 24, 20, 21]]
N = 8
DFLASH = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, target_layer_ids=[1, 3], block_size=4, mask_token_id=127)


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(tmp_path, case):
    folder = hf_models.save_tiny("qwen3_moe", tmp_path, seed=21, **MOE, **CASES[case])
    ids = np.random.RandomState(2).randint(0, 128, (2, 40))
    model = jaxspec.load(folder)
    n_layers = model.module.cfg.num_layers
    expected_dense = {"every-layer-moe": 0, "dense-first-layer-renormalised-tied": 1, "dense-first-layers-by-step": 1}
    assert model.module.cfg.moe.first_dense_layers == expected_dense[case] < n_layers
    np.testing.assert_allclose(jax_logits(model, ids), hf_logits(hf_models.load_hf(folder), ids), atol=2e-4,
                               rtol=1e-4)


def test_config_reads_the_hub_spelling_of_the_expert_count():
    """HF writes `num_local_experts` (its attribute map); published config.json files say `num_experts`."""
    hf = transformers.Qwen3MoeConfig(**hf_models.BASE, **MOE).to_dict()
    assert hf["num_local_experts"] == 8 and "num_experts" not in hf
    hub = {k: v for k, v in hf.items() if k != "num_local_experts"} | {"num_experts": 8}
    assert FAMILIES["qwen3_moe"].config_from_hf(hub) == FAMILIES["qwen3_moe"].config_from_hf(hf)
    cfg = FAMILIES["qwen3_moe"].config_from_hf(hf)
    assert (cfg.moe.scoring, cfg.moe.num_experts, cfg.moe.experts_per_token, cfg.head_dim) == ("softmax", 8, 2, 16)


@pytest.mark.parametrize("overrides, message", [
    (dict(mlp_only_layers=[2]), r"layers \[2\] dense, not only a first run"),
    (dict(use_sliding_window=True, sliding_window=4), "use_sliding_window"),
    (dict(attention_bias=True), "output projection"),
])
def test_unsupported_configs_name_the_setting(overrides, message):
    hf = transformers.Qwen3MoeConfig(**hf_models.BASE, **MOE, **overrides).to_dict()
    with pytest.raises(NotImplementedError, match=message):
        FAMILIES["qwen3_moe"].config_from_hf(hf)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A Qwen3-MoE target and a smaller dense Qwen3 assistant with its vocabulary."""
    target_dir = hf_models.save_tiny("qwen3_moe", tmp_path_factory.mktemp("qwen3_moe"), seed=22, **MOE)
    assistant_dir = hf_models.save_tiny("qwen3", tmp_path_factory.mktemp("assistant"), seed=23, num_hidden_layers=2,
                                        hidden_size=16, intermediate_size=32, num_attention_heads=2,
                                        num_key_value_heads=1, head_dim=8)
    return SimpleNamespace(target_dir=target_dir, target=jaxspec.load(target_dir), hf_target=hf_models.load_hf(target_dir),
                           assistant=jaxspec.load(assistant_dir))


@pytest.fixture(scope="module")
def plain(pair):
    return jaxspec.generate(pair.target, REPETITIVE, max_new_tokens=N, eos_token_id=[])


def test_greedy_ragged_batch_equals_transformers(pair, plain):
    ids, mask = left_padded(REPETITIVE)
    expected = pair.hf_target.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=N,
                                       do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(plain.sequences, expected)


@pytest.mark.parametrize("strategy", ["assistant_model", "prompt_lookup", "early_exit", "dflash", "eagle3"])
def test_every_drafter_equals_plain_greedy(pair, plain, strategy, tmp_path):
    if strategy == "dflash":
        dflash_fixtures.muse(DFLASH, seed=24).save_pretrained(tmp_path)
    if strategy == "eagle3":  # SpecForge's head for a target of this width, vocabulary and depth
        eagle3_fixtures.save(eagle3_fixtures.reference(seed=25), tmp_path)
    kwargs = {
        # threshold 0: a random model is rarely confident, and the default 0.4 would stop most drafts at once; a
        # constant schedule: the adaptive one would probe a random drafter in the shadow, verifying none of its drafts
        "assistant_model": dict(assistant_model=pair.assistant, num_assistant_tokens=3,
                                assistant_confidence_threshold=0.0, num_assistant_tokens_schedule="constant"),
        "prompt_lookup": dict(prompt_lookup_num_tokens=3),
        "early_exit": dict(assistant_early_exit=2, num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                           num_assistant_tokens_schedule="constant"),
        "dflash": dict(num_assistant_tokens_schedule="constant"),
        "eagle3": dict(num_assistant_tokens_schedule="constant"),
    }[strategy]
    if strategy in ("dflash", "eagle3"):
        kwargs["assistant_model"] = jaxspec.load(os.fspath(tmp_path))
    out = jaxspec.generate(pair.target, REPETITIVE, max_new_tokens=N, eos_token_id=[], **kwargs)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.drafted.sum() > 0, strategy  # the drafter really ran (plain decoding drafts nothing)


def test_dflash_greedy_equals_transformers_dflash(pair, tmp_path):
    """transformers' own DFlash loop over the same Qwen3-MoE target and drafter (batch 1, its only size)."""
    reference = dflash_fixtures.muse(DFLASH, seed=24)
    reference.save_pretrained(tmp_path)
    ids = torch.tensor(REPETITIVE[:1])
    with torch.no_grad():
        expected = pair.hf_target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=reference,
                                           speculation_type="dflash", max_new_tokens=12, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    out = jaxspec.generate(pair.target, REPETITIVE[:1], max_new_tokens=12, eos_token_id=[],
                           assistant_model=jaxspec.load(os.fspath(tmp_path)), num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(out.sequences, expected.numpy())

