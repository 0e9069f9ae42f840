"""HF `DeepseekV3ForCausalLM` tensor names -> jaxspec.models.deepseek_v3 parameters, plus the MoE-family rules that
GLM-4.5 shares (dense/MoE layer groups, per-expert tensors, MTP layers).

One HF pattern such as `model.layers.(\\d+).input_layernorm.weight` serves several params over disjoint layer ranges:
main layers [0, N), and MTP depth k at layer N + k (never a literal layer number). Per-expert tensors
`mlp.experts.{e}.{gate,up,down}_proj.weight` stack on an experts axis through a second index. The MTP copies of the
embedding and LM head (`model.layers.{N+k}.embed_tokens`, `.shared_head.head`) are ignored, as HF ignores them: the
MTP layers use the main model's embedding and head by definition.
"""

from __future__ import annotations

import numpy as np

from jaxspec.models.deepseek_v3 import DeepseekV3Config, param_shapes
from jaxspec.models.moe import FLOAT32_PARAMS, MTP_PREFIX

from .rules import (
    CheckpointMismatch,
    Ignore,
    IndexedRule,
    Layout,
    Plan,
    TensorSource,
    expected_names,
    merge_heads_out,
    plan_indexed,
    read_all,
    transposed,
)

LAYER = r"model\.layers\.(\d+)\."


def moe_family_rules(cfg, attention: list[tuple[str, str, Layout | None]]) -> list[IndexedRule]:
    """Rules for a MoE-family model. `attention` is (HF suffix after the layer prefix, param, layout) per
    attention tensor; every layer rule gets its layer offset here (dense: 0, MoE: first_k_dense_replace, MTP: N)."""
    t = transposed()
    n, n_dense = cfg.num_layers, cfg.moe.first_dense_layers
    block = [
        (r"input_layernorm\.weight", "attn_norm", None),
        (r"post_attention_layernorm\.weight", "mlp_norm", None),
        *attention,
    ]
    dense = [
        (r"mlp\.gate_proj\.weight", "w_gate", t),
        (r"mlp\.up_proj\.weight", "w_up", t),
        (r"mlp\.down_proj\.weight", "w_down", t),
    ]
    routed = [
        (r"mlp\.gate\.weight", "router", t),
        (r"mlp\.gate\.e_score_correction_bias", "router_bias", None),
        (r"mlp\.experts\.(\d+)\.gate_proj\.weight", "we_gate", t),
        (r"mlp\.experts\.(\d+)\.up_proj\.weight", "we_up", t),
        (r"mlp\.experts\.(\d+)\.down_proj\.weight", "we_down", t),
        (r"mlp\.shared_experts\.gate_proj\.weight", "ws_gate", t),
        (r"mlp\.shared_experts\.up_proj\.weight", "ws_up", t),
        (r"mlp\.shared_experts\.down_proj\.weight", "ws_down", t),
    ]
    mtp = [
        (r"enorm\.weight", "enorm", None),
        (r"hnorm\.weight", "hnorm", None),
        (r"eh_proj\.weight", "eh_proj", t),
        (r"shared_head\.norm\.weight", "out_norm", None),
    ]

    def rule(suffix, param, transform, offset):
        return IndexedRule(LAYER + suffix, param, transform, (offset,))

    rules = [
        IndexedRule(r"model\.embed_tokens\.weight", "embed"),
        IndexedRule(r"model\.norm\.weight", "final_norm"),
        IndexedRule(r"lm_head\.weight", "lm_head", t),
    ]
    rules += [rule(s, p, f, 0) for s, p, f in block + dense]
    rules += [rule(s, p, f, n_dense) for s, p, f in routed]
    rules += [rule(s, MTP_PREFIX + p, f, n) for s, p, f in block + routed + mtp]
    return rules


def moe_family_ignores(cfg) -> list[Ignore]:
    out = [Ignore(LAYER + r"self_attn\.rotary_emb\.inv_freq", "recomputed from the config")]
    if cfg.num_mtp_layers:
        mtp_layers = "|".join(str(cfg.num_layers + k) for k in range(cfg.num_mtp_layers))
        copies = rf"model\.layers\.({mtp_layers})\.(embed_tokens|shared_head\.head)\.weight"
        out.append(Ignore(copies, "MTP layers use the main embedding and LM head (HF ignores these copies too)"))
    if cfg.tie_word_embeddings:
        out.append(Ignore(r"lm_head\.weight", "tie_word_embeddings=True: the head is the input embedding"))
    return out


def check_mtp_tensors(cfg, source: TensorSource, rules: list[IndexedRule], shapes: dict[str, tuple[int, ...]]):
    """When config.json announces MTP layers, every one of their tensors must be in the checkpoint. Checked ahead of
    the conversion so the error names the setting that asked for them (HF's `save_pretrained` drops MTP tensors
    yet writes num_nextn_predict_layers=1, so such folders are common)."""
    mtp_rules = [r for r in rules if r.param.startswith(MTP_PREFIX) and r.param in shapes]
    wanted = [name for r in mtp_rules for name in expected_names(r, shapes[r.param])]
    missing = [name for name in wanted if name not in source.shapes]
    if missing:
        n, m = cfg.num_layers, cfg.num_mtp_layers
        raise CheckpointMismatch(
            f"config.json sets num_nextn_predict_layers={m}, so the checkpoint must hold MTP layer(s) "
            f"model.layers.{n}..{n + m - 1}, but it lacks {len(missing)} of their tensors: {missing}. "
            "Set num_nextn_predict_layers to 0 in config.json to load the model without MTP."
        )


def plan_moe_family(cfg, source, rules, ignores, shapes, dtype) -> Plan:
    if cfg.num_mtp_layers:
        check_mtp_tensors(cfg, source, rules, shapes)
    float32 = {name: np.dtype(np.float32) for name in FLOAT32_PARAMS if name in shapes}
    return plan_indexed(source, rules, ignores, shapes, dtype, param_dtypes=float32)


# ----------------------------------------------------------------------------------------------------------------
# DeepSeek-V3 attention


def deinterleave_order(size: int, start: int, width: int) -> tuple[int, ...]:
    """Row order that turns rows [start, start + width) from (x0, x1), (x2, x3), ... pairs into evens then odds."""
    order = np.arange(size)
    evens, odds = np.arange(start, start + width, 2), np.arange(start + 1, start + width, 2)
    order[start : start + width] = np.concatenate([evens, odds])
    return tuple(int(i) for i in order)


def attention_rules(cfg: DeepseekV3Config) -> list[tuple[str, str, Layout | None]]:
    h, r = cfg.num_heads, cfg.kv_lora_rank
    dn, dr, dqk = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.qk_head_dim
    interleaved = cfg.rope_interleave
    # HF [H*(Dn+Dr), in] -> [in, H, Dn+Dr], the rope rows of each head de-interleaved
    query = Layout(split=((h, dqk), None), perm=(2, 0, 1), orders=((1, deinterleave_order(dqk, dn, dr)),) * interleaved)
    # HF [R+Dr, D] -> [D, R+Dr], the rope rows de-interleaved
    kv_a = Layout(split=(None, None), perm=(1, 0), orders=((0, deinterleave_order(r + dr, r, dr)),) * interleaved)
    return [
        (r"self_attn\.q_proj\.weight", "wq", query),
        (r"self_attn\.q_a_proj\.weight", "wq_a", transposed()),
        (r"self_attn\.q_a_layernorm\.weight", "q_norm", None),
        (r"self_attn\.q_b_proj\.weight", "wq_b", query),
        (r"self_attn\.kv_a_proj_with_mqa\.weight", "wkv_a", kv_a),
        (r"self_attn\.kv_a_layernorm\.weight", "kv_norm", None),
        # HF [H*(Dn+Dv), R] -> [R, H, Dn+Dv]
        (r"self_attn\.kv_b_proj\.weight", "wkv_b", Layout(split=((h, dn + cfg.v_head_dim), None), perm=(2, 0, 1))),
        (r"self_attn\.o_proj\.weight", "wo", merge_heads_out(h, cfg.v_head_dim)),
    ]


def plan_checkpoint(cfg: DeepseekV3Config, source: TensorSource, dtype) -> Plan:
    rules = moe_family_rules(cfg, attention_rules(cfg))
    return plan_moe_family(cfg, source, rules, moe_family_ignores(cfg), param_shapes(cfg), dtype)


def convert_checkpoint(cfg: DeepseekV3Config, source: TensorSource, dtype, progress=None) -> dict[str, np.ndarray]:
    return read_all(plan_checkpoint(cfg, source, dtype), source, progress)
