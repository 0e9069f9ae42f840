"""HF `Gemma2ForCausalLM` / `Gemma3ForCausalLM` / `Gemma4ForCausalLM` tensor names -> jaxspec.models.gemma parameters.

Layers of one checkpoint differ (Gemma 4: head width per attention type, no k/v in KV-shared layers, wider MLPs
there), so every layer gets its own rules and every parameter is a separate slot: `layers.{i}.{name}`.
"""

from __future__ import annotations

import numpy as np

from jaxspec.models.gemma import GemmaConfig, layer_param_specs, top_param_specs

from .rules import Ignore, Rule, TensorSource, convert, split_heads


def _layer_rules(cfg: GemmaConfig, layer: int) -> list[Rule]:
    d, h = cfg.hidden_size, cfg.num_heads
    kind = cfg.kind(layer)
    k, dh = kind.num_kv_heads, kind.head_dim
    hf = {
        "attn_norm": ("input_layernorm.weight", None),
        "wq": ("self_attn.q_proj.weight", split_heads(d, h, dh)),
        "q_norm": ("self_attn.q_norm.weight", None),
        "wk": ("self_attn.k_proj.weight", split_heads(d, k, dh)),
        "k_norm": ("self_attn.k_norm.weight", None),
        "wv": ("self_attn.v_proj.weight", split_heads(d, k, dh)),
        "wo": ("self_attn.o_proj.weight", lambda w: w.T.reshape(h, dh, d)),
        "post_attn_norm": ("post_attention_layernorm.weight", None),
        "mlp_norm": ("pre_feedforward_layernorm.weight", None),
        "w_gate": ("mlp.gate_proj.weight", np.transpose),
        "w_up": ("mlp.up_proj.weight", np.transpose),
        "w_down": ("mlp.down_proj.weight", np.transpose),
        "post_mlp_norm": ("post_feedforward_layernorm.weight", None),
        "layer_scalar": ("layer_scalar", None),
        "ple_gate": ("per_layer_input_gate.weight", np.transpose),
        "ple_proj": ("per_layer_projection.weight", np.transpose),
        "ple_post_norm": ("post_per_layer_input_norm.weight", None),
    }
    rules = []
    for name in layer_param_specs(cfg, layer):
        tensor, transform = hf[name]
        pattern = rf"model\.layers\.{layer}\." + tensor.replace(".", r"\.")
        rules.append(Rule(pattern, f"layers.{layer}.{name}", transform or (lambda w: w)))
    return rules


def rules(cfg: GemmaConfig) -> list[Rule]:
    out = [
        Rule(r"model\.embed_tokens\.weight", "embed"),
        Rule(r"model\.norm\.weight", "final_norm"),
        Rule(r"lm_head\.weight", "lm_head", np.transpose),
        Rule(r"model\.embed_tokens_per_layer\.weight", "ple_embed"),
        Rule(r"model\.per_layer_model_projection\.weight", "ple_model_proj", np.transpose),
        Rule(r"model\.per_layer_projection_norm\.weight", "ple_proj_norm"),
    ]
    for layer in range(cfg.num_layers):
        out += _layer_rules(cfg, layer)
    return out


def ignores(cfg: GemmaConfig) -> list[Ignore]:
    out = [Ignore(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq", "recomputed from the config")]
    if cfg.tie_word_embeddings:
        out.append(Ignore(r"lm_head\.weight", "tie_word_embeddings=True: the head is the input embedding"))
    for layer in range(cfg.first_shared_layer, cfg.num_layers):
        # Released Gemma 4 checkpoints still carry k/v weights for KV-shared layers; HF drops them on load too.
        out.append(Ignore(rf"model\.layers\.{layer}\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight",
                          f"KV-shared layer: it attends to layer {cfg.kv_source(layer)}'s keys and values"))
    return out


def convert_checkpoint(cfg: GemmaConfig, source: TensorSource, dtype, progress=None) -> dict:
    """-> the module's pure dict: top-level params, and `layers: {i: {param: array}}`."""
    shapes = {name: shape for name, (shape, _) in top_param_specs(cfg).items()}
    for layer in range(cfg.num_layers):
        shapes |= {f"layers.{layer}.{name}": shape for name, (shape, _) in layer_param_specs(cfg, layer).items()}
    params = convert(source, rules(cfg), ignores(cfg), shapes, set(), dtype, progress=progress)
    out = {name: params[name] for name in top_param_specs(cfg)}
    out["layers"] = {
        layer: {name: params[f"layers.{layer}.{name}"] for name in layer_param_specs(cfg, layer)}
        for layer in range(cfg.num_layers)
    }
    return out
