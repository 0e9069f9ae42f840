"""Decoder-layer projections stored [out, in] on a CPU (jaxspec/layout.py, models/int8.py `TransposedWeight`): the
same products, logits and tokens as the model code's layout, and every path that reads params as arrays (saving,
writing a param, quantizing, sharding) sees the model code's layout. Logits against transformers for every family
are checked by the family tests, which load through `jaxspec.load` and so run this layout."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import jaxspec
from jaxspec import checkpoint, costs
from jaxspec.head import COPY_MAX_ROWS, for_rows
from jaxspec.layout import FUSED_GROUPS, LAYER_PROJECTIONS, standard_layout
from jaxspec.models import int8 as I

pytestmark = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the layout is XLA:CPU's alone")

SPECS = [  # (spec, x's free shape, w's shape, contracted axes of w): every projection spec of the layers
    ("btd,dhk->bthk", (16,), (16, 3, 4), (0,)),
    ("bthk,hkd->btd", (3, 4), (3, 4, 16), (0, 1)),
    ("...d,df->...f", (16,), (16, 40), (0,)),
    ("...d,dv->...v", (16,), (16, 50), (0,)),
]


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("spec, inner, shape, contracted", SPECS)
def test_project_by_a_transposed_weight_equals_the_einsum(spec, inner, shape, contracted, rows):
    kx, kw = jax.random.split(jax.random.PRNGKey(rows))
    x = jax.random.normal(kx, (1, rows) + inner)
    w = jax.random.normal(kw, shape)
    stored = I.contracted_last(w, contracted)
    assert stored.values.shape[-len(contracted):] == tuple(shape[a] for a in contracted)
    assert stored.shape == shape and stored.logical().shape == shape
    np.testing.assert_allclose(I.project(spec, x, stored), jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(stored.logical(), w)


def test_a_tied_head_is_the_embedding_read_in_place():
    embed = jax.random.normal(jax.random.PRNGKey(0), (50, 16))
    head = I.tied_head(embed)
    assert isinstance(head, I.TransposedWeight) and head.values is embed and head.shape == (16, 50)
    hidden = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 16))
    np.testing.assert_allclose(I.project("...d,dv->...v", hidden, head), hidden @ embed.T, rtol=1e-5, atol=1e-5)


def test_the_head_copy_serves_forwards_of_one_row():
    copy = jnp.zeros((16, 50))
    assert COPY_MAX_ROWS == 1
    assert for_rows(copy, 1) is copy
    assert for_rows(copy, 2) is None and for_rows(copy, 8) is None and for_rows(None, 1) is None


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 11, 16, 17, 32, 33])
def test_a_weight_takes_the_multiply_reduce_from_2_rows(rows):
    """A weight stored [out, in] (a layer's projection; a tied head read in place) is multiplied as an elementwise
    product and a sum from 2 rows (beyond 4 padded to a multiple of 8) to 32 where it has 2^23 elements or more and to
    16 where it is smaller; by the matrix-vector product at 1 row and matrix products beyond. So is a slice of the
    layer stack at every row count (`TransposedWeight.sliced`: XLA:CPU copies it before any kernel reads it). All
    equal the einsum."""
    dim = 64
    embed = jax.random.normal(jax.random.PRNGKey(0), (I.LARGE_WEIGHT // dim + 8, dim))  # [V, D]
    hidden = jax.random.normal(jax.random.PRNGKey(rows), (1, rows, dim))
    small = I.contracted_last(embed[:1000].T, (0,))  # [D, 1000] stored [1000, D]
    weights = ((I.tied_head(embed), embed, 32), (I.contracted_last(embed.T, (0,)), embed, 32),
               (small, embed[:1000], 16))
    for weight, table, most in weights:
        logits = I.project("...d,dv->...v", hidden, weight, preferred_element_type=jnp.float32)
        np.testing.assert_allclose(logits, hidden @ table.T, rtol=1e-4, atol=1e-4)
        for sliced in (False, True):
            reduced = 2 <= rows <= most and not sliced
            weight = dataclasses.replace(weight, sliced=sliced)
            primitives = str(jax.make_jaxpr(lambda h, w: I.project("...d,dv->...v", h, w))(hidden, weight))
            assert ("reduce_sum" in primitives, "dot_general" in primitives) == (reduced, not reduced)


def _standard(model):
    graphdef, state = nnx.split(model.module)
    return dataclasses.replace(model, module=nnx.merge(graphdef, standard_layout(state)))


def _transposed_names(module) -> set[str]:
    return {f"{index}.{name}" for index, layer in enumerate(module.layers) for name in LAYER_PROJECTIONS
            if isinstance(getattr(layer, name, None), nnx.Variable)
            and isinstance(getattr(layer, name)[...], I.TransposedWeight)}


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    from tests.fixtures import hf_models

    return hf_models.save_tiny_gemma("gemma3_text", tmp_path_factory.mktemp("gemma3"), seed=0)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_load_stores_every_layer_projection_transposed_with_the_same_logits_and_tokens(family, tiny_llama_dir,
                                                                                      tiny_gemma3_dir):
    model = jaxspec.load(tiny_llama_dir if family == "llama" else tiny_gemma3_dir)
    expected = {f"{index}.{name}" for index, layer in enumerate(model.module.layers) for name in LAYER_PROJECTIONS
                if getattr(layer, name, None) is not None}
    assert _transposed_names(model.module) == expected and expected
    standard = _standard(model)
    assert not _transposed_names(standard.module)
    tokens = jnp.asarray([[3, 7, 11, 2, 9, 4]])
    positions = jnp.arange(6)[None]
    ours, _, _ = model.module(tokens, positions, model.module.init_cache(1, 16))
    theirs, _, _ = standard.module(tokens, positions, standard.module.init_cache(1, 16))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)
    for kwargs in ({}, {"prompt_lookup_num_tokens": 3}):
        out = jaxspec.generate(model, [[3, 7, 11, 2, 9, 4, 3, 7]], max_new_tokens=8, eos_token_id=[], **kwargs)
        plain = jaxspec.generate(standard, [[3, 7, 11, 2, 9, 4, 3, 7]], max_new_tokens=8, eos_token_id=[])
        np.testing.assert_array_equal(out.sequences, plain.sequences)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_a_fused_group_is_one_product_equal_to_its_members_products(rows):
    """q, k and v fused (`I.fuse`): one buffer that every member holds, one product in the traced forward (a dot, or
    from 2 rows an elementwise product and a sum), and the members' products; a member written alone leaves the
    group, and the products stay equal, one each."""
    keys = jax.random.split(jax.random.PRNGKey(rows), 4)
    weights = [jax.random.normal(key, (16, heads, 4)) for key, heads in zip(keys, (4, 2, 2))]  # wq, wk, wv [D, H, Dh]
    members = I.fuse([I.contracted_last(w, (0,)) for w in weights])
    assert all(m.values is members[0].values for m in members) and members[0].values.shape == (8, 4, 16)
    assert [m.shape for m in members] == [w.shape for w in weights]
    x = jax.random.normal(keys[3], (1, rows, 16))
    spec = "...d,dhk->...hk"
    expected = [jnp.einsum(spec, x, w) for w in weights]

    def products(group):
        jaxpr = str(jax.make_jaxpr(lambda x, g: I.project_group(spec, x, g))(x, group))
        return jaxpr.count("dot_general") + jaxpr.count("reduce_sum")

    for got, want, member, w in zip(I.project_group(spec, x, members), expected, members, weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(I.project(spec, x, member), want, rtol=1e-5, atol=1e-5)  # a member alone
        np.testing.assert_array_equal(member.logical(), w)
    assert products(members) == 1
    members[1][...] = weights[1] * 2.0  # wk written: its own array now
    assert not members[1].group and members[1].values is not members[0].values
    got = I.project_group(spec, x, members)
    np.testing.assert_allclose(got[1], 2.0 * expected[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(got[2], expected[2], rtol=1e-5, atol=1e-5)
    assert products(members) == 3


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_load_fuses_each_layers_q_k_v_and_gate_up_into_one_buffer(family, tiny_llama_dir, tiny_gemma3_dir):
    """Every layer's groups share one buffer (Gemma's layers that share another's keys project q alone); saved and
    counted, the model is the one the model code names: bytes count each buffer once."""
    model = jaxspec.load(tiny_llama_dir if family == "llama" else tiny_gemma3_dir)
    standard = _standard(model)
    fused = 0
    for layer, plain in zip(model.module.layers, standard.module.layers):
        for names in FUSED_GROUPS:
            present = [name for name in names if getattr(layer, name, None) is not None]
            members = [getattr(layer, name)[...] for name in present]
            if len(members) < 2:
                continue
            fused += 1
            assert all(m.values is members[0].values and m.member == i for i, m in enumerate(members))
            for name, member in zip(present, members):
                np.testing.assert_array_equal(member.logical(), getattr(plain, name)[...])
    assert fused >= 2 * len(model.module.layers) - 1
    assert costs.weight_bytes(model.module) == costs.weight_bytes(standard.module)


def test_a_saved_model_holds_the_model_codes_layout_and_restores_transposed(target, tmp_path):
    folder = checkpoint.save(target, str(tmp_path / "saved"))
    restored = jaxspec.load(folder)
    assert _transposed_names(restored.module) == _transposed_names(target.module)
    expected = nnx.to_pure_dict(standard_layout(nnx.state(target.module)))
    for got, want in zip(jax.tree.leaves(nnx.to_pure_dict(standard_layout(nnx.state(restored.module)))),
                         jax.tree.leaves(expected)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as reader:  # the files themselves: [in, out], as the converters write
        on_disk = reader.restore(f"{folder}/{checkpoint.PARAMS_DIR}")
    assert tuple(on_disk["layers"]["0"]["wq"].shape) == target.module.layers[0].wq[...].shape


def test_writing_a_param_takes_the_model_codes_layout(tiny_llama_dir):
    """w_gate, a member of its layer's fused group, written: it leaves the group, and the logits are those of the
    model code's layout with the same write."""
    model = jaxspec.load(tiny_llama_dir)
    param = model.module.layers[0].w_gate
    doubled = jaxspec.layout.logical(param[...]) * 2.0
    param[...] = doubled
    assert isinstance(param[...], I.TransposedWeight) and not param[...].group
    np.testing.assert_array_equal(jaxspec.layout.logical(param[...]), doubled)
    with pytest.raises(TypeError, match="written whole"):
        param[...] = doubled.T
    standard = _standard(model)
    tokens, positions = jnp.asarray([[3, 7, 11, 2]]), jnp.arange(4)[None]
    ours, _, _ = model.module(tokens, positions, model.module.init_cache(1, 8))
    theirs, _, _ = standard.module(tokens, positions, standard.module.init_cache(1, 8))
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_quantizing_and_sharding_read_the_model_codes_layout(target):
    quantized, from_standard = jaxspec.quantize(target), jaxspec.quantize(_standard(target))
    for layer, other in zip(quantized.module.layers, from_standard.module.layers):
        np.testing.assert_array_equal(layer.wo[...], other.wo[...])
        assert layer.wo[...].dtype == jnp.int8
    assert not _transposed_names(quantized.module)  # int8 weights keep their own kernel
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    out = jaxspec.generate(target, [[3, 7, 11, 2]], max_new_tokens=6, eos_token_id=[], mesh=mesh)
    plain = jaxspec.generate(target, [[3, 7, 11, 2]], max_new_tokens=6, eos_token_id=[])
    np.testing.assert_array_equal(out.sequences, plain.sequences)
