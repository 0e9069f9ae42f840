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


# -- Gemma 4 MTP drafter (HF Gemma4AssistantForCausalLM) -----------------------------------------------------------

def patch_gemma4_assistant() -> None:
    """transformers 5.23 cannot instantiate Gemma4AssistantForCausalLM: `Gemma4TextConfig.kv_sharing_modes` raises
    when every layer is KV-shared, which the assistant config forces. Every layer of it reuses the target's keys and
    values, so answer "reuse" for each (transformers-assisted-decoding.md §6.4); other configs are unchanged."""
    config_cls = transformers.Gemma4TextConfig
    if getattr(config_cls, "_jaxspec_patched", False):
        return
    original = config_cls.kv_sharing_modes.fget

    def modes(self):
        if self.num_kv_shared_layers and self.num_kv_shared_layers == self.num_hidden_layers:
            return ["reuse"] * self.num_hidden_layers
        return original(self)

    config_cls.kv_sharing_modes = property(modes)
    config_cls._jaxspec_patched = True


def build_tiny_gemma4_assistant(seed: int = 0, target_overrides: dict | None = None, **overrides):
    """A drafter for `build_tiny_gemma("gemma4_text", **target_overrides)`: the target's head widths, kv heads,
    window and vocabulary (which the drafter must share), its own width and depth; random norms and layer scalars."""
    patch_gemma4_assistant()
    target = BASE | GEMMA["gemma4_text"] | (target_overrides or {})
    shared = {key: target[key] for key in ("vocab_size", "head_dim", "global_head_dim", "num_key_value_heads",
                                            "sliding_window", "max_position_embeddings", "bos_token_id",
                                            "eos_token_id", "pad_token_id")}
    text = shared | dict(hidden_size=24, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                         hidden_size_per_layer_input=0, vocab_size_per_layer_input=0, initializer_range=INIT_RANGE,
                         layer_types=["sliding_attention", "full_attention"])
    outer = {key: overrides.pop(key) for key in ("use_ordered_embeddings", "num_centroids",
                                                 "centroid_intermediate_top_k") if key in overrides}
    torch.manual_seed(seed)
    config = transformers.Gemma4AssistantConfig(text_config=transformers.Gemma4TextConfig(**(text | overrides)),
                                                backbone_hidden_size=target["hidden_size"], **outer)
    model = transformers.Gemma4AssistantForCausalLM(config).eval()
    _perturb_norms(model, seed)
    gen = torch.Generator().manual_seed(seed + 3000)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand(buffer.shape, generator=gen))
            elif name.endswith("token_ordering"):  # HF initialises it to zeros; a real one is a permutation
                buffer.copy_(torch.randperm(buffer.numel(), generator=gen))
    return model


def load_gemma4_assistant(folder):
    patch_gemma4_assistant()
    return transformers.Gemma4AssistantForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
