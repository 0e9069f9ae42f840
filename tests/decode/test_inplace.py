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
from tests.fixtures.patching import patched


def _branches():
    def write(value):
        def branch(state):
            buffer, calls = state
            return (buffer.at[value].set(value), calls + 1), jnp.float32(value) * 10
        return branch
    return [write(i) for i in range(3)]


@pytest.fixture(params=inplace.MODES)
def mode(request):
    """Each way a branch can run (JAXSPEC_BRANCHES): in place, as while loops of zero or one trip, or lax's."""
    with patched(inplace, jax_caches=False, MODE=request.param):
        yield request.param


@pytest.mark.parametrize("index", [0, 1, 2])
def test_switch_runs_the_selected_branch_once(index, mode):
    state = (jnp.zeros(4, jnp.int32), jnp.zeros((), jnp.int32))
    (buffer, calls), out = jax.jit(lambda i, s: inplace.switch(i, _branches(), s))(jnp.int32(index), state)
    expected = np.zeros(4, np.int32)
    expected[index] = index
    assert buffer.tolist() == expected.tolist() and int(calls) == 1 and float(out) == 10 * index


@pytest.mark.parametrize("index", [3, -1])
def test_switch_out_of_range_runs_nothing_and_cond_picks_by_predicate(index, mode):
    state = (jnp.full(4, 7, jnp.int32), jnp.zeros((), jnp.int32))
    (buffer, calls), out = jax.jit(lambda i, s: inplace.switch(i, _branches(), s))(jnp.int32(index), state)
    assert buffer.tolist() == [7] * 4 and int(calls) == 0 and float(out) == 0.0
    branches = _branches()
    (buffer, _), out = inplace.cond(jnp.bool_(True), branches[2], branches[1], state)
    assert buffer.tolist() == [7, 7, 2, 7] and float(out) == 20.0


CACHE = r"f32\[(\d+),(\d+),(\d+),(\d+),(\d+)\]"  # [L, B, K, S, Dh]: a KV cache (the target's or an assistant's)


def _caches(text: str, copies: bool) -> list[tuple[int, ...]]:
    """Whole caches of a batch of one row in optimized HLO (every layer, S >= the smallest buffer): every one, or
    only those copied. One layer's slice ([1, ...]) is left out: `test_attention_copies_no_layer_cache` counts those."""
    pattern = rf"= {CACHE}\{{[^}}]*\}} copy\(" if copies else CACHE
    shapes = (tuple(map(int, m)) for m in re.findall(pattern, text))
    return [shape for shape in shapes if shape[0] > 1 and shape[1] == 1 and shape[3] >= min_buffer()]


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
    (text,) = [compiled.as_text() for compiled in loop.compiled("rounds")]
    assert _caches(text, copies=False)  # the caches are there ...
    assert _caches(text, copies=True) == []  # ... and never copied


def test_plain_decoding_steps_nested_in_a_branch_on_a_cpu(tiny_llama_dir):
    """On XLA:CPU plain decoding's step runs inside a one-trip branch, as a strategy's round of width 1 does (the same
    kernels run faster there at a few rows: jaxspec/loop.py `NESTED_PLAIN_STEP`), and decodes what the step at the top
    of the rounds loop decodes."""
    target = jaxspec.load(tiny_llama_dir)
    prompts = [[5, 6, 7, 8], [9, 10]]
    sequences, scopes = {}, {}
    for nested in (True, False):
        with patched(loop, jax_caches=False, NESTED_PLAIN_STEP=nested):
            sequences[nested] = jaxspec.generate(target, prompts, max_new_tokens=6, eos_token_id=[]).sequences
            (text,) = [compiled.as_text() for compiled in loop.compiled("rounds")]
        # where the decoder layers run: the rounds loop's body, or a while loop (the branch) inside it
        scopes[nested] = set(re.findall(r'op_name="jit\(_rounds\)/((?:while/body/)+)jit\(_layer_call\)', text))
    assert scopes == {True: {"while/body/while/body/"}, False: {"while/body/"}}
    np.testing.assert_array_equal(sequences[True], sequences[False])

def _layer_cache_copies(text: str, layer_shape: tuple[int, ...]) -> list[str]:
    """Copies and transposes in optimized HLO of an array with the axes of one layer's cache (`layer_shape`, unit axes
    aside, in any order): keys or values rearranged into another layout. XLA writes a rearrangement as a transpose
    into a layout that keeps the bytes where they are, then a copy into the layout its consumer asked for."""
    def axes(dims):
        return sorted(d for d in dims if d > 1)

    found = re.findall(r"= f32\[([\d,]+)\]\{[^}]*\} (?:copy|transpose)\(", text)
    return [dims for dims in found if axes(map(int, dims.split(","))) == axes(layer_shape)]


def _tiny(family: str, folder) -> str:
    from tests.fixtures import hf_models, moe

    if family == "deepseek_v3":  # one layer: its cache stack is one layer deep (jaxspec.cache.stack_layers)
        return moe.save_checkpoint(family, folder, 1, 0, moe.CASES["deepseek_plain"][3])
    save = hf_models.save_tiny_gemma if family.startswith("gemma") else hf_models.save_tiny
    return save(family, folder, seed=0)


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "deepseek_v3"])
def test_attention_copies_no_layer_cache(tmp_path, family):
    """Caches are stored in the layout attention's products take (jaxspec/cache.py), so the compiled decode step
    rearranges no layer's keys, values or latents. Stored [L, B, S, K, Dh], XLA:CPU transposed each layer's keys
    and values into [B, K, S, Dh] and [B, K, Dh, S] in every step, and MLA's latent into [B, R, S]. (It still copies
    each layer's slice out of the stack as it lies; benchmarks/bench_cache_layout.py counts those.) Gemma 3's
    full-attention layer and the one-layer DeepSeek have stacks of one layer, whose write XLA:CPU fused into
    attention's read, copying the whole stack, until stacks got a second layer (jaxspec.cache.stack_layers)."""
    target = jaxspec.load(_tiny(family, tmp_path))
    loop._compiled.clear()
    jaxspec.generate(target, [[5, 6, 7, 8]], max_new_tokens=6, eos_token_id=[])
    (text,) = [compiled.as_text() for compiled in loop.compiled("rounds")]
    cache = jax.eval_shape(lambda: target.module.init_cache(1, min_buffer()))
    stacks = [x for x in jax.tree.leaves(cache) if x.ndim >= 4]  # [L, B, ..., S, F]: per layer, keys and values
    assert all(f"f32[{','.join(map(str, x.shape))}]" in text for x in stacks)  # the caches are in the loop ...
    for x in stacks:
        assert _layer_cache_copies(text, x.shape[1:]) == []  # ... and no layer of them is rearranged


# Slow: a knob for accelerator A/Bs, not a default (an H200 timed it no faster: docs/design.md, 'On a GPU').
@pytest.mark.slow
def test_lax_branches_decode_the_same_tokens_with_conditionals_in_the_loop(tiny_llama_dir):
    """JAXSPEC_BRANCHES=lax, the A/B for accelerators: the same greedy tokens as the in-place branches, from a
    rounds loop in which the in-place branches' while loops became XLA conditionals."""
    target = jaxspec.load(tiny_llama_dir)
    outputs, conditionals, loops = {}, {}, {}
    for mode in inplace.MODES:
        with patched(inplace, jax_caches=False, MODE=mode):
            out = jaxspec.generate(target, [[5, 6, 7, 8, 5, 6], [9, 3]], max_new_tokens=12, eos_token_id=[],
                                   prompt_lookup_num_tokens=4)
            (text,) = [compiled.as_text() for compiled in loop.compiled("rounds")]
        outputs[mode] = [out.new_tokens(row).tolist() for row in range(2)]
        conditionals[mode] = len(re.findall(r" conditional\(", text))
        loops[mode] = len(re.findall(r" while\(", text))
    assert outputs["lax"] == outputs["inplace"]
    assert conditionals["lax"] > conditionals["inplace"] and loops["lax"] < loops["inplace"], (conditionals, loops)


def test_the_branch_setting_is_read_and_checked(monkeypatch):
    """JAXSPEC_BRANCHES as jaxspec.inplace reads it at import: case and spaces do not matter, unset is the default,
    and a misspelt value is an error naming the variable and the choices."""
    from jaxspec.prompts import choice_setting

    monkeypatch.setenv("JAXSPEC_BRANCHES", " LAX ")
    assert choice_setting("JAXSPEC_BRANCHES", inplace.MODES) == "lax"
    monkeypatch.delenv("JAXSPEC_BRANCHES")
    assert choice_setting("JAXSPEC_BRANCHES", inplace.MODES) == "inplace"
    monkeypatch.setenv("JAXSPEC_BRANCHES", "while")
    with pytest.raises(ValueError, match="JAXSPEC_BRANCHES='while' is not one of inplace, lax"):
        choice_setting("JAXSPEC_BRANCHES", inplace.MODES)
