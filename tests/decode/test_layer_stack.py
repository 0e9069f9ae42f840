"""The CPU layer stack (jaxspec/layer_stack.py): forwards of two or more positions a row loop over a stacked copy of
the decoder layers instead of unrolling them. They compute what the unrolled forward does, the compiled loop holds one
layer for its wide blocks, the copy follows the model's weights, and the setting is checked before anything compiles."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxspec
from jaxspec import costs, loop
from jaxspec import layer_stack as stacks
from jaxspec.models.int8 import TransposedWeight
from jaxspec.strategies.base import run_tapped_layers
from tests.fixtures import hf_models
from tests.fixtures.patching import patched

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 5, 6, 7], [3, 4, 5], [20, 21, 22, 23, 24, 25, 20, 21, 22]]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """Qwen3's q/k-norm layers, six of them, with a tied head."""
    folder = hf_models.save_tiny("qwen3", tmp_path_factory.mktemp("qwen3"), seed=4, num_hidden_layers=6,
                                 tie_word_embeddings=True)
    return jaxspec.load(folder)


def _forward(model, stack, tokens, positions, segments):
    """logits of the whole forward and the layers run in `segments` (tapped as the block drafters tap them),
    with `stack` bound as the decode loop binds it, or unrolled (stack None)."""
    graphdef, state = nnx.split(model.module)

    @jax.jit
    def run(state, stack, tokens, positions):
        module = nnx.merge(graphdef, state)
        module.layer_stack = stack
        cache = module.init_cache(tokens.shape[0], 32)
        logits, _, cache = module(tokens, positions, cache)
        x, _, taps = run_tapped_layers(module, module.embed_tokens(tokens), positions,
                                       module.init_cache(tokens.shape[0], 32), segments)
        return logits, cache, x, taps

    return run(state, stack, tokens, positions)


@pytest.mark.parametrize("width", [1, 2, 5])
def test_looped_layers_compute_the_unrolled_forward(qwen3, width):
    stack = stacks.layer_stack(qwen3, None)
    assert stack is not None and {buffer.shape[0] for buffer in stack.buffers} == {6}
    # A fused group's members (q, k and v; gate and up) share one buffer in the stack, as in each layer.
    layer = jax.tree.leaves(qwen3.module.layers[0].params())
    assert len(stack.buffers) == len({id(leaf) for leaf in layer}) < len(layer)
    # A layer read from the stack keeps its matrix products (a slice is copied before any kernel reads it); the
    # layers' own weights take the elementwise product and sum from 2 rows (models/int8.py, `multiply_reduce_pays`).
    def transposed(params):
        return [w for w in jax.tree.leaves(params, is_leaf=lambda w: isinstance(w, TransposedWeight))
                if isinstance(w, TransposedWeight)]

    assert transposed(stack.layer(0)) and all(w.sliced for w in transposed(stack.layer(0)))
    assert not any(w.sliced for w in transposed(qwen3.module.layers[0].params()))
    tokens = jnp.asarray(np.random.default_rng(width).integers(0, 100, (2, width)), jnp.int32)
    positions = jnp.asarray([[3], [7]]) + jnp.arange(width)
    looped = _forward(qwen3, stack, tokens, positions, (1, 3))
    unrolled = _forward(qwen3, None, tokens, positions, (1, 3))
    # The same sums in another order: unrolled, 2 or more rows take the elementwise product and sum; looped, products.
    for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(unrolled)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-4, atol=2e-4)


def test_a_looped_forward_keeps_its_taps_in_one_loop(qwen3):
    """Taps at layers 1 and 3 of 6: looped, one loop over the layers keeps them. Segments that end at each tap would
    be three loops, and each a copy of the layer to compile, in every verify width of a feature-reading drafter."""
    stack = stacks.layer_stack(qwen3, None)
    graphdef, state = nnx.split(qwen3.module)

    def tapped(state, stack, tokens, positions):
        module = nnx.merge(graphdef, state)
        module.layer_stack = stack
        return run_tapped_layers(module, module.embed_tokens(tokens), positions, module.init_cache(2, 32), (1, 3))

    tokens, positions = jnp.zeros((2, 4), jnp.int32), jnp.broadcast_to(jnp.arange(4), (2, 4))
    lowered = jax.jit(tapped).lower(state, stack, tokens, positions).as_text()
    assert lowered.count("stablehlo.while") == 1


@pytest.mark.parametrize("family, types", [
    ("gemma3_text", ["sliding_attention"] * 2 + ["full_attention"]),  # period 3: a run of two, then one
    ("gemma2", ["sliding_attention", "full_attention"]),  # period 2
])
def test_looped_gemma_periods_compute_the_unrolled_forward(monkeypatch, tmp_path, family, types):
    """Seven layers: whole periods loop, the layers past the last whole period stay unrolled, and a tapped segment
    that starts or stops inside a period runs its partial periods unrolled."""
    monkeypatch.setenv("JAXSPEC_LAYER_STACK", "on")  # `auto` keeps Gemma unrolled
    folder = hf_models.save_tiny_gemma(family, tmp_path / family, seed=3, num_hidden_layers=7,
                                       layer_types=(types * 7)[:7])
    model = jaxspec.load(folder)
    assert model.module.cfg.layer_period == len(types)
    stack = stacks.layer_stack(model, None)
    assert stack is not None and {buffer.shape[0] for buffer in stack.buffers} == {7}
    for width in (1, 2, 5):
        tokens = jnp.asarray(np.random.default_rng(width).integers(0, 100, (2, width)), jnp.int32)
        positions = jnp.asarray([[3], [6]]) + jnp.arange(width)
        looped = _forward(model, stack, tokens, positions, (1, 5))
        unrolled = _forward(model, None, tokens, positions, (1, 5))
        for a, b in zip(jax.tree.leaves(looped), jax.tree.leaves(unrolled)):  # float32 summed in another order
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def _rounds_fusions(model, **strategy) -> tuple[int, np.ndarray]:
    """(fusions in the compiled round loop, the tokens) of a fresh compile of `generate(model, ...)`."""
    compiled = []
    compile_lowered = jax.stages.Lowered.compile

    def recording_compile(self, *args, **kwargs):
        executable = compile_lowered(self, *args, **kwargs)
        compiled.append(executable.as_text())
        return executable

    with patched(jax.stages.Lowered, jax_caches=False, compile=recording_compile):
        out = jaxspec.generate(model, PROMPTS, max_new_tokens=12, **strategy)
    rounds = [text for text in compiled if "while" in text and "jit__rounds" in text]
    assert len(rounds) == 1
    return len(re.findall(r"^  %\S+ = \S+ fusion\(", rounds[0], re.MULTILINE)), out.sequences


def _growth_with_depth(build, depths, **strategy) -> tuple[int, int]:
    """(fusions the compiled plain-decoding loop gains from the shallower model to the deeper, fusions the
    `strategy` loop gains), each model's strategy tokens checked against its plain greedy tokens on the way. Plain
    decoding runs one forward, a single token wide, so its gain is what the added layers cost one forward: a loop
    whose wide blocks hold one layer (or one period) gains that and no more, where unrolled blocks gain it once per
    verify width."""
    fusions = []
    for depth in depths:
        model = build(depth)
        plain, expected = _rounds_fusions(model)
        drafting, tokens = _rounds_fusions(model, **strategy)
        np.testing.assert_array_equal(tokens, expected)
        fusions.append((plain, drafting))
    (plain_shallow, drafting_shallow), (plain_deep, drafting_deep) = fusions
    return plain_deep - plain_shallow, drafting_deep - drafting_shallow


@pytest.mark.usefixtures("default_verify_widths")
def test_wide_blocks_compile_one_layer_and_decode_the_same_tokens(tmp_path):
    """`auto` loops Llama. Prompt lookup at K = 4 verifies blocks of 2, 4 and 5 beside the one-token step: four more
    layers (4 -> 8) add four forwards' worth of fusions unrolled; looped, what they add to plain decoding. (Measured:
    plain decoding's loop gained 120 fusions, prompt lookup's 116 looped and 476 with JAXSPEC_LAYER_STACK=off, which
    fails here.)"""

    def build(depth):
        return jaxspec.load(hf_models.save_tiny("llama", tmp_path / f"llama{depth}", seed=2, num_hidden_layers=depth))

    plain_growth, lookup_growth = _growth_with_depth(build, (4, 8), prompt_lookup_num_tokens=4)
    assert plain_growth > 0
    assert lookup_growth <= 1.5 * plain_growth, (lookup_growth, plain_growth)  # unrolled: about 4x


# Slow (~26 s): an opt-in setting (`auto` keeps Gemma unrolled); the default suite checks that looped Gemma periods
# compute the unrolled forward (above) and that Llama's default loop compiles one layer (the test before this one).
@pytest.mark.slow
@pytest.mark.usefixtures("default_verify_widths")
def test_gemma_asked_to_loop_compiles_one_layer_of_each_type_and_decodes_the_same_tokens(monkeypatch, tmp_path):
    """Gemma 3's period of three layers (two sliding, one global) looped when asked: from 6 layers to 9, prompt lookup's
    loop (verify widths 1, 2, 4 and 5) gains no more than plain decoding's does (measured: 98 fusions against 119),
    and trees run the looped periods too."""
    types = ["sliding_attention"] * 2 + ["full_attention"]
    monkeypatch.setenv("JAXSPEC_LAYER_STACK", "on")  # `auto` keeps Gemma unrolled
    models = {}

    def build(depth):
        folder = hf_models.save_tiny_gemma("gemma3_text", tmp_path / f"gemma3_{depth}", seed=2,
                                           num_hidden_layers=depth, layer_types=types * (depth // 3))
        models[depth] = jaxspec.load(folder)
        return models[depth]

    plain_growth, lookup_growth = _growth_with_depth(build, (6, 9), prompt_lookup_num_tokens=4)
    assert plain_growth > 0
    assert lookup_growth <= 1.5 * plain_growth, (lookup_growth, plain_growth)
    model = models[9]
    trees = jaxspec.generate(model, PROMPTS, max_new_tokens=12, prompt_lookup_num_tokens=4, tree=(4, 4)).sequences
    np.testing.assert_array_equal(trees, jaxspec.generate(model, PROMPTS, max_new_tokens=12).sequences)


def test_wide_blocks_read_the_stack_and_a_replaced_weight_makes_a_new_one(target):
    plain = jaxspec.generate(target, PROMPTS, max_new_tokens=16).sequences
    assert np.array_equal(jaxspec.generate(target, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3).sequences,
                          plain)
    sources, stack = target.layer_stack_cache
    # Verify blocks read the copy: scaled down, it changes what they commit.
    target.layer_stack_cache = (sources, jax.tree.map(lambda leaf: 0.1 * leaf, stack))
    try:
        poisoned = jaxspec.generate(target, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3).sequences
    finally:
        target.layer_stack_cache = (sources, stack)
    assert not np.array_equal(poisoned, plain)
    # A weight replaced in the module (as training or nnx.update does) is followed: the next call stacks again.
    layer = target.module.layers[1]
    name = next(name for name, value in vars(layer).items() if isinstance(value, nnx.Param))
    original = getattr(layer, name)[...]
    getattr(layer, name).set_value(-original)
    try:
        changed = jaxspec.generate(target, PROMPTS, max_new_tokens=16).sequences
        looped = jaxspec.generate(target, PROMPTS, max_new_tokens=16, prompt_lookup_num_tokens=3).sequences
        assert target.layer_stack_cache[1] is not stack
    finally:
        getattr(layer, name).set_value(original)
    assert not np.array_equal(changed, plain)
    np.testing.assert_array_equal(looped, changed)


def test_layers_laid_out_differently_stay_unrolled(tmp_path):
    """A fused group's member replaced in one layer leaves its group there (models/int8.py `TransposedWeight`): that
    layer's params no longer stack with the others', so the call decodes unrolled instead of failing."""
    model = jaxspec.load(hf_models.save_tiny("llama", tmp_path / "llama", seed=5))
    weight = model.module.layers[1].wq[...]
    model.module.layers[1].wq[...] = 0.5 * np.asarray(weight.logical())
    assert stacks.layer_stack(model, None) is None
    looped = jaxspec.generate(model, PROMPTS, max_new_tokens=12, prompt_lookup_num_tokens=3).sequences
    np.testing.assert_array_equal(looped, jaxspec.generate(model, PROMPTS, max_new_tokens=12).sequences)


def test_who_gets_a_stack(monkeypatch, target, tmp_path):
    assert stacks.layer_stack(target, None) is not None  # a tiny CPU Llama, under the size limit
    assert stacks.layer_stack(target, None) is stacks.layer_stack(target, None)  # made once, kept on the model
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    assert stacks.layer_stack(target, mesh) is None  # sharded calls keep their layers unrolled
    gemma3 = jaxspec.load(hf_models.save_tiny_gemma("gemma3_text", tmp_path / "gemma3"))
    assert stacks.layer_stack(gemma3, None) is None  # looped, its wide forwards cost more: only when asked
    gemma4 = jaxspec.load(hf_models.save_tiny_gemma("gemma4_text", tmp_path / "gemma4"))
    # Without per-layer inputs and KV sharing, Gemma 4's global layers' wider heads (global_head_dim) still do not
    # stack with its sliding layers'.
    plain_gemma4 = jaxspec.load(hf_models.save_tiny_gemma("gemma4_text", tmp_path / "plain-gemma4",
                                                          hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                                                          num_kv_shared_layers=0))
    with monkeypatch.context() as patch:
        patch.setenv("JAXSPEC_LAYER_STACK", "on")
        assert stacks.layer_stack(gemma3, None) is not None  # loops over whole periods of its layer types
        # Gemma 4's per-layer inputs and KV-shared layers differ from period to period: it stays unrolled.
        assert not gemma4.module.loops_wide_forwards and stacks.layer_stack(gemma4, None) is None
        assert plain_gemma4.module.loops_wide_forwards and stacks.layer_stack(plain_gemma4, None) is None
    monkeypatch.setattr(stacks, "STACK_MAX_BYTES", 0)
    assert stacks.layer_stack(target, None) is None  # above the limit
    monkeypatch.setenv("JAXSPEC_LAYER_STACK", "on")
    assert stacks.layer_stack(target, None) is not None  # any size, asked for
    monkeypatch.setenv("JAXSPEC_LAYER_STACK", "off")
    assert stacks.layer_stack(target, None) is None


def test_a_misspelt_setting_is_named_before_anything_compiles(monkeypatch, target):
    monkeypatch.setenv("JAXSPEC_LAYER_STACK", "yes")
    traced = loop.trace_count()
    with pytest.raises(ValueError, match="JAXSPEC_LAYER_STACK='yes' is not one of auto, on, off"):
        jaxspec.generate(target, PROMPTS, max_new_tokens=4, prompt_lookup_num_tokens=3)
    assert loop.trace_count() == traced


def test_each_setting_measures_its_own_step_costs(monkeypatch, target, tmp_path):
    """A looped loop's verify blocks cost what they cost: prices stored for the unrolled loop must not price it."""
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measure")
    timed = []

    def recorded_time_loop(call, prefill, rounds, widths, drafts, prefix):
        timed.append(prefix)
        return {f"{prefix}|verify|{width}": float(width) for width in widths}

    monkeypatch.setattr(costs, "time_loop", recorded_time_loop)
    for setting in ("off", "auto", "off"):
        monkeypatch.setenv("JAXSPEC_LAYER_STACK", setting)
        jaxspec.generate(target, PROMPTS, max_new_tokens=4, prompt_lookup_num_tokens=3)
    assert len(timed) == 2 and timed[0] != timed[1]  # the third call read the first one's prices
