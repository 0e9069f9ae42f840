"""HF `LlamaForCausalLM` / `Qwen2ForCausalLM` tensor names -> jaxspec.models.llama parameters."""

from __future__ import annotations

import numpy as np

from jaxspec.models.llama import TOP_LEVEL, LlamaConfig, param_shapes

from .rules import Ignore, Rule, TensorSource, convert, split_head_bias, split_heads

LAYER = r"model\.layers\.(\d+)\."


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
    """-> the module's pure dict: top-level params, and `layers: {i: {param: array}}`."""
    shapes = param_shapes(cfg)
    stacked = {name for name in shapes if name not in TOP_LEVEL}
    params = convert(source, rules(cfg), ignores(cfg), shapes, stacked, dtype, progress=progress)
    out = {name: params[name] for name in shapes if name in TOP_LEVEL}
    out["layers"] = {i: {name: params[name][i] for name in stacked} for i in range(cfg.num_layers)}
    return out
