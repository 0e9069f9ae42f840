"""EAGLE-3 draft heads in the layout vLLM and SGLang load (`LlamaForCausalLMEagle3`; SGLang's SpecForge trains it,
`specforge/modeling/draft/llama3_eagle.py`).

A head is one Llama decoder layer whose attention reads twice the width, a feature projection and a draft-vocabulary
head. What is fed where (D the head's width, D_t the target's, V' the draft vocabulary):

    g_t      = fc(concat_l h_l[t])                         # [3 D_t] -> [D]: target layers `aux_layer_ids`, in order
        h_l: the output of the target's decoder layer l (0-based; transformers' `hidden_states[l + 1]`, un-normed),
        optionally RMS-normed first (`fc_norm`). SpecForge's default layers: (1, n//2 - 1, n - 4) for n target layers
        (SGLang and vLLM capture the same states as the inputs of layers 2, n//2 and n - 3).
    entry t  = midlayer(emb(token[t + 1]), g_t) at rope position t:
        x = concat(input_layernorm(emb), hidden_norm(g))   # [2 D]
        a = g + o_proj(attention(q, k, v from x))          # causal, over the head's own entries at positions <= t
        a = a + mlp(post_attention_layernorm(a))           # a: the entry's output, un-normed
    logits   = lm_head(norm(a))                            # [V'] (no norm when config `norm_output` is false)
    draft id d -> target token d + d2t[d]

The first draft of a round comes from the entry at L - 2 (the target's feature there, the newest committed token at
L - 1); each later draft k from an entry at L - 2 + k that reads the previous entry's output `a` in place of g and
the previous draft's embedding. SpecForge's training-time test builds exactly those entries: step k's query at
index t sees step 0's entries up to t and step j's entry at t, at rope position t + j, for j <= k.

The embedding is the target's raw table (SpecForge copies it in with `load_embedding`, unscaled) unless the
checkpoint has its own `embed_tokens.weight`.

Dimension letters: B batch, T entries, S cache length, H query heads, K kv heads, Dh head width.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jaxspec.cache import KVCache, init_kv_cache, write_kv

from . import int8 as I
from . import layers as L

EAGLE3 = "LlamaForCausalLMEagle3"
SUPPORTED_ROPE_TYPES = ("default", "llama3")

# Keys an EAGLE-3 config.json may carry that change nothing at inference here (LlamaConfig's generic keys).
_IGNORED_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "_name_or_path", "dtype", "torch_dtype", "id2label",
    "label2id", "problem_type", "return_dict", "output_attentions", "output_hidden_states", "chunk_size_feed_forward",
    "is_encoder_decoder", "use_cache", "initializer_range", "attention_dropout", "bos_token_id", "pad_token_id",
    "eos_token_id", "tie_word_embeddings", "pretraining_tp", "tokenizer_class", "num_hidden_layers",
})
_KNOWN_KEYS = _IGNORED_KEYS | {
    "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
    "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings", "hidden_act", "vocab_size",
    "draft_vocab_size", "target_hidden_size", "eagle_config", "fc_norm", "norm_output", "attention_bias", "mlp_bias",
}
# eagle_config keys; any other (an EAGLE variant's switches) is named as not understood rather than ignored
_EAGLE_CONFIG_KEYS = frozenset({"eagle_aux_hidden_state_layer_ids", "use_aux_hidden_state"})


@dataclasses.dataclass(frozen=True)
class Eagle3Config:
    hidden_size: int  # D
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int  # the target's vocabulary, which d2t maps into
    draft_vocab_size: int  # V'
    target_hidden_size: int  # D_t
    aux_layer_ids: tuple[int, ...] | None = None  # None: SpecForge's default for the target's depth (`layer_ids`)
    fc_norm: bool = False  # an RMSNorm on each of the three tapped states before fc
    norm_output: bool = True  # the head reads the final-normed output
    own_embedding: bool = False  # the checkpoint has embed_tokens.weight (convert/eagle3.py `config_for_source`)
    rope_llama3: tuple[float, float, float, int] | None = None
    model_type: str = "llama"

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads "
                             f"({self.num_kv_heads}).")
        if not 0 < self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size must be in [1, vocab_size={self.vocab_size}], got "
                             f"{self.draft_vocab_size}.")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Eagle3Config:
        """An EAGLE-3 config.json (a Llama config with the EAGLE-3 keys); raises on anything not understood."""
        if EAGLE3 not in (hf.get("architectures") or ()):
            raise ValueError(f"Eagle3Config reads architectures [{EAGLE3!r}], got {hf.get('architectures')}.")
        unknown = sorted(set(hf) - _KNOWN_KEYS)
        if unknown:
            raise ValueError(f"{EAGLE3} config: keys jaxspec does not understand: {unknown}.")
        eagle = dict(hf.get("eagle_config") or {})
        unknown = sorted(set(eagle) - _EAGLE_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"{EAGLE3} config: eagle_config keys jaxspec does not understand: {unknown}.")
        if eagle.get("use_aux_hidden_state") is False:
            raise NotImplementedError("eagle_config.use_aux_hidden_state=false is an EAGLE-1/2 head (it reads the "
                                      "target's last hidden state only); jaxspec runs EAGLE-3 heads, which read three "
                                      "target layers.")
        layers = hf.get("num_hidden_layers", 1)
        if layers != 1:
            raise NotImplementedError(f"EAGLE-3 heads with num_hidden_layers={layers} are not supported yet: jaxspec "
                                      "runs the single-midlayer head (SpecForge's LlamaForCausalLMEagle3).")
        if hf.get("hidden_act", "silu") != "silu":
            raise NotImplementedError(f"hidden_act={hf['hidden_act']!r} is not supported; EAGLE-3 heads use 'silu'.")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise NotImplementedError(f"{flag}=true is not supported: the EAGLE-3 midlayer has no biases.")
        rope = L.rope_parameters(hf)
        rope_type = rope.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise NotImplementedError(f"rope type {rope_type!r} is not supported yet; supported: "
                                      f"{SUPPORTED_ROPE_TYPES}.")
        llama3 = None
        if rope_type == "llama3":
            llama3 = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                      int(rope["original_max_position_embeddings"]))
        ids = eagle.get("eagle_aux_hidden_state_layer_ids")
        if ids is not None and (len(ids) != 3 or len(set(ids)) != 3
                                or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)):
            raise ValueError(f"eagle_config.eagle_aux_hidden_state_layer_ids must be three distinct target layer "
                             f"indices, got {ids!r}.")
        heads = hf["num_attention_heads"]
        return cls(
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]),
            rope_llama3=llama3,
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            vocab_size=hf["vocab_size"],
            draft_vocab_size=int(hf.get("draft_vocab_size") or hf["vocab_size"]),
            target_hidden_size=hf.get("target_hidden_size") or hf["hidden_size"],
            aux_layer_ids=None if ids is None else tuple(ids),
            fc_norm=bool(hf.get("fc_norm", False)),
            norm_output=bool(hf.get("norm_output", True)),
        )

    def inv_freq(self) -> jax.Array:
        if self.rope_llama3 is not None:
            return L.llama3_inv_freq(self.head_dim, self.rope_theta, *self.rope_llama3)
        return L.default_inv_freq(self.head_dim, self.rope_theta)

    def layer_ids(self, num_target_layers: int) -> tuple[int, ...]:
        """The target layers whose outputs g concatenates, in order: the config's, else SpecForge's default."""
        if self.aux_layer_ids is not None:
            return self.aux_layer_ids
        return default_layer_ids(num_target_layers)

    def check_target(self, target_cfg: Any) -> None:
        """Raise unless a target with config `target_cfg` (hidden_size, num_layers, vocab_size) can feed this head."""
        if target_cfg.hidden_size != self.target_hidden_size:
            raise ValueError(f"the EAGLE-3 head's fc reads target hidden states of width {self.target_hidden_size}, "
                             f"but the target's hidden_size is {target_cfg.hidden_size}.")
        if target_cfg.vocab_size != self.vocab_size:
            raise ValueError(f"the EAGLE-3 head maps drafts into a vocabulary of {self.vocab_size} tokens "
                             f"(config vocab_size); the target has {target_cfg.vocab_size}.")
        if not self.own_embedding and target_cfg.hidden_size != self.hidden_size:
            raise ValueError(f"the EAGLE-3 head has no embed_tokens.weight of its own, so it embeds tokens with the "
                             f"target's table, of width {target_cfg.hidden_size}; the head's hidden_size is "
                             f"{self.hidden_size}.")
        ids = self.layer_ids(target_cfg.num_layers)
        if max(ids) >= target_cfg.num_layers:
            raise ValueError(f"the EAGLE-3 head reads target layers {list(ids)} (eagle_config."
                             f"eagle_aux_hidden_state_layer_ids, or the default for the target's depth); the target "
                             f"has {target_cfg.num_layers} layers.")


def default_layer_ids(num_target_layers: int) -> tuple[int, ...]:
    """SpecForge's `resolve_eagle_capture_layers` default: outputs of layers 1, n//2 - 1 and n - 4."""
    ids = (1, num_target_layers // 2 - 1, num_target_layers - 4)
    if num_target_layers < 5 or len(set(ids)) != 3:
        raise ValueError(f"a {num_target_layers}-layer target has no default EAGLE-3 layers (1, n//2 - 1, n - 4 must "
                         "be distinct and present); set eagle_config.eagle_aux_hidden_state_layer_ids.")
    return ids


# Logical axes of every parameter (the head is one layer: no layers axis).
PARAM_AXES: dict[str, tuple[str, ...]] = L.GQA_ATTENTION_AXES | {
    "embed": ("vocab", "embed"),
    "fc": ("mlp", "embed"),  # [3 D_t, D], sharded on its input like a down projection
    "fc_norm": (None, "embed"),
    "input_norm": ("embed",),
    "hidden_norm": ("embed",),
    "mlp_norm": ("embed",),
    "w_gate": ("embed", "mlp"),
    "w_up": ("embed", "mlp"),
    "w_down": ("mlp", "embed"),
    "final_norm": ("embed",),
    "lm_head": ("embed", "vocab"),
}


def param_shapes(cfg: Eagle3Config) -> dict[str, tuple[int, ...]]:
    d, h, k, dh, f = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    shapes = {
        "fc": (3 * cfg.target_hidden_size, d), "input_norm": (d,), "hidden_norm": (d,),
        "wq": (2 * d, h, dh), "wk": (2 * d, k, dh), "wv": (2 * d, k, dh), "wo": (h, dh, d),
        "mlp_norm": (d,), "w_gate": (d, f), "w_up": (d, f), "w_down": (f, d),
        "final_norm": (d,), "lm_head": (d, cfg.draft_vocab_size),
    }
    if cfg.fc_norm:
        shapes["fc_norm"] = (3, cfg.target_hidden_size)
    if cfg.own_embedding:
        shapes["embed"] = (cfg.vocab_size, d)
    return shapes


class Eagle3Head(nnx.Module):
    """An EAGLE-3 head. One round, for rows with committed length L (module docstring for the recipe):

        g         = head.project_features(taps)                      # [B, T, 3 D_t] -> [B, T, D], stored by position
        a, cache  = head.step(embed(tokens at t + 1), g, t, cache)   # entries t = L-2-K .. L-2: committed
        d_1       = head.vocab_ids[argmax head.logits(a[:, -1])]
        a, cache  = head.step(embed(d_1), a[:, -1:], L-1, cache)     # and so on: drafts 2 .. K
    The cache is position-indexed, so rollback is a length: entries past L - 2 are rewritten before any query reads
    them.
    """

    def __init__(self, cfg: Eagle3Config, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        rngs = rngs or nnx.Rngs(0)
        for name, shape in param_shapes(cfg).items():
            setattr(self, name, nnx.Param(L.init_value(name, shape, dtype, rngs), logical_axes=PARAM_AXES[name]))
        self.vocab_ids = L.DraftVocab(L.initial_ids(cfg.draft_vocab_size))

    def params(self) -> dict[str, jax.Array]:
        return I.layer_params(self)

    def project_features(self, taps: jax.Array) -> jax.Array:
        """taps [B, T, 3 D_t] (the tapped target layers' outputs in `layer_ids` order) -> g [B, T, D]."""
        cfg = self.cfg
        taps = taps.astype(self.dtype)
        if cfg.fc_norm:
            parts = jnp.split(taps, 3, axis=-1)
            taps = jnp.concatenate([L.rms_norm(part, self.fc_norm[i], cfg.rms_norm_eps)
                                    for i, part in enumerate(parts)], axis=-1)
        return I.project("btc,cd->btd", taps, I.weight(self, "fc"))

    def embed_tokens(self, tokens: jax.Array) -> jax.Array:
        """The head's own embedding rows [B, T, D] (only when the checkpoint has its own table)."""
        return I.lookup(I.weight(self, "embed"), tokens, self.dtype)

    def init_cache(self, batch: int, size: int) -> KVCache:
        """The midlayer's keys and values by position: k, v [2, B, K, S, Dh] (a stack of two, jaxspec/cache.py
        `stack_layers`: layer 1 is never written or read)."""
        c = self.cfg
        return init_kv_cache(1, batch, size, c.num_kv_heads, c.head_dim, self.dtype)

    def attention_inputs(self, p, embeds: jax.Array, hidden: jax.Array, positions: jax.Array):
        """The midlayer's attention inputs from embeds [B, T, D] and hidden [B, T, D] (g or a previous output) at
        rope positions [B, T] -> q [B, T, H, Dh], k, v [B, T, K, Dh]."""
        cfg = self.cfg
        x = jnp.concatenate([L.rms_norm(embeds.astype(self.dtype), p["input_norm"], cfg.rms_norm_eps),
                             L.rms_norm(hidden.astype(self.dtype), p["hidden_norm"], cfg.rms_norm_eps)], axis=-1)
        inv_freq = cfg.inv_freq()
        q = L.apply_rope(I.project("btc,chk->bthk", x, p["wq"]), positions, inv_freq)
        k = L.apply_rope(I.project("btc,chk->bthk", x, p["wk"]), positions, inv_freq)
        v = I.project("btc,chk->bthk", x, p["wv"])
        return q, k, v

    def attention_outputs(self, p, hidden: jax.Array, attn: jax.Array) -> jax.Array:
        """The entry's output a [B, T, D] from its residual input `hidden` [B, T, D] and attention [B, T, H, Dh]."""
        x = hidden.astype(self.dtype) + I.project("bthk,hkd->btd", attn, p["wo"])
        h = L.rms_norm(x, p["mlp_norm"], self.cfg.rms_norm_eps)
        return x + L.gated_mlp(h, p["w_gate"], p["w_up"], p["w_down"])

    def step(self, embeds: jax.Array, hidden: jax.Array, positions: jax.Array, cache: KVCache
             ) -> tuple[jax.Array, KVCache]:
        """Entries at positions [B, T] (consecutive per row) from embeds and hidden [B, T, D] -> (outputs a
        [B, T, D], the cache with their keys and values written). Each query sees the entries at positions at or
        before its own; positions at or past S are dropped."""
        p = self.params()
        q, k, v = self.attention_inputs(p, embeds, hidden, positions)
        cache = write_kv(cache, 0, positions, k, v)
        attn = L.attend_live(L.cached_attention, q, cache.k, cache.v, positions, self.cfg.head_dim**-0.5, layer=0)
        return self.attention_outputs(p, hidden, attn), cache

    def logits(self, outputs: jax.Array) -> jax.Array:
        """Draft-vocabulary logits [..., V'] (float32) from entry outputs a [..., D]."""
        h = L.rms_norm(outputs, self.final_norm[...], self.cfg.rms_norm_eps) if self.cfg.norm_output else outputs
        return I.project("...d,dv->...v", h, I.weight(self, "lm_head"), preferred_element_type=jnp.float32)

    def target_logits(self, outputs: jax.Array) -> jax.Array:
        """The same logits over the target's vocabulary [..., V]: -inf outside the draft vocabulary, so the draft
        distribution q is zero there (which keeps speculative sampling exact: the residual gives that mass back)."""
        return L.spread_to_vocab(self.logits(outputs), self.vocab_ids[...], self.cfg.vocab_size)
