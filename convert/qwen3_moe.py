"""HF `Qwen3MoeForCausalLM` tensor names -> jaxspec.models.qwen3_moe parameters: GLM-4.5's rules (grouped-query
attention with q/k norms, the MoE family's dense/MoE layer groups and per-expert tensors `mlp.experts.{e}.*`, which
is how transformers 5.23 saves them). Its router has no score bias and it has no shared experts, so those rules find
no param to fill.
"""

from __future__ import annotations

import numpy as np

from jaxspec.models.qwen3_moe import Qwen3MoeConfig, param_shapes

from .deepseek_v3 import moe_family_ignores, moe_family_rules, plan_moe_family
from .glm4_moe import attention_rules
from .rules import Plan, TensorSource, read_all


def plan_checkpoint(cfg: Qwen3MoeConfig, source: TensorSource, dtype) -> Plan:
    rules = moe_family_rules(cfg, attention_rules(cfg))
    return plan_moe_family(cfg, source, rules, moe_family_ignores(cfg), param_shapes(cfg), dtype)


def convert_checkpoint(cfg: Qwen3MoeConfig, source: TensorSource, dtype, progress=None) -> dict[str, np.ndarray]:
    return read_all(plan_checkpoint(cfg, source, dtype), source, progress)
