"""EAGLE-3 head tensor names (the layout vLLM and SGLang load) -> jaxspec.models.eagle3 parameters.

    jaxspec param   tensor                                           HF shape
    fc              fc.weight                                        [D, 3 D_t]
    fc_norm         fc_norm.{0,1,2}.weight (config fc_norm only)      [D_t] each
    input_norm      midlayer.input_layernorm.weight                  [D]
    hidden_norm     midlayer.hidden_norm.weight                      [D]
    wq, wk, wv, wo  midlayer.self_attn.{q,k,v,o}_proj.weight         [H Dh, 2 D], ..., [D, H Dh]
    mlp_norm        midlayer.post_attention_layernorm.weight         [D]
    w_gate, w_up    midlayer.mlp.{gate,up}_proj.weight               [F, D]
    w_down          midlayer.mlp.down_proj.weight                    [D, F]
    final_norm      norm.weight                                      [D]
    lm_head         lm_head.weight                                   [V', D]
    embed           embed_tokens.weight (optional: else the target's) [V, D]
    vocab_ids       d2t (int: draft id d is token d + d2t[d]); t2d (bool [V], optional) must mark exactly those tokens

A draft vocabulary as large as the target's may omit d2t (the identity). Every other tensor is named as unexpected.
"""

from __future__ import annotations

import dataclasses

from jaxspec.models.eagle3 import Eagle3Config, param_shapes

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

EMBEDDING = "embed_tokens.weight"


def config_for_source(cfg: Eagle3Config, source: TensorSource) -> Eagle3Config:
    """The config as the checkpoint's tensors complete it: whether the head has an embedding table of its own."""
    return dataclasses.replace(cfg, own_embedding=EMBEDDING in source.shapes)


def rules(cfg: Eagle3Config) -> list[IndexedRule]:
    d, h, k, dh = 2 * cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attention = [IndexedRule(r"midlayer\." + pattern, param, transform)
                 for pattern, param, transform in gqa_attention_rules(d, h, k, dh)]
    return attention + [
        IndexedRule(r"fc\.weight", "fc", transposed()),
        IndexedRule(r"fc_norm\.(\d+)\.weight", "fc_norm"),
        IndexedRule(r"midlayer\.input_layernorm\.weight", "input_norm"),
        IndexedRule(r"midlayer\.hidden_norm\.weight", "hidden_norm"),
        IndexedRule(r"midlayer\.post_attention_layernorm\.weight", "mlp_norm"),
        IndexedRule(r"midlayer\.mlp\.gate_proj\.weight", "w_gate", transposed()),
        IndexedRule(r"midlayer\.mlp\.up_proj\.weight", "w_up", transposed()),
        IndexedRule(r"midlayer\.mlp\.down_proj\.weight", "w_down", transposed()),
        IndexedRule(r"norm\.weight", "final_norm"),
        IndexedRule(r"lm_head\.weight", "lm_head", transposed()),
        IndexedRule(r"embed_tokens\.weight", "embed"),
        IndexedRule(r"d2t", "d2t"),
        IndexedRule(r"t2d", "t2d"),
    ]


def ignores() -> list[Ignore]:
    return [Ignore(r"midlayer\.self_attn\.rotary_emb\.(original_)?inv_freq", "recomputed from the config")]


def convert_checkpoint(cfg: Eagle3Config, source: TensorSource, dtype, progress=None) -> dict:
    """-> the module's pure dict: every param of `param_shapes`, and `vocab_ids` (int32 [V'], from d2t)."""
    vocab_shapes, vocab_dtypes = draft_vocab_slots(source, cfg.draft_vocab_size, cfg.vocab_size,
                                                   required=cfg.draft_vocab_size < cfg.vocab_size)
    params = convert_indexed(source, rules(cfg), ignores(), dict(param_shapes(cfg)) | vocab_shapes, dtype,
                             progress=progress, param_dtypes=vocab_dtypes)
    params["vocab_ids"] = take_vocab_ids(params, cfg.draft_vocab_size, cfg.vocab_size)
    return params
