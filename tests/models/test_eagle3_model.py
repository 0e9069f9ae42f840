"""The EAGLE-3 head against SpecForge's reference modeling code: the same logits for the same target features over
chained draft steps, with the head's own embedding or the target's; and loading errors that name the tensor or key."""

from __future__ import annotations

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jaxspec.convert.errors import CheckpointError
from safetensors.torch import load_file, save_file

import jaxspec
from jaxspec.models import layers as L
from tests.fixtures import eagle3 as eagle3_fixtures

STEPS = 4
LENGTH = 9


def _jax_chained_logits(head, embed, features, tokens, steps):
    """jaxspec's head over the same chain, read at the last index t = T-1: the committed entries 0..T-1 in one
    step, then each draft entry at T-1+i reading the previous output. Returns [steps, V'] draft-vocab logits."""
    length = features.shape[1]
    module = head.module
    cache = module.init_cache(1, 32)
    g = module.project_features(jnp.asarray(features))
    positions = jnp.arange(length)[None]
    out, cache = module.step(embed(jnp.asarray(tokens[:, 1:length + 1])), g, positions, cache)
    logits, prev = [module.logits(out[:, -1])], out[:, -1:]
    for step in range(1, steps):
        position = jnp.full((1, 1), length - 1 + step)
        token = jnp.asarray(tokens[:, length + step: length + step + 1])
        prev, cache = module.step(embed(token), prev, position, cache)
        logits.append(module.logits(prev[:, -1]))
    return np.stack([np.asarray(x[0]) for x in logits]), np.asarray(module.logits(out)[0])


@pytest.mark.parametrize("own_embedding", [False, True])
def test_chained_logits_equal_the_reference(tmp_path, own_embedding):
    reference = eagle3_fixtures.reference(seed=5)
    table = torch.randn(128, 32, generator=torch.Generator().manual_seed(9))  # the "target's" embedding
    if not own_embedding:
        with torch.no_grad():
            reference.embed_tokens.weight.copy_(table)
    head = jaxspec.load(eagle3_fixtures.save(reference, tmp_path, own_embedding=own_embedding))
    assert head.config.own_embedding == own_embedding
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(1, LENGTH, 3 * 32, generator=generator)
    tokens = torch.randint(0, 128, (1, LENGTH + STEPS), generator=generator)
    expected = eagle3_fixtures.chained_logits(reference, features, tokens, STEPS)
    embed = head.module.embed_tokens if own_embedding else (lambda t: jnp.asarray(table.numpy())[t])
    chained, first = _jax_chained_logits(head, embed, features.numpy(), tokens.numpy(), STEPS)
    np.testing.assert_allclose(first, expected[0][0].numpy(), rtol=1e-4, atol=1e-4)  # step 0 at every index
    np.testing.assert_allclose(chained, np.stack([e[0, -1].numpy() for e in expected]), rtol=1e-4, atol=1e-4)
    # The draft vocabulary maps into the target's: -inf elsewhere
    full = np.asarray(head.module.target_logits(jnp.zeros((1, 32))))
    ids = np.asarray(head.module.vocab_ids[...])
    np.testing.assert_array_equal(ids, (reference.d2t + torch.arange(48)).numpy())
    assert np.isfinite(full[0, ids]).all() and np.isneginf(np.delete(full[0], ids)).all()


def test_spreading_to_the_vocabulary_places_each_logit_at_its_token():
    rng = np.random.default_rng(0)
    ids = rng.permutation(50)[:12]  # distinct, unordered
    logits = rng.normal(size=(2, 3, 12)).astype(np.float32)
    expected = np.full((2, 3, 50), -np.inf, np.float32)
    expected[..., ids] = logits
    np.testing.assert_array_equal(np.asarray(L.spread_to_vocab(jnp.asarray(logits), jnp.asarray(ids), 50)), expected)


def test_draft_logits_of_a_batch_are_multiplied_rows_first(tmp_path):
    """The product behind a batch's draft logits is [B, D] x [D, V'], not the transposed [V', D] x [D, B] that a
    scatter into the vocabulary had XLA compute, the layout XLA:CPU multiplies slowly at a few rows."""
    head = jaxspec.load(eagle3_fixtures.save(eagle3_fixtures.reference(seed=2), tmp_path / "head"))
    graphdef, state = nnx.split(head.module)
    draft_size = head.config.draft_vocab_size
    hlo = jax.jit(lambda state, a: nnx.merge(graphdef, state).target_logits(a)).lower(
        state, jnp.ones((8, head.config.hidden_size))).compile().as_text()
    products = re.findall(r"= f32\[([\d,]+)\][^ ]* dot\(", hlo)
    assert f"8,{draft_size}" in products and f"{draft_size},8" not in products, products


@pytest.fixture
def saved_head(tmp_path):
    return eagle3_fixtures.save(eagle3_fixtures.reference(seed=2), tmp_path / "head")


def _edit_tensors(folder, edit):
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def _edit_config(folder, edit):
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    edit(config)
    with open(path, "w") as f:
        json.dump(config, f)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t.pop("midlayer.hidden_norm.weight"), "midlayer.hidden_norm.weight"),
    (lambda t: t.update({"midlayer.extra.weight": torch.zeros(2)}), "midlayer.extra.weight"),
    (lambda t: t.update({"fc.weight": torch.zeros(32, 64)}), "fc.weight"),
    (lambda t: t.update({"d2t": torch.zeros(48, dtype=torch.int64)}), "d2t"),
    (lambda t: t["t2d"].__setitem__(0, True), "t2d"),
])
def test_tensor_errors_name_the_tensor(saved_head, edit, message):
    _edit_tensors(saved_head, edit)
    with pytest.raises(CheckpointError, match=message):
        jaxspec.load(saved_head)


@pytest.mark.parametrize("edit, error, message", [
    (lambda c: c.update({"num_hidden_layers": 2}), NotImplementedError, "num_hidden_layers=2"),
    (lambda c: c.update({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 1, 3]}}), ValueError,
     "eagle_aux_hidden_state_layer_ids"),
    (lambda c: c.update({"some_new_key": 1}), ValueError, "some_new_key"),
    (lambda c: c["eagle_config"].update({"use_mtp_layernorm": True}), ValueError, "use_mtp_layernorm"),
    (lambda c: c.pop("intermediate_size"), CheckpointError, "intermediate_size"),
    (lambda c: c.update({"draft_vocab_size": 500}), ValueError, "draft_vocab_size"),
])
def test_config_errors_name_the_key(saved_head, edit, error, message):
    _edit_config(saved_head, edit)
    with pytest.raises(error, match=message):
        jaxspec.load(saved_head)


def test_without_a_draft_vocabulary_d2t_may_be_absent(tmp_path):
    reference = eagle3_fixtures.reference({"draft_vocab_size": 128}, seed=1, draft_ids=list(range(128)))
    folder = eagle3_fixtures.save(reference, tmp_path)
    _edit_tensors(folder, lambda t: (t.pop("d2t"), t.pop("t2d")))
    head = jaxspec.load(folder)
    np.testing.assert_array_equal(np.asarray(head.module.vocab_ids[...]), np.arange(128))
    shutil.rmtree(folder)
