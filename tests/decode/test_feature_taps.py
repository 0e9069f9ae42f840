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
from jaxspec.strategies.base import (PENDING_ROUNDS, Context, Drafter, PrefillChunk, RoundResult, defer_committed,
                                     flush_pending, pending_features)
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


K = 7  # the ring tests' drafter: K + 1 = 8 slots a round, a ring of PENDING_ROUNDS * 8
SIZE, DIM = 96, 3


def _ring_round(committed, lengths, key):
    """A verified round whose rows committed `committed` ([B]) tokens, now at `lengths`; features random."""
    committed = jnp.asarray(committed, jnp.int32)
    features = jax.random.normal(key, (committed.shape[0], K + 1, DIM))
    return RoundResult(drafted=committed, accepted=committed, committed=committed,
                       tokens=jnp.zeros((committed.shape[0], K + 1), jnp.int32), hidden=features,
                       lengths=jnp.asarray(lengths, jnp.int32), features=features)


def _recording_write(taps, at, state):
    """A drafter's projection stand-in: writes 2 * taps at positions `at` (dropped past the buffer), and records the
    width it was handed and how often it ran."""
    buffer, widths = state
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, at].set(2.0 * taps, mode="drop"), widths.at[taps.shape[1]].add(1)


def _eager_write(result, state):
    """The round's committed slots written at once, as drafters did before the ring."""
    offsets = jnp.arange(K + 1)[None, :]
    first = result.lengths - result.committed - 1
    positions = jnp.where(offsets < result.committed[:, None], first[:, None] + offsets, SIZE)
    return _recording_write(result.features, positions, state)


@jax.jit
def _ring_rounds(committed_by_round, drafting_by_round):
    """Rounds [R] of ragged commits ([R, B]), each flushing first where it drafts ([R] bool), then deferring its
    commits, beside the same rounds written eagerly -> (ring buffer, eager buffer, widths the ring projected)."""
    batch = committed_by_round.shape[1]
    empty = (jnp.zeros((batch, SIZE, DIM)), jnp.zeros((PENDING_ROUNDS * (K + 1) + 1,), jnp.int32))
    drafter = Drafter(max_draft=K)
    pending = pending_features(drafter, batch, DIM, jnp.float32, drop=SIZE)

    def one_round(carry, xs):
        ring, pending, eager, lengths = carry
        committed, drafting, key = xs
        ring, pending = flush_pending(drafter, pending, _recording_write, ring, drafting)
        # A drafting round reads what the eager writes hold, so the ring's buffer must hold it too.
        mismatch = jnp.any(jnp.where(drafting, ring[0] != eager[0], False))
        lengths = lengths + committed
        result = _ring_round(committed, lengths, key)
        ring, pending = defer_committed(drafter, result, pending, _recording_write, ring)
        eager = _eager_write(result, eager)
        return (ring, pending, eager, lengths), mismatch

    keys = jax.random.split(jax.random.key(0), committed_by_round.shape[0])
    start = (empty, pending, empty, jnp.full((batch,), 5, jnp.int32))
    (ring, pending, eager, _), mismatches = jax.lax.scan(one_round, start, (committed_by_round, drafting_by_round,
                                                                             keys))
    ring, _ = flush_pending(drafter, pending, _recording_write, ring, jnp.ones((), bool))
    return ring, eager, mismatches


def test_pending_features_reach_the_drafter_as_eager_writes_would():
    """Rounds of ragged commits (0 to K + 1 a row, finished rows committing nothing), some drafting: whenever a round
    drafts, the drafter's buffer holds exactly what writing every round's committed slots at once would have put
    there, and so does it after a last flush."""
    rng = np.random.default_rng(0)
    rounds, batch = 60, 3
    committed = rng.integers(0, K + 2, (rounds, batch))
    committed[rng.random((rounds, batch)) < 0.5] = 1  # plain rounds, as the schedule runs most of them
    committed[40:, 2] = 0  # a finished row
    drafting = rng.random(rounds) < 0.2
    (ring, _), (eager, _), mismatches = _ring_rounds(jnp.asarray(committed, jnp.int32), jnp.asarray(drafting))
    assert not np.any(np.asarray(mismatches))
    np.testing.assert_array_equal(np.asarray(ring), np.asarray(eager))


def test_idle_rounds_project_nothing_until_the_ring_is_full():
    """Rounds that commit one token each and draft nothing append to the ring and run no projection until it could
    not hold another round's K + 1 slots; then one projection of the whole ring. A round that drafts after at most
    K + 1 pending slots projects K + 1 of them, not the ring."""
    capacity = PENDING_ROUNDS * (K + 1)
    idle = capacity - K  # rounds until the ring holds more than capacity - (K + 1)
    committed = jnp.ones((idle, 2), jnp.int32)
    (_, widths), _, _ = _ring_rounds(committed, jnp.zeros((idle,), bool))
    widths = np.asarray(widths)
    assert widths[capacity] == 1 and widths.sum() == 1  # one flush of the whole ring, at the last round

    committed = jnp.asarray([[3, 1], [1, 1], [8, 1]], jnp.int32)  # each round drafts after <= K + 1 pending
    (_, widths), _, _ = _ring_rounds(committed, jnp.asarray([False, True, True]))
    widths = np.asarray(widths)
    assert widths[K + 1] == 3 and widths.sum() == 3  # two drafting rounds and the last flush, K + 1 wide each
