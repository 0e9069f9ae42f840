"""Gemma 2, Gemma 3 (text) and Gemma 4 (text) decoders, as HF transformers 5.23 defines them.

One config reader and one layer recipe serve the three families; what differs is a handful of switches:

| | Gemma 2 | Gemma 3 | Gemma 4 |
|---|---|---|---|
| norms (float32, then cast) | scale 1 + w | scale 1 + w | scale w |
| q/k norm, v norm | - | q, k | q, k, v (unscaled) |
| attention scale | query_pre_attn_scalar^-0.5 | same | 1 |
| soft-caps | attention scores, final logits | final logits if set | final logits if set |
| rope | one | per layer type (linear scaling) | per layer type (proportional on full layers) |
| per layer | - | - | per-layer inputs (PLE), KV sharing, layer scalar, own head width |

Every family has pre- and post-norms around attention and MLP, embeddings scaled by sqrt(hidden) in the param
dtype, and a tanh-GELU gated MLP. Layers are "sliding_attention" (a window of `sliding_window` keys ending at the
query) or "full_attention".

Sliding windows are masks over the full-size position-indexed cache (`layers.windowed_attention`), not rings of
window + K + 1 entries. The cache index stays the absolute position, so rolling back a rejected draft stays a
length and every drafter that writes or reads the target's cache (early exit, the Gemma 4 drafter) works unchanged;
a prompt longer than the window needs no separate prefill path (a block longer than a ring overwrites entries its
own earlier queries need). The price is cache memory and attention reads of S entries instead of window + K + 1 in
windowed layers: small next to the weights read per step at the cache sizes jaxspec allocates (prompt bucket +
budget), large only for contexts far beyond the window, where a ring is the next step. Qwen2's
`use_sliding_window` uses the same attention.

The cache (`GemmaCache`) holds one position-indexed stack per attention type, with an entry only for layers that
compute their own keys and values: Gemma 4's last `num_kv_shared_layers` layers attend to the entries of the last
earlier layer of their own type (its "store" layer) and have no k/v projections.

For the Gemma 4 MTP drafter (HF `Gemma4AssistantForCausalLM`, driven by `SinglePositionMultiTokenCandidateGenerator`
in transformers/generation/candidate_generator.py), what it reads from the target is available here:
- the shared KV states of each attention type: `module.shared_kv(cache, "sliding_attention" | "full_attention")`
  gives `(k, v)`, each `[B, kv_heads, S, head_dim]` (the cache's layout, jaxspec/cache.py), the target cache of
  `cfg.kv_store_layer(type)`. They are position-indexed (entry p holds position p, already k-normed, v-normed and
  rotated), valid below each row's committed length - 1; entries at or past it are stale drafts or zeros. HF's
  drafter sees, for sliding layers, only the last `sliding_window + 1` entries: mask them with
  `layers.sliding_window_mask` or your own rule.
  HF marks store layers only when `num_kv_shared_layers > 0`; a drafter should refuse a target without sharing, as
  HF does (`cfg.num_kv_shared_layers == 0`).
- the target's last hidden state: the `hidden` output of `module(tokens, positions, cache)` (final-normed, the
  one HF's drafter reads from `hidden_states[-1]`); the decode loop hands it to drafters as `Prefill.hidden` and
  `RoundResult.hidden`.
- the target's token embedding with its sqrt(hidden) scale (HF `get_input_embeddings()(token)`):
  `module.input_embeddings(tokens)`. For a Gemma 4 with per-layer inputs, `embed_tokens` returns more than that
  (see below), so drafters that need just the embedding call `input_embeddings`.

Per-layer inputs (Gemma 4 PLE) depend on the token ids, which `run_layers` does not receive. `embed_tokens` therefore
returns `[B, T, D + L * P]`: the scaled embedding followed by every layer's per-layer input, packed. `run_layers`
takes that packed array, or a `[B, T, D]` hidden state when it starts past layer 0 (early exit's verification); in
the second case it reads the per-layer inputs from the cache, where the run from layer 0 that produced the hidden
state wrote them (only runs that stop before the last layer write them). It always returns `[B, T, D]`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.cache import KVCache, init_kv_cache, move_entries, move_kv_entries, write_kv

from . import int8 as I
from . import layers as L

SLIDING, FULL = "sliding_attention", "full_attention"
LAYER_TYPES = (SLIDING, FULL)
FAMILIES = ("gemma2", "gemma3_text", "gemma4_text")


# ----------------------------------------------------------------------------------------------------------------
# Config


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    rope_type: str  # "default", "linear" (Gemma 3 global layers) or "proportional" (Gemma 4 full layers)
    theta: float
    factor: float = 1.0
    partial_rotary_factor: float = 1.0

    def inv_freq(self, head_dim: int) -> jax.Array:
        """[head_dim // 2]; every type rotates the whole head in rotate-half layout."""
        if self.rope_type == "proportional":
            return L.proportional_inv_freq(head_dim, self.theta, self.partial_rotary_factor, self.factor)
        return L.default_inv_freq(head_dim, self.theta) / self.factor


@dataclasses.dataclass(frozen=True)
class AttentionKind:
    """What one attention type's layers share: head width, kv heads, window (None: global) and rope."""

    head_dim: int
    num_kv_heads: int
    window: int | None
    rope: RopeSpec


@dataclasses.dataclass(frozen=True)
class GemmaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    sliding: AttentionKind
    full: AttentionKind
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    norm_offset: float  # 1.0: norms scale by 1 + w (Gemma 2, 3); 0.0: by w (Gemma 4)
    qk_norm: bool
    v_norm: bool
    layer_scalar: bool
    per_layer_input_size: int = 0  # P; 0 without per-layer inputs
    per_layer_vocab_size: int = 0
    num_kv_shared_layers: int = 0
    k_eq_v: bool = False  # full-attention layers use the key projection as values
    double_wide_mlp: bool = False  # KV-shared layers have a twice wider MLP
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "GemmaConfig":
        """Build from a config.json dict (HF 5.23's layout, or the older keys it still reads); raise on anything
        this implementation would silently get wrong."""
        model_type = hf.get("model_type")
        if model_type not in FAMILIES:
            raise ValueError(f"GemmaConfig cannot read model_type={model_type!r}; expected one of {FAMILIES}.")
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise NotImplementedError(f"hidden_activation={act!r} is not supported; Gemma uses 'gelu_pytorch_tanh'.")
        if hf.get("attention_bias"):
            raise NotImplementedError("attention_bias=True is not supported for Gemma checkpoints.")
        if hf.get("use_bidirectional_attention") in (True, "all"):  # Gemma 4's "vision" leaves text causal
            raise NotImplementedError("use_bidirectional_attention (Gemma embedding models) is not supported: "
                                      "jaxspec decodes causally.")
        reader = {"gemma2": _gemma2_fields, "gemma3_text": _gemma3_fields, "gemma4_text": _gemma4_fields}[model_type]
        fields = reader(hf)
        num_layers = hf["num_hidden_layers"]
        if len(fields["layer_types"]) != num_layers or not set(fields["layer_types"]) <= set(LAYER_TYPES):
            raise ValueError(f"layer_types must list {num_layers} entries of {LAYER_TYPES}; got {fields['layer_types']}.")
        eos = hf.get("eos_token_id", 1)
        cfg = cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=num_layers,
            num_heads=hf["num_attention_heads"],
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            bos_token_id=hf.get("bos_token_id", 2),
            eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            pad_token_id=hf.get("pad_token_id", 0),
            **fields,
        )
        cfg._check_kv_sharing()
        return cfg

    # -- per-layer structure --------------------------------------------------------------------------------------

    def kind(self, layer: int) -> AttentionKind:
        return self.sliding if self.layer_types[layer] == SLIDING else self.full

    @property
    def first_shared_layer(self) -> int:
        return self.num_layers - self.num_kv_shared_layers

    def computes_kv(self, layer: int) -> bool:
        """Whether the layer projects its own keys and values (and owns a cache entry)."""
        return layer < self.first_shared_layer

    def kv_store_layer(self, layer_type: str) -> int | None:
        """The last layer of `layer_type` that computes its own keys and values: KV-shared layers of that type
        attend to its cache entries (HF's "store" layer). None when no layer of that type computes keys."""
        owners = [i for i in range(self.first_shared_layer) if self.layer_types[i] == layer_type]
        return owners[-1] if owners else None

    def kv_source(self, layer: int) -> int:
        """The layer whose cache entries `layer` attends to: itself, or its type's store layer."""
        return layer if self.computes_kv(layer) else self.kv_store_layer(self.layer_types[layer])

    def cache_slot(self, layer: int) -> int:
        """Index of `kv_source(layer)` in its attention type's cache stack."""
        source = self.kv_source(layer)
        return sum(1 for i in range(source) if self.layer_types[i] == self.layer_types[source])

    def cache_layers(self, layer_type: str) -> int:
        """How many layers of `layer_type` own a cache entry."""
        return sum(1 for i in range(self.first_shared_layer) if self.layer_types[i] == layer_type)

    def has_value_proj(self, layer: int) -> bool:
        return self.computes_kv(layer) and not (self.k_eq_v and self.layer_types[layer] == FULL)

    def mlp_width(self, layer: int) -> int:
        return self.intermediate_size * (2 if self.double_wide_mlp and not self.computes_kv(layer) else 1)

    @property
    def layer_period(self) -> int:
        """The shortest P for which layer i has layer i - P's type, for every i >= P: 2 for Gemma 2's alternating
        layers, 6 for Gemma 3's five sliding layers to one global."""
        types = self.layer_types
        return next(p for p in range(1, len(types) + 1) if types[p:] == types[:len(types) - p])

    @property
    def loops_layers(self) -> bool:
        """Whether wide forwards may loop over whole periods of layers (`_looped_periods`): every layer projects and
        owns its keys and values, and none reads a per-layer input. Gemma 2 and 3; not Gemma 4's PLE, KV-sharing or
        k_eq_v layers, which differ from period to period."""
        return not (self.per_layer_input_size or self.num_kv_shared_layers or self.k_eq_v)

    def whole_periods(self, start: int, stop: int) -> tuple[int, int]:
        """[first, last): the layers of [start, stop) that make up whole periods (`layer_period`), aligned at layer
        0; first == last when none do."""
        period = self.layer_period
        first = min(-(-start // period) * period, stop)
        return first, first + (stop - first) // period * period

    def _check_kv_sharing(self) -> None:
        if not 0 <= self.num_kv_shared_layers < self.num_layers:
            raise ValueError(f"num_kv_shared_layers={self.num_kv_shared_layers} must be in [0, {self.num_layers}).")
        for layer in range(self.first_shared_layer, self.num_layers):
            if self.kv_store_layer(self.layer_types[layer]) is None:
                raise ValueError(f"layer {layer} ({self.layer_types[layer]}) shares keys and values, but no earlier "
                                 "layer of its type computes them (num_kv_shared_layers is too large).")


def _layer_types(hf: dict[str, Any], default_pattern: int) -> tuple[str, ...]:
    """`layer_types` as written, else HF's default: every `pattern`-th layer global, the others sliding."""
    if hf.get("layer_types"):
        return tuple(hf["layer_types"])
    pattern = hf.get("sliding_window_pattern", default_pattern)
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"]))


def _rope_spec(params: dict[str, Any], supported: tuple[str, ...], where: str) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in supported:
        raise NotImplementedError(f"rope type {rope_type!r} for {where} is not supported; supported: {supported}.")
    if rope_type == "linear" and params.get("partial_rotary_factor", 1.0) != 1.0:
        raise NotImplementedError("linear rope scaling with partial_rotary_factor != 1 is not supported.")
    return RopeSpec(
        rope_type=rope_type,
        theta=float(params["rope_theta"]),
        factor=float(params.get("factor", 1.0)) if rope_type != "default" else 1.0,
        partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
    )


def _per_type_rope(hf: dict[str, Any], defaults: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """`rope_parameters` keyed by layer type (HF 5 layout). Gemma 3 configs written before it carry `rope_theta`
    (global), `rope_local_base_freq` (local) and `rope_scaling` (global layers only); read them as HF does."""
    rope = hf.get("rope_parameters")
    if rope is not None and not set(rope) <= set(LAYER_TYPES):
        raise ValueError(f"rope_parameters must be keyed by layer type {LAYER_TYPES}; got keys {sorted(rope)}.")
    rope = {t: dict((rope or {}).get(t) or {}) for t in LAYER_TYPES}
    if hf.get("rope_scaling"):
        rope[FULL].update(hf["rope_scaling"])
    for t in LAYER_TYPES:
        for key, value in defaults[t].items():
            rope[t].setdefault(key, value)
    return rope


def _gemma2_fields(hf: dict[str, Any]) -> dict[str, Any]:
    head_dim = hf.get("head_dim", 256)
    kv_heads = hf.get("num_key_value_heads", 4)
    rope = _rope_spec(L.rope_parameters(hf), ("default",), "Gemma 2")
    return dict(
        layer_types=_layer_types(hf, default_pattern=2),
        sliding=AttentionKind(head_dim, kv_heads, hf.get("sliding_window", 4096), rope),
        full=AttentionKind(head_dim, kv_heads, None, rope),
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        attn_softcap=hf.get("attn_logit_softcapping", 50.0),
        final_softcap=hf.get("final_logit_softcapping", 30.0),
        norm_offset=1.0,
        qk_norm=False,
        v_norm=False,
        layer_scalar=False,
    )


def _gemma3_fields(hf: dict[str, Any]) -> dict[str, Any]:
    head_dim = hf.get("head_dim", 256)
    kv_heads = hf.get("num_key_value_heads", 4)
    rope = _per_type_rope(hf, {
        FULL: {"rope_type": "default", "rope_theta": hf.get("rope_theta", 1_000_000.0)},
        SLIDING: {"rope_type": "default", "rope_theta": hf.get("rope_local_base_freq", 10_000.0)},
    })
    supported = ("default", "linear")
    return dict(
        layer_types=_layer_types(hf, default_pattern=6),
        sliding=AttentionKind(head_dim, kv_heads, hf.get("sliding_window", 4096),
                              _rope_spec(rope[SLIDING], supported, "Gemma 3 sliding layers")),
        full=AttentionKind(head_dim, kv_heads, None, _rope_spec(rope[FULL], supported, "Gemma 3 global layers")),
        query_scale=float(hf.get("query_pre_attn_scalar", 256)) ** -0.5,
        # Gemma 3's attention never passes `attn_logit_softcapping` on in transformers 5.23, so it is ignored here too.
        attn_softcap=None,
        final_softcap=hf.get("final_logit_softcapping"),
        norm_offset=1.0,
        qk_norm=True,
        v_norm=False,
        layer_scalar=False,
    )


_GEMMA4_OVERRIDES = ("head_dim", "num_key_value_heads")


def _gemma4_fields(hf: dict[str, Any]) -> dict[str, Any]:
    if hf.get("enable_moe_block"):
        raise NotImplementedError("Gemma 4 MoE blocks (enable_moe_block=True) are not supported yet.")
    layer_types = list(_layer_types(hf, default_pattern=6))
    layer_types[-1] = FULL  # HF forces the last layer global (with a warning)
    head_dim = hf.get("head_dim", 256)
    kv_heads = hf.get("num_key_value_heads", 4)
    k_eq_v = bool(hf.get("attention_k_eq_v", False))
    # Full-attention layers override head_dim (and kv heads): 5.23 writes the overrides per layer in
    # `per_layer_config`; earlier configs write `global_head_dim` (default 512) and `num_global_key_value_heads`.
    overrides = hf.get("per_layer_config")
    if overrides is None:
        full_override = {"head_dim": hf.get("global_head_dim", 512)}
        if k_eq_v and hf.get("num_global_key_value_heads") is not None:
            full_override["num_key_value_heads"] = hf["num_global_key_value_heads"]
        overrides = {str(i): full_override for i, t in enumerate(layer_types) if t == FULL}
    per_type: dict[str, set[tuple[int, int]]] = {t: set() for t in LAYER_TYPES}
    for i, t in enumerate(layer_types):
        override = dict(overrides.get(str(i), overrides.get(i)) or {})
        unknown = set(override) - set(_GEMMA4_OVERRIDES)
        if unknown:
            raise NotImplementedError(f"per_layer_config overrides {sorted(unknown)} for layer {i} are not supported; "
                                      f"only {_GEMMA4_OVERRIDES}.")
        per_type[t].add((override.get("head_dim", head_dim), override.get("num_key_value_heads", kv_heads)))
    if any(len(shapes) > 1 for shapes in per_type.values()):
        raise NotImplementedError(f"layers of one attention type with different head shapes are not supported: "
                                  f"{ {t: sorted(s) for t, s in per_type.items()} }.")
    shape = {t: next(iter(s)) if s else (head_dim, kv_heads) for t, s in per_type.items()}
    rope = hf.get("rope_parameters") or {  # HF's default replaces the whole dict; it is not merged key by key
        SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
        FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
    }
    if set(rope) != set(LAYER_TYPES):
        raise ValueError(f"rope_parameters must be keyed by layer type {LAYER_TYPES}; got keys {sorted(rope)}.")
    supported = ("default", "linear", "proportional")
    per_layer_size = hf.get("hidden_size_per_layer_input", 256) or 0
    per_layer_vocab = hf.get("vocab_size_per_layer_input", 262_144) or 0
    if per_layer_size and per_layer_vocab < hf["vocab_size"]:
        raise NotImplementedError(f"vocab_size_per_layer_input ({per_layer_vocab}) below vocab_size "
                                  f"({hf['vocab_size']}) is not supported: some tokens would have no per-layer input.")
    return dict(
        layer_types=tuple(layer_types),
        sliding=AttentionKind(*shape[SLIDING], hf.get("sliding_window", 512),
                              _rope_spec(rope[SLIDING], supported, "Gemma 4 sliding layers")),
        full=AttentionKind(*shape[FULL], None, _rope_spec(rope[FULL], supported, "Gemma 4 full layers")),
        query_scale=1.0,
        attn_softcap=None,
        final_softcap=hf.get("final_logit_softcapping"),
        norm_offset=0.0,
        qk_norm=True,
        v_norm=True,
        layer_scalar=True,
        per_layer_input_size=per_layer_size,
        per_layer_vocab_size=per_layer_vocab if per_layer_size else 0,
        num_kv_shared_layers=hf.get("num_kv_shared_layers", 0) or 0,
        k_eq_v=k_eq_v,
        double_wide_mlp=bool(hf.get("use_double_wide_mlp", False)),
    )


# ----------------------------------------------------------------------------------------------------------------
# Parameters: name -> (shape, logical axes). Layers differ (head width per type, KV-shared layers own no k/v), so
# each layer lists its own.


def top_param_specs(cfg: GemmaConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    d, v = cfg.hidden_size, cfg.vocab_size
    specs = {"embed": ((v, d), ("vocab", "embed")), "final_norm": ((d,), ("embed",))}
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((d, v), ("embed", "vocab"))
    if cfg.per_layer_input_size:
        packed = cfg.num_layers * cfg.per_layer_input_size  # every layer's input side by side
        specs["ple_embed"] = ((cfg.per_layer_vocab_size, packed), ("vocab", "layers"))
        specs["ple_model_proj"] = ((d, packed), ("embed", "layers"))
        specs["ple_proj_norm"] = ((cfg.per_layer_input_size,), ("head_dim",))
    return specs


def layer_param_specs(cfg: GemmaConfig, layer: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    d, h, f = cfg.hidden_size, cfg.num_heads, cfg.mlp_width(layer)
    kind = cfg.kind(layer)
    k, dh = kind.num_kv_heads, kind.head_dim
    specs = {
        "attn_norm": ((d,), ("embed",)),
        "wq": ((d, h, dh), ("embed", "heads", "head_dim")),
        "wo": ((h, dh, d), ("heads", "head_dim", "embed")),
        "post_attn_norm": ((d,), ("embed",)),
        "mlp_norm": ((d,), ("embed",)),
        "w_gate": ((d, f), ("embed", "mlp")),
        "w_up": ((d, f), ("embed", "mlp")),
        "w_down": ((f, d), ("mlp", "embed")),
        "post_mlp_norm": ((d,), ("embed",)),
    }
    if cfg.qk_norm:
        specs["q_norm"] = ((dh,), ("head_dim",))
    if cfg.computes_kv(layer):
        specs["wk"] = ((d, k, dh), ("embed", "kv_heads", "head_dim"))
        if cfg.qk_norm:
            specs["k_norm"] = ((dh,), ("head_dim",))
    if cfg.has_value_proj(layer):
        specs["wv"] = ((d, k, dh), ("embed", "kv_heads", "head_dim"))
    if cfg.layer_scalar:
        specs["layer_scalar"] = ((1,), ("embed",))
    if cfg.per_layer_input_size:
        p = cfg.per_layer_input_size
        specs["ple_gate"] = ((d, p), ("embed", "head_dim"))
        specs["ple_proj"] = ((p, d), ("head_dim", "embed"))
        specs["ple_post_norm"] = ((d,), ("embed",))
    return specs


def _init_value(name: str, shape: tuple[int, ...], cfg: GemmaConfig, dtype, rngs: nnx.Rngs) -> jax.Array:
    """Random init for tests and abstract shapes; a norm starts at scale 1 (w = 0 when the scale is 1 + w)."""
    if (abstract := L.shapes_only(shape, dtype)) is not None:
        return abstract
    if "norm" in name or name == "layer_scalar":
        return jnp.full(shape, 0.0 if "norm" in name and cfg.norm_offset else 1.0, dtype)
    return (0.02 * jax.random.normal(rngs.params(), shape)).astype(dtype)


# ----------------------------------------------------------------------------------------------------------------
# Cache


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class GemmaCache:
    """Position-indexed keys and values per attention type (their head widths may differ), for the layers that
    compute their own (`GemmaConfig.cache_slot` maps a layer to its entry), plus Gemma 4's packed per-layer inputs
    per position ([B, S, 0] without them) for runs that resume past layer 0."""

    sliding: KVCache
    full: KVCache
    per_layer_inputs: jax.Array  # [B, S, L * P]

    @property
    def size(self) -> int:
        return self.per_layer_inputs.shape[1]

    @staticmethod
    def logical_axes() -> "GemmaCache":
        return GemmaCache(sliding=KVCache.logical_axes(), full=KVCache.logical_axes(),  # type: ignore[arg-type]
                          per_layer_inputs=("batch", "seq", "layers"))

    def stack(self, layer_type: str) -> KVCache:
        return self.sliding if layer_type == SLIDING else self.full

    def move_entries(self, start: jax.Array, source: jax.Array) -> "GemmaCache":
        """`jaxspec.cache.move_entries` on every stack; the per-layer inputs have no layer axis of their own."""
        return GemmaCache(sliding=move_kv_entries(self.sliding, start, source),
                          full=move_kv_entries(self.full, start, source),
                          per_layer_inputs=move_entries(self.per_layer_inputs[None], start, source)[0])


# ----------------------------------------------------------------------------------------------------------------
# Module


class GemmaDecoderLayer(nnx.Module):
    """One layer's parameters, each its own array (see `LlamaForCausalLM` for why they are not stacked)."""

    def __init__(self, cfg: GemmaConfig, layer: int, dtype, rngs: nnx.Rngs):
        for name, (shape, axes) in layer_param_specs(cfg, layer).items():
            setattr(self, name, nnx.Param(_init_value(name, shape, cfg, dtype, rngs), logical_axes=axes))

    def params(self) -> dict[str, jax.Array]:
        return I.layer_params(self)


class GemmaForCausalLM(nnx.Module):
    """`model(tokens[B,T], positions[B,T], cache) -> (logits[B,T,V] float32, hidden[B,T,D], cache)`.

    `hidden` is the final-normed last hidden state. Logits are soft-capped when the config says so (Gemma 2), in
    `logits()`, so every sampler and verifier sees the capped distribution. The layer loop is unrolled over
    per-layer arrays, as in `LlamaForCausalLM`, except in forwards of two or more positions a row where the decode
    loop binds a `layer_stack` (jaxspec/layer_stack.py, with `JAXSPEC_LAYER_STACK=on`): Gemma 2 and 3 then loop over
    whole periods of their layer types (`_looped_periods`), one layer of each type to compile instead of every layer.
    """

    tree_attention = True  # verifies tree-shaped blocks (`tree=`; jaxspec/tree.py)
    # Every decoder layer's params stacked [L, ...], bound by the decode loop for one trace on a CPU
    # (jaxspec/layer_stack.py), which wide forwards loop over where the config allows (`GemmaConfig.loops_layers`).
    layer_stack: Any = None
    # Only JAXSPEC_LAYER_STACK=on binds one: looped, Gemma 3 270M's wide forwards cost enough more to slow down prompt
    # lookup where it verifies wide blocks most rounds (docs/design.md, 'Gemma loops by period, when asked').
    stacked_by_default = False

    def __init__(self, cfg: GemmaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        rngs = rngs or nnx.Rngs(0)
        for name, (shape, axes) in top_param_specs(cfg).items():
            setattr(self, name, nnx.Param(_init_value(name, shape, cfg, dtype, rngs), logical_axes=axes))
        self.layers = nnx.List([GemmaDecoderLayer(cfg, i, dtype, rngs) for i in range(cfg.num_layers)])

    @property
    def loops_wide_forwards(self) -> bool:
        """Whether this model's wide forwards loop over a bound `layer_stack` (jaxspec/layer_stack.py asks)."""
        return self.cfg.loops_layers

    # -- pieces, so drafters can run part of the network ---------------------------------------------------------

    def input_embeddings(self, tokens: jax.Array) -> jax.Array:
        """The token embedding scaled by sqrt(hidden), the scale rounded to the param dtype as HF does. [B, T, D]"""
        return (I.lookup(I.weight(self, "embed"), tokens, self.dtype)
                * _scale(math.sqrt(self.cfg.hidden_size), self.dtype))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The input of `run_layers` from layer 0: [B, T, D], or [B, T, D + L * P] with per-layer inputs packed."""
        x = self.input_embeddings(tokens)
        if not self.cfg.per_layer_input_size:
            return x
        return jnp.concatenate([x, self._per_layer_inputs(tokens, x)], axis=-1)

    def _per_layer_inputs(self, tokens: jax.Array, x: jax.Array) -> jax.Array:
        """Gemma 4 PLE (HF `get_per_layer_inputs` + `project_per_layer_inputs`): a per-layer token embedding plus a
        normed projection of the scaled embedding, averaged by 1/sqrt(2). [B, T, L * P]"""
        cfg, p = self.cfg, self.cfg.per_layer_input_size
        table = self.ple_embed[...]
        token_part = table[tokens] * _scale(math.sqrt(p), table.dtype)  # [B, T, L*P]
        projected = (x @ self.ple_model_proj[...]) * cfg.hidden_size**-0.5  # [B, T, L*P]
        projected = projected.reshape(*x.shape[:-1], cfg.num_layers, p)
        projected = L.gemma_rms_norm(projected, self.ple_proj_norm[...], cfg.rms_norm_eps, cfg.norm_offset)
        combined = (projected + token_part.reshape(projected.shape)) * 2.0**-0.5
        return combined.reshape(token_part.shape)

    def run_layers(
        self, x: jax.Array, positions: jax.Array, cache: GemmaCache, start: int = 0, stop: int | None = None,
        tree=None,
    ) -> tuple[jax.Array, GemmaCache]:
        """Run decoder layers [start, stop) on x, writing their cache entries at `positions`. -> ([B, T, D], cache)

        x: `embed_tokens` output, or a [B, T, D] hidden state when starting past layer 0 (see the module docstring
        for where per-layer inputs come from then). A tree-shaped block (`tree`, jaxspec/tree.py) is written at its
        slots and attends as `layers.tree_visibility` lays it out, `positions` being the entries' rope positions.
        """
        cfg = self.cfg
        stop = cfg.num_layers if stop is None else stop
        slots = positions if tree is None else tree.slots()  # where the entries are written: a tree's own slots
        x, per_layer, cache = self._split_per_layer_inputs(x, slots, cache, start, stop)
        stacks = {SLIDING: cache.sliding, FULL: cache.full}

        def unrolled(x, stacks, layers: range):
            for index in layers:
                p = self.layers[index].params()
                layer_input = None if per_layer is None else per_layer[..., index, :]
                x, stacks = _layer_call(cfg, p, x, layer_input, positions, stacks, cfg.cache_slot(index),
                                        cfg.layer_types[index], cfg.computes_kv(index), cfg.has_value_proj(index),
                                        tree)
            return x, stacks

        looped = self.layer_stack is not None and x.shape[1] > 1 and cfg.loops_layers
        first, last = cfg.whole_periods(start, stop) if looped else (stop, stop)
        x, stacks = unrolled(x, stacks, range(start, first))
        if last > first:
            x, stacks = _looped_periods(cfg, self.layer_stack, x, positions, stacks, first, last, tree)
        x, stacks = unrolled(x, stacks, range(last, stop))
        return x, dataclasses.replace(cache, sliding=stacks[SLIDING], full=stacks[FULL])

    def _split_per_layer_inputs(self, x, slots, cache: GemmaCache, start: int, stop: int):
        """-> (hidden [B, T, D], per-layer inputs [B, T, L, P] or None, cache); the stored inputs are at `slots`."""
        cfg = self.cfg
        if not cfg.per_layer_input_size:
            return x, None, cache
        d, packed = cfg.hidden_size, cfg.num_layers * cfg.per_layer_input_size
        rows = jnp.arange(x.shape[0])[:, None]
        if x.shape[-1] == d + packed:
            x, per_layer = x[..., :d], x[..., d:]
            if stop < cfg.num_layers:  # a later run resumes from a hidden state and needs these
                stored = cache.per_layer_inputs.at[rows, slots].set(per_layer.astype(self.dtype), mode="drop")
                cache = dataclasses.replace(cache, per_layer_inputs=stored)
        elif start == 0:
            raise ValueError(f"run_layers from layer 0 of a Gemma 4 with per-layer inputs needs `embed_tokens` output "
                             f"(width {d + packed}); got width {x.shape[-1]}.")
        else:
            per_layer = cache.per_layer_inputs[rows, slots]  # [B, T, L*P], written by the run from layer 0
        return x, per_layer.reshape(*x.shape[:-1], cfg.num_layers, cfg.per_layer_input_size), cache

    def final_hidden(self, x: jax.Array) -> jax.Array:
        return L.gemma_rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps, self.cfg.norm_offset)

    def logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """LM head over final-normed hidden states, then the final soft-cap if any: [..., D] -> [..., V] float32.
        `head`: the [D, V] head where the caller holds it in another layout (`jaxspec.head.verify_head`)."""
        if head is None:  # this model's own; a tied head on a CPU reads the embedding in place (int8.head_weight)
            head = I.head_weight(self)
        logits = I.project("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)
        return L.soft_cap(logits, self.cfg.final_softcap)

    def head_matrix(self) -> jax.Array:
        """[D, V]: the tied embedding, transposed (a view XLA folds into the product), or the untied head."""
        return I.weight(self, "embed").T if self.cfg.tie_word_embeddings else I.weight(self, "lm_head")

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: GemmaCache, head: jax.Array | None = None,
                 tree=None):
        x, cache = self.run_layers(self.embed_tokens(tokens), positions, cache, tree=tree)
        hidden = self.final_hidden(x)
        return self.logits(hidden, head), hidden, cache

    def init_cache(self, batch: int, size: int) -> GemmaCache:
        cfg = self.cfg

        def stack(layer_type: str) -> KVCache:
            kind = cfg.sliding if layer_type == SLIDING else cfg.full
            return init_kv_cache(cfg.cache_layers(layer_type), batch, size, kind.num_kv_heads, kind.head_dim, self.dtype)

        packed = cfg.num_layers * cfg.per_layer_input_size
        return GemmaCache(sliding=stack(SLIDING), full=stack(FULL),
                          per_layer_inputs=jnp.zeros((batch, size, packed), self.dtype))

    def shared_kv(self, cache: GemmaCache, layer_type: str) -> tuple[jax.Array, jax.Array]:
        """Keys and values of `layer_type`'s store layer (`cfg.kv_store_layer`): ([B, K, S, Dh], [B, K, S, Dh]).
        What HF returns as `shared_kv_states[layer_type]`, position-indexed, in the cache's layout (jaxspec/cache.py);
        see the module docstring."""
        store = self.cfg.kv_store_layer(layer_type)
        if store is None:
            raise ValueError(f"no layer of type {layer_type!r} computes keys and values in this model.")
        kv = cache.stack(layer_type)
        slot = self.cfg.cache_slot(store)
        return kv.k[slot], kv.v[slot]


def _scale(value: float, dtype) -> jax.Array:
    """A python scale as HF applies it: a float32 tensor cast to the param dtype."""
    return jnp.asarray(np.float32(value)).astype(dtype)


@functools.partial(jax.jit, static_argnames=("cfg", "layer_type", "computes_kv", "value_proj"))
def _layer_call(cfg: GemmaConfig, p, x, per_layer_input, positions, stacks, slot, layer_type: str, computes_kv: bool,
                value_proj: bool, tree=None):
    """One Gemma block as a call that every layer of the same kind and shapes shares (`slot`, its cache slot, is
    traced), so an unrolled forward traces and lowers it once per kind, not once per layer (llama's `_layer_call`
    says why; XLA inlines it again)."""
    kind = cfg.sliding if layer_type == SLIDING else cfg.full
    inv_freq = kind.rope.inv_freq(kind.head_dim)
    return _decoder_layer(cfg, p, x, per_layer_input, positions, stacks, slot, layer_type, computes_kv, value_proj,
                          inv_freq, tree)


def _looped_periods(cfg: GemmaConfig, stack, x, positions, stacks, first: int, last: int, tree=None):
    """Layers [first, last), whole periods of `cfg.layer_types` (`GemmaConfig.whole_periods`), as one loop over the
    periods; layer i reads its params from `stack` (a `jaxspec.layer_stack.LayerStack`) at i. Inside a period each
    run of layers of one type is a loop of its own (Gemma 3's five sliding layers), so a forward compiles one layer
    of each type. A layer's cache slot in its type's stack counts the earlier layers of that type: the period's
    count of them for each period before, plus those before it in its own period. -> (x, stacks)"""
    period = cfg.layer_period
    types = cfg.layer_types[:period]
    per_period = {layer_type: types.count(layer_type) for layer_type in LAYER_TYPES}

    def one_period(index, carry):
        offset = 0
        for layer_type, run in itertools.groupby(types):
            count = len(list(run))
            kind = cfg.sliding if layer_type == SLIDING else cfg.full
            inv_freq = kind.rope.inv_freq(kind.head_dim)
            layer0 = index * period + offset
            slot0 = index * per_period[layer_type] + cfg.cache_slot(offset)

            def layer(i, carry, layer_type=layer_type, layer0=layer0, slot0=slot0, inv_freq=inv_freq):
                x, stacks = carry
                return _decoder_layer(cfg, stack.layer(layer0 + i), x, None, positions, stacks, slot0 + i,
                                      layer_type, True, True, inv_freq, tree)

            carry = layer(0, carry) if count == 1 else jax.lax.fori_loop(0, count, layer, carry)
            offset += count
        return carry

    return jax.lax.fori_loop(first // period, last // period, one_period, (x, stacks))


def _decoder_layer(cfg: GemmaConfig, p, x, per_layer_input, positions, stacks, slot, layer_type: str,
                   computes_kv: bool, value_proj: bool, inv_freq, tree=None):
    """One Gemma block: norm -> attention -> norm, residual; norm -> MLP -> norm, residual; then Gemma 4's per-layer
    input and layer scalar. stacks: {layer type: KVCache [L_type, B, K, S, Dh]}; `slot`: the cache slot the layer
    writes (if `computes_kv`) and reads, in its type's stack; `value_proj`: whether it projects values (else its raw
    keys are its values, Gemma 4's k_eq_v). A tree-shaped block (`tree`) is written at its slots and sees the
    committed entries and its ancestors, within the window by rope position (`layers.tree_visibility`); a layer
    that shares another's keys and values reads them there too."""
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    kind = cfg.sliding if layer_type == SLIDING else cfg.full

    h = L.gemma_rms_norm(x, p["attn_norm"], eps, offset)
    own_kv = ("wk", "wv") if value_proj else ("wk",)  # k_eq_v: no value projection
    names = ("wq",) + (own_kv if computes_kv else ())  # a layer sharing another's keys projects queries only
    q, *kv = I.project_group("...d,dhk->...hk", h, tuple(p[name] for name in names))  # [B, T, H, Dh] each
    if cfg.qk_norm:
        q = L.gemma_rms_norm(q, p["q_norm"], eps, offset)
    q = L.apply_rope(q, positions, inv_freq)
    stack = stacks[layer_type]
    if computes_kv:
        k = kv[0]  # [B, T, K, Dh]
        v = kv[1] if value_proj else k  # k_eq_v: raw keys
        if cfg.qk_norm:
            k = L.gemma_rms_norm(k, p["k_norm"], eps, offset)
        if cfg.v_norm:
            v = L.gemma_rms_norm(v, None, eps)
        k = L.apply_rope(k, positions, inv_freq)
        stack = write_kv(stack, slot, positions if tree is None else tree.slots(), k, v)
        stacks = stacks | {layer_type: stack}
    if tree is None:
        attn = L.attend_live(L.windowed_attention, q, stack.k, stack.v, positions, cfg.query_scale, kind.window,
                             cfg.attn_softcap, layer=slot)
    else:
        attn = L.attend_live(L.tree_attention, q, stack.k, stack.v, tree.slots(), cfg.query_scale, tree.start,
                             tree.ancestors, positions, kind.window, cfg.attn_softcap, layer=slot)
    out = I.project("bthk,hkd->btd", attn, p["wo"])
    x = x + L.gemma_rms_norm(out, p["post_attn_norm"], eps, offset)

    h = L.gemma_rms_norm(x, p["mlp_norm"], eps, offset)
    h = L.gelu_gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])
    x = x + L.gemma_rms_norm(h, p["post_mlp_norm"], eps, offset)

    if per_layer_input is not None:
        h = jax.nn.gelu(x @ p["ple_gate"], approximate=True) * per_layer_input  # [B, T, P]
        x = x + L.gemma_rms_norm(h @ p["ple_proj"], p["ple_post_norm"], eps, offset)
    if cfg.layer_scalar:
        x = x * p["layer_scalar"]
    return x, stacks
