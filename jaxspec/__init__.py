"""jaxspec: assisted (speculative) decoding for JAX/Flax language models, in one jit-compiled loop."""

from .generate import GenerateOutput, generate
from .loading import Model, load

__all__ = ["GenerateOutput", "Model", "STRATEGIES", "generate", "load"]

STRATEGIES = ("greedy", "sample", "speculative", "prompt_lookup", "early_exit", "mtp")
