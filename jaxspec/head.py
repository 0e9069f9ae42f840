"""The verifying LM head in the layout XLA:CPU multiplies fastest.

A head can be stored two ways: [D, V], a column per token (an untied head as jaxspec converts it), or [V, D], a row
per token (a tied head: the embedding, read as [D, V] through a transpose XLA folds into the product). At one
position the product costs about the same either way. At the 2-8 positions of a verify block, XLA:CPU's matrix
multiply is faster on one layout than on the other, and which one depends on the machine and the matrix:

- on SmolLM2-135M (tied, 49,152 x 576, float32, batch 1) one day a two-token verify block cost 1.21 plain steps
  with the embedding and 1.14 with a [D, V] copy, and an eight-token one 1.56 against 1.45;
- on Qwen2.5-Coder-0.5B (untied, 151,936 x 896) on another day a two-token block cost 1.46 plain steps with its
  [D, V] head and 1.32 with a [V, D] copy, a four-token one 2.04 against 1.76; Qwen2.5-Coder-1.5B's (x 1536) cost
  the same either way (`python scripts/bench_verify_width.py --model ...` times both layouts).

So on CPU, `generate` can hand the loop a contiguous copy of the head in the other layout (`verify_heads`), which
the target's verify blocks use (`Context.head_for`). Where the adaptive schedule measures step costs
(jaxspec/costs.py), it times a two-token verify block with each layout and keeps the faster (the copy must win by
`COPY_MARGIN`); otherwise a tied head is verified through a [D, V] copy and an untied one as it is stored (the
first measurement's rule). A copy costs a second head's memory for as long as the model lives (113 MB for
SmolLM2-135M, 544 MB for Qwen2.5-Coder-0.5B, in float32) and one transpose when it is first made, so it is made
once per model and kept. Accelerators choose their own layouts and get no copy; neither do int8 heads
(`jaxspec.quantize`), which keep their scales in their own layout.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh

from .loading import Model
from .models.int8 import SCALE_SUFFIX

COLUMNS = "dv"  # [D, V]: a column per token
ROWS = "vd"  # [V, D]: a row per token (the embedding's layout)
LAYOUTS = (COLUMNS, ROWS)
COPY_MARGIN = 0.03  # a copy costs a head's memory: it is chosen when its verify block is at least this much cheaper

_transpose = jax.jit(lambda matrix: matrix.T)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class HeadRows:
    """A head stored [V, D] handed to the loop, which reads it as [D, V] (`as_columns`) through a transpose that XLA
    folds into the product, as it does for a tied embedding."""

    rows: jax.Array  # [V, D]


def as_columns(head: jax.Array | HeadRows | None) -> jax.Array | None:
    """[D, V] (or None: the model's own head) from what `verify_head` returned; call it inside the jitted loop."""
    return head.rows.T if isinstance(head, HeadRows) else head


def is_quantized(model: Model) -> bool:
    """Whether `model` went through `jaxspec.quantize` (its embedding holds int8 rows and their scales)."""
    return hasattr(model.module, "embed" + SCALE_SUFFIX)


def own_layout(model: Model) -> str:
    """The layout the model stores its head in: the embedding's rows when tied, else [D, V] columns."""
    return ROWS if getattr(model.config, "tie_word_embeddings", False) else COLUMNS


def layout_matters(model: Model) -> bool:
    """A float head on XLA:CPU: the case where a copy in the other layout can make verify blocks cheaper."""
    if is_quantized(model):
        return False  # an int8 head (jaxspec.quantize) keeps its own layout and scales
    return all(device.platform == "cpu" for device in _source(model).devices())


def default_layout(model: Model) -> str | None:
    """The verify layout where nothing was measured: [D, V] on CPU (a tied head gets a copy), None elsewhere."""
    return COLUMNS if layout_matters(model) else None


def verify_heads(model: Model, target_state, mesh: Mesh | None, layout: str | None = None) -> tuple:
    """(one, block): the heads of the target's one-position forwards and of its verify blocks of 2 and more, each
    None where the model's own serves, else a contiguous copy, [D, V] or `HeadRows`.

    `layout` None (or a head whose layout does not matter) keeps the model's own everywhere. A [D, V] layout serves
    both widths; with a [V, D] one, one-position forwards keep an untied head's own [D, V], which their
    matrix-vector product reads fastest (`python scripts/bench_verify_width.py --model qwen2.5-coder-0.5b`: 95 ms
    against 99 with the copy), so plain steps cost what plain decoding's do. `target_state`: the module's state as
    the loop receives it (sharded on `mesh` if any); the copy is transposed from its head, so it inherits that
    sharding. It is cached on `model` until the module's head is replaced."""
    if layout is not None and layout not in LAYOUTS:
        raise ValueError(f"verify head layout {layout!r} is not one of {LAYOUTS}.")
    if layout is None or layout == own_layout(model) or not layout_matters(model):
        return None, None
    source = _source(model)
    cached = model.head_cache
    if cached is None or cached[0] is not source or cached[1] != (mesh, layout):
        copy = _transpose(target_state[_source_name(model)].get_value())
        model.head_cache = (source, (mesh, layout), copy if layout == COLUMNS else HeadRows(copy))
    copy = model.head_cache[2]
    return (copy, copy) if layout == COLUMNS else (None, copy)


def _source_name(model: Model) -> str:
    return "embed" if own_layout(model) == ROWS else "lm_head"


def _source(model: Model) -> jax.Array:
    return getattr(model.module, _source_name(model))[...]
