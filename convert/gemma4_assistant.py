"""HF `Gemma4AssistantForCausalLM` tensor names -> jaxspec.models.gemma4_assistant parameters.

The layers are Gemma 4 layers without key/value projections, named as in the target (`convert/gemma.py`'s rules);
around them sit the two projections between the target's width and the drafter's, and the optional centroid head.
`token_ordering` (integers) is read as int32 whatever the param dtype: a bfloat16 copy would not hold token ids.
"""

from __future__ import annotations

import numpy as np

from jaxspec.models.gemma import layer_param_specs
from jaxspec.models.gemma4_assistant import Gemma4AssistantConfig, top_param_specs

from .gemma import _layer_rules
from .rules import Ignore, IndexedRule, convert_indexed, transposed


def rules(cfg: Gemma4AssistantConfig) -> list[IndexedRule]:
    out = [
        IndexedRule(r"model\.embed_tokens\.weight", "embed"),
        IndexedRule(r"model\.norm\.weight", "final_norm"),
        IndexedRule(r"pre_projection\.weight", "pre_projection", transposed()),
        IndexedRule(r"post_projection\.weight", "post_projection", transposed()),
        IndexedRule(r"lm_head\.weight", "lm_head", transposed()),
        IndexedRule(r"masked_embedding\.centroids\.weight", "centroids", transposed()),
        IndexedRule(r"masked_embedding\.token_ordering", "token_ordering"),
    ]
    for layer in range(cfg.text.num_layers):
        out += [IndexedRule(r.pattern, r.param, r.transform) for r in _layer_rules(cfg.text, layer)]
    return out


def ignores(cfg: Gemma4AssistantConfig) -> list[Ignore]:
    out = [Ignore(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "recomputed from the config")]
    if cfg.tie_word_embeddings:
        out.append(Ignore(r"lm_head\.weight", "tie_word_embeddings=True: the head is model.embed_tokens"))
    return out


def param_shapes(cfg: Gemma4AssistantConfig) -> dict[str, tuple[int, ...]]:
    shapes = {name: shape for name, (shape, _) in top_param_specs(cfg).items()}
    for layer in range(cfg.text.num_layers):
        shapes |= {f"layers.{layer}.{name}": shape for name, (shape, _) in layer_param_specs(cfg.text, layer).items()}
    return shapes


def convert_checkpoint(cfg: Gemma4AssistantConfig, source, dtype, progress=None) -> dict:
    """-> the module's pure dict: top-level params, and `layers: {i: {param: array}}`."""
    params = convert_indexed(source, rules(cfg), ignores(cfg), param_shapes(cfg), dtype, progress=progress,
                             param_dtypes={"token_ordering": np.int32})
    out = {name: params[name] for name in top_param_specs(cfg)}
    out["layers"] = {
        layer: {name: params[f"layers.{layer}.{name}"] for name in layer_param_specs(cfg.text, layer)}
        for layer in range(cfg.text.num_layers)
    }
    return out
