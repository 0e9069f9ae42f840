"""Build tiny random transformers models from configs and save them; no hub access anywhere."""

from __future__ import annotations

import os

import torch
import transformers

# Large enough init that the argmax of random logits is decided by the weights, not by float rounding.
INIT_RANGE = 0.3

BASE = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
    initializer_range=INIT_RANGE,
    tie_word_embeddings=False,
)

CLASSES = {
    "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
    "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
    "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
    "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    "gemma4_text": (transformers.Gemma4TextConfig, transformers.Gemma4ForCausalLM),
}

# Gemma defaults are real-model sizes (head_dim 256, Gemma 4 global_head_dim 512, PLE 256); these keep them tiny.
# The sliding window (4) is far shorter than the test sequences, so windowed layers really drop keys.
GEMMA = {
    "gemma2": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=8, attn_logit_softcapping=4.0,
                   final_logit_softcapping=6.0),
    "gemma3_text": dict(head_dim=8, sliding_window=4, query_pre_attn_scalar=12,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                         "full_attention": {"rope_type": "linear", "factor": 4.0,
                                                            "rope_theta": 1000000.0}},
                        tie_word_embeddings=True),
    "gemma4_text": dict(head_dim=8, global_head_dim=16, sliding_window=4, num_kv_shared_layers=2,
                        hidden_size_per_layer_input=8, vocab_size_per_layer_input=128,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                        final_logit_softcapping=8.0),
}


def build_tiny(family: str, seed: int = 0, **overrides):
    config_cls, model_cls = CLASSES[family]
    torch.manual_seed(seed)
    config = config_cls(**(BASE | overrides))
    model = model_cls(config).eval()
    _perturb_norms(model, seed)
    return model


def _perturb_norms(model, seed):
    """HF initialises norms to 1 and biases to 0; random values make the parity tests check them too."""
    gen = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))


def save_tiny(family: str, folder, seed: int = 0, **overrides) -> str:
    model = build_tiny(family, seed, **overrides)
    model.save_pretrained(folder)
    return os.fspath(folder)


def load_hf(folder):
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def build_tiny_gemma(family: str, seed: int = 0, **overrides):
    """A tiny Gemma 2 / 3 / 4 (`GEMMA` sizes plus `overrides`); Gemma 4's layer scalars (buffers that load from the
    checkpoint, 1 at init) get random values too."""
    model = build_tiny(family, seed, **(GEMMA[family] | overrides))
    gen = torch.Generator().manual_seed(seed + 2000)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
    return model


def save_tiny_gemma(family: str, folder, seed: int = 0, **overrides) -> str:
    build_tiny_gemma(family, seed, **overrides).save_pretrained(folder)
    return os.fspath(folder)
