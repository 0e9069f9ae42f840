"""DeepSeek-V3 (`DeepseekV3ForCausalLM`) as HF transformers 5.23 defines it: multi-head latent attention (MLA),
dense first layers then sigmoid-routed MoE layers (models/moe.py), YaRN rope, and MTP layers.

The cache stores MLA's latent form, not expanded keys and values: per position and layer, the normed compressed
latent (`kv_lora_rank`, shared by every head) and the rotated rope key (`qk_rope_head_dim`, shared by every head).
At DeepSeek-V3's sizes that is 512 + 64 numbers instead of 128 heads x (192 + 128), 71x less memory, which is what
lets a long context and a draft window fit. Attention then runs in the latent space ("absorbed" MLA): the no-rope
part of each query head is multiplied into the latent by that head's key up-projection, scores are
`q_latent . latent + q_rope . k_rope`, and the softmax-weighted latent is expanded by the value up-projection only
for the T new queries. Each step therefore reads the cache once at its compressed width and never expands S cached
positions into per-head keys; it is the same arithmetic as HF's expand-then-attend, reassociated.

Rope: DeepSeek checkpoints lay each rope feature pair out interleaved, (x0, x1), (x2, x3), ... (`rope_interleave`,
default true). The converter permutes those rows of `q_b_proj`/`q_proj` and `kv_a_proj_with_mqa` to evens-then-odds,
so the usual rotate-half `apply_rope` gives exactly HF's interleaved rotation (HF's output is in that order too).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from jaxspec.cache import MLACache, init_mla_cache, write_at_positions

from . import layers as L
from . import moe
from .moe import MoeCausalLM, MoeConfig, RopeConfig, mtp_chain_from_scratch

__all__ = ["DeepseekV3Config", "DeepseekV3ForCausalLM", "mtp_chain_from_scratch", "param_shapes"]

# HF `DeepseekV3Config` class defaults: they apply where config.json lacks a key.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_attention_heads=128,
    n_shared_experts=1,
    n_routed_experts=256,
    routed_scaling_factor=2.5,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_rope_head_dim=64,
    v_head_dim=128,
    qk_nope_head_dim=128,
    n_group=8,
    topk_group=4,
    num_experts_per_tok=8,
    first_k_dense_replace=3,
    norm_topk_prob=True,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
)


@dataclasses.dataclass(frozen=True)
class DeepseekV3Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    q_lora_rank: int | None  # None: queries come from one full-rank projection
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # only the converter reads it (it de-interleaves the rope rows)
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
    def from_hf_config(cls, hf: dict[str, Any]) -> "DeepseekV3Config":
        """Build from a config.json dict; raise on anything this implementation would silently get wrong."""
        if hf.get("model_type") != "deepseek_v3":
            raise ValueError(f"DeepseekV3Config cannot read model_type={hf.get('model_type')!r}.")
        if hf.get("attention_bias"):
            raise NotImplementedError("attention_bias=True is not supported yet for DeepSeek-V3 checkpoints.")
        def get(key):
            return HF_DEFAULTS[key] if hf.get(key) is None else hf[key]

        num_heads = get("num_attention_heads")
        if hf.get("num_key_value_heads", num_heads) not in (None, num_heads):
            # MLA expands one latent into every head; HF's attention breaks for any other value.
            raise NotImplementedError(f"num_key_value_heads must equal num_attention_heads={num_heads} for MLA.")
        rope = L.rope_parameters(hf)
        if rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise NotImplementedError("partial_rotary_factor is not supported for DeepSeek-V3 (rope has its own dims).")
        qk_nope, qk_rope = get("qk_nope_head_dim"), get("qk_rope_head_dim")
        return cls(
            model_type="deepseek_v3",
            q_lora_rank=hf.get("q_lora_rank", HF_DEFAULTS["q_lora_rank"]),
            kv_lora_rank=get("kv_lora_rank"),
            qk_nope_head_dim=qk_nope,
            qk_rope_head_dim=qk_rope,
            v_head_dim=get("v_head_dim"),
            rope_interleave=bool(hf.get("rope_interleave", True)),
            rope=moe.rope_from_hf(hf, rope, qk_rope),
            **moe.common_fields(hf, HF_DEFAULTS),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        return self.qk_head_dim**-0.5 * self.rope.softmax_mscale()


ATTENTION_AXES: dict[str, tuple[str, ...]] = {
    # latent ranks are named head_dim: shared by every head, they stay replicated
    "wq": ("embed", "heads", "head_dim"),
    "wq_a": ("embed", "head_dim"),
    "q_norm": ("head_dim",),
    "wq_b": ("head_dim", "heads", "head_dim"),
    "wkv_a": ("embed", "head_dim"),
    "kv_norm": ("head_dim",),
    "wkv_b": ("head_dim", "heads", "head_dim"),
    "wo": ("heads", "head_dim", "embed"),
}


def attention_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    """One layer's MLA params. wkv_a: [D, R + Dr] (latent, then rope key); wkv_b: [R, H, Dn + Dv]."""
    d, h, r = cfg.hidden_size, cfg.num_heads, cfg.kv_lora_rank
    shapes = {
        "wkv_a": (d, r + cfg.qk_rope_head_dim),
        "kv_norm": (r,),
        "wkv_b": (r, h, cfg.qk_nope_head_dim + cfg.v_head_dim),
        "wo": (h, cfg.v_head_dim, d),
    }
    if cfg.q_lora_rank is None:
        return shapes | {"wq": (d, h, cfg.qk_head_dim)}
    rq = cfg.q_lora_rank
    return shapes | {"wq_a": (d, rq), "q_norm": (rq,), "wq_b": (rq, h, cfg.qk_head_dim)}


def param_shapes(cfg: DeepseekV3Config) -> dict[str, tuple[int, ...]]:
    return moe.stack_shapes(cfg, attention_shapes(cfg))


def mla_attention(cfg: DeepseekV3Config, p, h, positions, cache: MLACache, index, first, tree=None):
    """Absorbed multi-head latent attention of h: [B, T, D] at `positions`, writing layer `index` of the cache (a
    tree-shaped block, `tree`: at its slots, each entry seeing the committed entries and its ancestors)."""
    dn, r = cfg.qk_nope_head_dim, cfg.kv_lora_rank
    if cfg.q_lora_rank is None:
        q = jnp.einsum("btd,dhk->bthk", h, p["wq"])  # [B, T, H, Dn+Dr]
    else:
        q_latent = L.rms_norm(h @ p["wq_a"], p["q_norm"], cfg.rms_norm_eps)  # [B, T, Rq]
        q = jnp.einsum("btr,rhk->bthk", q_latent, p["wq_b"])
    kv = h @ p["wkv_a"]  # [B, T, R+Dr]
    latent = L.rms_norm(kv[..., :r], p["kv_norm"], cfg.rms_norm_eps)  # [B, T, R]
    inv_freq, scaling = cfg.rope.inv_freq(), cfg.rope.attention_factor
    q_rope = L.apply_rope(q[..., dn:], positions, inv_freq, scaling)  # [B, T, H, Dr]
    k_rope = L.apply_rope(kv[:, :, None, r:], positions, inv_freq, scaling)[:, :, 0]  # [B, T, Dr]
    slots = positions if tree is None else tree.slots()
    cache = MLACache(latent=write_at_positions(cache.latent, index, slots, latent),
                     k_rope=write_at_positions(cache.k_rope, index, slots, k_rope))
    w_uk, w_uv = p["wkv_b"][..., :dn], p["wkv_b"][..., dn:]  # [R, H, Dn], [R, H, Dv]
    q_absorbed = jnp.einsum("bthk,rhk->bthr", q[..., :dn], w_uk)  # [B, T, H, R]
    if tree is None:
        out_latent = L.attend_live(latent_attention, (q_absorbed, q_rope), cache.latent, cache.k_rope, positions,
                                   cfg.softmax_scale, first, layer=index)  # [B, T, H, R]
    else:
        out_latent = L.attend_live(tree_latent_attention, (q_absorbed, q_rope), cache.latent, cache.k_rope, slots,
                                   cfg.softmax_scale, tree.start, tree.ancestors, positions, layer=index)
    out = jnp.einsum("bthr,rhv->bthv", out_latent, w_uv)  # [B, T, H, Dv]
    return jnp.einsum("bthv,hvd->btd", out, p["wo"]), cache


def latent_attention(q, c_latent, c_rope, positions, scale: float, first):
    """Attention of absorbed queries over the latent cache. q: (q_absorbed [B, T, H, R], q_rope [B, T, H, Dr]);
    c_latent: [B, S, R]; c_rope: [B, S, Dr]; keys in [first, query position] (`causal_window`). -> [B, T, H, R]"""
    return _latent_attention(q, c_latent, c_rope, L.causal_window(positions, c_latent.shape[1], first), scale)


def tree_latent_attention(q, c_latent, c_rope, slots, scale: float, start, ancestors, positions):
    """`latent_attention` of a tree-shaped block whose entries sit in `slots` [B, W] (what `attend_live` sizes the
    cache prefix by): each entry sees the committed entries and its ancestors (`layers.tree_visibility`)."""
    del slots  # every slot a query may see is below start + W, which attend_live's prefix holds
    return _latent_attention(q, c_latent, c_rope, L.tree_visibility(start, ancestors, positions, c_latent.shape[1]),
                             scale)


def _latent_attention(q, c_latent, c_rope, visible, scale: float):
    """The absorbed attention over the keys `visible` [B, T, S] marks. -> [B, T, H, R]"""
    q_absorbed, q_rope = q
    scores = jnp.einsum("bthr,bsr->bhts", q_absorbed, c_latent, preferred_element_type=jnp.float32)
    scores += jnp.einsum("bthk,bsk->bhts", q_rope, c_rope, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None], scores * scale, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(c_latent.dtype)  # [B, H, T, S]
    # The product in its natural order (batch, then the weights' axes, then the latent's): asked for [B, T, H, R]
    # directly, XLA:CPU computed it transposed, from a transposed copy of the layer's latent cache.
    return jnp.einsum("bhts,bsr->bhtr", weights, c_latent).transpose(0, 2, 1, 3)


class DeepseekV3ForCausalLM(MoeCausalLM):
    """`model(tokens[B,T], positions[B,T], cache: MLACache) -> (logits[B,T,V], hidden[B,T,D], cache)`.

    `hidden` is the final-normed last hidden state (what an LM head or an MTP layer reads). MTP: see
    `MoeCausalLM.mtp_step` and `init_mtp_cache` (an `MLACache` with one layer per depth).
    """

    ATTENTION_AXES = ATTENTION_AXES

    def attention_shapes(self) -> dict[str, tuple[int, ...]]:
        return attention_shapes(self.cfg)

    def attention(self, p, h, positions, cache, index, first, tree=None):
        return mla_attention(self.cfg, p, h, positions, cache, index, first, tree)

    def new_cache(self, layers: int, batch: int, size: int) -> MLACache:
        c = self.cfg
        return init_mla_cache(layers, batch, size, c.kv_lora_rank, c.qk_rope_head_dim, self.dtype)
