"""Run-time branches that update KV caches in place.

`lax.cond` and `lax.switch` return a fresh buffer for every output. When a branch writes a few positions of a cache
and returns it, and the cache is also carried by the decode loop, XLA's copy insertion copies the whole cache (on
the way in, on the way out, or both), every round, paid even by rounds that draft nothing (see docs/design.md,
'In-place branches'). A `lax.while_loop` carry, in contrast, is updated in place. So a branch here runs as a while
loop that takes zero or one trip: each branch's loop runs only when the index selects it, and the state it updates
stays in the same buffer throughout.

Branches are `state -> (state, out)`: `state` (the caches, and whatever else is updated) keeps its structure and
shapes; `out` is whatever else the branch returns, the same structure and shapes for every branch.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

Branch = Callable[[Any], tuple[Any, Any]]


def switch(index: jax.Array, branches: Sequence[Branch], state: Any) -> tuple[Any, Any]:
    """`lax.switch(index, branches, state)` with `state` updated in place; an index out of range runs none.

    index: [] int. -> (state, out) of the branch it selects.
    """
    out_shapes = jax.eval_shape(lambda s: branches[0](s)[1], state)
    out = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), out_shapes)
    for i, branch in enumerate(branches):

        def run_once(carry, branch=branch):
            _, state, _ = carry
            state, out = branch(state)
            return jnp.zeros((), bool), state, out

        _, state, out = jax.lax.while_loop(lambda carry: carry[0], run_once, (index == i, state, out))
    return state, out


def cond(pred: jax.Array, true_branch: Branch, false_branch: Branch, state: Any) -> tuple[Any, Any]:
    """`lax.cond(pred, true_branch, false_branch, state)` with `state` updated in place. pred: [] bool."""
    return switch(pred.astype(jnp.int32), (false_branch, true_branch), state)
