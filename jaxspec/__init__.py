"""jaxspec: assisted (speculative) decoding for JAX/Flax language models, in one jit-compiled loop."""

from .api import enable_compilation_cache, load
from .generate import generate, generate_with_drafter
from .loading import Model
from .output import GenerateOutput
from .quantize import quantize
from .settings import SamplingConfig
from .strategies import STRATEGIES, DraftingConfig
from .streaming import StreamingConfig
from .text import generate_text

__all__ = ["STRATEGIES", "DraftingConfig", "GenerateOutput", "Model", "SamplingConfig", "StreamingConfig",
           "enable_compilation_cache", "generate", "generate_with_drafter", "generate_text", "load", "quantize"]
