"""Decoder-layer projections stored [out, in] on a CPU.

XLA:CPU multiplies a token's row by a weight stored row-major [out, in] (each output a dot product over a contiguous
row) faster than by the same weight stored [in, out], the layout the model code names (x @ w). So when a model lives
on one CPU device, `jaxspec.load` stores the attention and MLP projections of its decoder layers with their contracted
axes last (`models/int8.py`, `TransposedWeight`). `project` contracts them in place, so the model code, the
converters and the checkpoints keep one layout, and only what reads params as arrays sees the difference: saving,
exporting, quantizing and sharding go through `logical` / `standard_layout` (figures: docs/design.md, 'Weights on a
CPU'). A layer's q, k and v projections, and its gate and up, are also stored as one buffer each (`FUSED_GROUPS`),
which each of them holds and reads its own slice of: the forward multiplies a group once (`project_group`). Count
bytes once per array (by identity), since the members of a group share one, and train decoder layers
from `standard_layout` (jaxspec's trainers keep the target frozen): a gradient reaches a group through its first
member only.

Left as they are: embeddings and heads (a tied head is read [V, D] already, and jaxspec/head.py decides its verify
copy), MTP layers (trained in place), drafter modules, int8 weights, models created sharded on a mesh (their rules
name the [in, out] axes), and accelerators, which choose their own layouts.
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from .loading import Model
from .models import int8 as I
from .models.gemma import GemmaForCausalLM
from .models.llama import LlamaForCausalLM

# Contracted axes of each decoder-layer projection (the int8 scales of jaxspec/quantize.py are over the same axes).
LAYER_PROJECTIONS = {"wq": (0,), "wk": (0,), "wv": (0,), "wo": (0, 1), "w_gate": (0,), "w_up": (0,), "w_down": (0,)}
# Projections of one input, fused into one buffer and one product (`models/int8.py` `fuse`, `project_group`): a
# small product spreads over XLA:CPU's threads poorly, so SmolLM2's k and v ([192, 576]) took about as long as q.
FUSED_GROUPS = (("wq", "wk", "wv"), ("w_gate", "w_up"))


def wants_cpu_layout(model: Model) -> bool:
    """Llama-family and Gemma models whose float params all live on one CPU device."""
    if not isinstance(model.module, (LlamaForCausalLM, GemmaForCausalLM)):
        return False
    devices = {device for array in jax.tree.leaves(nnx.state(model.module, nnx.Param)) for device in array.devices()}
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"


def use_cpu_layout(model: Model) -> Model:
    """`model`, its decoder-layer projections now stored contracted axes last where `wants_cpu_layout`, each layer's
    `FUSED_GROUPS` in one buffer each (in place: each weight is replaced by its transpose, then a group by its
    buffer, so memory never holds both layouts of more than one group)."""
    if not wants_cpu_layout(model):
        return model
    for layer in model.module.layers:
        for name, contracted in LAYER_PROJECTIONS.items():
            param = getattr(layer, name, None)
            if param is None or getattr(layer, name + I.SCALE_SUFFIX, None) is not None:
                continue  # absent (a layer that shares another's keys) or int8 (its own kernel)
            value = param[...]
            if not isinstance(value, I.TransposedWeight):
                param.set_value(I.contracted_last(value, contracted))
        for names in FUSED_GROUPS:
            params = [getattr(layer, name) for name in names if getattr(layer, name, None) is not None]
            if len(params) > 1 and I.fusable([param[...] for param in params]):  # Gemma's shared-KV layers: q only
                for param, member in zip(params, I.fuse([param[...] for param in params])):
                    param.set_value(member)
    return model


def standard_layout(state: Any) -> Any:
    """A module state (or any pytree of params) with every `TransposedWeight` back in the model code's layout."""
    return jax.tree.map(I.logical, state, is_leaf=lambda leaf: isinstance(leaf, I.TransposedWeight))


logical = I.logical  # one param as the model code names its layout: `TransposedWeight.logical()`, else as is
