"""HF `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` tensor names -> jaxspec.models.llama parameters.

Qwen3 adds the per-head norms `self_attn.q_norm.weight` and `self_attn.k_norm.weight` [head_dim]; a rule fills a
param only where the config has it (`param_shapes`), so a Llama or Qwen2 checkpoint that carried them would be
rejected as having unexpected tensors, and a Qwen3 one without them as missing them.

MTP layers (config.json `num_nextn_predict_layers` = K > 0) use DeepSeek-V3's layout: depth k is
`model.layers.{N + k}` (N = num_hidden_layers) with the decoder block's own tensor names plus `enorm`, `hnorm`,
`eh_proj` and `shared_head.norm`; copies of the embedding and head there (`embed_tokens`, `shared_head.head`) are
ignored, as HF ignores them. A draft vocabulary (`draft_vocab_size` = V') is the int tensor `model.draft_vocab`
[V'] of token ids. They are converted apart from the main model (`convert_mtp_layers`), so a file that holds only
them (a trained set shipped for a model that has none) converts on its own.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from jaxspec.models.llama import TOP_LEVEL, LlamaConfig, mtp_layer_shapes, param_shapes

from .rules import CheckpointMismatch, Ignore, Rule, TensorSource, convert, split_head_bias, split_heads

LAYER = r"model\.layers\.(\d+)\."
DRAFT_VOCAB = "model.draft_vocab"


def rules(cfg: LlamaConfig) -> list[Rule]:
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim

    return [
        Rule(r"model\.embed_tokens\.weight", "embed"),
        Rule(LAYER + r"input_layernorm\.weight", "attn_norm"),
        Rule(LAYER + r"self_attn\.q_proj\.weight", "wq", split_heads(d, h, dh)),
        Rule(LAYER + r"self_attn\.k_proj\.weight", "wk", split_heads(d, k, dh)),
        Rule(LAYER + r"self_attn\.v_proj\.weight", "wv", split_heads(d, k, dh)),
        Rule(LAYER + r"self_attn\.q_proj\.bias", "bq", split_head_bias(h, dh)),
        Rule(LAYER + r"self_attn\.k_proj\.bias", "bk", split_head_bias(k, dh)),
        Rule(LAYER + r"self_attn\.v_proj\.bias", "bv", split_head_bias(k, dh)),
        Rule(LAYER + r"self_attn\.o_proj\.weight", "wo", lambda w: w.T.reshape(h, dh, d)),
        Rule(LAYER + r"self_attn\.o_proj\.bias", "bo"),
        Rule(LAYER + r"self_attn\.q_norm\.weight", "q_norm"),
        Rule(LAYER + r"self_attn\.k_norm\.weight", "k_norm"),
        Rule(LAYER + r"post_attention_layernorm\.weight", "mlp_norm"),
        Rule(LAYER + r"mlp\.gate_proj\.weight", "w_gate", np.transpose),
        Rule(LAYER + r"mlp\.up_proj\.weight", "w_up", np.transpose),
        Rule(LAYER + r"mlp\.down_proj\.weight", "w_down", np.transpose),
        Rule(r"model\.norm\.weight", "final_norm"),
        Rule(r"lm_head\.weight", "lm_head", np.transpose),
    ]


def ignores(cfg: LlamaConfig) -> list[Ignore]:
    out = [Ignore(LAYER + r"self_attn\.rotary_emb\.inv_freq", "recomputed from the config")]
    if cfg.tie_word_embeddings:
        # Some tied checkpoints still store the head; it is the embedding by definition.
        out.append(Ignore(r"lm_head\.weight", "tie_word_embeddings=True: the head is the input embedding"))
    return out


def convert_checkpoint(cfg: LlamaConfig, source: TensorSource, dtype, progress=None) -> dict:
    """-> the module's pure dict: top-level params, `layers: {i: {param: array}}`, and with MTP layers
    `mtp_layers: {k: {param: array}}` (plus `draft_vocab` with a draft vocabulary)."""
    main, mtp = _split_mtp(cfg, source)
    shapes = param_shapes(cfg)
    stacked = {name for name in shapes if name not in TOP_LEVEL}
    params = convert(main, rules(cfg), ignores(cfg), shapes, stacked, dtype, progress=progress)
    out = {name: params[name] for name in shapes if name in TOP_LEVEL}
    out["layers"] = {i: {name: params[name][i] for name in stacked} for i in range(cfg.num_layers)}
    if cfg.num_mtp_layers:
        out |= convert_mtp_layers(cfg, mtp, dtype)
    return out


def mtp_rules(cfg: LlamaConfig) -> list[Rule]:
    """Depth k's tensors at `model.layers.{N + k}`: the decoder block's own names, then what MTP adds."""
    block = [rule for rule in rules(cfg) if rule.pattern.startswith(LAYER)]
    return block + [
        Rule(LAYER + r"enorm\.weight", "enorm"),
        Rule(LAYER + r"hnorm\.weight", "hnorm"),
        Rule(LAYER + r"eh_proj\.weight", "eh_proj", np.transpose),  # HF [D, 2D] -> [2D, D]
        Rule(LAYER + r"shared_head\.norm\.weight", "out_norm"),
    ]


def mtp_ignores(cfg: LlamaConfig) -> list[Ignore]:
    return [
        Ignore(LAYER + r"self_attn\.rotary_emb\.inv_freq", "recomputed from the config"),
        Ignore(LAYER + r"(embed_tokens|shared_head\.head)\.weight",
               "MTP layers use the main embedding and LM head (HF ignores these copies too)"),
    ]


def convert_mtp_layers(cfg: LlamaConfig, source: TensorSource, dtype) -> dict:
    """Only the MTP tensors (and the draft vocabulary) -> `{"mtp_layers": {k: {param: array}}, "draft_vocab": ids}`.

    `source` must hold exactly the tensors of depths 0..K-1 at `model.layers.{N + k}`; an error names every missing
    or unexpected one and the config.json settings that asked for them.
    """
    n, k = cfg.num_layers, cfg.num_mtp_layers
    names = {name for name in source.shapes if name != DRAFT_VOCAB}
    layer_shapes = {name: (k, *shape) for name, shape in mtp_layer_shapes(cfg).items()}
    try:
        params = convert(_Subset(source, names), mtp_rules(cfg), mtp_ignores(cfg), layer_shapes, set(layer_shapes),
                         dtype, layer_offset=lambda param: n)
        vocab = _draft_vocab(cfg, source)
    except CheckpointMismatch as error:
        raise CheckpointMismatch(
            f"MTP layers: config.json sets num_nextn_predict_layers={k} (model.layers.{n}..{n + k - 1}) and "
            f"draft_vocab_size={cfg.draft_vocab_size}. {error}"
        ) from error
    out = {"mtp_layers": {depth: {name: params[name][depth] for name in layer_shapes} for depth in range(k)}}
    if vocab is not None:
        out["draft_vocab"] = vocab
    return out


# The inverse of a decoder block's conversion: param name -> (HF tensor name, [D]-width-aware layout change). Shared by
# every exporter of Llama/Qwen-style blocks (trained MTP layers here, DFlash drafters in jaxspec.train).
_HF_LAYER_TENSORS = {
    "attn_norm": ("input_layernorm.weight", None),
    "wq": ("self_attn.q_proj.weight", lambda w, d: w.reshape(d, -1).T),  # [D, H, Dh] -> [H*Dh, D]
    "wk": ("self_attn.k_proj.weight", lambda w, d: w.reshape(d, -1).T),
    "wv": ("self_attn.v_proj.weight", lambda w, d: w.reshape(d, -1).T),
    "bq": ("self_attn.q_proj.bias", lambda w, d: np.ravel(w)),
    "bk": ("self_attn.k_proj.bias", lambda w, d: np.ravel(w)),
    "bv": ("self_attn.v_proj.bias", lambda w, d: np.ravel(w)),
    "wo": ("self_attn.o_proj.weight", lambda w, d: w.reshape(-1, d).T),  # [H, Dh, D] -> [D, H*Dh]
    "bo": ("self_attn.o_proj.bias", None),
    "q_norm": ("self_attn.q_norm.weight", None),
    "k_norm": ("self_attn.k_norm.weight", None),
    "mlp_norm": ("post_attention_layernorm.weight", None),
    "w_gate": ("mlp.gate_proj.weight", lambda w, d: w.T),
    "w_up": ("mlp.up_proj.weight", lambda w, d: w.T),
    "w_down": ("mlp.down_proj.weight", lambda w, d: w.T),
    "enorm": ("enorm.weight", None),  # DeepSeek-style MTP layers' extras
    "hnorm": ("hnorm.weight", None),
    "eh_proj": ("eh_proj.weight", lambda w, d: w.T),
    "out_norm": ("shared_head.norm.weight", None),
}


def layer_hf_tensors(layer: dict[str, Any], width: int, prefix: str) -> dict[str, np.ndarray]:
    """One decoder block's params (a pure dict) -> HF tensors named `prefix + HF name`, in HF's layouts."""
    out = {}
    for param, value in layer.items():
        name, transform = _HF_LAYER_TENSORS[param]
        value = np.asarray(value)
        out[prefix + name] = np.ascontiguousarray(value if transform is None else transform(value, width))
    return out


def mtp_hf_tensors(cfg: LlamaConfig, mtp_layers: dict, draft_vocab: np.ndarray | None = None) -> dict:
    """The inverse of `convert_mtp_layers`: `{k: {param: array}}` (and the draft vocabulary) -> HF tensor names and
    layouts, the file a trained set is shipped as."""
    out = {}
    for depth, params in mtp_layers.items():
        out |= layer_hf_tensors(params, cfg.hidden_size, f"model.layers.{cfg.num_layers + int(depth)}.")
    if draft_vocab is not None:
        out[DRAFT_VOCAB] = np.asarray(draft_vocab, np.int32)
    return out


def _draft_vocab(cfg: LlamaConfig, source: TensorSource) -> np.ndarray | None:
    """The draft vocabulary's token ids [V'], distinct and in range, or None when the config has none."""
    present = DRAFT_VOCAB in source.shapes
    if not cfg.draft_vocab_size:
        if present:
            raise CheckpointMismatch(f"unexpected tensors (no rule uses them): ['{DRAFT_VOCAB}'] (draft_vocab_size "
                                     "is absent or 0 in config.json)")
        return None
    if not present:
        raise CheckpointMismatch(f"missing tensors for ['{DRAFT_VOCAB}']")
    ids = np.asarray(source.read(DRAFT_VOCAB))
    if ids.shape != (cfg.draft_vocab_size,) or not np.issubdtype(ids.dtype, np.integer):
        raise CheckpointMismatch(f"mis-shaped tensors: ['{DRAFT_VOCAB}': {ids.dtype}{list(ids.shape)}, expected "
                                 f"integer token ids [{cfg.draft_vocab_size}]]")
    if len(np.unique(ids)) != len(ids) or ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise CheckpointMismatch(f"'{DRAFT_VOCAB}' must hold distinct token ids below vocab_size={cfg.vocab_size}")
    return ids.astype(np.int32)


def _split_mtp(cfg: LlamaConfig, source: TensorSource) -> tuple[TensorSource, TensorSource]:
    """(main model's tensors, MTP tensors): layers at or past N and the draft vocabulary go to the second when the
    config announces MTP layers; otherwise everything stays with the main model (extra layers are an error there)."""
    if not cfg.num_mtp_layers:
        return source, _Subset(source, set())
    layer = re.compile(LAYER)
    mtp = {name for name in source.shapes
           if name == DRAFT_VOCAB or ((m := layer.match(name)) and int(m.group(1)) >= cfg.num_layers)}
    return _Subset(source, set(source.shapes) - mtp), _Subset(source, mtp)


class _Subset:
    """Some of a tensor source's tensors, read from it on demand."""

    def __init__(self, source: TensorSource, names: set[str]):
        self._source = source
        self.shapes = {name: shape for name, shape in source.shapes.items() if name in names}

    def read(self, name: str) -> np.ndarray:
        return self._source.read(name)

    def __getattr__(self, name: str):
        """Optional reading methods of the source (e.g. `read_box`) pass through."""
        return getattr(self._source, name)
