"""Int8 (W8A8) models: the product against a numpy reference, quantized models against their float32 selves, a
quantized assistant's greedy output against plain greedy, its sampled output against the target's exact law (slow
only: the default suite samples with float assistants only), errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

import jaxspec
import jaxspec.checkpoint
from jaxspec.models import int8 as I
from jaxspec.quantize import is_quantized, quantize
from tests.fixtures import hf_models, oracles
from tests.fixtures.moe import CASES, save_checkpoint
from tests.fixtures.prompts import PROMPTS, left_padded

N = 24


def reference_w8a8(spec: str, x: np.ndarray, w: np.ndarray, w_contracted: tuple[int, ...]) -> np.ndarray:
    """W8A8 in numpy, written out: per-channel weight scales, per-token activation scales (x's trailing axes that
    the spec contracts), an exact integer product, then both scales."""
    w_scale = np.abs(w).max(axis=w_contracted, keepdims=True) / 127.0
    w_q = np.clip(np.round(w / w_scale), -127, 127).astype(np.int64)
    x_axes = spec.split(",")[0].replace("...", "")
    contracted = sum(1 for a in x_axes if a in spec.split(",")[1].split("->")[0] and a not in spec.split("->")[1])
    x_scale = np.abs(x).max(axis=tuple(range(x.ndim - contracted, x.ndim)), keepdims=True) / 127.0
    x_q = np.clip(np.round(x / x_scale), -127, 127).astype(np.int64)
    product = np.einsum(spec, x_q, w_q).astype(np.float64)
    # Rescale: each output element by its token's and its channel's scale.
    token_scale = x_scale.reshape(x.shape[: x.ndim - contracted])
    channel_scale = np.squeeze(w_scale, axis=w_contracted)
    return product * token_scale.reshape(token_scale.shape + (1,) * channel_scale.ndim) * channel_scale


@pytest.mark.parametrize("spec, x_shape, w_shape, w_contracted", [
    ("btd,dhk->bthk", (2, 3, 16), (16, 4, 8), (0,)),  # q/k/v projections
    ("btd,dhk->bthk", (1, 1, 16), (16, 4, 8), (0,)),  # one token: the CPU pads it to two rows
    ("bthk,hkd->btd", (2, 3, 4, 8), (4, 8, 16), (0, 1)),  # output projection: two contracted axes
    ("...d,df->...f", (3, 16), (16, 24), (0,)),  # MLP, ellipsis
    ("...d,dv->...v", (2, 1, 16), (16, 40), (0,)),  # LM head
])
def test_product_equals_a_numpy_reference(spec, x_shape, w_shape, w_contracted):
    rng = np.random.default_rng(0)
    x = rng.normal(size=x_shape).astype(np.float32)
    w = rng.normal(size=w_shape).astype(np.float32)
    values, scale = I.quantize(jnp.asarray(w), w_contracted)
    out = I.project(spec, jnp.asarray(x), I.Int8Weight(values, scale))
    expected = reference_w8a8(spec, x.astype(np.float64), w.astype(np.float64), w_contracted)
    assert out.shape == expected.shape and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_a_tied_head_reads_the_embedding_rows_scale_per_token():
    rng = np.random.default_rng(1)
    embed = rng.normal(size=(40, 16)).astype(np.float32)
    values, scale = I.quantize(jnp.asarray(embed), (1,))
    table = I.Int8Weight(values, scale)
    hidden = rng.normal(size=(1, 2, 16)).astype(np.float32)
    logits = I.project("...d,dv->...v", jnp.asarray(hidden), table.T, preferred_element_type=jnp.float32)
    expected = reference_w8a8("...d,dv->...v", hidden.astype(np.float64), embed.T.astype(np.float64), (0,))
    np.testing.assert_allclose(np.asarray(logits), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    ids = jnp.asarray([[3, 39]])
    np.testing.assert_allclose(np.asarray(I.lookup(table, ids, jnp.float32)), embed[[3, 39]][None], atol=0.02)


@pytest.mark.parametrize("rows", [1, 2])
def test_a_tied_head_on_flat_hidden_states_keeps_the_int8_kernel(rows):
    """[B, D] hidden states (a catch-up's last positions) against the int8 embedding read as [D, V]: the same values
    as [B, 1, D], and on a CPU no int32 copy of the table, the lowering that made this product 30 times slower."""
    rng = np.random.default_rng(2)
    values, scale = I.quantize(jnp.asarray(rng.normal(size=(1024, 64)).astype(np.float32)), (1,))
    table = I.Int8Weight(values, scale)
    hidden = jnp.asarray(rng.normal(size=(rows, 64)).astype(np.float32))
    head = jax.jit(lambda h, t: I.project("...d,dv->...v", h, t.T, preferred_element_type=jnp.float32))
    np.testing.assert_array_equal(np.asarray(head(hidden, table)), np.asarray(head(hidden[:, None], table)[:, 0]))
    if jax.default_backend() == "cpu":
        assert "s32[1024,64]" not in head.lower(hidden, table).compile().as_text()


def assert_close_to_float32(model, quantized, tokens):
    """A quantized model's logits track the float32 model's: an error of at most a fifth of their spread (RMS; about
    a tenth on these tiny models), and the same top token at most positions. A scale on the wrong axis or a dropped
    scale gives unrelated logits."""
    positions = jnp.arange(tokens.shape[1])[None]
    exact = model.module(tokens, positions, model.module.init_cache(1, 32))[0]
    approx = quantized.module(tokens, positions, quantized.module.init_cache(1, 32))[0]
    assert float(jnp.sqrt(jnp.mean((approx - exact) ** 2))) < 0.2 * float(jnp.std(exact))
    assert float(jnp.mean(approx.argmax(-1) == exact.argmax(-1))) >= 0.75


@pytest.mark.parametrize("family, overrides", [
    ("llama", {}), ("qwen2", {}), ("llama", {"tie_word_embeddings": True}),
])
def test_quantized_llama_family_tracks_float32(tmp_path, family, overrides):
    model = jaxspec.load(hf_models.save_tiny(family, tmp_path, seed=3, **overrides))
    quantized = quantize(model)
    assert is_quantized(quantized) and not is_quantized(model)
    assert quantized.module.layers[0].wq[...].dtype == jnp.int8 and model.module.layers[0].wq[...].dtype == jnp.float32
    assert_close_to_float32(model, quantized, jnp.asarray([[5, 9, 17, 3, 11, 40, 2, 7]]))


def test_quantized_gemma_tracks_float32(tmp_path):
    model = jaxspec.load(hf_models.save_tiny_gemma("gemma3_text", tmp_path, seed=3))
    assert_close_to_float32(model, quantize(model), jnp.asarray([[5, 9, 17, 3, 11, 40, 2, 7]]))


@pytest.fixture(scope="module")
def target(tiny_llama_dir):
    return jaxspec.load(tiny_llama_dir)


@pytest.mark.parametrize("batch", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_a_quantized_assistant_keeps_greedy_output(target, batch):
    """The target itself, quantized, drafts: most drafts are accepted, and the output is plain greedy's."""
    ids, mask = left_padded(PROMPTS[:batch])
    plain = jaxspec.generate(target, ids, mask, max_new_tokens=N).sequences
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=quantize(target),
                           num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
                           assistant_confidence_threshold=0.0)
    np.testing.assert_array_equal(out.sequences, plain)
    assert out.accepted.sum() > 0.5 * out.drafted.sum() > 0


@pytest.mark.slow  # ~40 s: 6000 rows
def test_sampling_with_a_quantized_assistant_is_exact(tiny_llama_dir, target):
    """Slow only. 6000 rows, budget K + 2 with K = 3 drafts of the target's own int8 copy: the first three sampled
    tokens follow the float32 target's exact law over the whole vocabulary; q is the int8 assistant's distribution,
    which differs from p enough to reject some drafts."""
    prompt, k, rows = [5, 6, 7, 8], 3, 6000
    exact = oracles.exact_marginals(hf_models.load_hf(tiny_llama_dir), prompt, positions=3)
    out = jaxspec.generate(target, [prompt] * rows, seed=3, max_new_tokens=k + 2, do_sample=True, top_k=0,
                           eos_token_id=[], assistant_model=quantize(target), num_assistant_tokens=k,
                           num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    assert out.drafted.sum() >= rows * k and 0 < out.accepted.sum() < out.drafted.sum()
    new = out.sequences[:, len(prompt):]
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


@pytest.mark.slow
def test_a_quantized_target_decodes_its_own_greedy(target):
    quantized = quantize(target)
    ids, mask = left_padded(PROMPTS[:2])
    plain = jaxspec.generate(quantized, ids, mask, max_new_tokens=N).sequences
    out = jaxspec.generate(quantized, ids, mask, max_new_tokens=N, assistant_model=quantized,
                           num_assistant_tokens=3, num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(out.sequences, plain)


def test_a_quantized_tied_target_decodes_with_its_int8_head(tmp_path):
    """A tied head is read from the int8 embedding with its scales (not from the CPU head copy of float32 models):
    each greedy token is the argmax of the quantized model's own logits over the sequence so far."""
    model = quantize(jaxspec.load(hf_models.save_tiny("llama", tmp_path, seed=4, tie_word_embeddings=True)))
    prompt = [5, 9, 17, 3]
    out = jaxspec.generate(model, [prompt], max_new_tokens=12, eos_token_id=[])
    tokens = jnp.asarray(out.sequences)
    logits = model.module(tokens, jnp.arange(tokens.shape[1])[None], model.module.init_cache(1, 32))[0]
    np.testing.assert_array_equal(np.asarray(logits.argmax(-1))[0, len(prompt) - 1: -1], out.sequences[0, len(prompt):])


def test_errors(target, tmp_path):
    with pytest.raises(ValueError, match="mode 'int4' is not one of int8"):
        quantize(target, "int4")
    with pytest.raises(ValueError, match="quantized already"):
        quantize(quantize(target))
    with pytest.raises(NotImplementedError, match="Save the float model and quantize it after loading"):
        jaxspec.checkpoint.save(quantize(target), str(tmp_path / "converted"))
    assert not (tmp_path / "converted").exists()
    model_type, n_layers, n_mtp, overrides = CASES["glm_plain"]
    moe = jaxspec.load(save_checkpoint(model_type, str(tmp_path / "glm"), n_layers, n_mtp, overrides))
    with pytest.raises(NotImplementedError, match="no int8 path yet"):
        quantize(moe)


@pytest.mark.slow  # the default suite runs the float32 assistant on the mesh (test_every_strategy)
def test_a_quantized_assistant_on_a_2x2_mesh_equals_one_device(target):
    """Scales follow their weights' logical axes (their size-1 contracted axes stay unsharded)."""
    assistant = quantize(target)
    ids, mask = left_padded(PROMPTS[:2])
    settings = dict(max_new_tokens=N, assistant_model=assistant, num_assistant_tokens=3,
                    num_assistant_tokens_schedule="constant")
    one = jaxspec.generate(target, ids, mask, **settings)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
    sharded = jaxspec.generate(target, ids, mask, mesh=mesh, **settings)
    np.testing.assert_array_equal(sharded.sequences, one.sequences)
    np.testing.assert_array_equal(sharded.accepted, one.accepted)
