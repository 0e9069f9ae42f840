"""Blocks of 2-4 rows run their MLPs and LM head one row at a time on a CPU (models/int8.py, `per_row`): the same
values as the whole-block product, and the split happens exactly where it is meant to."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.models import int8 as I
from jaxspec.models import layers as L

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the split is XLA:CPU's alone")


def _maps(fn, *args) -> int:
    """How many `lax.map` loops (scans) the traced function runs."""
    return str(jax.make_jaxpr(fn)(*args)).count("scan[")


def _products(fn, *args) -> int:
    """How many matrix products the traced function runs."""
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general[")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
def test_mlp_splits_blocks_of_two_to_four_rows_and_equals_the_whole_block(rows):
    keys = jax.random.split(jax.random.PRNGKey(rows), 4)
    x = jax.random.normal(keys[0], (1, rows, 16))  # [B, T, D]
    w_gate, w_up = jax.random.normal(keys[1], (16, 40)), jax.random.normal(keys[2], (16, 40))
    w_down = jax.random.normal(keys[3], (40, 16))
    whole = jnp.einsum("btf,fd->btd", jax.nn.silu(x @ w_gate) * (x @ w_up), w_down)
    np.testing.assert_allclose(L.gated_mlp(x, w_gate, w_up, w_down), whole, rtol=1e-5, atol=1e-4)
    assert _maps(L.gated_mlp, x, w_gate, w_up, w_down) == (1 if 2 <= rows <= I.PER_ROW_MAX else 0)


def test_int8_weights_keep_their_whole_block_kernel():
    x = jax.random.normal(jax.random.PRNGKey(0), (1, 2, 16))
    weights = [I.Int8Weight(*I.quantize(jax.random.normal(jax.random.PRNGKey(i), shape), (axis,)))
               for i, (shape, axis) in enumerate([((16, 40), 0), ((16, 40), 0), ((40, 16), 0)], start=1)]
    assert _maps(L.gated_mlp, x, *weights) == 0


@pytest.mark.parametrize("spec,x_shape,w_shape", [
    ("...d,dv->...v", (1, 3, 8), (8, 1 << 20)),  # an untied head, or the tied head's [D, V] copy
    ("...d,vd->...v", (2, 1, 8), (1 << 20, 8)),  # a draft head's gathered rows
])
def test_project_splits_the_rows_of_a_head_sized_weight(spec, x_shape, w_shape):
    x = jax.random.normal(jax.random.PRNGKey(0), x_shape)
    w = jax.random.normal(jax.random.PRNGKey(1), w_shape)
    np.testing.assert_allclose(I.project(spec, x, w), jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-4)
    rows = x_shape[0] * x_shape[1]
    assert _products(lambda x, w: I.project(spec, x, w), x, w) == rows  # one per row, unrolled
    small = w[..., :64] if w_shape[0] == 8 else w[:64]
    assert _products(lambda x, w: I.project(spec, x, w), x, small) == 1  # smaller weights: one product per block
