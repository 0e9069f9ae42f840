"""DeepSeek-V3 and GLM-4.5 (glm4_moe): tiny random HF checkpoints, with MTP layers written in HF's layout
(`model.layers.{N + k}.*`, which `save_pretrained` drops), converted with `jaxspec.load` and checked against
transformers in float32: main logits, MTP draft logits (HF's own `MtpModel`), the routed MoE against a dense
reference, incremental MTP caches against the from-scratch definition, sharded checkpoints, and MTP errors.

Compiles dominate the run time on CPU, so each case jits its functions once and every check reuses the same shapes.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from safetensors.torch import save_file
from transformers.modeling_layers import MtpModel

import jaxspec
from jaxspec.convert.rules import CheckpointMismatch
from jaxspec.models import moe
from jaxspec.models.deepseek_v3 import DeepseekV3Config
from jaxspec.models.glm4_moe import Glm4MoeConfig
from tests.fixtures.moe import CASES, COMMON, HF_CLASSES, read_tensors, save_checkpoint, write_config

B, T = 2, 14  # every forward and MTP reference runs at this shape
CACHE = 2 * T
ATOL = 1e-4  # logits here are of magnitude 1-10

MTP_CASES = [name for name, case in CASES.items() if case[2]]

# ----------------------------------------------------------------------------------------------------------------
# References from transformers (the checkpoints are built in tests/fixtures/moe.py)


def hf_reference(model_type, folder, n_layers, n_mtp, tokens) -> tuple[np.ndarray, np.ndarray | None]:
    """HF logits [B, T, V] and, with MTP, HF's MTP draft logits [B, K, V] of the from-scratch chain (the
    definition that exp_mtp_cache_rollback.py verified against HF's cached drafting)."""
    model_cls = HF_CLASSES[model_type][1]
    saved = model_cls._keys_to_ignore_on_load_unexpected
    # HF finds MTP tensors by the real checkpoints' layer numbers (61, 46, 92); point it at this tiny model's
    model_cls._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n_layers + k}\..*" for k in range(n_mtp)]
    try:
        model = model_cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
        ids = torch.as_tensor(tokens)
        with torch.no_grad():
            logits = model(ids).logits.numpy()
            if not n_mtp:
                return logits, None
            return logits, hf_mtp_drafts(model, MtpModel.from_pretrained(model), ids, n_mtp)
    finally:
        model_cls._keys_to_ignore_on_load_unexpected = saved


def hf_mtp_drafts(model, mtp, ids, n_mtp) -> np.ndarray:
    b, t = ids.shape
    mask = torch.full((t - 1, t - 1), float("-inf")).triu(1)[None, None]
    hidden = model.model(ids[:, :-1]).last_hidden_state
    window, pos = ids[:, 1:], torch.arange(1, t)[None].expand(b, -1)
    drafts = []
    for k in range(n_mtp):
        layer = mtp.layers[k]
        x = layer.eh_proj(torch.cat([layer.enorm(model.model.embed_tokens(window)), layer.hnorm(hidden)], -1))
        rope = model.model.rotary_emb(x, pos)
        hidden = layer.post_norm(layer.mtp_block(x, attention_mask=mask, position_ids=pos, position_embeddings=rope))
        logits = model.lm_head(hidden[:, -1])
        drafts.append(logits)
        window, pos = torch.cat([window[:, 1:], logits.argmax(-1, keepdim=True)], -1), pos + 1
    return torch.stack(drafts, 1).numpy()


# ----------------------------------------------------------------------------------------------------------------
# One loaded case, with its functions jitted once


@dataclasses.dataclass
class Case:
    name: str
    folder: str
    n_layers: int
    module: Any
    tokens: np.ndarray  # [B, T]
    hf_logits: np.ndarray
    hf_mtp: np.ndarray | None

    def __post_init__(self):
        graphdef, state = nnx.split(self.module)
        self._state = state

        def merge(state):
            return nnx.merge(graphdef, state)

        @jax.jit
        def forward(state, tokens, positions, cache):
            return merge(state)(tokens, positions, cache)

        @jax.jit
        def mtp_reference(state, tokens):
            return moe.mtp_chain_from_scratch(merge(state), tokens)

        @jax.jit
        def mtp_round(state, tokens, positions, prev_hidden, cache):
            """All MTP depths over a window ending at the newest token: the same chain as the reference, but
            reading everything before the window from `cache`."""
            model = merge(state)
            drafts = []
            for depth in range(model.num_mtp_layers):
                out, logits, cache = model.mtp_step(depth, tokens, prev_hidden, positions, cache)
                drafts.append(logits[:, -1])
                next_token = jnp.argmax(logits[:, -1], axis=-1)[:, None]
                tokens, positions, prev_hidden = jnp.concatenate([tokens[:, 1:], next_token], 1), positions + 1, out
            return jnp.stack(drafts, 1), cache

        self._forward, self._mtp_reference, self._mtp_round = forward, mtp_reference, mtp_round

    def forward(self, tokens, positions, cache):
        return self._forward(self._state, jnp.asarray(tokens), jnp.asarray(positions), cache)

    def full_forward(self, tokens):
        """(logits, hidden) over tokens [B, T] from position 0."""
        logits, hidden, _ = self.forward(tokens, positions_of(tokens), self.module.init_cache(B, CACHE))
        return np.asarray(logits), np.asarray(hidden)

    def mtp_reference(self, tokens):
        return np.asarray(self._mtp_reference(self._state, jnp.asarray(tokens)))

    def mtp_round(self, tokens, positions, prev_hidden, cache):
        drafts, cache = self._mtp_round(self._state, *map(jnp.asarray, (tokens, positions, prev_hidden)), cache)
        return np.asarray(drafts), cache


def positions_of(tokens, start=0):
    return np.broadcast_to(np.arange(start, start + tokens.shape[1]), tokens.shape)


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return _build_case(request.param, tmp_path_factory)


@pytest.fixture(scope="module", params=MTP_CASES)
def mtp_case(request, tmp_path_factory):
    return _build_case(request.param, tmp_path_factory)


_CASES: dict[str, Case] = {}


def _build_case(name, tmp_path_factory) -> Case:
    """Cases are shared by the fixtures above, so each checkpoint is built and compiled once."""
    if name not in _CASES:
        model_type, n_layers, n_mtp, overrides = CASES[name]
        folder = save_checkpoint(model_type, str(tmp_path_factory.mktemp(name) / "ckpt"), n_layers, n_mtp, overrides)
        tokens = np.random.default_rng(0).integers(3, COMMON["vocab_size"], (B, T)).astype(np.int32)
        hf_logits, hf_mtp = hf_reference(model_type, folder, n_layers, n_mtp, tokens)
        module = jaxspec.load(folder, dtype=jnp.float32).module
        _CASES[name] = Case(name, folder, n_layers, module, tokens, hf_logits, hf_mtp)
    return _CASES[name]


# ----------------------------------------------------------------------------------------------------------------
# Parity with transformers


def test_logits_match_transformers(case):
    logits, hidden = case.full_forward(case.tokens)
    assert np.abs(case.hf_logits).max() > 1.0  # the comparison is not between near-zero numbers
    np.testing.assert_allclose(logits, case.hf_logits, atol=ATOL, rtol=0)
    np.testing.assert_allclose(np.asarray(case.module.logits(jnp.asarray(hidden))), logits, atol=1e-5, rtol=0)


def test_mtp_drafts_match_transformers_mtp_model(mtp_case):
    drafts = mtp_case.mtp_reference(mtp_case.tokens)  # [B, K, V]
    assert drafts.shape == mtp_case.hf_mtp.shape
    np.testing.assert_allclose(drafts, mtp_case.hf_mtp, atol=ATOL, rtol=0)


def test_cache_chunks_match_one_forward(tmp_path_factory):
    """Two forwards of the same width against one cache, each a real chunk of half the sequence followed by junk
    (as a verify step's rejected drafts): the real positions' logits are those of one full forward. The first
    call's junk sits where the second call writes before it attends; the model has a dense layer and two MoE
    layers, scanned as two stacks that must write distinct cache layers."""
    case = _build_case("deepseek_mtp", tmp_path_factory)
    full, _ = case.full_forward(case.tokens)
    half = T // 2
    junk = np.random.default_rng(2).integers(3, COMMON["vocab_size"], (B, half)).astype(np.int32)
    cache = case.module.init_cache(B, CACHE)
    chunk = np.concatenate([case.tokens[:, :half], junk], 1)
    first, _, cache = case.forward(chunk, positions_of(chunk), cache)
    chunk = np.concatenate([case.tokens[:, half:], junk], 1)
    second, _, _ = case.forward(chunk, positions_of(chunk, half), cache)
    np.testing.assert_allclose(np.concatenate([first[:, :half], second[:, :half]], 1), full, atol=ATOL, rtol=0)


def test_router_matches_transformers():
    """Group-limited sigmoid routing with a score bias, against HF's router module on many tokens."""
    hf_config = transformers.DeepseekV3Config(
        **COMMON, **CASES["deepseek_mtp"][3], num_hidden_layers=1, num_nextn_predict_layers=0
    )
    torch.manual_seed(0)
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(hf_config)
    with torch.no_grad():
        router.weight.normal_(std=0.2)
        router.e_score_correction_bias.normal_(std=0.3)
    x = torch.randn(256, hf_config.hidden_size)
    with torch.no_grad():
        _, hf_weights, hf_experts = router(x)
    cfg = DeepseekV3Config.from_hf_config(hf_config.to_dict()).moe
    w_router, score_bias = router.weight.detach().numpy().T, router.e_score_correction_bias.numpy()
    weights, experts = jax.jit(moe.route, static_argnums=3)(x.numpy(), w_router, score_bias, cfg)
    order, hf_order = np.argsort(experts, 1), hf_experts.argsort(1).numpy()  # both unsorted within a token
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(experts), order, 1),
                                  np.take_along_axis(hf_experts.numpy(), hf_order, 1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, 1),
                               np.take_along_axis(hf_weights.numpy(), hf_order, 1), atol=1e-6, rtol=0)


def test_routed_experts_equal_dense_reference():
    n, d, f, e, k = 40, 16, 12, 8, 3
    rng = np.random.default_rng(0)
    shapes = [(n, d), (d, e), (e,), (e, d, f), (e, d, f), (e, f, d)]
    x, w_router, score_bias, *expert_weights = (rng.normal(size=s).astype(np.float32) for s in shapes)
    cfg = moe.MoeConfig(
        num_experts=e,
        experts_per_token=k,
        num_groups=4,
        topk_groups=2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_shared_experts=1,
        expert_size=f,
        first_dense_layers=0,
    )

    @jax.jit
    def both(x, w_router, score_bias, expert_weights):
        weights, experts = moe.route(x, w_router, score_bias, cfg)
        args = (x, weights, experts, *expert_weights)
        return moe.routed_experts(*args), moe.dense_experts_reference(*args)

    routed, dense = both(x, w_router, score_bias, expert_weights)
    assert np.abs(np.asarray(dense)).max() > 1.0
    np.testing.assert_allclose(np.asarray(routed), np.asarray(dense), atol=1e-4, rtol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# MTP caches


def test_mtp_step_with_caches_equals_from_scratch(mtp_case):
    """Draft rounds with forced partial acceptance (all, none, some): each round re-runs a fixed window of W
    positions per depth, ending at its newest token, on top of the persistent per-depth caches. Stale entries of
    rejected drafts sit at positions the window rewrites before any query reads them. After the last round the drafts
    must equal the from-scratch chain over the final sequence (which both rows reach with different histories).

    The model's step alone, compared after the last round: the drafter driven round by round, with every round
    compared and idle rounds in between, is tests/strategies/test_mtp.py's slow-only from-scratch chain test."""
    module, k = mtp_case.module, mtp_case.module.num_mtp_layers
    prompt = 6
    window = prompt - 1  # covers the prompt in round one, and >= 2K positions (every stale entry) later
    accepted = [[2, 0, 1, 1], [0, 1, 2, 1]]
    rng = np.random.default_rng(1)
    sequences = [list(mtp_case.tokens[row, :prompt]) for row in range(B)]
    cache = module.init_mtp_cache(B, CACHE)
    rows = np.arange(B)[:, None]
    for round_ in range(len(accepted[0]) + 1):
        lengths = np.array([len(s) for s in sequences])
        padded = np.zeros((B, T), np.int32)
        for row, s in enumerate(sequences):
            padded[row, : len(s)] = s
        _, hidden = mtp_case.full_forward(padded)  # causal: padding after a row's length changes nothing before it
        positions = (lengths - window)[:, None] + np.arange(window)  # [B, W], ends at the newest token
        logits, cache = mtp_case.mtp_round(padded[rows, positions], positions, hidden[rows, positions - 1], cache)
        if round_ == len(accepted[0]):
            break
        drafts = logits.argmax(-1)  # [B, K]
        for row in range(B):
            sequences[row] += list(drafts[row, : accepted[row][round_]]) + [int(rng.integers(3, 128))]
    final = np.array(sequences, np.int32)
    assert final.shape == (B, T) and k == 2
    reference = mtp_case.mtp_reference(final)
    np.testing.assert_array_equal(logits.argmax(-1), reference.argmax(-1))
    np.testing.assert_allclose(logits, reference, atol=ATOL, rtol=0)


# ----------------------------------------------------------------------------------------------------------------
# Loading: sharded checkpoints, config handling, errors


def _params(module) -> dict[str, np.ndarray]:
    return {name: np.asarray(v) for name, v in nnx.to_pure_dict(nnx.state(module)).items()}


def test_sharded_checkpoint_with_mtp_in_its_own_shard(tmp_path, tmp_path_factory):
    case = _build_case("deepseek_mtp", tmp_path_factory)
    tensors = read_tensors(os.path.join(case.folder, "model.safetensors"))
    mtp_prefixes = tuple(f"model.layers.{case.n_layers + k}." for k in range(case.module.num_mtp_layers))
    main, mtp = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    shards = {main: {}, mtp: {}}
    for name, value in tensors.items():
        shards[mtp if name.startswith(mtp_prefixes) else main][name] = value
    weight_map = {}
    for shard, part in shards.items():
        save_file(part, str(tmp_path / shard))
        weight_map |= {name: shard for name in part}
    with open(tmp_path / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(case.folder, "config.json")) as f:
        write_config(tmp_path, json.load(f))
    sharded = _params(jaxspec.load(str(tmp_path), dtype=jnp.float32).module)
    single = _params(case.module)
    assert sharded.keys() == single.keys() and any(name.startswith("mtp_") for name in sharded)
    for name in single:
        np.testing.assert_array_equal(sharded[name], single[name], err_msg=name)


def test_missing_mtp_tensor_names_the_setting_and_the_tensors(tmp_path):
    _, n_layers, n_mtp, overrides = CASES["glm_mtp"]
    folder = save_checkpoint("glm4_moe", str(tmp_path / "ckpt"), n_layers, n_mtp, overrides)
    tensors = read_tensors(os.path.join(folder, "model.safetensors"))
    dropped = [f"model.layers.{n_layers}.eh_proj.weight", f"model.layers.{n_layers + 1}.mlp.experts.3.up_proj.weight"]
    save_file({k: v for k, v in tensors.items() if k not in dropped}, os.path.join(folder, "model.safetensors"))
    with pytest.raises(CheckpointMismatch) as error:
        jaxspec.load(folder, dtype=jnp.float32)
    message = str(error.value)
    assert "num_nextn_predict_layers=2" in message
    assert all(name in message for name in dropped)


def test_mtp_layer_count_comes_from_config_json():
    """An absent key means no MTP layers (HF's class default of 1 would ask for tensors that are not there);
    `num_mtp_layers` is accepted as an alias."""
    _, n_layers, _, overrides = CASES["glm_mtp"]
    hf = transformers.Glm4MoeConfig(**COMMON, **overrides, num_hidden_layers=n_layers).to_dict()
    del hf["num_nextn_predict_layers"]
    assert Glm4MoeConfig.from_hf_config(hf).num_mtp_layers == 0
    assert Glm4MoeConfig.from_hf_config(hf | {"num_mtp_layers": 3}).num_mtp_layers == 3
    assert Glm4MoeConfig.from_hf_config(hf | {"num_nextn_predict_layers": 1}).num_mtp_layers == 1


def test_mtp_on_a_model_without_mtp_layers_is_an_error(tmp_path_factory):
    module = _build_case("deepseek_plain", tmp_path_factory).module
    assert module.num_mtp_layers == 0
    with pytest.raises(ValueError, match="num_nextn_predict_layers=0"):
        module.init_mtp_cache(B, CACHE)
    with pytest.raises(ValueError, match="MTP depth 0 does not exist"):
        module.mtp_step(0, np.zeros((B, 1), np.int32), np.zeros((B, 1, COMMON["hidden_size"])), np.ones((B, 1)), None)


def test_unsupported_configs_raise():
    _, n_layers, _, overrides = CASES["deepseek_mtp"]
    hf = transformers.DeepseekV3Config(**COMMON, **overrides, num_hidden_layers=n_layers).to_dict()
    with pytest.raises(NotImplementedError, match="quant_method='gptq'"):  # fp8 block scales load (test_fp8.py)
        DeepseekV3Config.from_hf_config(hf | {"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(NotImplementedError, match="rope type 'dynamic'"):
        DeepseekV3Config.from_hf_config(hf | {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ValueError, match="n_group=3"):
        DeepseekV3Config.from_hf_config(hf | {"n_group": 3})
