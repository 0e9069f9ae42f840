"""HF `Glm4MoeForCausalLM` (GLM-4.5, GLM-4.5-Air) tensor names -> jaxspec.models.glm4_moe parameters.

Everything but attention (dense/MoE layer groups, per-expert tensors, MTP layers at `model.layers.{N + k}`) follows
the DeepSeek-V3 MoE family's rules in convert/deepseek_v3.py.
"""

from __future__ import annotations

import numpy as np

from jaxspec.models.glm4_moe import Glm4MoeConfig, param_shapes

from .deepseek_v3 import moe_family_ignores, moe_family_rules, plan_moe_family
from .rules import Layout, Plan, TensorSource, gqa_attention_rules, read_all


def attention_rules(cfg: Glm4MoeConfig) -> list[tuple[str, str, Layout | None]]:
    return gqa_attention_rules(cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim)


def plan_checkpoint(cfg: Glm4MoeConfig, source: TensorSource, dtype) -> Plan:
    rules = moe_family_rules(cfg, attention_rules(cfg))
    return plan_moe_family(cfg, source, rules, moe_family_ignores(cfg), param_shapes(cfg), dtype)


def convert_checkpoint(cfg: Glm4MoeConfig, source: TensorSource, dtype, progress=None) -> dict[str, np.ndarray]:
    return read_all(plan_checkpoint(cfg, source, dtype), source, progress)
