"""Model families by HF `model_type`. The core imports families only through this table, lazily."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any


@dataclasses.dataclass(frozen=True)
class Family:
    model_module: str  # defines the config class and the Flax module
    config_class: str
    model_class: str
    convert_module: str  # defines convert_checkpoint(cfg, source, dtype, progress) -> {param: array}

    def config_from_hf(self, hf_config: dict[str, Any]):
        return getattr(importlib.import_module(self.model_module), self.config_class).from_hf_config(hf_config)

    def model_cls(self):
        return getattr(importlib.import_module(self.model_module), self.model_class)

    def converter(self):
        return importlib.import_module(self.convert_module).convert_checkpoint


_LLAMA = Family("jaxspec.models.llama", "LlamaConfig", "LlamaForCausalLM", "jaxspec.convert.llama")
_GEMMA = Family("jaxspec.models.gemma", "GemmaConfig", "GemmaForCausalLM", "jaxspec.convert.gemma")
_DFLASH = Family("jaxspec.models.dflash", "DFlashConfig", "DFlashDrafter", "jaxspec.convert.dflash")
_EAGLE3 = Family("jaxspec.models.eagle3", "Eagle3Config", "Eagle3Head", "jaxspec.convert.eagle3")

FAMILIES: dict[str, Family] = {
    "llama": _LLAMA,
    "qwen2": _LLAMA,
    "qwen3": _LLAMA,  # dense Qwen3: the Llama block with per-head q/k RMSNorm
    "deepseek_v3": Family(
        "jaxspec.models.deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", "jaxspec.convert.deepseek_v3"
    ),
    "glm4_moe": Family("jaxspec.models.glm4_moe", "Glm4MoeConfig", "Glm4MoeForCausalLM", "jaxspec.convert.glm4_moe"),
    "qwen3_moe": Family("jaxspec.models.qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM",
                        "jaxspec.convert.qwen3_moe"),
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA,
    "gemma4_text": _GEMMA,
    # The Gemma 4 MTP drafter: it runs only as the assistant_model of a Gemma 4 target (strategies/gemma4_drafter.py).
    "gemma4_assistant": Family("jaxspec.models.gemma4_assistant", "Gemma4AssistantConfig", "Gemma4AssistantForCausalLM",
                               "jaxspec.convert.gemma4_assistant"),
    # DFlash block drafters (models/dflash.py): they run only beside a target, whose tapped hidden states, embedding
    # and head they read. HF transformers' layout has its own model_type; z-lab's checkpoints say model_type "qwen3"
    # with architectures ["DFlashDraftModel"], so their entry is keyed by that architecture, which `family_for` must
    # consult before the model_type for them to reach it.
    "muse_glimmer_assistant": _DFLASH,
    "DFlashDraftModel": _DFLASH,
    # EAGLE-3 heads (models/eagle3.py): they run only beside a target whose tapped hidden states they read. Their
    # config says model_type "llama"; the architecture names them.
    "LlamaForCausalLMEagle3": _EAGLE3,
}


# Architectures that decide the family before model_type does -> their key in FAMILIES. DFlash 2's config raises
# NotImplementedError naming the parts jaxspec lacks.
ARCHITECTURE_FAMILIES = {"DFlashDraftModel": "DFlashDraftModel", "DFlash2DraftModel": "DFlashDraftModel",
                         "LlamaForCausalLMEagle3": "LlamaForCausalLMEagle3"}


def family_for(hf_config: dict[str, Any], where: str) -> Family:
    """The family named by config.json's `model_type`; never guessed from a folder or file name. Drafter layouts that
    reuse a model_type for another network (z-lab's DFlash drafters say "qwen3") are named by their architecture."""
    for architecture in hf_config.get("architectures") or ():
        if architecture in ARCHITECTURE_FAMILIES:
            return FAMILIES[ARCHITECTURE_FAMILIES[architecture]]
    model_type = hf_config.get("model_type")
    if model_type is None:
        raise ValueError(f"{where}: config has no `model_type`, so jaxspec cannot tell which model family it is.")
    if model_type not in FAMILIES:
        raise ValueError(
            f"{where}: unknown model_type {model_type!r} (architectures={hf_config.get('architectures')}). "
            f"jaxspec supports: {sorted(FAMILIES)}."
        )
    return FAMILIES[model_type]
