"""Feature taps: a drafter that names decoder layers (`Drafter.feature_layers`) receives their outputs for every
committed position, from the prompt's chunks and from each verified round, equal to transformers' hidden states.
Block and EAGLE-style drafters build their context from these."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec import settings as settings_lib
from jaxspec.strategies.draft_model import DraftModelDrafter
from jaxspec.strategies.base import Context, Drafter, PrefillChunk, RoundResult, write_committed
from jaxspec.schedule import make_schedule
from tests.fixtures import hf_models

LAYERS = (0, 2)  # of the tiny target's 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class RecorderState:
    inner: Any  # the assistant drafter's own state
    features: jax.Array  # [B, S, F*D] what the loop handed over, at each position


@dataclasses.dataclass(frozen=True)
class FeatureRecorder(DraftModelDrafter):
    """An assistant drafter (the target itself, so whole blocks are accepted) that writes every handed-over feature
    at its position."""

    def init(self, ctx: Context, batch: int, size: int) -> RecorderState:
        width = len(self.feature_layers) * ctx.target.cfg.hidden_size
        return RecorderState(super().init(ctx, batch, size), jnp.zeros((batch, size, width), jnp.float32))

    def prefill_chunk(self, ctx: Context, state: RecorderState, chunk: PrefillChunk) -> RecorderState:
        rows = jnp.arange(chunk.positions.shape[0])[:, None]
        where = jnp.where(chunk.valid, chunk.positions, state.features.shape[1])  # padding: dropped
        return dataclasses.replace(state, features=state.features.at[rows, where].set(chunk.features, mode="drop"))

    def draft(self, ctx, loop, state: RecorderState, rng):
        step = super().draft(ctx, loop, state.inner, rng)
        return dataclasses.replace(step, state=dataclasses.replace(state, inner=step.state))

    def update(self, ctx: Context, state: RecorderState, result: RoundResult) -> RecorderState:
        slots = jnp.arange(result.features.shape[1])[None, :]
        first = result.lengths - result.committed - 1  # the position of the round's first fed token
        where = jnp.where(slots < result.committed[:, None], first[:, None] + slots, state.features.shape[1])
        rows = jnp.arange(where.shape[0])[:, None]
        features = state.features.at[rows, where].set(result.features, mode="drop")
        return RecorderState(super().update(ctx, state.inner, result), features)

    def summary(self, state: RecorderState) -> dict[str, jax.Array]:
        return {"features": state.features}


@pytest.mark.parametrize("family", ["llama", pytest.param("gemma3_text", marks=pytest.mark.slow)])
def test_committed_positions_get_the_tapped_layers(tmp_path, family):
    folder = hf_models.save_tiny(family, tmp_path, seed=0)
    model, reference = jaxspec.load(folder), hf_models.load_hf(folder)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4]]  # ragged; read in chunks of 8
    settings = settings_lib.resolve(model, max_new_tokens=24, eos_token_id=[])
    drafter = FeatureRecorder(max_draft=4, feature_layers=LAYERS, confidence_threshold=0.0, catch_up_width=8,
                              schedule=make_schedule("constant", 4, 4, draft_cost=0.0))
    out = jaxspec.generate_with_drafter(model, prompts, None, drafter, settings, assistant=model, prefill_chunk=8)
    plain = jaxspec.generate(model, prompts, max_new_tokens=24, eos_token_id=[])
    np.testing.assert_array_equal(out.sequences, plain.sequences)  # taps change nothing
    assert out.accepted_hist[:, 2:].sum() > 0  # rounds that verified and committed several tokens
    features = out.drafter_summary["features"]
    for row, prompt in enumerate(prompts):
        sequence = [*prompt, *out.new_tokens(row).tolist()]
        with torch.no_grad():
            states = reference(torch.tensor([sequence]), output_hidden_states=True).hidden_states
        expected = np.concatenate([states[layer + 1][0].numpy() for layer in LAYERS], axis=-1)
        fed = len(sequence) - 1  # the last committed token is fed in the next round
        np.testing.assert_allclose(features[row, :fed], expected[:fed], atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("committed, width", [((1, 1, 0), 1), ((0, 0, 0), 1), ((1, 2, 1), 8), ((0, 8, 5), 8)])
def test_a_round_projects_only_the_slots_its_rows_committed(committed, width):
    """`write_committed` hands a drafter's projection one slot where no row committed more than one token, else all
    K + 1 (K = 7), and what it writes equals a write of all K + 1 slots: an idle round projects one slot (K + 1 made
    DFlash's idle rounds at batch 32 cost 5% more than a plain step)."""
    batch, k1, size, dim = len(committed), 8, 16, 3
    committed = jnp.asarray(committed, jnp.int32)
    features = jax.random.normal(jax.random.key(0), (batch, k1, dim))
    lengths = jnp.asarray([9, 5, 7], jnp.int32)
    slots = jnp.arange(k1)[None, :]
    first = lengths - committed - 1
    positions = jnp.where(slots < committed[:, None], first[:, None] + slots, size)  # uncommitted: past the buffer
    result = RoundResult(drafted=committed, accepted=committed, committed=committed, tokens=jnp.zeros((batch, k1)),
                         hidden=features, lengths=lengths, features=features)

    def write(taps, at, state):
        buffer, widths = state
        rows = jnp.arange(batch)[:, None]
        return buffer.at[rows, at].set(2.0 * taps, mode="drop"), widths.at[0].set(taps.shape[1])

    empty = (jnp.zeros((batch, size, dim)), jnp.zeros((1,), jnp.int32))
    written, used = jax.jit(lambda r, p: write_committed(Drafter(max_draft=k1 - 1), r, p, write, empty))(result,
                                                                                                        positions)
    expected, _ = write(features, positions, empty)
    assert int(used[0]) == width
    np.testing.assert_array_equal(np.asarray(written), np.asarray(expected))
