"""Wide forwards on a CPU run their decoder layers under one loop over a stacked copy of the layer weights.

The decode loop compiles one forward per verify width (and the prefill one per chunk width), each with every
decoder layer unrolled: SmolLM2's prompt-lookup loop holds five 30-layer forwards, and XLA spends most of a first
run compiling them. A forward that loops over the layers compiles one layer instead of thirty. On XLA:CPU the loop
has a price: a matrix product reads its weights from a slice of stacked arrays only after copying that slice, so a
looped forward reads every weight twice. A one-token forward is memory-bound and pays for that copy in full, so
plain decoding steps stay unrolled; a block of two or more tokens a row is mostly arithmetic, and pays little for
it. Figures: docs/design.md, 'Compile time'.

So on a CPU, `generate` hands the loop every decoder layer's params stacked on a leading axis (`layer_stack`), and the
target's forwards of two or more positions a row run their layers as a loop over it (`run_layers` of models/llama.py,
and of models/gemma.py for Gemma 2 and 3, which loop over whole periods of their layer types). The stack is a second
copy of the layer weights, made once per model and kept, like the CPU head copy (jaxspec/head.py); it is made only where
that copy is small (`STACK_MAX_BYTES`): a small model is where compile time is most of a short call. Accelerators,
sharded models and families without a looped forward get none, and Gemma gets one only when asked (`on`): looped, its
wide forwards cost enough more to slow down prompt lookup where it verifies wide blocks most rounds (docs/design.md,
'Gemma loops by period, when asked').

`JAXSPEC_LAYER_STACK` chooses: `auto` (the default, as above), `on` (a CPU model of any size and family) or `off` (every
forward unrolled, as before 2026-12-06: the fastest wide blocks where memory or steps matter more than compiles).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from .loading import Model
from .models.int8 import TransposedWeight
from .prompts import choice_setting

MODES = ("auto", "on", "off")

# The largest stacked copy made: SmolLM2-135M's layers (0.42 GB in float32) fit. Qwen2.5-0.5B's (1.43 GB) do not:
# looped, its wide blocks cost enough more to slow prompt lookup down (docs/design.md, 'Compile time').
STACK_MAX_BYTES = 512 << 20


def mode() -> str:
    """`JAXSPEC_LAYER_STACK`, checked: a misspelt value is an error, not a silent fallback."""
    return choice_setting("JAXSPEC_LAYER_STACK", MODES)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerStack:
    """Every decoder layer's params (`layer.params()`) stacked on a leading layer axis, each distinct buffer once:
    the members of a fused group (a layer's q, k and v; its gate and up: jaxspec/layout.py) share their group's
    buffer, here as in the layers."""

    buffers: tuple[jax.Array, ...]  # [L, ...] each: the layers' distinct buffers, stacked
    treedef: Any = dataclasses.field(metadata=dict(static=True))  # of one layer's params
    buffer_of_leaf: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # leaf i reads buffers[j]

    def layer(self, index: jax.Array | int) -> dict:
        """Layer `index`'s params, as `layer.params()` returns them: each buffer read once, at `index`. Their
        `TransposedWeight`s are marked `sliced`: inside the layer loop they keep their matrix products (models/int8.py,
        `multiply_reduce_pays`)."""
        sliced = [buffer[index] for buffer in self.buffers]
        params = jax.tree.unflatten(self.treedef, [sliced[j] for j in self.buffer_of_leaf])
        return jax.tree.map(lambda w: dataclasses.replace(w, sliced=True) if isinstance(w, TransposedWeight) else w,
                            params, is_leaf=lambda w: isinstance(w, TransposedWeight))


@jax.jit
def _stack(layers: list[list[jax.Array]]) -> tuple[jax.Array, ...]:
    return tuple(jnp.stack(per_layer) for per_layer in zip(*layers))


def _layer_params(model: Model) -> list[dict]:
    return [layer.params() for layer in model.module.layers]


def _sharing(leaves: list[jax.Array]) -> tuple[int, ...]:
    """For each leaf, the index of the first leaf holding the same buffer."""
    first: dict[int, int] = {}
    return tuple(first.setdefault(id(leaf), i) for i, leaf in enumerate(leaves))


def _build(layers: list[dict]) -> LayerStack | None:
    """The stack, or None where the layers' params are not laid out alike (a fused group's member replaced in one
    layer has its own array there, of another shape; a Gemma whose global layers have wider heads than its sliding
    ones): those layers cannot be stacked, and stay unrolled."""
    flat = [jax.tree.flatten(params) for params in layers]
    treedef, sharing = flat[0][1], _sharing(flat[0][0])
    shapes = [(leaf.shape, leaf.dtype) for leaf in flat[0][0]]
    if any(other != treedef or [(leaf.shape, leaf.dtype) for leaf in leaves] != shapes for leaves, other in flat):
        return None
    if any(_sharing(leaves) != sharing for leaves, _ in flat):
        sharing = tuple(range(len(sharing)))  # buffers shared differently from layer to layer: each leaf its own
    distinct = sorted(set(sharing))
    buffers = _stack([[leaves[i] for i in distinct] for leaves, _ in flat])
    # Committed, as the loop's other inputs are (jaxspec/generate.py `_committed`): a converted model's arrays are
    # not, a restored one's are, and the compiled loop's cache key tells the two apart.
    buffers = tuple(jax.device_put(buffer, buffer.sharding) for buffer in buffers)
    return LayerStack(buffers, treedef, tuple(distinct.index(j) for j in sharing))


def _fits(leaves: list[jax.Array]) -> bool:
    """Layers (`leaves`) on XLA:CPU whose copy fits STACK_MAX_BYTES, or of any size with `JAXSPEC_LAYER_STACK=on`."""
    buffers = {id(leaf): leaf for leaf in leaves}.values()  # a fused group's members share one buffer
    if not all(device.platform == "cpu" for buffer in buffers for device in buffer.devices()):
        return False
    return mode() == "on" or sum(buffer.size * buffer.dtype.itemsize for buffer in buffers) <= STACK_MAX_BYTES


def layer_stack(model: Model, mesh: Mesh | None) -> LayerStack | None:
    """The model's decoder layers stacked (`LayerStack`), or None where forwards stay unrolled: with
    `JAXSPEC_LAYER_STACK=off`, on a mesh, for families without a looped forward, with `auto` for families whose
    looped forward is not `stacked_by_default` (Gemma), and where the layers do not `_fit`.
    Cached on `model` until any of its layer weights is replaced: a stale copy would verify with other weights than
    the plain steps decode with."""
    chosen = mode()
    if chosen == "off" or mesh is not None or not getattr(model.module, "loops_wide_forwards", False):
        return None
    if chosen == "auto" and not getattr(model.module, "stacked_by_default", False):
        return None
    layers = _layer_params(model)
    sources = jax.tree.leaves(layers)
    if not _fits(sources):
        return None
    cached = model.layer_stack_cache
    if cached is None or len(cached[0]) != len(sources) or any(a is not b for a, b in zip(cached[0], sources)):
        model.layer_stack_cache = (sources, _build(layers))  # None kept too: such layers are not stacked again
    return model.layer_stack_cache[1]
