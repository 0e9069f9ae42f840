"""jaxspec: assisted (speculative) decoding for JAX/Flax language models, in one jit-compiled loop."""

from .generate import GenerateOutput, generate
from .api import enable_compilation_cache, load
from .loading import Model
from .quantize import quantize
from .text import generate_text

__all__ = ["GenerateOutput", "Model", "enable_compilation_cache", "generate", "generate_text", "load", "quantize"]
