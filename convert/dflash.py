"""DFlash drafter tensor names (both layouts) -> jaxspec.models.dflash parameters.

The two layouts name the decoder layers alike (Qwen3 names: `layers.{i}.self_attn.{q,k,v,o}_proj`, `q_norm`,
`k_norm`, `input_layernorm`, `post_attention_layernorm`, `mlp.{gate,up,down}_proj`, and the final `norm`); they
differ in the context projection:

    jaxspec param   HF muse_glimmer_assistant            z-lab DFlashDraftModel
    fc              encoder.fc.weight [D, n*D]           fc.weight [D, n*D]
    hidden_norm     encoder.output_norm_enc.weight       hidden_norm.weight

Attention biases exist only in z-lab's layout with `attention_bias: true`. Neither layout has an embedding or a
head (the target's are used). A drafter whose config sets `draft_vocab_size` (jaxspec's addition, models/dflash.py)
stores its draft vocabulary as EAGLE-3 heads do: `d2t` (draft id d is token d + d2t[d]) and optionally `t2d`, read
into `vocab_ids`. Both save without a prefix (the model class is the base model); a checkpoint saved
from a wrapper puts every name under `model.`, which is read alike. Nothing else is accepted: a DFlash 2 tensor
(`attention_conv`, `mlp_conv`, `candidate_selector`) or any other is named as unexpected.
"""

from __future__ import annotations

from jaxspec.models.dflash import DFLASH, MUSE, DFlashConfig, layer_param_shapes, top_param_shapes

from .rules import (
    Ignore,
    IndexedRule,
    TensorSource,
    convert_indexed,
    draft_vocab_slots,
    gqa_attention_rules,
    take_vocab_ids,
    transposed,
)

LAYER = r"layers\.(\d+)\."
CONTEXT_NAMES = {  # param -> tensor name, per layout
    MUSE: {"fc": r"encoder\.fc\.weight", "hidden_norm": r"encoder\.output_norm_enc\.weight"},
    DFLASH: {"fc": r"fc\.weight", "hidden_norm": r"hidden_norm\.weight"},
}


def _prefix(source: TensorSource) -> str:
    """`model\\.` when the checkpoint was saved under a wrapper (its final norm is `model.norm.weight`), else none."""
    return r"model\." if "model.norm.weight" in source.shapes else ""


def rules(cfg: DFlashConfig, prefix: str = "") -> list[IndexedRule]:
    d, h, k, dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    names = CONTEXT_NAMES[cfg.layout]
    top = [
        IndexedRule(names["fc"], "fc", transposed()),  # [D, n*D] -> [n*D, D]
        IndexedRule(names["hidden_norm"], "hidden_norm"),
        IndexedRule(r"norm\.weight", "final_norm"),
    ]
    layer = [  # stacked params `layers.{name}` [num_layers, ...]: the group is the layer
        (r"input_layernorm\.weight", "attn_norm", None),
        *gqa_attention_rules(d, h, k, dh),
        (r"self_attn\.o_proj\.bias", "bo", None),
        (r"post_attention_layernorm\.weight", "mlp_norm", None),
        (r"mlp\.gate_proj\.weight", "w_gate", transposed()),
        (r"mlp\.up_proj\.weight", "w_up", transposed()),
        (r"mlp\.down_proj\.weight", "w_down", transposed()),
    ]
    if cfg.draft_vocab_size:
        top += [IndexedRule(r"d2t", "d2t"), IndexedRule(r"t2d", "t2d")]
    return ([IndexedRule(prefix + r.pattern, r.param, r.transform) for r in top]
            + [IndexedRule(prefix + LAYER + pattern, f"layers.{param}", transform)
               for pattern, param, transform in layer])


def ignores(prefix: str = "") -> list[Ignore]:
    return [Ignore(prefix + r"(layers\.\d+\.self_attn\.)?rotary_emb\.(original_)?inv_freq",
                   "recomputed from the config")]


def param_shapes(cfg: DFlashConfig) -> dict[str, tuple[int, ...]]:
    """Top-level params, and each layer param stacked over layers as `layers.{name}` (split per layer afterwards)."""
    stacked = {f"layers.{name}": (cfg.num_layers, *shape) for name, shape in layer_param_shapes(cfg).items()}
    return top_param_shapes(cfg) | stacked


def convert_checkpoint(cfg: DFlashConfig, source: TensorSource, dtype, progress=None) -> dict:
    """-> the module's pure dict: `fc`, `hidden_norm`, `final_norm`, and `layers: {i: {param: array}}`. Every tensor
    fills exactly one slot or is an ignored rotary buffer; a missing, unexpected or mis-shaped one is named."""
    prefix = _prefix(source)
    shapes, dtypes = param_shapes(cfg), {}
    if cfg.draft_vocab_size:
        vocab_shapes, dtypes = draft_vocab_slots(source, cfg.draft_vocab_size, cfg.vocab_size, required=True,
                                                 prefix=prefix.replace("\\", ""))
        shapes = shapes | vocab_shapes
    params = convert_indexed(source, rules(cfg, prefix), ignores(prefix), shapes, dtype, progress=progress,
                             param_dtypes=dtypes)
    out = {name: params[name] for name in top_param_shapes(cfg)}
    if cfg.draft_vocab_size:
        out["vocab_ids"] = take_vocab_ids(params, cfg.draft_vocab_size, cfg.vocab_size)
    out["layers"] = {i: {name: params[f"layers.{name}"][i] for name in layer_param_shapes(cfg)}
                     for i in range(cfg.num_layers)}
    return out
