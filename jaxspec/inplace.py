"""Run-time branches that update KV caches in place.

`lax.cond` and `lax.switch` return a fresh buffer for every output. When a branch writes a few positions of a cache
and returns it, and the cache is also carried by the decode loop, XLA's copy insertion copies the whole cache (on
the way in, on the way out, or both), every round, paid even by rounds that draft nothing (see docs/design.md,
'In-place branches'). A `lax.while_loop` carry, in contrast, is updated in place. So a branch here runs as a while
loop that takes zero or one trip: each branch's loop runs only when the index selects it, and the state it updates
stays in the same buffer throughout.

Branches are `state -> (state, out)`: `state` (the caches, and whatever else is updated) keeps its structure and
shapes; `out` is whatever else the branch returns, the same structure and shapes for every branch.

That choice was measured on a CPU, and held on a GPU: XLA records a conditional into a CUDA graph that branches on
the device, where a data-dependent while loop often cannot be recorded (openxla/xla#19528), so these loops were the
suspect when drafters ran below plain decoding on an H200; timed there, a round's in-place branches cost no more
than XLA conditionals, for a 135M model at batch 1 and an 8B one at batch 8 (docs/design.md, 'On a GPU').
`JAXSPEC_BRANCHES=lax` (read once, at import) runs every branch as `lax.switch` / `lax.cond` instead, for a device
where that differs.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .prompts import choice_setting

Branch = Callable[[Any], tuple[Any, Any]]

MODES = ("inplace", "lax")
MODE = choice_setting("JAXSPEC_BRANCHES", MODES)  # how run-time branches run in the loops this process compiles


def switch(index: jax.Array, branches: Sequence[Branch], state: Any) -> tuple[Any, Any]:
    """`lax.switch(index, branches, state)` with `state` updated in place (with `JAXSPEC_BRANCHES=lax`, lax.switch
    itself); an index out of range runs none.

    index: [] int. -> (state, out) of the branch it selects.
    """
    out_shapes = jax.eval_shape(lambda s: branches[0](s)[1], state)
    out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)  # what a run of no branch returns
    if MODE == "lax":
        # lax.switch clamps its index, so running none is one more branch, selected by any index out of range.
        in_range = (index >= 0) & (index < len(branches))
        return jax.lax.switch(jnp.where(in_range, index, len(branches)), [*branches, lambda s: (s, out)], state)
    for i, branch in enumerate(branches):

        def run_once(carry, branch=branch):
            _, state, _ = carry
            state, out = branch(state)
            return jnp.zeros((), bool), state, out

        _, state, out = jax.lax.while_loop(lambda carry: carry[0], run_once, (index == i, state, out))
    return state, out


def cond(pred: jax.Array, true_branch: Branch, false_branch: Branch, state: Any) -> tuple[Any, Any]:
    """`lax.cond(pred, true_branch, false_branch, state)` with `state` updated in place (with `JAXSPEC_BRANCHES=lax`,
    lax.cond itself). pred: [] bool."""
    if MODE == "lax":
        return jax.lax.cond(pred, true_branch, false_branch, state)
    return switch(pred.astype(jnp.int32), (false_branch, true_branch), state)
