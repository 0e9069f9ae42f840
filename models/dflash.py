"""DFlash block drafters: one forward drafts a whole block from the target's hidden states.

Two public layouts compute the same network (they differ in names, config keys and attention masks):
- `muse_glimmer_assistant` (transformers 5.23, `MuseGlimmerAssistantModel`, driven by `DFlashTokenCandidateGenerator`
  with a `DFlashCache`);
- z-lab's `DFlashDraftModel` (PyPI `dflash` 0.1.0, `dflash/model.py`, driven by `dflash_generate`): config.json says
  `model_type: "qwen3"` with `architectures: ["DFlashDraftModel"]`, and the DFlash settings in `dflash_config`.

What is fed where (n = len(target_layer_ids); D the drafter's width, which both references require to be the
target's: `fc` reads n * D features and the block is embedded by the target's table):

    context  = hidden_norm(fc(concat_l h_l))             # [B, T, n*D] -> [B, T, D], once per committed position
        h_l: the target's hidden state after decoder layer l (0-based) for l in target_layer_ids, in that order; HF's
        `hidden_states[l + 1]`, which transformers 5.23 returns un-normed for every layer but the last (the last
        entry is the final-normed state).
    per layer i, for every committed position p:
        K_i[p] = rope(k_norm(context[p] @ Wk_i (+ bk_i)), p) ; V_i[p] = context[p] @ Wv_i (+ bv_i)
        (the context enters each layer's k/v projections directly: no input_layernorm, and the same context for
        every layer; both references concatenate it before the block's own k/v inside each attention and keep only
        the context's entries in their cache, which is what `write_context` stores.)
    block    = [bonus, mask_token_id x (block_size - 1)] at positions L .. L + block_size - 1, where L is the row's
               committed length (the context covers positions 0 .. L-1, the bonus token is the target's newest
               token, not yet run through the target). Embedded by the target's input embedding (HF muse: the
               target's `get_input_embeddings()(ids)` without an `embed_norm`; z-lab: the raw embedding rows times
               `input_embedding_scale`, 1 by default).
    per layer (pre-norm, Qwen3/Exaone4 style):
        x += o_proj(attention(q = rope(q_norm(input_layernorm(x) @ Wq)), keys = [K_i context ; block's own k],
                              values = [V_i context ; block's own v]))
        x += mlp(post_attention_layernorm(x))              # SwiGLU
    hidden   = norm(x)                                     # the drafter's final norm, [B, W, D]
    logits   = hidden[:, 1:] @ target_head (* output_multiplier, soft-capped by final_logit_softcapping: z-lab only)

The block's own keys and values are never cached (HF crops them, `DFlashCache`/`crop(-block_size)`): a block sees
the committed context and itself. Masks, by query position q and key position k (`layer_reach`, `layer_causal`):
- HF muse: bidirectional everywhere (context keys are all earlier than the block); sliding layers (the default:
  every layer, window 2048) keep keys with |q - k| <= sliding_window (`create_bidirectional_sliding_window_mask`).
- z-lab: full-attention layers are bidirectional; sliding layers are causal (k <= q) unless config.json sets
  `is_causal`, and keep keys with |q - k| < sliding_window (`_attention_mask`); `is_causal: true` makes every layer
  causal, `false` none.

A draft vocabulary (jaxspec's addition to both layouts, as FR-Spec and EAGLE-3 heads reduce theirs): with
`draft_vocab_size` V' > 0 in config.json and `d2t` in the weights (draft id d is token d + d2t[d]; `t2d`, a [V] mask
of the same tokens, optional), drafts come from the target's head rows for those V' tokens only, -inf elsewhere
(`draft_vocab_logits`), so a draft reads V' of the head's V rows. q is zero outside V', which keeps sampling exact
(the residual returns the target's mass there), and greedy output is plain greedy's whatever the drafts. Neither
reference reads it: their drafts use the whole head.

Where the final norm lives: in the drafter (`draft_block` returns final-normed states), since it is the drafter's
tensor. The head is the target's: `drafter.logits(hidden, head)` with the target's [D, V] head. Not
`target.logits`: a target family that soft-caps its own logits (Gemma) would cap drafts that neither reference caps.

Dimension letters: B batch, T context entries, W block width (block_size), S cache length, D width, H query heads,
K kv heads, Dh head width, V vocabulary.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache, init_kv_cache, write_kv

from . import int8 as I
from . import layers as L

MUSE = "muse_glimmer_assistant"
DFLASH = "DFlashDraftModel"  # z-lab's layout, told by its architecture (its model_type is "qwen3")
SLIDING, FULL = "sliding_attention", "full_attention"
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Keys any HF config.json may carry that change nothing at inference here.
_GENERIC_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "id2label",
    "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "use_cache", "initializer_range", "attention_dropout", "bos_token_id", "pad_token_id",
    "eos_token_id", "auto_map", "tie_word_embeddings", "tokenizer_class",
})
_SHARED_KEYS = frozenset({
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "rms_norm_eps", "rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings", "sliding_window",
    "layer_types", "hidden_act",
})
# `draft_vocab_size` (with `d2t` / `t2d` tensors, as EAGLE-3 heads store theirs) is jaxspec's addition to both
# layouts: a draft vocabulary, which neither reference reads (module docstring).
_MUSE_KEYS = _GENERIC_KEYS | _SHARED_KEYS | {"block_size", "mask_token_id", "target_layer_ids", "draft_vocab_size"}
# z-lab reads each DFlash setting from `dflash_config` first, then from the top level (`_draft_value`).
_DRAFT_VALUES = ("block_size", "mask_token_id", "target_layer_ids", "input_embedding_scale", "output_multiplier",
                 "final_logit_softcapping")
_DFLASH_KEYS = (_GENERIC_KEYS | _SHARED_KEYS | set(_DRAFT_VALUES)
                | {"vocab_size", "attention_bias", "use_sliding_window", "max_window_layers", "is_causal",
                   "num_target_layers", "dflash_config", "draft_vocab_size"})
# What DFlash 2 (`DFlash2DraftModel`) adds; none of it runs here.
_DFLASH2_KEYS = ("selector_rank", "selector_top_k", "conv_kernel_size", "conv_group_size")
DFLASH2_UNSUPPORTED = (
    "DFlash 2 checkpoints (DFlash2DraftModel) are not supported yet: jaxspec implements the DFlash drafter "
    "(DFlashDraftModel) only. DFlash 2 adds (1) a candidate selector (`candidate_selector`: predecessor and successor "
    "codebooks and a hidden projection that re-score the head's top-k candidates of each block position against the "
    "previously chosen token, choosing the drafts one position after another, so its q is no longer one independent "
    "distribution per position), and (2) grouped dynamic causal convolutions around every layer's attention and MLP "
    "(`attention_conv`, `mlp_conv`: a base kernel plus a kernel projected from the hidden state)."
)


@dataclasses.dataclass(frozen=True)
class DFlashConfig:
    layout: str  # MUSE or DFLASH
    model_type: str  # config.json's
    hidden_size: int  # D, also the target's width
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    block_size: int  # W: the bonus token and W - 1 mask tokens; W - 1 drafts per block
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # the target layers whose outputs are concatenated, in order
    layer_types: tuple[str, ...]
    # Per layer: the largest |query - key| position distance a key may have (None: any), and whether keys after the
    # query are hidden. See the module docstring for how each layout sets them.
    layer_reach: tuple[int | None, ...]
    layer_causal: tuple[bool, ...]
    attention_bias: bool = False  # z-lab (Qwen3 config): q/k/v/o biases
    rope_llama3: tuple[float, float, float, int] | None = None
    input_embedding_scale: float = 1.0  # z-lab: the block's embedding rows are scaled by this
    output_multiplier: float = 1.0  # z-lab: draft logits are scaled by this ...
    final_logit_softcapping: float | None = None  # ... then soft-capped
    vocab_size: int | None = None  # the target's (z-lab's config has it; HF muse's has none)
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    tie_word_embeddings: bool = False  # the drafter has no embedding or head of its own
    draft_vocab_size: int = 0  # V': drafts come from the target's head over these token ids only; 0: every token

    def __post_init__(self):
        if isinstance(self.block_size, bool) or self.block_size < 2:
            raise ValueError(f"block_size must be at least 2 (the bonus token and one mask token), got "
                             f"{self.block_size}.")
        size = self.draft_vocab_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 0 \
                or (self.vocab_size is not None and size > self.vocab_size):
            raise ValueError(f"draft_vocab_size must be an integer from 1 to the vocabulary's size "
                             f"({self.vocab_size}), or 0 for none; got {size!r}.")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads}).")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "DFlashConfig":
        """Either layout's config.json; raises on keys and values this implementation does not understand."""
        architectures = hf.get("architectures") or []
        dflash_config = hf.get("dflash_config") or {}
        if "DFlash2DraftModel" in architectures or any(k in dflash_config or k in hf for k in _DFLASH2_KEYS):
            raise NotImplementedError(DFLASH2_UNSUPPORTED)
        if hf.get("model_type") == MUSE:
            return cls._from_muse(hf)
        if DFLASH in architectures:
            return cls._from_dflash(hf, dflash_config)
        raise ValueError(f"DFlashConfig reads model_type {MUSE!r} or architectures [{DFLASH!r}]; got model_type "
                         f"{hf.get('model_type')!r}, architectures {architectures}.")

    @classmethod
    def _from_muse(cls, hf: dict[str, Any]) -> "DFlashConfig":
        """HF `MuseGlimmerAssistantConfig`: absent keys take its defaults."""
        _reject_unknown(hf, _MUSE_KEYS, MUSE)
        layers = hf["num_hidden_layers"]
        window = hf.get("sliding_window", 2048)
        layer_types = tuple(hf.get("layer_types") or [SLIDING] * layers)
        _check_layer_types(layer_types, layers)
        if SLIDING in layer_types and window is None:
            raise ValueError("sliding_attention layers need a sliding_window (HF raises too).")
        return cls(
            **_shared(hf, layers, rope_theta_default=500000.0, eps_default=1e-5, max_positions_default=131072,
                      head_dim_default=128, kv_heads_default=8),
            layout=MUSE,
            block_size=int(hf.get("block_size", 16)),
            mask_token_id=int(hf.get("mask_token_id", 201818)),
            target_layer_ids=_layer_ids(hf.get("target_layer_ids", None), (1, 13, 25, 37, 49)),
            layer_types=layer_types,
            # create_bidirectional_sliding_window_mask: |q - k| <= sliding_window; never causal
            layer_reach=tuple(int(window) if t == SLIDING else None for t in layer_types),
            layer_causal=(False,) * layers,
            bos_token_id=hf.get("bos_token_id", 200000),
            eos_token_id=_ids(hf.get("eos_token_id", 200001)),
            pad_token_id=hf.get("pad_token_id", 200018),
            draft_vocab_size=hf.get("draft_vocab_size") or 0,
        )

    @classmethod
    def _from_dflash(cls, hf: dict[str, Any], dflash_config: dict[str, Any]) -> "DFlashConfig":
        """z-lab's `DFlashDraftModel` over HF `Qwen3Config`: absent keys take Qwen3Config's defaults."""
        if hf.get("model_type") != "qwen3":
            raise ValueError(f"a DFlashDraftModel checkpoint's config is a Qwen3 config (z-lab's model class reads "
                             f"Qwen3Config); got model_type {hf.get('model_type')!r}.")
        _reject_unknown(hf, _DFLASH_KEYS, DFLASH)
        _reject_unknown(dflash_config, set(_DRAFT_VALUES), f"{DFLASH} dflash_config")

        def draft_value(name, default=None):
            return dflash_config[name] if name in dflash_config else hf.get(name, default)

        layers = hf["num_hidden_layers"]
        # Qwen3Config: the window exists only with use_sliding_window; layer_types default to sliding from
        # max_window_layers on when it does.
        window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
        layer_types = tuple(hf.get("layer_types") or [
            SLIDING if window is not None and i >= hf.get("max_window_layers", 28) else FULL for i in range(layers)])
        _check_layer_types(layer_types, layers)
        is_causal = hf.get("is_causal")
        mask_token_id = draft_value("mask_token_id")
        if mask_token_id is None:
            raise KeyError("mask_token_id")  # z-lab reads it from dflash_config (or the top level); it has no default
        target_layer_ids = draft_value("target_layer_ids")
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(hf["num_target_layers"], layers)
        softcap = draft_value("final_logit_softcapping")
        return cls(
            **_shared(hf, layers, rope_theta_default=10000.0, eps_default=1e-6, max_positions_default=32768,
                      head_dim_default=128, kv_heads_default=hf["num_attention_heads"]),
            layout=DFLASH,
            block_size=int(draft_value("block_size", 16)),
            mask_token_id=int(mask_token_id),
            target_layer_ids=_layer_ids(target_layer_ids, None),
            layer_types=layer_types,
            # `_attention_mask`: q - k < sliding_window (and k - q < sliding_window when not causal)
            layer_reach=tuple(int(window) - 1 if t == SLIDING and window is not None else None for t in layer_types),
            layer_causal=tuple(t == SLIDING if is_causal is None else bool(is_causal) for t in layer_types),
            attention_bias=bool(hf.get("attention_bias", False)),
            input_embedding_scale=float(draft_value("input_embedding_scale", 1.0)),
            output_multiplier=float(draft_value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap is not None and float(softcap) > 0 else None,
            vocab_size=hf.get("vocab_size", 151936),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=_ids(hf.get("eos_token_id")),
            pad_token_id=hf.get("pad_token_id"),
            draft_vocab_size=hf.get("draft_vocab_size") or 0,
        )

    @property
    def context_width(self) -> int:
        """n * D: the width of the concatenated target hidden states `fc` reads."""
        return len(self.target_layer_ids) * self.hidden_size

    def inv_freq(self) -> jax.Array:
        if self.rope_llama3 is not None:
            return L.llama3_inv_freq(self.head_dim, self.rope_theta, *self.rope_llama3)
        return L.default_inv_freq(self.head_dim, self.rope_theta)

    def check_target(self, target_cfg: Any) -> None:
        """Raise unless a target with config `target_cfg` (hidden_size, num_layers, vocab_size) can feed this drafter:
        the same width, every tapped layer present, the mask token in its vocabulary."""
        width, layers = target_cfg.hidden_size, target_cfg.num_layers
        if width != self.hidden_size:
            raise ValueError(f"the DFlash drafter reads target hidden states and embeddings of width "
                             f"{self.hidden_size}, but the target's hidden_size is {width}.")
        if max(self.target_layer_ids) >= layers or min(self.target_layer_ids) < 0:
            raise ValueError(f"the DFlash drafter taps target layers {list(self.target_layer_ids)}; the target has "
                             f"{layers} layers.")
        if not 0 <= self.mask_token_id < target_cfg.vocab_size:
            raise ValueError(f"the DFlash drafter's mask_token_id {self.mask_token_id} is outside the target's "
                             f"vocabulary of {target_cfg.vocab_size} tokens.")


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> tuple[int, ...]:
    """z-lab's `build_target_layer_ids`, for configs without target_layer_ids: the middle layer for one draft layer,
    else `num_draft_layers` layers spread evenly over [1, num_target_layers - 3]."""
    if num_draft_layers == 1:
        return (num_target_layers // 2,)
    start, end = 1, num_target_layers - 3
    return tuple(round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers))


def _reject_unknown(hf: dict[str, Any], known, where: str) -> None:
    unknown = sorted(set(hf) - set(known))
    if unknown:
        raise ValueError(f"{where} config: keys jaxspec does not understand: {unknown}.")


def _layer_ids(ids, default) -> tuple[int, ...]:
    ids = default if ids is None else ids
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise ValueError(f"target_layer_ids must be a non-empty list of target layer indices, got {ids!r}.")
    return tuple(ids)


def _check_layer_types(layer_types: tuple[str, ...], layers: int) -> None:
    if len(layer_types) != layers or not set(layer_types) <= {SLIDING, FULL}:
        raise ValueError(f"layer_types must name {layers} layers, each {SLIDING!r} or {FULL!r}; "
                         f"got {list(layer_types)}.")


def _ids(value) -> tuple[int, ...]:
    return tuple(value) if isinstance(value, list) else (() if value is None else (value,))


def _shared(hf, layers, *, rope_theta_default, eps_default, max_positions_default, head_dim_default,
            kv_heads_default) -> dict[str, Any]:
    """The decoder settings both layouts spell alike."""
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise NotImplementedError(f"hidden_act={act!r} is not supported; DFlash drafters use 'silu'.")
    # HF fills an absent rope_theta with the config class's default (muse: 500000, Qwen3: 10000).
    rope = L.rope_parameters(hf | {"rope_theta": hf.get("rope_theta", rope_theta_default)})
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope type {rope_type!r} is not supported yet; supported: {SUPPORTED_ROPE_TYPES}.")
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise NotImplementedError(f"partial_rotary_factor={rope['partial_rotary_factor']} is not supported yet.")
    llama3 = None
    if rope_type == "llama3":
        llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                  int(rope["original_max_position_embeddings"]))
    return dict(
        model_type=hf["model_type"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=layers,
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or kv_heads_default,
        head_dim=hf.get("head_dim") or head_dim_default,
        rms_norm_eps=float(hf.get("rms_norm_eps", eps_default)),
        rope_theta=float(rope["rope_theta"]),
        rope_llama3=llama3,
        max_position_embeddings=hf.get("max_position_embeddings", max_positions_default),
    )


# Logical axes of every parameter (per layer: without a layers axis, as each layer keeps its own arrays).
TOP_AXES: dict[str, tuple[str, ...]] = {
    "fc": ("mlp", "embed"),  # [n*D, D], sharded on its input like a down projection
    "hidden_norm": ("embed",),
    "final_norm": ("embed",),
}
LAYER_AXES: dict[str, tuple[str, ...]] = L.GQA_ATTENTION_AXES | {
    "attn_norm": ("embed",),
    "bo": ("embed",),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
}


def top_param_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    d = cfg.hidden_size
    return {"fc": (cfg.context_width, d), "hidden_norm": (d,), "final_norm": (d,)}


def layer_param_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    d, h, k, dh, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "attn_norm": (d,), "wq": (d, h, dh), "wk": (d, k, dh), "wv": (d, k, dh), "wo": (h, dh, d),
        "q_norm": (dh,), "k_norm": (dh,), "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
    }
    if cfg.attention_bias:
        shapes |= {"bq": (h, dh), "bk": (k, dh), "bv": (k, dh), "bo": (d,)}
    return shapes


class DFlashLayer(nnx.Module):
    def __init__(self, cfg: DFlashConfig, dtype, rngs: nnx.Rngs):
        for name, shape in layer_param_shapes(cfg).items():
            setattr(self, name, nnx.Param(L.init_value(name, shape, dtype, rngs), logical_axes=LAYER_AXES[name]))

    def params(self) -> dict[str, jax.Array]:
        return I.layer_params(self)


class DFlashDrafter(nnx.Module):
    """The DFlash drafter (either layout). It has no embedding or head: the strategy embeds the block with the
    target's table and applies the target's head (module docstring).

    One round, for rows whose committed length is `lengths` [B] (positions 0 .. lengths-1 committed):
        cache  = drafter.write_context(drafter.project_context(taps), new_positions, cache)  # newly committed only
        hidden = drafter.draft_block(embed(drafter.block_tokens(bonus)), lengths[:, None] + arange(W), cache, lengths)
        q      = softmax(drafter.logits(hidden[:, 1:], target_head))                         # [B, W-1, V]
    Rollback is a length: entries at or past a row's length are never read and are overwritten when written again.
    """

    def __init__(self, cfg: DFlashConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        rngs = rngs or nnx.Rngs(0)
        for name, shape in top_param_shapes(cfg).items():
            setattr(self, name, nnx.Param(L.init_value(name, shape, dtype, rngs), logical_axes=TOP_AXES[name]))
        self.layers = nnx.List([DFlashLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        if cfg.draft_vocab_size:
            self.vocab_ids = L.DraftVocab(L.initial_ids(cfg.draft_vocab_size))

    def project_context(self, target_hidden: jax.Array) -> jax.Array:
        """target_hidden [B, T, n*D] (the tapped target layers' outputs, concatenated in `target_layer_ids` order)
        -> context [B, T, D] = hidden_norm(target_hidden @ fc)."""
        x = I.project("btc,cd->btd", target_hidden.astype(self.dtype), I.weight(self, "fc"))
        return L.rms_norm(x, self.hidden_norm[...], self.cfg.rms_norm_eps)

    def init_cache(self, batch: int, size: int) -> KVCache:
        """The context's keys and values, position-indexed, in the target cache's layout (jaxspec/cache.py): k
        [layers, B, K, S, Dh], v [layers, B, K, S, Dh], zeros."""
        c = self.cfg
        return init_kv_cache(c.num_layers, batch, size, c.num_kv_heads, c.head_dim, self.dtype)

    def write_context(self, context: jax.Array, positions: jax.Array, cache: KVCache) -> KVCache:
        """context [B, T, D] (from `project_context`) at positions [B, T] -> the cache with every layer's
        K = rope(k_norm(context @ Wk)), V = context @ Wv written there. Positions at or past S are dropped (padding);
        entries at positions a row has not committed are written but never read."""
        inv_freq = self.cfg.inv_freq()
        context = context.astype(self.dtype)
        for index, layer in enumerate(self.layers):
            k, v = self._key_value(layer.params(), context, positions, inv_freq)  # [B, T, K, Dh]
            cache = write_kv(cache, index, positions, k, v)
        return cache

    def draft_block(self, block_embeddings: jax.Array, positions: jax.Array, cache: KVCache,
                    lengths: jax.Array) -> jax.Array:
        """block_embeddings [B, W, D] (the target's embedding of [bonus, mask x (W-1)]), positions [B, W] (lengths +
        0 .. W-1), the context cache, lengths [B] -> final-normed hidden [B, W, D]; entry j >= 1 drafts the token at
        positions[:, j]. Queries attend to cache entries at positions < lengths[b] and to the whole block (within
        each layer's window and causality, module docstring). The cache is not changed."""
        cfg = self.cfg
        inv_freq = cfg.inv_freq()
        x = block_embeddings.astype(self.dtype)
        for index, layer in enumerate(self.layers):
            p = layer.params()
            h = L.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
            q = I.project("btd,dhk->bthk", h, p["wq"])  # [B, W, H, Dh]
            if cfg.attention_bias:
                q = q + p["bq"]
            q = L.apply_rope(L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps), positions, inv_freq)
            k, v = self._key_value(p, h, positions, inv_freq)  # the block's own keys and values, [B, W, K, Dh]
            attend = functools.partial(_block_attention, lengths=lengths, block_k=k, block_v=v,
                                       reach=cfg.layer_reach[index], causal=cfg.layer_causal[index],
                                       scale=cfg.head_dim**-0.5)
            attn = L.attend_live(attend, q, cache.k, cache.v, positions, layer=index)  # [B, W, H, Dh]
            out = I.project("bthk,hkd->btd", attn, p["wo"])
            x = x + (out + p["bo"] if cfg.attention_bias else out)
            h = L.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
            x = x + L.gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])
        return L.rms_norm(x, self.final_norm[...], cfg.rms_norm_eps)

    def logits(self, hidden: jax.Array, head: jax.Array) -> jax.Array:
        """Draft logits from final-normed states: hidden [..., D] @ head [D, V] (the target's head), times
        output_multiplier, soft-capped by final_logit_softcapping (z-lab's `compute_logits`) -> [..., V] float32."""
        return self._scaled(I.project("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32))

    def draft_vocab_logits(self, hidden: jax.Array, rows: jax.Array) -> jax.Array:
        """`logits` over the draft vocabulary only: hidden [..., D] and the target head's rows for `vocab_ids`
        [V', D] (gathered once per call: `int8.head_rows`) -> [..., V'] float32, in `vocab_ids` order
        (`layers.spread_to_vocab` places them in the target's vocabulary, -inf elsewhere)."""
        return self._scaled(I.project("...d,vd->...v", hidden, rows, preferred_element_type=jnp.float32))

    def _scaled(self, logits: jax.Array) -> jax.Array:
        if self.cfg.output_multiplier != 1.0:
            logits = logits * self.cfg.output_multiplier
        return L.soft_cap(logits, self.cfg.final_logit_softcapping)

    def block_tokens(self, bonus: jax.Array) -> jax.Array:
        """bonus [B] -> the block's tokens [B, W]: the bonus token, then W - 1 mask tokens."""
        masks = jnp.full((bonus.shape[0], self.cfg.block_size - 1), self.cfg.mask_token_id, bonus.dtype)
        return jnp.concatenate([bonus[:, None], masks], axis=1)

    def _key_value(self, p, x, positions, inv_freq) -> tuple[jax.Array, jax.Array]:
        """A layer's keys and values of x [B, T, D] at positions [B, T]: rope(k_norm(x @ Wk)), x @ Wv."""
        cfg = self.cfg
        k = I.project("btd,dhk->bthk", x, p["wk"])
        v = I.project("btd,dhk->bthk", x, p["wv"])
        if cfg.attention_bias:
            k, v = k + p["bk"], v + p["bv"]
        k = L.apply_rope(L.rms_norm(k, p["k_norm"], cfg.rms_norm_eps), positions, inv_freq)
        return k, v


def _block_attention(q, k_cache, v_cache, positions, *, lengths, block_k, block_v, reach, causal, scale):
    """Grouped-query attention of the block over [context cache ; the block itself].

    q [B, W, H, Dh]; k_cache, v_cache [B, K, S, Dh] (a live prefix of the cache); positions [B, W];
    lengths [B]; block_k, block_v [B, W, K, Dh]. Cache entry s is at position s and live when s < lengths[b]; block
    entry j is at positions[b, j]. A key is seen when live, within `reach` of the query (None: any) and, if
    `causal`, not after it. The context and the block are scored apart and share one softmax, so the cache is read
    where it lies rather than copied into a concatenation with the block. Returns [B, W, H, Dh].
    """
    b, w, h, dh = q.shape
    kv_heads, size = k_cache.shape[1], k_cache.shape[2]
    slots = jnp.broadcast_to(jnp.arange(size), (b, size))
    key_pos = jnp.concatenate([slots, positions], axis=1)  # [B, S+W]
    live = jnp.concatenate([slots < lengths[:, None], jnp.ones((b, w), bool)], axis=1)  # [B, S+W]
    delta = positions[:, :, None] - key_pos[:, None, :]  # [B, W, S+W]: query position - key position
    visible = live[:, None, :]
    if causal:
        visible = visible & (delta >= 0)
    if reach is not None:
        visible = visible & (jnp.abs(delta) <= reach)
    q = q.reshape(b, w, kv_heads, h // kv_heads, dh)  # [B, W, K, G, Dh]
    context = jnp.einsum("bwkgd,bksd->bkgws", q, k_cache, preferred_element_type=jnp.float32)  # [B, K, G, W, S]
    own = jnp.einsum("bwkgd,bjkd->bkgwj", q, block_k.astype(k_cache.dtype), preferred_element_type=jnp.float32)
    scores = jnp.concatenate([context, own], axis=-1) * scale  # [B, K, G, W, S+W]
    scores = jnp.where(visible[:, None, None], scores, jnp.finfo(jnp.float32).min)
    weights = jax.nn.softmax(scores, axis=-1).astype(v_cache.dtype)
    # [B, K, G, W, Dh]: (B, K) leading, then query order afterwards, so the values are read as they lie (see
    # layers.grouped_attention)
    out = (jnp.einsum("bkgws,bksd->bkgwd", weights[..., :size], v_cache)
           + jnp.einsum("bkgwj,bjkd->bkgwd", weights[..., size:], block_v.astype(v_cache.dtype)))
    return out.transpose(0, 3, 1, 2, 4).reshape(b, w, h, v_cache.shape[-1])
