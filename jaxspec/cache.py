"""The target's key/value cache: a plain pytree of position-indexed buffers.

A row's cache index is its absolute position, so a row never needs a start offset and rows of one batch advance by
different amounts. The cache stores no length of its own: the decode state's per-row `lengths` is the single source
of truth, and the target's live prefix is always `lengths - 1` entries (the newest token has not been run yet).
Rolling back a rejected draft therefore costs nothing: the length moves, stale entries stay where they are and are
overwritten by the next round before any query at their position can see them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KV_CACHE_AXES = ("layers", "batch", "seq", "kv_heads", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, S, K, Dh]
    v: jax.Array  # [L, B, S, K, Dh]

    @property
    def size(self) -> int:
        return self.k.shape[2]

    @staticmethod
    def logical_axes() -> "KVCache":
        return KVCache(k=KV_CACHE_AXES, v=KV_CACHE_AXES)  # type: ignore[arg-type]


def init_kv_cache(
    num_layers: int, batch: int, size: int, kv_heads: int, head_dim: int, dtype: jnp.dtype, v_head_dim: int | None = None
) -> KVCache:
    """Zero-filled cache for `size` positions per row."""
    return KVCache(
        k=jnp.zeros((num_layers, batch, size, kv_heads, head_dim), dtype),
        v=jnp.zeros((num_layers, batch, size, kv_heads, v_head_dim or head_dim), dtype),
    )


# Multi-head latent attention (DeepSeek-V2/V3) caches what its keys and values are computed from, not the keys and
# values: one latent shared by every head, and one rope key shared by every head. Neither splits with the heads, so
# their feature axes are replicated (`head_dim` maps to no mesh axis).
MLA_CACHE_AXES = ("layers", "batch", "seq", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MLACache:
    latent: jax.Array  # [L, B, S, R] normed compressed key/value latent (kv_lora_rank)
    k_rope: jax.Array  # [L, B, S, Dr] rotated rope key (qk_rope_head_dim)

    @property
    def size(self) -> int:
        return self.latent.shape[2]

    @staticmethod
    def logical_axes() -> "MLACache":
        return MLACache(latent=MLA_CACHE_AXES, k_rope=MLA_CACHE_AXES)  # type: ignore[arg-type]


def init_mla_cache(
    num_layers: int, batch: int, size: int, latent_dim: int, rope_dim: int, dtype: jnp.dtype
) -> MLACache:
    """Zero-filled latent cache for `size` positions per row."""
    return MLACache(
        latent=jnp.zeros((num_layers, batch, size, latent_dim), dtype),
        k_rope=jnp.zeros((num_layers, batch, size, rope_dim), dtype),
    )
