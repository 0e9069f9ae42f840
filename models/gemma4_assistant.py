"""The Gemma 4 MTP drafter (HF `Gemma4AssistantForCausalLM`, transformers 5.23), a network with no KV cache of its own.

Every layer is a Gemma 4 layer whose attention reads the *target's* keys and values (HF `shared_kv_states`: the
cache of the target's last layer of each attention type that computes its own), so the drafter has query and output
projections only. One step (HF `SinglePositionMultiTokenCandidateGenerator`):

    x = pre_projection(concat(target_embedding(token), hidden))     # [B, 1, 2 D_t] -> [B, 1, D]
    x = layers(x, query position L-1, target K/V) ; h = final_norm(x)
    logits = h @ embed.T  (or the centroid head) ; next hidden = post_projection(h)   # D -> D_t

where `token` is the row's last committed token (position L-1), `hidden` the target's final-normed hidden state at
L-2 for the first draft, then the previous step's `post_projection` output. Every step of a round queries from the
same position L-1 (HF's constant `position_ids`), with the drafter's own rope per layer type.

Keys the query sees (`key_window`): every target entry before the query position on full-attention layers, and
the last `sliding_window + 1` entries before it on sliding layers. That is the window HF's mask gives over a shared
tensor that reaches L-2: `create_attention_masks` (transformers/models/gemma4_assistant/modeling_gemma4_assistant.py)
builds a bidirectional sliding mask for the single query at index 0, which keeps kv entries with
|q - kv| <= sliding_window (the first `sliding_window + 1`), then flips it on the kv axis, so the last
`sliding_window + 1` stay visible. The target's own sliding layers see `sliding_window` keys ending at the query. No
softcap on the drafter's logits.

The centroid head (`use_ordered_embeddings`): the top `centroid_intermediate_top_k` of `num_centroids` clusters
choose which vocabulary rows get a real logit (`token_ordering` lists each cluster's tokens); every other token gets
the lowest selected logit minus 1. HF takes that minimum over the whole batch; here it is per row, so a row's draft
distribution does not depend on the other rows (identical at batch 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from . import layers as L
from .gemma import FULL, SLIDING, GemmaConfig, GemmaDecoderLayer, _init_value

# HF `Gemma4AssistantConfig.validate_architecture`: what a drafter's text config must be (defaults as HF reads them).
_REQUIRED_TEXT = {"hidden_size_per_layer_input": (256, 0), "vocab_size_per_layer_input": (262_144, 0),
                  "enable_moe_block": (False, False), "use_double_wide_mlp": (False, False)}


@dataclasses.dataclass(frozen=True)
class Gemma4AssistantConfig:
    text: GemmaConfig  # the drafter's layers; every one of them is KV-shared (num_kv_shared_layers == num_layers)
    backbone_hidden_size: int  # D_t, the target's width
    use_ordered_embeddings: bool = False
    num_centroids: int = 2048
    centroid_top_k: int = 32
    model_type: str = "gemma4_assistant"

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "Gemma4AssistantConfig":
        if hf.get("model_type") != "gemma4_assistant":
            raise ValueError(f"Gemma4AssistantConfig reads model_type gemma4_assistant, not {hf.get('model_type')!r}.")
        text = dict(hf.get("text_config") or {})
        if text.get("model_type", "gemma4_text") != "gemma4_text":
            raise ValueError(f"a Gemma 4 drafter's text_config must be gemma4_text, got {text.get('model_type')!r}.")
        for key, (default, required) in _REQUIRED_TEXT.items():
            if (text.get(key, default) or required) != required:
                raise ValueError(f"a Gemma 4 drafter's text_config needs {key}={required!r} (HF refuses others too); "
                                 f"got {text.get(key, default)!r}.")
        layers = text["num_hidden_layers"]
        if text.get("num_kv_shared_layers") not in (None, 0, layers):
            raise ValueError(f"every layer of a Gemma 4 drafter reads the target's keys and values: "
                             f"num_kv_shared_layers must be {layers}, got {text['num_kv_shared_layers']}.")
        # GemmaConfig checks that shared layers have an owner of their type in the same model; here the owner is
        # the target's store layer (checked when the pair meets), so read the layers unshared, then share them all.
        text_cfg = GemmaConfig.from_hf_config(text | {"model_type": "gemma4_text", "num_kv_shared_layers": 0,
                                                      "tie_word_embeddings": hf.get("tie_word_embeddings", True)})
        text_cfg = dataclasses.replace(text_cfg, num_kv_shared_layers=layers)
        cfg = cls(text=text_cfg, backbone_hidden_size=hf.get("backbone_hidden_size", 1536),
                  use_ordered_embeddings=bool(hf.get("use_ordered_embeddings", False)),
                  num_centroids=hf.get("num_centroids", 2048), centroid_top_k=hf.get("centroid_intermediate_top_k", 32))
        clusters_fit = cfg.vocab_size % cfg.num_centroids == 0 and cfg.centroid_top_k <= cfg.num_centroids
        if cfg.use_ordered_embeddings and not clusters_fit:
            raise ValueError(f"use_ordered_embeddings needs vocab_size ({cfg.vocab_size}) divisible by num_centroids "
                             f"({cfg.num_centroids}) and centroid_intermediate_top_k ({cfg.centroid_top_k}) <= it.")
        return cfg

    # What `jaxspec.Model` and the strategy checks read of any config.
    @property
    def vocab_size(self) -> int:
        return self.text.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.text.hidden_size

    @property
    def eos_token_id(self) -> tuple[int, ...]:
        return self.text.eos_token_id

    @property
    def max_position_embeddings(self) -> int:
        return self.text.max_position_embeddings

    @property
    def tie_word_embeddings(self) -> bool:
        return self.text.tie_word_embeddings

    @property
    def layer_types(self) -> tuple[str, ...]:
        return self.text.layer_types

    @property
    def cluster_size(self) -> int:
        return self.vocab_size // self.num_centroids


def top_param_specs(cfg: Gemma4AssistantConfig) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    d, dt, v = cfg.hidden_size, cfg.backbone_hidden_size, cfg.vocab_size
    specs = {
        "embed": ((v, d), ("vocab", "embed")),  # the tied LM head (inputs come from the target's embedding)
        "final_norm": ((d,), ("embed",)),
        "pre_projection": ((2 * dt, d), ("embed", "mlp")),
        "post_projection": ((d, dt), ("mlp", "embed")),
    }
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ((d, v), ("embed", "vocab"))
    if cfg.use_ordered_embeddings:
        specs["centroids"] = ((d, cfg.num_centroids), ("embed", "vocab"))
        specs["token_ordering"] = ((v,), ("vocab",))
    return specs


def key_window(layer_type: str, sliding_window: int | None) -> int | None:
    """How many target entries before the query position a drafter layer sees (None: all of them); see the module
    docstring. With `layers.sliding_window_mask` at the query position - 1, the keys are (q-1) - window < key <= q-1."""
    return sliding_window + 1 if layer_type == SLIDING else None


class Gemma4AssistantForCausalLM(nnx.Module):
    """`drafter(inputs[B,T,2 D_t], positions[B,T], shared_kv) -> (logits[B,T,V] float32, next hidden[B,T,D_t])`.

    `shared_kv`: {layer type: (k, v)}, each [B, K, S, Dh], the target's position-indexed store-layer cache
    (`GemmaForCausalLM.shared_kv`). Entries at or past a query's position are never read.
    """

    def __init__(self, cfg: Gemma4AssistantConfig, *, dtype: jnp.dtype = jnp.float32, rngs: nnx.Rngs | None = None):
        self.cfg = cfg
        self.dtype = dtype
        rngs = rngs or nnx.Rngs(0)
        for name, (shape, axes) in top_param_specs(cfg).items():
            if name == "token_ordering":  # a permutation of the vocabulary, kept exact in every param dtype
                value = L.shapes_only(shape, jnp.int32)
                if value is None:
                    value = jax.random.permutation(rngs.params(), cfg.vocab_size).astype(jnp.int32)
            else:
                value = _init_value(name, shape, cfg.text, dtype, rngs)
            setattr(self, name, nnx.Param(value, logical_axes=axes))
        self.layers = nnx.List([GemmaDecoderLayer(cfg.text, i, dtype, rngs) for i in range(cfg.text.num_layers)])

    def __call__(self, inputs: jax.Array, positions: jax.Array, shared_kv: dict[str, tuple[jax.Array, jax.Array]]):
        text = self.cfg.text
        x = inputs.astype(self.dtype) @ self.pre_projection[...]  # [B, T, D]
        inv_freq = {SLIDING: text.sliding.rope.inv_freq(text.sliding.head_dim),
                    FULL: text.full.rope.inv_freq(text.full.head_dim)}
        for index, layer in enumerate(self.layers):
            layer_type = text.layer_types[index]
            k, v = shared_kv[layer_type]
            window = key_window(layer_type, text.kind(index).window)
            x = _layer(text, layer.params(), x, positions, k, v, window, inv_freq[layer_type])
        hidden = L.gemma_rms_norm(x, self.final_norm[...], text.rms_norm_eps, text.norm_offset)
        return self.logits(hidden), hidden @ self.post_projection[...]

    def logits(self, hidden: jax.Array) -> jax.Array:
        """[B, T, D] final-normed -> [B, T, V] float32."""
        if self.cfg.use_ordered_embeddings:
            return self._ordered_logits(hidden)
        head = self.lm_head[...] if not self.cfg.tie_word_embeddings else self.embed[...].T
        return jnp.einsum("btd,dv->btv", hidden, head, preferred_element_type=jnp.float32)

    def _ordered_logits(self, hidden: jax.Array) -> jax.Array:
        """HF `Gemma4AssistantMaskedEmbedder`: logits for the tokens of the top clusters only (module docstring)."""
        cfg = self.cfg
        b, t, _ = hidden.shape
        _, top = jax.lax.top_k(hidden @ self.centroids[...], cfg.centroid_top_k)  # [B, T, top_k]
        clusters = self.token_ordering[...].reshape(cfg.num_centroids, cfg.cluster_size)
        ids = clusters[top].reshape(b, t, -1)  # [B, T, top_k * cluster]
        head = self.lm_head[...].T if not cfg.tie_word_embeddings else self.embed[...]  # [V, D]
        selected = jnp.einsum("btd,btnd->btn", hidden, head[ids], preferred_element_type=jnp.float32)
        floor = jnp.min(selected, axis=-1, keepdims=True) - 1.0
        logits = jnp.broadcast_to(floor, (b, t, cfg.vocab_size))
        rows, steps = jnp.arange(b)[:, None, None], jnp.arange(t)[None, :, None]
        return logits.at[rows, steps, ids].set(selected)


def _layer(cfg: GemmaConfig, p, x, positions, k, v, window, inv_freq) -> jax.Array:
    """A Gemma 4 block whose attention reads the target's keys and values: norm -> attention -> norm, residual;
    norm -> MLP -> norm, residual; layer scalar. x: [B, T, D]; k, v: [B, K, S, Dh]."""
    eps, offset = cfg.rms_norm_eps, cfg.norm_offset
    h = L.gemma_rms_norm(x, p["attn_norm"], eps, offset)
    q = L.gemma_rms_norm(jnp.einsum("btd,dhk->bthk", h, p["wq"]), p["q_norm"], eps, offset)  # [B, T, H, Dh]
    q = L.apply_rope(q, positions, inv_freq)
    attn = L.attend_live(L.windowed_attention, q, k.astype(q.dtype), v.astype(q.dtype), positions - 1, cfg.query_scale,
                         window)
    x = x + L.gemma_rms_norm(jnp.einsum("bthk,hkd->btd", attn, p["wo"]), p["post_attn_norm"], eps, offset)
    h = L.gelu_gated_mlp(L.gemma_rms_norm(x, p["mlp_norm"], eps, offset), p["w_gate"], p["w_up"], p["w_down"])
    x = x + L.gemma_rms_norm(h, p["post_mlp_norm"], eps, offset)
    return x * p["layer_scalar"]

