"""`quantize(model, "int8")`: a copy of a model whose projections are int8 with int8 activations (models/int8.py).

Meant for assistants: a drafter's forward is what speculative decoding pays per draft, and its mistakes cost only
acceptance, because the target verifies every token. Output stays exactly the target's (greedy: plain greedy of the
target, token for token; sampling: the target's distribution) whatever the assistant's precision. A quantized target
is allowed too, but then it is a different model: its greedy output is plain greedy of the quantized model.

What is quantized: every attention and MLP projection of every decoder layer, and the LM head with the embedding
(one table when tied: int8 rows with a scale per token, which is the head's per-output-channel scale). Norms,
biases, Gemma 4's per-layer-input tables and MTP layers keep their dtype. Llama-family and Gemma models only.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from flax import nnx

from .head import is_quantized
from .layout import LAYER_PROJECTIONS
from .loading import Model
from .models import int8 as I
from .models.gemma import GemmaForCausalLM
from .models.llama import LlamaForCausalLM

MODES = ("int8",)
# Contracted axes of each quantized param (decoder layers': jaxspec/layout.py): its scales are per output channel,
# over these.
TOP_PROJECTIONS = {"embed": (1,), "lm_head": (0,)}  # embed [V, D] is read as the head [D, V]: a scale per token


def quantize(model: Model, mode: str = "int8") -> Model:
    """A new `Model` (the given one is untouched) whose projections are `mode` (only "int8": W8A8, per-channel
    weight scales, per-token activation scales)."""
    if mode not in MODES:
        raise ValueError(f"quantize: mode {mode!r} is not one of {', '.join(MODES)}.")
    module = model.module
    if not isinstance(module, (LlamaForCausalLM, GemmaForCausalLM)):
        raise NotImplementedError(
            f"quantize: {type(module).__name__} ({model.hf_config.get('model_type')}) has no int8 path yet; only "
            "Llama-family and Gemma models do (mixture-of-experts layers would need int8 expert products).")
    if is_quantized(model):
        raise ValueError(f"quantize: {model.source or 'this model'} is quantized already.")
    graphdef, state = nnx.split(module)
    copy = nnx.merge(graphdef, state)  # new modules holding the same arrays; the quantized ones replace theirs
    _quantize_params(copy, TOP_PROJECTIONS)
    for layer in copy.layers:
        _quantize_params(layer, LAYER_PROJECTIONS)
    quantized = dataclasses.replace(model, module=copy)
    quantized.head_cache = quantized.layer_stack_cache = None
    return quantized


def _quantize_params(module: nnx.Module, projections: dict[str, tuple[int, ...]]) -> None:
    for name, contracted in projections.items():
        param = getattr(module, name, None)
        if param is None:
            continue
        values, scale = _quantize(I.logical(param[...]), contracted)  # a CPU-laid-out weight as named
        axes = param.get_metadata().get("logical_axes")  # a scale axis of size 1 is left unsharded by the rules
        setattr(module, name, nnx.Param(values, logical_axes=axes))
        setattr(module, name + I.SCALE_SUFFIX, nnx.Param(scale, logical_axes=axes))


@functools.partial(jax.jit, static_argnums=1)
def _quantize(w: jax.Array, contracted: tuple[int, ...]):
    return I.quantize(w, contracted)
