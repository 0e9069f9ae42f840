"""The verifying LM head in the layout XLA:CPU multiplies fastest.

A tied head is the embedding read as [D, V] through a transpose of its [V, D] array (on a CPU, a `TransposedWeight`
that the product reads in place: models/int8.py `tied_head`). For one row XLA:CPU multiplies a contiguous [D, V]
array fastest; from 2 to 32 rows (a verify block, a batch of 8) the embedding read in place as an elementwise product
and a sum (`_multiply_reduce`), and beyond that by its matrix multiply in place.

So on CPU, `generate` hands the loop a contiguous [D, V] copy of a tied head (`verify_head`) and the target's
verifying forwards of one row use it (`Context.head`, `for_rows`). The copy costs a second embedding's
memory (V * D params) for as long as the model lives and one transpose when it is first made, so it is made once
per model and kept. Accelerators choose their own layouts and get no copy; neither do untied heads, which are
stored [D, V] already (see docs/design.md, 'Verify widths and the CPU head copy').
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh

from .loading import Model
from .models.int8 import SCALE_SUFFIX

_transpose = jax.jit(lambda matrix: matrix.T)


def is_quantized(model: Model) -> bool:
    """Whether `model` went through `jaxspec.quantize` (its embedding holds int8 rows and their scales)."""
    return hasattr(model.module, "embed" + SCALE_SUFFIX)


def wants_contiguous_head(model: Model) -> bool:
    """A tied head on XLA:CPU: the case where a [D, V] copy makes one-row forwards cheaper."""
    if not getattr(model.config, "tie_word_embeddings", False) or is_quantized(model):
        return False  # an int8 head (jaxspec.quantize) keeps its own layout and scales
    return all(device.platform == "cpu" for device in model.module.embed[...].devices())


# The most rows (batch x block width) a forward multiplies by the copy: two rows ran faster on the embedding in place
# once blocks of 2-4 rows were no longer split row by row (docs/design.md, 'Verify blocks on a CPU').
COPY_MAX_ROWS = 1


def for_rows(head: jax.Array | None, rows: int) -> jax.Array | None:
    """The verify copy for a forward over `rows` rows (batch x block width), or None where the model's own head
    multiplies faster: XLA:CPU runs 2 rows or more faster against the tied embedding read in place (figures:
    docs/design.md, 'Weights on a CPU' and 'Every weight by 2-16 rows')."""
    return head if rows <= COPY_MAX_ROWS else None


def verify_head(model: Model, target_state, mesh: Mesh | None) -> jax.Array | None:
    """[D, V]: a contiguous copy of `model`'s tied head for the verifying forwards, or None where the model's own
    head serves (accelerators, untied heads). `target_state`: the module's state as the loop receives it (sharded on
    `mesh` if any); the copy is transposed from its embedding, so it inherits that sharding. It is cached on `model`
    until the module's embedding is replaced."""
    if not wants_contiguous_head(model):
        return None
    source = model.module.embed[...]
    cached = model.head_cache
    if cached is None or cached[0] is not source or cached[1] != mesh:
        model.head_cache = (source, mesh, _transpose(target_state["embed"].get_value()))
    return model.head_cache[2]
