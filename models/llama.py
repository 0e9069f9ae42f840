"""Llama-family decoder (`LlamaForCausalLM`, `Qwen2ForCausalLM`, dense `Qwen3ForCausalLM`) as HF transformers defines
it. Qwen3 is this block with an RMSNorm over each query and key head (`q_norm`, `k_norm`, [head_dim]) between the
head split and RoPE, and an explicit `head_dim` that need not be hidden_size / num_heads.

Each layer keeps its own arrays and the forward pass is an unrolled Python loop over them (see `LlamaForCausalLM`
for why not a scan over stacked weights, and where wide forwards loop instead); a contiguous range of layers (the
early-exit drafter's first E) is a static range of that loop.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache, init_kv_cache, write_kv

from . import int8 as I
from . import layers as L

if TYPE_CHECKING:
    from jaxspec.tree import TreeBlock

SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    rope_theta: float
    rope_type: str = "default"
    # llama3 scaling, as (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    qk_norm: bool = False  # Qwen3: RMSNorm per query/key head (`q_norm`, `k_norm`) before RoPE
    # Qwen2/Qwen3's use_sliding_window: these layers attend to the last `sliding_window` positions only
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    num_mtp_layers: int = 0  # DeepSeek-style MTP layers stored at model.layers.{num_layers + k}
    draft_vocab_size: int = 0  # V' > 0: MTP drafts use a head over these V' token ids only (EAGLE-3, FR-Spec)

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "LlamaConfig":
        """Build from a config.json dict; raise on anything this implementation would silently get wrong."""
        model_type = hf.get("model_type")
        if model_type not in ("llama", "qwen2", "qwen3"):
            raise ValueError(
                f"LlamaConfig cannot read model_type={model_type!r}; expected 'llama', 'qwen2' or 'qwen3'."
            )
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"hidden_act={act!r} is not supported yet; only 'silu' is.")
        if hf.get("mlp_bias"):
            raise NotImplementedError("mlp_bias=True is not supported yet for Llama checkpoints.")
        sliding_window, sliding_layers = _qwen_sliding_layers(hf) if model_type != "llama" else (None, ())
        rope = L.rope_parameters(hf)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope type {rope_type!r} is not supported yet; supported: {SUPPORTED_ROPE_TYPES}.")
        rope_llama3 = None
        if rope_type == "llama3":
            rope_llama3 = (
                float(rope["factor"]),
                float(rope["low_freq_factor"]),
                float(rope["high_freq_factor"]),
                int(rope["original_max_position_embeddings"]),
            )
        num_heads = hf["num_attention_heads"]
        # HF's Qwen3Config defaults head_dim to 128 (not hidden_size / num_heads) when config.json lacks it.
        head_dim = hf.get("head_dim") or (128 if model_type == "qwen3" else hf["hidden_size"] // num_heads)
        attention_bias = bool(hf.get("attention_bias", False))
        eos = hf.get("eos_token_id")
        mtp_layers, draft_vocab_size = L.num_mtp_layers(hf), int(hf.get("draft_vocab_size") or 0)
        if draft_vocab_size and not (mtp_layers and 0 < draft_vocab_size <= hf["vocab_size"]):
            raise ValueError(
                f"draft_vocab_size={draft_vocab_size} restricts the head of MTP drafts, so it needs "
                f"num_nextn_predict_layers > 0 (got {mtp_layers}) and at most vocab_size={hf['vocab_size']} tokens."
            )
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v biases and no output bias; Llama and Qwen3 have all four or none
            # (`attention_bias`).
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type != "qwen2" and attention_bias,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rope_type=rope_type,
            rope_llama3=rope_llama3,
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
            pad_token_id=hf.get("pad_token_id"),
            qk_norm=model_type == "qwen3",
            sliding_window=sliding_window,
            sliding_layers=sliding_layers,
            num_mtp_layers=mtp_layers,
            draft_vocab_size=draft_vocab_size,
        )

    def window(self, layer: int) -> int | None:
        """The layer's attention window (None: every earlier position)."""
        return self.sliding_window if layer in self.sliding_layers else None

    def inv_freq(self) -> jax.Array:
        if self.rope_llama3 is not None:
            return L.llama3_inv_freq(self.head_dim, self.rope_theta, *self.rope_llama3)
        return L.default_inv_freq(self.head_dim, self.rope_theta)


# Logical axes of every parameter; the sharding rules map them to mesh axes.
PARAM_AXES: dict[str, tuple[str, ...]] = {
    "embed": ("vocab", "embed"),
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads", "head_dim"),
    "wk": ("layers", "embed", "kv_heads", "head_dim"),
    "wv": ("layers", "embed", "kv_heads", "head_dim"),
    "bq": ("layers", "heads", "head_dim"),
    "bk": ("layers", "kv_heads", "head_dim"),
    "bv": ("layers", "kv_heads", "head_dim"),
    "wo": ("layers", "heads", "head_dim", "embed"),
    "bo": ("layers", "embed"),
    "q_norm": ("layers", "head_dim"),
    "k_norm": ("layers", "head_dim"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter this config has (biases and the untied head only when present)."""
    n, d, h, k, dh, f, v = (
        cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
        cfg.vocab_size,
    )
    shapes = {
        "embed": (v, d),
        "attn_norm": (n, d),
        "wq": (n, d, h, dh),
        "wk": (n, d, k, dh),
        "wv": (n, d, k, dh),
        "wo": (n, h, dh, d),
        "mlp_norm": (n, d),
        "w_gate": (n, d, f),
        "w_up": (n, d, f),
        "w_down": (n, f, d),
        "final_norm": (d,),
    }
    if cfg.qkv_bias:
        shapes |= {"bq": (n, h, dh), "bk": (n, k, dh), "bv": (n, k, dh)}
    if cfg.o_bias:
        shapes["bo"] = (n, d)
    if cfg.qk_norm:
        shapes |= {"q_norm": (n, dh), "k_norm": (n, dh)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (d, v)
    return shapes


TOP_LEVEL = ("embed", "final_norm", "lm_head")

# What an MTP layer adds to a decoder block (DeepSeek-V3's names): norms on the token embedding and on the previous
# state, the projection of their concatenation [2D, D], and the norm on the block output (HF `shared_head.norm`).
MTP_AXES: dict[str, tuple[str, ...]] = {
    "enorm": ("embed",),
    "hnorm": ("embed",),
    "eh_proj": ("mlp", "embed"),  # sharded on its input like a down projection
    "out_norm": ("embed",),
}


def mtp_layer_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Shape of every parameter of one MTP layer: a decoder block of the target's own recipe plus `MTP_AXES`."""
    d = cfg.hidden_size
    block = {name: shape[1:] for name, shape in param_shapes(cfg).items() if name not in TOP_LEVEL}
    return block | {"enorm": (d,), "hnorm": (d,), "eh_proj": (2 * d, d), "out_norm": (d,)}


class LlamaDecoderLayer(nnx.Module):
    """One layer's parameters, each its own array (see `LlamaForCausalLM` for why they are not stacked)."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        for name, shape in param_shapes(cfg).items():
            if name not in TOP_LEVEL:
                setattr(self, name, nnx.Param(L.init_value(name, shape[1:], dtype, rngs),
                                              logical_axes=PARAM_AXES[name][1:]))

    def params(self) -> dict[str, jax.Array]:
        return I.layer_params(self)


class LlamaMtpLayer(LlamaDecoderLayer):
    """One MTP depth: a decoder block of the target's recipe plus enorm, hnorm, eh_proj and out_norm."""

    def __init__(self, cfg: LlamaConfig, dtype, rngs: nnx.Rngs):
        for name, shape in mtp_layer_shapes(cfg).items():
            axes = MTP_AXES.get(name) or PARAM_AXES[name][1:]
            setattr(self, name, nnx.Param(L.init_value(name, shape, dtype, rngs), logical_axes=axes))


class LlamaForCausalLM(nnx.Module):
    """`model(tokens[B,T], positions[B,T], cache) -> (logits[B,T,V], hidden[B,T,D], cache)`.

    `hidden` is the final-normed last hidden state (what an LM head or an MTP layer reads).

    Each layer keeps its own arrays and the layer loop is unrolled. Decoding is memory-bound, and XLA:CPU feeds a
    matmul from a slice of stacked weights (`lax.scan` over a layer axis) by copying that slice first, so a scan
    reads every weight more than once per step (see docs/design.md, 'Architecture and the one loop'). Forwards of
    two or more positions a row, which pay little for that copy, loop over `layer_stack` where the decode loop
    binds one (jaxspec/layer_stack.py): one layer to compile instead of L.
    """

    tree_attention = True  # verifies tree-shaped blocks (`tree=`; jaxspec/tree.py)
    loops_wide_forwards = True  # runs its layers as a loop over `layer_stack` where one is bound
    stacked_by_default = True  # JAXSPEC_LAYER_STACK=auto binds one: looped, its wide forwards cost little more
    # Every decoder layer's params stacked [L, ...], bound by the decode loop for one trace on a CPU
    # (jaxspec/layer_stack.py): forwards of two or more positions a row then loop over the layers instead of
    # unrolling them, which compiles one layer instead of L.
    layer_stack: Any = None

    def __init__(self, cfg: LlamaConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        rngs = rngs or nnx.Rngs(0)
        for name, shape in param_shapes(cfg).items():
            if name in TOP_LEVEL:
                setattr(self, name, nnx.Param(L.init_value(name, shape, dtype, rngs), logical_axes=PARAM_AXES[name]))
        self.layers = nnx.List([LlamaDecoderLayer(cfg, dtype, rngs) for _ in range(cfg.num_layers)])
        # Only models that have them get the attributes, so conversions written without MTP keep their layout.
        if cfg.num_mtp_layers:
            self.mtp_layers = nnx.List([LlamaMtpLayer(cfg, dtype, rngs) for _ in range(cfg.num_mtp_layers)])
        if cfg.draft_vocab_size:
            self.draft_vocab = L.DraftVocab(L.initial_ids(cfg.draft_vocab_size))

    # -- pieces, so drafters can run part of the network ---------------------------------------------------------

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        return I.lookup(I.weight(self, "embed"), tokens, self.dtype)  # [B, T, D]

    def run_layers(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, start: int = 0, stop: int | None = None,
        tree: TreeBlock | None = None,
    ) -> tuple[jax.Array, KVCache]:
        """Run decoder layers [start, stop) on x: [B, T, D], writing their cache entries at `positions`; for a
        tree-shaped block (`tree`), at its slots, with `positions` the entries' rope positions."""
        stop = self.cfg.num_layers if stop is None else stop
        if self._loops(x, start, stop):
            x, cache, _ = _looped_layers(self.cfg, self.layer_stack, x, positions, cache, start, stop, tree=tree)
            return x, cache
        for index in range(start, stop):
            p = self.layers[index].params()
            x, cache = _layer_call(self.cfg, p, x, positions, cache, index, window=self.cfg.window(index), tree=tree)
        return x, cache

    def looped_taps(
        self, x: jax.Array, positions: jax.Array, cache: KVCache, taps: tuple[int, ...], tree: TreeBlock | None = None,
    ) -> tuple[jax.Array, KVCache, jax.Array] | None:
        """Every decoder layer on x as one loop that keeps the outputs of the layers in `taps` (ascending) ->
        (x [B, T, D], cache, taps' outputs concatenated [B, T, F*D]), or None where `run_layers` would unroll.

        `jaxspec.strategies.base.run_tapped_layers` otherwise runs the layers in segments that end at each tap: free
        unrolled, but looped each segment is a loop of its own, and a feature-reading drafter's verify block of each
        width compiled F + 1 copies of the layer (docs/design.md, 'Compile time')."""
        if not self._loops(x, 0, self.cfg.num_layers):
            return None
        return _looped_layers(self.cfg, self.layer_stack, x, positions, cache, 0, self.cfg.num_layers, tree=tree,
                              taps=taps)

    def _loops(self, x: jax.Array, start: int, stop: int) -> bool:
        """Whether layers [start, stop) on x run as a loop over the bound stack: two or more positions a row, and one
        attention window for them all (a loop body is one layer)."""
        windows = {self.cfg.window(index) for index in range(start, stop)}
        return self.layer_stack is not None and x.shape[1] > 1 and len(windows) == 1

    def final_hidden(self, x: jax.Array) -> jax.Array:
        return L.rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)

    def logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """LM head over final-normed hidden states: [..., D] -> [..., V], always float32. `head`: the [D, V] head
        where the caller holds it in another layout (`jaxspec.head.verify_head`), else this model's own."""
        if head is None:  # this model's own; a tied head on a CPU reads the embedding in place (int8.head_weight)
            head = I.head_weight(self)
        return I.project("...d,dv->...v", hidden, head, preferred_element_type=jnp.float32)

    def head_matrix(self) -> jax.Array:
        """[D, V]: the tied embedding, transposed (a view XLA folds into the product), or the untied head."""
        return I.weight(self, "embed").T if self.cfg.tie_word_embeddings else I.weight(self, "lm_head")

    def __call__(self, tokens: jax.Array, positions: jax.Array, cache: KVCache, head: jax.Array | None = None,
                 tree: TreeBlock | None = None):
        x, cache = self.run_layers(self.embed_tokens(tokens), positions, cache, tree=tree)
        hidden = self.final_hidden(x)
        return self.logits(hidden, head), hidden, cache

    def init_cache(self, batch: int, size: int) -> KVCache:
        c = self.cfg
        return init_kv_cache(c.num_layers, batch, size, c.num_kv_heads, c.head_dim, self.dtype)

    # -- MTP: the interface of MoeCausalLM (models/moe.py), so the same MtpDrafter runs both ------------------------

    @property
    def num_mtp_layers(self) -> int:
        return self.cfg.num_mtp_layers

    def init_mtp_cache(self, batch: int, size: int, depths: int | None = None) -> KVCache:
        """One position-indexed cache per MTP depth, stacked on the leading axis; `depths` may exceed the number of
        layers when the last layer drafts the extra tokens (each depth still keeps its own cache)."""
        self._check_mtp_depth(0)
        c = self.cfg
        return init_kv_cache(depths or c.num_mtp_layers, batch, size, c.num_kv_heads, c.head_dim, self.dtype)

    def mtp_step(
        self, depth: int, tokens: jax.Array, prev_hidden: jax.Array, positions: jax.Array, mtp_cache: KVCache,
        layer: int | None = None,
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """One MTP depth over T entries: `(normed_out[B,T,D], logits[B,T,V], mtp_cache)`, as `MoeCausalLM.mtp_step`.

        Entry j embeds `tokens[:, j]` at `positions[:, j]` = i and reads `prev_hidden[:, j]`, the state at i-1 (depth
        0: the main model's final-normed hidden state; depth k: depth k-1's `normed_out`); its logits predict the
        token at i+1. Attention sees this depth's cache entries in [depth+1, i]: depth k has none below k+1.
        """
        layer = depth if layer is None else layer
        self._check_mtp_depth(layer)
        p = self.mtp_layers[layer].params()
        eps = self.cfg.rms_norm_eps
        e = L.rms_norm(self.embed_tokens(tokens), p["enorm"], eps)
        h = L.rms_norm(prev_hidden.astype(e.dtype), p["hnorm"], eps)
        x = jnp.concatenate([e, h], axis=-1) @ p["eh_proj"]  # [B, T, D]
        x, mtp_cache = _layer_call(self.cfg, p, x, positions, mtp_cache, depth, first=depth + 1)
        out = L.rms_norm(x, p["out_norm"], eps)
        return out, self.logits(out), mtp_cache

    def draft_head(self) -> jax.Array:
        """[V', D]: the head's rows for the draft vocabulary's ids. Gathering them reads as many bytes as the product
        that uses them, so decoding gathers them once per call (`MtpDrafter.init`), not once per draft step."""
        return I.head_rows(self, self.draft_vocab[...])

    def draft_vocab_logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """The draft head over the V' token ids of `draft_vocab`: [..., D] -> [..., V'], float32. `head`: this
        model's `draft_head()`, where the caller gathered it already."""
        head = self.draft_head() if head is None else head
        return I.project("...d,vd->...v", hidden, head, preferred_element_type=jnp.float32)

    def draft_logits(self, hidden: jax.Array, head: jax.Array | None = None) -> jax.Array:
        """Logits that MTP drafts are chosen from: [..., D] -> [..., V], float32.

        With a draft vocabulary only its V' columns of the head are computed (`head`: `draft_head()`, if gathered
        already) and every other token gets -inf: the draft distribution q is zero outside V', which keeps
        speculative sampling exact (a draft is accepted with min(1, p/q), and the residual max(p - q, 0) gives the
        target's mass outside V' back) and leaves greedy output unchanged (verification decides every committed
        token). Without one, this is the full head.
        """
        if not self.cfg.draft_vocab_size:
            return self.logits(hidden)
        return L.spread_to_vocab(self.draft_vocab_logits(hidden, head), self.draft_vocab[...], self.cfg.vocab_size)

    def _check_mtp_depth(self, depth: int):
        if not 0 <= depth < self.cfg.num_mtp_layers:
            raise ValueError(
                f"MTP depth {depth} does not exist: config.json sets num_nextn_predict_layers="
                f"{self.cfg.num_mtp_layers} (an absent key reads as 0)."
            )


@functools.partial(jax.jit, static_argnames=("cfg", "first", "window"))
def _layer_call(cfg: LlamaConfig, p, x, positions, cache: KVCache, index, first: int = 0, window: int | None = None,
                tree: TreeBlock | None = None) -> tuple[jax.Array, KVCache]:
    """`_decoder_layer` as one call that every layer of the same shapes shares, `index` a traced layer number.

    An unrolled forward otherwise traces and lowers the block once per layer, per verify width and per branch: 240
    blocks for SmolLM2's prompt-lookup loop. A call is traced and lowered once per distinct shape, and XLA inlines
    it again (the layer number becomes a constant), so the compiled step is the unrolled one.
    """
    return _decoder_layer(cfg, p, x, positions, cache, index, cfg.inv_freq(), first=first, window=window, tree=tree)


def _looped_layers(cfg: LlamaConfig, stack, x, positions, cache: KVCache, start: int, stop: int,
                   tree: TreeBlock | None, taps: tuple[int, ...] = ()) -> tuple[jax.Array, KVCache, jax.Array | None]:
    """Layers [start, stop), of one attention window, as one loop: layer `index` reads its params from `stack` (a
    `jaxspec.layer_stack.LayerStack`) at `index`. The whole stack is indexed in the loop, not a [start, stop) slice
    of it, which would copy those layers' weights in every forward (as models/moe.py `_scan`).
    -> (x, cache, the outputs of the layers in `taps` (ascending, in [start, stop)) concatenated [B, T, F*D], or None
    without taps)."""
    inv_freq = cfg.inv_freq()
    window = cfg.window(start)
    if list(taps) != sorted(set(taps)) or any(not start <= tap < stop for tap in taps):
        raise ValueError(f"taps must be distinct ascending layers in [{start}, {stop}); got {taps}")
    tap_layers = jnp.asarray(taps, jnp.int32)  # [F]

    def keep_tap(index, x, tapped):  # tapped: [F, B, T, D]; slot `slot` takes x where layer `index` is tapped
        slot = jnp.minimum(jnp.sum(tap_layers < index), len(taps) - 1)
        kept = jnp.where(tap_layers[slot] == index, x, tapped[slot])
        return jax.lax.dynamic_update_index_in_dim(tapped, kept, slot, 0)

    def layer(index, carry):
        x, cache, tapped = carry
        p = stack.layer(index)
        x, cache = _decoder_layer(cfg, p, x, positions, cache, index, inv_freq, window=window, tree=tree)
        return x, cache, keep_tap(index, x, tapped) if taps else None

    tapped = jnp.zeros((len(taps), *x.shape), x.dtype) if taps else None
    x, cache, tapped = jax.lax.fori_loop(start, stop, layer, (x, cache, tapped))
    features = jnp.concatenate(list(tapped), axis=-1) if taps else None
    return x, cache, features


def _decoder_layer(cfg: LlamaConfig, p, x, positions, cache: KVCache, index, inv_freq, first: int = 0,
                   window: int | None = None, tree: TreeBlock | None = None) -> tuple[jax.Array, KVCache]:
    """One pre-norm block. p: this layer's params; cache: every layer's, written at layer `index`. Attention sees
    cache entries from position `first` on (an MTP depth k has none below k+1), and only the last `window`
    positions when the layer slides (Qwen2/Qwen3's use_sliding_window). A tree-shaped block (`tree`) is written at
    its slots and attends as jaxspec/tree.py lays it out."""
    h = L.rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    q, k, v = I.project_group("...d,dhk->...hk", h, (p["wq"], p["wk"], p["wv"]))  # [B, T, H | K | K, Dh]
    if cfg.qkv_bias:
        q, k, v = q + p["bq"], k + p["bk"], v + p["bv"]
    if cfg.qk_norm:  # Qwen3: over each head's Dh features, after the bias and before RoPE (HF Qwen3Attention)
        q, k = L.rms_norm(q, p["q_norm"], cfg.rms_norm_eps), L.rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    q = L.apply_rope(q, positions, inv_freq)
    k = L.apply_rope(k, positions, inv_freq)
    scale = cfg.head_dim**-0.5
    if tree is not None:
        slots = tree.slots()
        cache = write_kv(cache, index, slots, k, v)
        attn = L.attend_live(L.tree_attention, q, cache.k, cache.v, slots, scale, tree.start, tree.ancestors,
                             positions, window, layer=index)
        return _block_output(cfg, p, x, attn), cache
    cache = write_kv(cache, index, positions, k, v)
    if first:
        attn = L.attend_live(L.cached_attention_window, q, cache.k, cache.v, positions, scale, first, layer=index)
    elif window is not None:
        attn = L.attend_live(L.windowed_attention, q, cache.k, cache.v, positions, scale, window, layer=index)
    else:
        attn = L.attend_live(L.cached_attention, q, cache.k, cache.v, positions, scale, layer=index)
    return _block_output(cfg, p, x, attn), cache


def _block_output(cfg: LlamaConfig, p, x, attn) -> jax.Array:
    """The rest of the block after attention [B, T, H, Dh]: output projection, residual, MLP."""
    out = I.project("bthk,hkd->btd", attn, p["wo"])
    if cfg.o_bias:
        out = out + p["bo"]
    x = x + out
    h = L.rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    return x + L.gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])


def _qwen_sliding_layers(hf: dict[str, Any]) -> tuple[int | None, tuple[int, ...]]:
    """(window, sliding layer indices) as HF `Qwen2Config` and `Qwen3Config` read them (alike): nothing slides unless
    use_sliding_window; then the layers that `layer_types` marks "sliding_attention", by default those from
    max_window_layers on."""
    if not hf.get("use_sliding_window") or hf.get("sliding_window") is None:
        return None, ()
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if i >= hf.get("max_window_layers", 28) else "full_attention"
        for i in range(hf["num_hidden_layers"])
    ]
    return int(hf["sliding_window"]), tuple(i for i, t in enumerate(layer_types) if t == "sliding_attention")
