"""The target's key/value cache: a plain pytree of position-indexed buffers.

A row's cache index is its absolute position, so a row never needs a start offset and rows of one batch advance by
different amounts. The cache stores no length of its own: the decode state's per-row `lengths` is the single source
of truth, and the target's live prefix is always `lengths - 1` entries (the newest token has not been run yet).
Rolling back a rejected draft therefore costs nothing: the length moves, stale entries stay where they are and are
overwritten by the next round before any query at their position can see them.

Layout: keys and values are stored `[L, B, K, S, Dh]`, kv heads before positions (MLA's latents `[L, B, S, R]`):
the layouts in which attention's products (`models/layers.grouped_attention`) take a layer's slice as it lies.
XLA:CPU runs a batched matrix product with its batch axes (B, K) leading in both operands; stored `[L, B, S, K, Dh]`,
every layer's keys and values were transposed into that order in every step (tests/decode/test_inplace.py checks
that no such rearrangement remains). What XLA:CPU still does is copy the layer's slice out of the stack before the
product reads it, as it does for any slice of a stacked array it feeds a product (docs/design.md says the same of
stacked weights): a contiguous copy now, not a transposing one. `python benchmarks/bench_cache_layout.py` counts
both kinds and measures the step with either layout. Positions are second to last in every stack, so one write
(`write_at_positions`) and one prefix slice (`models/layers.attend_live`) serve them all.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

KV_CACHE_AXES = ("layers", "batch", "kv_heads", "seq", "head_dim")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    k: jax.Array  # [L, B, K, S, Dh]
    v: jax.Array  # [L, B, K, S, Dv]

    @property
    def size(self) -> int:
        return self.k.shape[3]

    @staticmethod
    def logical_axes() -> "KVCache":
        return KVCache(k=KV_CACHE_AXES, v=KV_CACHE_AXES)  # type: ignore[arg-type]


def init_kv_cache(
    num_layers: int, batch: int, size: int, kv_heads: int, head_dim: int, dtype: jnp.dtype, v_head_dim: int | None = None
) -> KVCache:
    """Zero-filled cache for `size` positions per row of `num_layers` layers (`stack_layers` of them)."""
    layers = stack_layers(num_layers)
    return KVCache(
        k=jnp.zeros((layers, batch, kv_heads, size, head_dim), dtype),
        v=jnp.zeros((layers, batch, kv_heads, size, v_head_dim or head_dim), dtype),
    )


def stack_layers(num_layers: int) -> int:
    """How many layers a cache stack holds for `num_layers`: at least two, the second of a one-layer model never
    written or read. In a one-layer stack, a layer's slice is the whole buffer, and XLA:CPU fuses the step's write
    into attention's read of it: it then computes the write twice, in place and into copies of the whole stack,
    several per step (tests/decode/test_inplace.py checks that none remain). In a stack of two or more, attention
    reads a slice of a buffer written in place."""
    return max(num_layers, 2)


def write_kv(cache: KVCache, layer: int | jax.Array, positions: jax.Array, k: jax.Array, v: jax.Array) -> KVCache:
    """The cache with layer `layer`'s keys k [B, T, K, Dh] and values v [B, T, K, Dv] written at each row's
    positions [B, T]. Positions at or past S are dropped (padding rows, a prompt's padding)."""
    return KVCache(k=write_at_positions(cache.k, layer, positions, k),
                   v=write_at_positions(cache.v, layer, positions, v))


def write_at_positions(buffer: jax.Array, layer: int | jax.Array, positions: jax.Array, entries: jax.Array
                       ) -> jax.Array:
    """Any cache stack of this module, [L, B, ..., S, F] (positions second to last), with `entries` [B, T, ..., F]
    written at (layer, row b, positions[b, t]). Positions at or past S are dropped.

    When axes stand between B and S (a KVCache's heads), NumPy's rule puts the indexed axes' broadcast shape [B, T]
    first in the update, which is the order `entries` come in; when none do (MLA), it stays in place, which is too.
    """
    rows = jnp.arange(entries.shape[0])[:, None]  # [B, 1]
    return buffer.at[layer, rows, ..., positions, :].set(entries.astype(buffer.dtype), mode="drop")


def move_entries(buffer: jax.Array, start: jax.Array, source: jax.Array) -> jax.Array:
    """Any cache stack of this module, [L, B, ..., S, F], with the entry in slot start + source[b, j] copied to slot
    start + j, for every layer (start [B], source [B, W]). After a tree-shaped verify block (jaxspec/tree.py), this
    moves the accepted path's entries to consecutive positions, so rollback stays a length."""
    rows = jnp.arange(source.shape[0])[:, None]  # [B, 1]
    width = source.shape[1]
    taken = buffer[:, rows, ..., start[:, None] + source, :]  # [B, W, L, ..., F]: the indexed axes come first
    return buffer.at[:, rows, ..., start[:, None] + jnp.arange(width)[None, :], :].set(taken, mode="drop")


def move_cache_entries(cache, start: jax.Array, source: jax.Array):
    """`move_entries` on every stack of a model's cache: a cache class whose arrays are not all [L, B, ..., S, F]
    (Gemma's per-position inputs) says how with its own `move_entries` method."""
    own = getattr(cache, "move_entries", None)
    if own is not None:
        return own(start, source)
    return jax.tree.map(lambda x: move_entries(x, start, source), cache)


def move_kv_entries(cache: KVCache, start: jax.Array, source: jax.Array) -> KVCache:
    """`move_entries` on both of a KVCache's stacks."""
    return KVCache(k=move_entries(cache.k, start, source), v=move_entries(cache.v, start, source))


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
    """Zero-filled latent cache for `size` positions per row of `num_layers` layers (`stack_layers` of them)."""
    layers = stack_layers(num_layers)
    return MLACache(
        latent=jnp.zeros((layers, batch, size, latent_dim), dtype),
        k_rope=jnp.zeros((layers, batch, size, rope_dim), dtype),
    )
