"""GLM-4.5 / GLM-4.5-Air (`Glm4MoeForCausalLM`) as HF transformers 5.23 defines it: grouped-query attention with
partial rotary (`partial_rotary_factor`, rotate-half on the first dims of each head), optional q/k/v biases
(`attention_bias`) and per-head q/k RMSNorm (`use_qk_norm`), then the DeepSeek-V3 MoE family's dense first layers,
sigmoid-routed MoE layers and MTP layers (models/moe.py). The cache is the plain `KVCache`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

from jaxspec.cache import KVCache, init_kv_cache, write_kv

from . import layers as L
from . import moe
from .moe import MoeCausalLM, MoeConfig, RopeConfig, mtp_chain_from_scratch

__all__ = ["Glm4MoeConfig", "Glm4MoeForCausalLM", "mtp_chain_from_scratch", "param_shapes"]

# HF `Glm4MoeConfig` class defaults: they apply where config.json lacks a key.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    num_attention_heads=96,
    num_key_value_heads=8,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    moe_intermediate_size=1408,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_routed_experts=128,
    routed_scaling_factor=1.0,
    n_group=1,
    topk_group=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    partial_rotary_factor=0.5,
)


@dataclasses.dataclass(frozen=True)
class Glm4MoeConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    attention_bias: bool  # q/k/v biases (the output projection never has one)
    use_qk_norm: bool
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope: RopeConfig
    moe: MoeConfig
    num_mtp_layers: int
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "Glm4MoeConfig":
        """Build from a config.json dict; raise on anything this implementation would silently get wrong."""
        if hf.get("model_type") != "glm4_moe":
            raise ValueError(f"Glm4MoeConfig cannot read model_type={hf.get('model_type')!r}.")
        num_heads = hf.get("num_attention_heads", HF_DEFAULTS["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf.get("hidden_size", HF_DEFAULTS["hidden_size"]) // num_heads
        rope = L.rope_parameters(hf)
        rope.setdefault("partial_rotary_factor", HF_DEFAULTS["partial_rotary_factor"])  # HF's backward-compat default
        return cls(
            model_type="glm4_moe",
            num_kv_heads=hf.get("num_key_value_heads") or HF_DEFAULTS["num_key_value_heads"],
            head_dim=head_dim,
            attention_bias=bool(hf.get("attention_bias", False)),
            use_qk_norm=bool(hf.get("use_qk_norm", False)),
            rope=moe.rope_from_hf(hf, rope, head_dim),
            **moe.common_fields(hf, HF_DEFAULTS),
        )


ATTENTION_AXES: dict[str, tuple[str, ...]] = L.GQA_ATTENTION_AXES


def attention_shapes(cfg: Glm4MoeConfig) -> dict[str, tuple[int, ...]]:
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    shapes = {"wq": (d, h, dh), "wk": (d, k, dh), "wv": (d, k, dh), "wo": (h, dh, d)}
    if cfg.attention_bias:
        shapes |= {"bq": (h, dh), "bk": (k, dh), "bv": (k, dh)}
    if cfg.use_qk_norm:
        shapes |= {"q_norm": (dh,), "k_norm": (dh,)}
    return shapes


def param_shapes(cfg: Glm4MoeConfig) -> dict[str, tuple[int, ...]]:
    return moe.stack_shapes(cfg, attention_shapes(cfg))


def gqa_attention(cfg: Glm4MoeConfig, p, h, positions, cache: KVCache, index, first, tree=None):
    """Grouped-query attention of h: [B, T, D] at `positions`, writing layer `index` of the cache (a tree-shaped
    block, `tree`: at its slots, attending as `layers.tree_attention` lays it out)."""
    q = jnp.einsum("btd,dhk->bthk", h, p["wq"])  # [B, T, H, Dh]
    k = jnp.einsum("btd,dhk->bthk", h, p["wk"])  # [B, T, K, Dh]
    v = jnp.einsum("btd,dhk->bthk", h, p["wv"])
    if cfg.attention_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.use_qk_norm:
        q = L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
        k = L.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    inv_freq, scaling = cfg.rope.inv_freq(), cfg.rope.attention_factor
    q = L.apply_rope(q, positions, inv_freq, scaling)
    k = L.apply_rope(k, positions, inv_freq, scaling)
    scale = cfg.head_dim**-0.5
    if tree is not None:
        cache = write_kv(cache, index, tree.slots(), k, v)
        attn = L.attend_live(L.tree_attention, q, cache.k, cache.v, tree.slots(), scale, tree.start, tree.ancestors,
                             positions, layer=index)
        return jnp.einsum("bthk,hkd->btd", attn, p["wo"]), cache
    cache = write_kv(cache, index, positions, k, v)
    attn = L.attend_live(L.cached_attention_window, q, cache.k, cache.v, positions, scale, first, layer=index)
    return jnp.einsum("bthk,hkd->btd", attn, p["wo"]), cache


class Glm4MoeForCausalLM(MoeCausalLM):
    """`model(tokens[B,T], positions[B,T], cache: KVCache) -> (logits[B,T,V], hidden[B,T,D], cache)`.

    `hidden` is the final-normed last hidden state (what an LM head or an MTP layer reads). MTP: see
    `MoeCausalLM.mtp_step` and `init_mtp_cache` (a `KVCache` with one layer per depth).
    """

    ATTENTION_AXES = ATTENTION_AXES

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        return attention_shapes(self.cfg)

    def attention(self, p, h, positions, cache, index, first, tree=None):
        return gqa_attention(self.cfg, p, h, positions, cache, index, first, tree)

    def new_cache(self, layers: int, batch: int, size: int) -> KVCache:
        c = self.cfg
        return init_kv_cache(layers, batch, size, c.num_kv_heads, c.head_dim, self.dtype)
