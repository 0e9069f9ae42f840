"""jaxspec.inplace: run-time branches that update caches in place, and the copies they exist to avoid."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import inplace

from jaxspec import loop
from jaxspec.prompts import min_buffer


def _branches():
    def write(value):
        def branch(state):
            buffer, calls = state
            return (buffer.at[value].set(value), calls + 1), jnp.float32(value) * 10
        return branch
    return [write(i) for i in range(3)]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch_runs_the_selected_branch_once(index):
    state = (jnp.zeros(4, jnp.int32), jnp.zeros((), jnp.int32))
    (buffer, calls), out = jax.jit(lambda i, s: inplace.switch(i, _branches(), s))(jnp.int32(index), state)
    expected = np.zeros(4, np.int32)
    expected[index] = index
    assert buffer.tolist() == expected.tolist() and int(calls) == 1 and float(out) == 10 * index


def test_switch_out_of_range_runs_nothing_and_cond_picks_by_predicate():
    state = (jnp.full(4, 7, jnp.int32), jnp.zeros((), jnp.int32))
    (buffer, calls), out = inplace.switch(jnp.int32(3), _branches(), state)
    assert buffer.tolist() == [7] * 4 and int(calls) == 0 and float(out) == 0.0
    branches = _branches()
    (buffer, _), out = inplace.cond(jnp.bool_(True), branches[2], branches[1], state)
    assert buffer.tolist() == [7, 7, 2, 7] and float(out) == 20.0


CACHE = r"f32\[(\d+),(\d+),(\d+),(\d+),(\d+)\]"  # [L, B, S, K, Dh]: a KV cache (the target's or an assistant's)


def _caches(text: str, copies: bool) -> list[tuple[int, ...]]:
    """Whole caches of a batch of one row in optimized HLO (every layer, S >= the smallest buffer): every one, or
    only those copied. One layer's slice ([1, ...]) is left out: attention copies it into another layout."""
    pattern = rf"= {CACHE}\{{[^}}]*\}} copy\(" if copies else CACHE
    shapes = (tuple(map(int, m)) for m in re.findall(pattern, text))
    return [shape for shape in shapes if shape[0] > 1 and shape[1] == 1 and shape[2] >= min_buffer()]


@pytest.mark.parametrize("strategy", ["prompt_lookup", "speculative", "early_exit"])
def test_rounds_loop_never_copies_a_whole_cache(tiny_llama_dir, tiny_llama_draft_dir, strategy):
    """The regression this module fixed: with lax.cond/switch, the compiled rounds loop copied the target's cache
    (and an assistant's) every round, a few percent of every step even where nothing was drafted."""
    target = jaxspec.load(tiny_llama_dir)
    kwargs = {"prompt_lookup": dict(prompt_lookup_num_tokens=4),
              "speculative": dict(assistant_model=jaxspec.load(tiny_llama_draft_dir)),
              "early_exit": dict(assistant_early_exit=1)}[strategy]
    loop._compiled.clear()
    jaxspec.generate(target, [[5, 6, 7, 8]], max_new_tokens=6, eos_token_id=[], **kwargs)
    (text,) = [compiled.as_text() for key, compiled in loop._compiled.items() if key[1] == "rounds"]
    assert _caches(text, copies=False)  # the caches are there ...
    assert _caches(text, copies=True) == []  # ... and never copied
