"""Building blocks shared by the model families: RMSNorm, rotary embeddings, cached attention, gated MLP, and the
config.json readers several families share (rope parameters, MTP depth).

Everything here is a pure function of arrays or of a config dict. Modules in the family files own the parameters
and call these.
Dimension letters: B batch, T query length, S cache length, D model width, H query heads, K kv heads
(in this file only), G = H // K query heads per kv head, Dh head width, F MLP width, V vocabulary.
"""

from __future__ import annotations

import contextvars
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from . import int8 as I


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as Llama defines it: normalise in float32, cast back, then scale (HF `LlamaRMSNorm`)."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Config readers that several families share (see also `rope_parameters`)


def num_mtp_layers(hf: dict[str, Any]) -> int:
    """MTP depth from config.json, read alike by every family with MTP layers (Llama/Qwen2 and the MoE families).
    HF's config classes default to 1 when the key is absent, but a checkpoint without the key has no MTP tensors to
    load, so jaxspec reads an absent key as 0."""
    value = hf.get("num_nextn_predict_layers", hf.get("num_mtp_layers", 0))
    if value is None or value < 0:
        raise ValueError(f"num_nextn_predict_layers={value!r} must be a non-negative integer.")
    return int(value)


# ----------------------------------------------------------------------------------------------------------------
# Rotary position embeddings


def rope_parameters(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 writes `rope_parameters`; older checkpoints write `rope_theta` and `rope_scaling`."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope.setdefault("rope_type", rope.get("type", "default"))
    if "partial_rotary_factor" in hf:
        rope.setdefault("partial_rotary_factor", hf["partial_rotary_factor"])
    return rope


def default_inv_freq(head_dim: int, theta: float, rotary_dim: int | None = None) -> jax.Array:
    """Inverse frequencies of the original RoPE, one per pair of rotated dimensions. [rotary_dim // 2]"""
    rotary_dim = rotary_dim or head_dim
    return 1.0 / (theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim))


def llama3_inv_freq(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> jax.Array:
    """Llama 3.1 frequency scaling: long wavelengths are divided by `factor`, short ones kept, the band between
    interpolated smoothly (HF `_compute_llama3_parameters`)."""
    inv_freq = default_inv_freq(head_dim, theta)
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return jnp.where(is_medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array, attention_scaling: float = 1.0) -> jax.Array:
    """Rotate the first `2 * len(inv_freq)` dims of x in HF's rotate-half layout; the rest pass through.

    x: [B, T, N, Dh], positions: [B, T] (absolute positions, so a row's cache index equals its position).
    """
    rotary_dim = 2 * inv_freq.shape[0]
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, T, rotary_dim/2]
    angles = jnp.concatenate([angles, angles], axis=-1)[:, :, None, :]  # [B, T, 1, rotary_dim]
    cos = (jnp.cos(angles) * attention_scaling).astype(x.dtype)
    sin = (jnp.sin(angles) * attention_scaling).astype(x.dtype)
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated_half = jnp.concatenate([-x_rot[..., half:], x_rot[..., :half]], axis=-1)
    out = x_rot * cos + rotated_half * sin
    return jnp.concatenate([out, x_pass], axis=-1) if x_pass.shape[-1] else out


# ----------------------------------------------------------------------------------------------------------------
# Attention over a position-indexed cache
#
# A cache is sized for the prompt bucket plus the whole budget, and decoding starts near its beginning: at a
# 4096-entry cache and a 200-token context, attention over every entry reads twenty times the keys and values it
# needs. `attend_live` runs the attention over the shortest static prefix of the cache that holds every query's keys
# (`key_extents`), chosen at run time, so a step costs what its context needs, not what its budget reserved. Keys
# past a query's position are masked either way: the result is the same attention. The choice is a branch per
# layer, which costs something of its own and compiles one attention per prefix, so a cache too short to gain from
# it is read whole and compiles only the one attention it always did. What a shorter prefix saves grows with the
# rows that read it, so a batch of BATCH_ROWS or more chooses among shorter prefixes, in shorter caches, than one row
# (see docs/design.md, 'Live-prefix attention').

PREFIX_FROM = 2048  # a cache of one to three rows chooses a prefix from this many entries ...
MIN_KEY_EXTENT = 512  # ... its shortest
BATCH_ROWS = 4  # a batch of at least this many rows chooses ...
BATCH_PREFIX_FROM_KEYS = 8192  # ... once its cache holds this many entries over all its rows ...
BATCH_MIN_KEY_EXTENT = 128  # ... among prefixes from this many entries, in caches of at least four of them


def key_extents(size: int, batch: int = 1) -> tuple[int, ...]:
    """The static prefixes of a `size`-entry cache of `batch` rows that attention chooses from, ascending: the
    shortest prefix doubled while shorter than `size`, then `size`; only `size` where the cache is too short to
    choose (PREFIX_FROM entries for one row; BATCH_PREFIX_FROM_KEYS over the rows of a batch)."""
    if batch >= BATCH_ROWS:
        shortest = BATCH_MIN_KEY_EXTENT
        chooses = batch * size >= BATCH_PREFIX_FROM_KEYS and size >= 4 * shortest
    else:
        shortest, chooses = MIN_KEY_EXTENT, size >= PREFIX_FROM
    if not chooses:
        return (size,)
    extents = []
    extent = shortest
    while extent < size:
        extents.append(extent)
        extent *= 2
    return (*extents, size)


def attend_live(attend, q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, *args,
                layer: int | jax.Array | None = None) -> jax.Array:
    """`attend(q, k, v, positions, *args)` over the cache prefix [0, E) for the smallest E in `key_extents` that
    holds every query's position; `attend` masks by the cache size it is given. positions: [B, T] (a tree block's
    slots), whose rows size the prefixes.

    k_cache, v_cache: one layer's caches with positions second to last (a `KVCache` layer's [B, K, S, Dh], MLA's
    latent [B, S, R] and rope key [B, S, Dr]), or stacks of them on a leading layers axis, read at `layer`. The
    caches enter the branches whole and each branch slices its own prefix, so no branch copies more than its prefix.
    """
    size = k_cache.shape[-2]
    extents = key_extents(size, batch=positions.shape[0])

    def prefix(cache: jax.Array, extent: int) -> jax.Array:
        return cache[..., :extent, :] if layer is None else cache[layer, ..., :extent, :]

    def branch(extent: int):
        return lambda q, k, v, p: attend(q, prefix(k, extent), prefix(v, extent), p, *args)

    if len(extents) == 1:
        return branch(size)(q, k_cache, v_cache, positions)
    needed = jnp.max(positions) + 1  # positions past the cache (dropped writes of padding rows) take the whole cache
    choice = jnp.minimum(jnp.searchsorted(jnp.asarray(extents), needed), len(extents) - 1)
    return jax.lax.switch(choice, [branch(e) for e in extents], q, k_cache, v_cache, positions)


def grouped_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, visible: jax.Array, scale: float,
                      softcap: float | None = None) -> jax.Array:
    """Grouped-query attention of T queries over the S entries of one layer's cache, where `visible` allows.

    q: [B, T, H, Dh]; k_cache: [B, K, S, Dh]; v_cache: [B, K, S, Dv]; visible: [B, T, S] bool. Scores are scaled,
    soft-capped (`softcap`; None: not), then masked. Returns [B, T, H, Dv].

    Both products keep (B, K) as their leading batch axes, in operands and result alike, so XLA takes the layer's
    keys and values as they lie, untransposed (jaxspec/cache.py); the result is put in query order afterwards, a
    transpose of T x H x Dv numbers. Asking the product itself for [B, T, K, G, Dv] made XLA:CPU compute it
    transposed, from a transposed copy of the values.
    """
    b, t, h, dh = q.shape
    kv_heads = k_cache.shape[1]
    q = q.reshape(b, t, kv_heads, h // kv_heads, dh)  # [B, T, K, G, Dh]
    scores = jnp.einsum("btkgd,bksd->bkgts", q, k_cache, preferred_element_type=jnp.float32) * scale
    scores = soft_cap(scores, softcap)
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)  # [B, K, G, T, S]
    weights = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    out = jnp.einsum("bkgts,bksd->bkgtd", weights, v_cache)  # [B, K, G, T, Dv]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, v_cache.shape[-1])


def cached_attention(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, scale: float
) -> jax.Array:
    """Causal grouped-query attention of T new queries against a cache that already holds them.

    q: [B, T, H, Dh]; k_cache: [B, K, S, Dh]; v_cache: [B, K, S, Dv]; positions: [B, T]. The cache index is the
    absolute position, so the causal mask alone (key index <= query position) selects every live entry: entries
    past a row's committed length are stale drafts or padding and sit at later positions, where no query looks.
    Returns [B, T, H, Dv].
    """
    return grouped_attention(q, k_cache, v_cache, causal_window(positions, k_cache.shape[2]), scale)


def gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """SwiGLU MLP: down(silu(x @ gate) * (x @ up)). x: [..., D], w_gate/w_up: [D, F], w_down: [F, D]."""
    return _gated_mlp(x, w_gate, w_up, w_down, jax.nn.silu)


def _gated_mlp(x: jax.Array, w_gate, w_up, w_down, activation) -> jax.Array:
    """down(activation(x @ gate) * (x @ up)). x: [..., D] -> [..., D]."""
    gate, up = I.project_group("...d,df->...f", x, (w_gate, w_up))
    return I.project("...f,fd->...d", activation(gate) * up, w_down)


# ----------------------------------------------------------------------------------------------------------------
# YaRN rope scaling and attention over a window of a position-indexed cache (DeepSeek-V3, GLM-4.5, their MTP layers)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction `0.1 * mscale * ln(scale) + 1` (1 when not extending), HF `get_mscale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_inv_freq(
    rotary_dim: int,
    theta: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> jax.Array:
    """YaRN frequencies (HF `_compute_yarn_parameters`): high frequencies (many rotations within the original
    context) are kept, low ones divided by `factor`, with a linear ramp between the two correction dims.
    [rotary_dim // 2]"""

    def correction_dim(num_rotations):
        return rotary_dim * math.log(original_max_position_embeddings / (num_rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # HF's guard against a zero-width ramp
    ramp = jnp.clip((jnp.arange(rotary_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    pos_freqs = theta ** (jnp.arange(0, rotary_dim, 2, dtype=jnp.float32) / rotary_dim)
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def causal_window(positions: jax.Array, size: int, first: int | jax.Array = 0) -> jax.Array:
    """Keys each query sees in a position-indexed cache of `size` entries: `first <= key <= query position`.
    [B, T, S]. `first` > 0 hides entries that are never written: an MTP depth k has no entry below position k+1."""
    key_index = jnp.arange(size)
    return (key_index >= first) & (key_index[None, None, :] <= positions[:, :, None])


def cached_attention_window(
    q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array, scale: float, first: int | jax.Array
) -> jax.Array:
    """`cached_attention` over keys in [first, query position] only (see `causal_window`).

    q: [B, T, H, Dh]; k_cache: [B, K, S, Dh]; v_cache: [B, K, S, Dv]; positions: [B, T]. Returns [B, T, H, Dv].
    """
    return grouped_attention(q, k_cache, v_cache, causal_window(positions, k_cache.shape[2], first), scale)


# ----------------------------------------------------------------------------------------------------------------
# Gemma-family parts: float32 norms with an optional unit offset, soft-capping, GELU-tanh MLP, sliding windows
#
# Sliding-window attention masks keys outside the window in the full-size, position-indexed cache; it does not keep
# a ring of window + K + 1 entries. Why:
# - the cache index stays the absolute position, so rollback after a rejected draft stays a length, and every
#   drafter that shares or reads the target's cache (early exit writes it, the Gemma 4 drafter reads it) works
#   unchanged for windowed layers;
# - a prompt longer than the window needs no separate prefill path (a block of T > window + K + 1 tokens written
#   into a ring overwrites entries that earlier queries of the same block still need);
# - the cost is memory and attention reads of S entries instead of window + K + 1 for windowed layers. Decoding reads
#   every weight once per step; at the context lengths jaxspec sizes its caches for (prompt bucket + budget), the
#   key/value reads of the windowed layers are a small fraction of that. A ring pays off only for contexts far
#   longer than the window, where it is the next step.


def gemma_rms_norm(x: jax.Array, weight: jax.Array | None, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm as the Gemma family computes it (HF `Gemma2RMSNorm` .. `Gemma4RMSNorm`): normalise and scale in float32,
    then cast back (Llama casts before scaling). The scale is `offset + weight`: Gemma 2 and 3 store w and scale by
    1 + w (offset 1), Gemma 4 stores the scale itself (offset 0). `weight=None` normalises without scaling."""
    x32 = x.astype(jnp.float32)
    normed = x32 * jnp.power(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps, -0.5)
    if weight is not None:
        normed = normed * (offset + weight.astype(jnp.float32))
    return normed.astype(x.dtype)


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """`cap * tanh(x / cap)`: bounds logits smoothly to (-cap, cap); None leaves x unchanged."""
    return x if cap is None else jnp.tanh(x / cap) * cap


def gelu_gated_mlp(x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array) -> jax.Array:
    """GeGLU MLP with the tanh GELU (HF `gelu_pytorch_tanh`): down(gelu(x @ gate) * (x @ up))."""
    return _gated_mlp(x, w_gate, w_up, w_down, functools.partial(jax.nn.gelu, approximate=True))


def proportional_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float, factor: float = 1.0) -> jax.Array:
    """Gemma 4's "proportional" RoPE (HF `_compute_proportional_rope_parameters`): the first
    `partial_rotary_factor * head_dim / 2` frequencies follow `theta ** (-2i / head_dim)` (the exponent is over the
    whole head, not over the rotated part), the rest are 0 so their pairs pass through unrotated. Rotation is over
    the whole head in rotate-half layout, so pair i is (i, i + head_dim / 2). [head_dim // 2]"""
    rotated = int(partial_rotary_factor * head_dim // 2)
    inv_freq = 1.0 / (theta ** (jnp.arange(0, 2 * rotated, 2, dtype=jnp.float32) / head_dim))
    inv_freq = jnp.concatenate([inv_freq, jnp.zeros(head_dim // 2 - rotated, jnp.float32)])
    return inv_freq / factor


def sliding_window_mask(positions: jax.Array, size: int, window: int | None) -> jax.Array:
    """Keys each query sees in a position-indexed cache of `size` entries: `query - window < key <= query`, i.e. the
    query and the `window - 1` positions before it (HF `sliding_window_overlay`); `window=None` is plain causal.
    [B, T, S]"""
    key_index = jnp.arange(size)[None, None, :]
    visible = key_index <= positions[:, :, None]
    if window is not None:
        visible &= key_index > positions[:, :, None] - window
    return visible


def windowed_attention(
    q: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> jax.Array:
    """`cached_attention` with an optional sliding window (`sliding_window_mask`) and an optional soft-cap of the
    scaled scores before masking (Gemma 2's `attn_logit_softcapping`).

    q: [B, T, H, Dh]; k_cache: [B, K, S, Dh]; v_cache: [B, K, S, Dv]; positions: [B, T]. Returns [B, T, H, Dv].
    Entries past a row's committed length are stale drafts or padding at later positions, which no query sees.
    """
    visible = sliding_window_mask(positions, k_cache.shape[2], window)  # [B, T, S]
    return grouped_attention(q, k_cache, v_cache, visible, scale, softcap)


def tree_visibility(start: jax.Array, ancestors: jax.Array, positions: jax.Array, size: int,
                    window: int | None = None) -> jax.Array:
    """Keys each entry of a tree-shaped verify block sees (jaxspec/tree.py `TreeBlock`): the committed entries, in
    slots below `start`, and the block's entries that are the entry itself or its ancestors. [B, W, S]

    start [B]: the slot of the block's entry 0 (entry j sits in slot start + j); ancestors [B, W, W] bool; positions
    [B, W]: the entries' rope positions (start + depth), by which a sliding `window` measures distance (a committed
    entry's position is its slot)."""
    width = positions.shape[1]
    rel = jnp.arange(size)[None, :] - start[:, None]  # [B, S]: the block entry in each slot
    in_block = (rel >= 0) & (rel < width)
    entry = jnp.clip(rel, 0, width - 1)
    related = jnp.take_along_axis(ancestors, jnp.broadcast_to(entry[:, None, :], (*positions.shape, size)), axis=2)
    visible = (rel < 0)[:, None, :] | (in_block[:, None, :] & related)
    if window is not None:
        key_position = jnp.where(in_block, jnp.take_along_axis(positions, entry, axis=1), jnp.arange(size)[None, :])
        visible &= key_position[:, None, :] > positions[:, :, None] - window
    return visible


def tree_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, slots: jax.Array, scale: float,
                   start: jax.Array, ancestors: jax.Array, positions: jax.Array, window: int | None = None,
                   softcap: float | None = None) -> jax.Array:
    """Grouped-query attention of a tree-shaped verify block whose entries were written at `slots` [B, W]
    (start + 0 .. W-1): see `tree_visibility`; `softcap` as in `windowed_attention`. q: [B, W, H, Dh]; k_cache,
    v_cache: [B, K, S, Dh]. `slots` is what `attend_live` sizes the cache prefix by. Returns [B, W, H, Dv]."""
    del slots  # every slot a query may see is below start + W, which attend_live's prefix holds
    visible = tree_visibility(start, ancestors, positions, k_cache.shape[2], window)
    return grouped_attention(q, k_cache, v_cache, visible, scale, softcap)


def spread_to_vocab(logits: jax.Array, ids: jax.Array, vocab_size: int) -> jax.Array:
    """Logits over a reduced vocabulary [..., V'] at target token ids [V'] (distinct) -> logits over the whole
    vocabulary [..., V], -inf at every id outside it.

    A gather through the inverse map, not a scatter of `logits` into a -inf array: the scatter takes its updates as
    [V', B] windows, so XLA computes the product that makes `logits` transposed, [V', D] x [D, B], a layout XLA:CPU
    multiplies slowly at a few rows: an EAGLE-3 head's draft then cost more than a target step at batch 8
    (docs/design.md, 'Spreading the draft vocabulary').
    """
    draft_size = ids.shape[0]
    inverse = jnp.full((vocab_size,), draft_size, jnp.int32).at[ids].set(jnp.arange(draft_size, dtype=jnp.int32))
    padded = jnp.concatenate([logits, jnp.full((*logits.shape[:-1], 1), -jnp.inf, logits.dtype)], axis=-1)
    return jnp.take(padded, inverse, axis=-1)  # [..., V]: entry V' is the -inf column


# True while `abstract_module` builds a module: fresh params are then only their shapes and dtypes.
_SHAPES_ONLY = contextvars.ContextVar("jaxspec_shapes_only", default=False)


def abstract_module(build: Callable[[], Any]) -> Any:
    """The module `build()` makes, every param a `jax.ShapeDtypeStruct`: what `nnx.eval_shape(build)` gives, without
    tracing each param's initialiser. Loading fills a module built this way (and builds one again to attach MTP
    layers), and tracing a model's random initialisers took most of a build (docs/design.md, 'Loading before the
    compile'). The families' initialisers (`init_value`, `shapes_only`) honour it; tests/models/test_model_interface.py
    checks every family against `nnx.eval_shape`."""
    token = _SHAPES_ONLY.set(True)
    try:
        return build()
    finally:
        _SHAPES_ONLY.reset(token)


def shapes_only(shape: tuple[int, ...], dtype) -> jax.ShapeDtypeStruct | None:
    """Inside `abstract_module`, what a fresh param of `shape` and `dtype` stands for; None otherwise (initialise
    it for real)."""
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) if _SHAPES_ONLY.get() else None


class DraftVocab(nnx.Variable):
    """The target token ids [V'] of a draft vocabulary (drafts may propose only these); not a trained parameter."""


def initial_ids(size: int) -> jax.Array | jax.ShapeDtypeStruct:
    """Token ids 0 .. size-1, a draft vocabulary's map before loading replaces it (its shape, in `abstract_module`)."""
    if (abstract := shapes_only((size,), jnp.int32)) is not None:
        return abstract
    return jnp.arange(size, dtype=jnp.int32)


def init_value(name: str, shape: tuple[int, ...], dtype, rngs) -> jax.Array | jax.ShapeDtypeStruct:
    """A fresh parameter by the naming convention the families share: norms start at one, biases (`b*`) at zero,
    matrices small and random (`rngs`: an nnx.Rngs). Loading replaces every value; this only gives shapes and
    dtypes something to hold (only that, inside `abstract_module`)."""
    if (abstract := shapes_only(shape, dtype)) is not None:
        return abstract
    if "norm" in name:
        return jnp.ones(shape, dtype)
    if name.startswith("b"):
        return jnp.zeros(shape, dtype)
    return (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)


# Logical axes of a grouped-query attention block's params (GLM-4.5, the DFlash drafters); biases and q/k norms are
# present where the family's config has them.
GQA_ATTENTION_AXES: dict[str, tuple[str, ...]] = {
    "wq": ("embed", "heads", "head_dim"),
    "wk": ("embed", "kv_heads", "head_dim"),
    "wv": ("embed", "kv_heads", "head_dim"),
    "bq": ("heads", "head_dim"),
    "bk": ("kv_heads", "head_dim"),
    "bv": ("kv_heads", "head_dim"),
    "q_norm": ("head_dim",),
    "k_norm": ("head_dim",),
    "wo": ("heads", "head_dim", "embed"),
}
