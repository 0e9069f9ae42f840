"""Qwen3-MoE (`Qwen3MoeForCausalLM`: Qwen3-30B-A3B, Qwen3-235B-A22B, Qwen3-Coder-30B-A3B) as HF transformers 5.23
defines it: Qwen3's attention (grouped queries, an RMSNorm over each query and key head before a full-width RoPE) in
GLM-4.5's module, and MoE feed-forwards routed by a softmax top-k with no groups, score bias or shared experts
(models/moe.py, `scoring="softmax"`). The cache is the plain `KVCache`.

HF chooses each layer's feed-forward by `mlp_only_layers` and `decoder_sparse_step`; the MoE family stacks dense
layers first and MoE layers after them, which covers the published checkpoints (every layer MoE) and any config
whose dense layers come first. Other patterns, sliding windows and attention biases (which Qwen3-MoE puts on the
output projection too) raise NotImplementedError naming the setting.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from . import layers as L
from . import moe
from .glm4_moe import ATTENTION_AXES, Glm4MoeConfig, Glm4MoeForCausalLM, attention_shapes

__all__ = ["Qwen3MoeConfig", "Qwen3MoeForCausalLM", "param_shapes"]

# HF `Qwen3MoeConfig` class defaults: they apply where config.json lacks a key.
HF_DEFAULTS: dict[str, Any] = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    num_attention_heads=32,
    num_key_value_heads=4,
    max_position_embeddings=32768,
    rms_norm_eps=1e-6,
    moe_intermediate_size=768,
    num_experts_per_tok=8,
    num_experts=128,
    norm_topk_prob=False,
    decoder_sparse_step=1,
)


def is_moe_layer(hf: dict[str, Any], index: int, num_experts: int) -> bool:
    """HF's rule (`Qwen3MoeDecoderLayer`): layer `index` has the MoE feed-forward unless `mlp_only_layers` lists it,
    the model has no experts, or the layer falls between `decoder_sparse_step`s."""
    step = hf.get("decoder_sparse_step") or HF_DEFAULTS["decoder_sparse_step"]
    return index not in (hf.get("mlp_only_layers") or ()) and num_experts > 0 and (index + 1) % step == 0


def moe_config(hf: dict[str, Any]) -> moe.MoeConfig:
    """The MoE settings from Qwen3-MoE's own keys. HF reads `num_experts` as `num_local_experts` and writes that."""
    def get(key):
        return HF_DEFAULTS[key] if hf.get(key) is None else hf[key]

    num_experts = hf.get("num_experts", hf.get("num_local_experts"))
    num_experts = HF_DEFAULTS["num_experts"] if num_experts is None else num_experts
    layers = hf["num_hidden_layers"]
    kinds = [is_moe_layer(hf, i, num_experts) for i in range(layers)]
    first_dense_layers = kinds.index(True) if True in kinds else layers
    if not all(kinds[first_dense_layers:]):
        dense = [i for i, is_moe in enumerate(kinds) if not is_moe]
        raise NotImplementedError(
            f"mlp_only_layers={hf.get('mlp_only_layers')} with decoder_sparse_step={get('decoder_sparse_step')} makes "
            f"layers {dense} dense, not only a first run of layers; jaxspec's MoE stack holds dense layers before MoE "
            "layers."
        )
    if num_experts and not 1 <= get("num_experts_per_tok") <= num_experts:
        raise ValueError(f"num_experts_per_tok={get('num_experts_per_tok')} must be between 1 and num_experts="
                         f"{num_experts}.")
    return moe.MoeConfig(
        num_experts=num_experts,
        experts_per_token=get("num_experts_per_tok"),
        num_groups=1,
        topk_groups=1,
        routed_scaling_factor=1.0,
        norm_topk_prob=bool(get("norm_topk_prob")),
        num_shared_experts=0,
        expert_size=get("moe_intermediate_size"),
        first_dense_layers=first_dense_layers,
        scoring="softmax",
    )


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(Glm4MoeConfig):
    """GLM-4.5's fields (the attention function reads them), read from Qwen3-MoE's config.json."""

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> "Qwen3MoeConfig":
        """Build from a config.json dict; raise on anything this implementation would silently get wrong."""
        if hf.get("model_type") != "qwen3_moe":
            raise ValueError(f"Qwen3MoeConfig cannot read model_type={hf.get('model_type')!r}.")
        if hf.get("use_sliding_window"):
            raise NotImplementedError("use_sliding_window=True is not supported for qwen3_moe yet (the published "
                                      "checkpoints do not use it).")
        if hf.get("attention_bias"):
            raise NotImplementedError("attention_bias=True is not supported for qwen3_moe yet: Qwen3-MoE then adds a "
                                      "bias to the output projection too, which jaxspec's GQA attention lacks.")
        num_heads = hf.get("num_attention_heads", HF_DEFAULTS["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf.get("hidden_size", HF_DEFAULTS["hidden_size"]) // num_heads
        return cls(
            model_type="qwen3_moe",
            num_kv_heads=hf.get("num_key_value_heads") or HF_DEFAULTS["num_key_value_heads"],
            head_dim=head_dim,
            attention_bias=False,
            use_qk_norm=True,
            rope=moe.rope_from_hf(hf, L.rope_parameters(hf), head_dim),
            **moe.common_fields(hf, HF_DEFAULTS, moe_config(hf)),
        )


def param_shapes(cfg: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    return moe.stack_shapes(cfg, attention_shapes(cfg))


class Qwen3MoeForCausalLM(Glm4MoeForCausalLM):
    """`model(tokens[B,T], positions[B,T], cache: KVCache) -> (logits[B,T,V], hidden[B,T,D], cache)`: GLM-4.5's
    module, whose attention and MoE stack read everything that differs from the config."""

    ATTENTION_AXES = ATTENTION_AXES
