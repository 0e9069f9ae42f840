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
