"""EAGLE-3 drafting (`assistant_model=` an EAGLE-3 head; CLI `--strategy eagle3 --assistant PATH`).

The head (models/eagle3.py) reads the target's outputs at three layers, which the loop taps in every target forward
(`Drafter.feature_layers`). Its entry at position t combines the projected features g_t with the embedding of the
token at t + 1, so the entries of a row with committed length L exist up to L - 2; the entry at L - 2 drafts the
token at L, and each later draft comes from an entry that reads the previous entry's output and draft.

Caching, as for MTP layers (jaxspec/strategies/mtp.py): g is kept in a position-indexed buffer, written at each
verified round's committed positions (their taps wait in a ring until a round drafts or the ring is full:
`base.PendingFeatures`), and the head's own cache is position-indexed, so rollback is a length.
`synced` says below which position the head's entries are committed ones, which never change. A drafting round
recomputes a fixed window of K + 1 entries, [L-2-K, L-2]: at most K + 1 tokens were committed since the head last
ran, so the window covers every new entry (and those a rejected draft left), and the entries it recomputes
needlessly come out identical. A head that was idle (rounds in which no row drafted run no head at all) first
catches its committed entries up from `synced`, CATCH_UP_WIDTH positions at a time; the prompt's entries are
caught up that way at the first draft. Draft entries at L-1 .. L-3+K are written too, and rewritten by a later
window before any committed query reads them.

Exact sampling: draft k is drawn from the head's processed distribution over the target's vocabulary (zero outside
the draft vocabulary: `Eagle3Head.target_logits`), with the drafts before it in the history the processors read,
and that distribution is q. The next entry reads the drawn token, so the drafts are a sample of the head's chain.

With `tree=(N, D)` each step keeps F = N // D candidates (`jaxspec.tree.draw_candidates`: the F best, or F draws
without replacement, each with its own law), the first continuing the chain: a tree whose alternatives at each
depth are leaves (`jaxspec.tree.sibling_tree`). It costs no head work beyond the chain's; the window recomputed
every round makes the head indifferent to which branch was committed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import inplace
from ..models import int8 as I
from ..schedule import DraftLength, Schedule, make_schedule
from ..tree import candidate_weights, draw_candidates, sibling_tree
from .base import (
    Context,
    DecodeState,
    Draft,
    Drafter,
    DraftStep,
    PendingFeatures,
    PrefillChunk,
    RoundResult,
    deciding_rows,
    defer_committed,
    flush_pending,
    pending_features,
    room_for_drafts,
)
from .spec import (
    ASSISTANT_ENSEMBLE_WEIGHT,
    ASSISTANT_MODEL,
    NUM_ASSISTANT_TOKENS,
    NUM_ASSISTANT_TOKENS_SCHEDULE,
    TREE,
    BuildRequest,
    Strategy,
    StrategyChoice,
    check_positive_int,
    schedule_kind,
    tree_pricing,
    tree_shape,
)

CATCH_UP_WIDTH = 32  # entries per block when the head catches its committed entries up (the prompt, idle rounds)
DEFAULT_DRAFTS = 4  # K where the caller does not say: the issue's and the EAGLE papers' chain length on a CPU


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Eagle3State:
    cache: Any  # the head's keys and values, by position
    features: jax.Array  # [B, S, D] g at each position the target verified (projected once, when written)
    pending: PendingFeatures  # committed tokens' taps not yet projected into `features`
    synced: jax.Array  # [B] the head's entries below synced are committed ones
    length: DraftLength


@dataclasses.dataclass(frozen=True)
class Eagle3Drafter(Drafter):
    schedule: Schedule = Schedule()
    keep_probs: bool = False
    # The head's three target layers in its order (fc's input order); feature_layers holds them sorted, as the loop
    # taps them.
    context_layers: tuple[int, ...] = ()

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        return {"initial_draft_length": np.int32(self.schedule.initial)}

    def init(self, ctx: Context, batch: int, size: int) -> Eagle3State:
        head = ctx.assistant
        return Eagle3State(cache=head.init_cache(batch, size),
                           features=jnp.zeros((batch, size, head.cfg.hidden_size), head.dtype),
                           pending=pending_features(self, batch, len(self.feature_layers) * ctx.target.cfg.hidden_size,
                                                    ctx.target.dtype, drop=size),
                           synced=jnp.zeros((batch,), jnp.int32),
                           length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]))

    def prefill_chunk(self, ctx: Context, state: Eagle3State, chunk: PrefillChunk) -> Eagle3State:
        """Only g is stored: an entry needs the token after it, which the next chunk or the first generated token
        brings. The first drafting round catches the prompt's entries up."""
        positions = jnp.where(chunk.valid, chunk.positions, state.features.shape[1])  # padding: dropped
        return dataclasses.replace(state, features=self._write_features(ctx, chunk.features, positions,
                                                                        state.features))

    def update(self, ctx: Context, state: Eagle3State, result: RoundResult) -> Eagle3State:
        """The committed tokens' taps join the pending ring, projected into g when a round drafts."""
        features, pending = defer_committed(self, result, state.pending,
                                            functools.partial(self._write_features, ctx), state.features)
        return dataclasses.replace(state, features=features, pending=pending,
                                   length=self.schedule.update(state.length, result, self.max_draft))

    def draft(self, ctx: Context, loop: DecodeState, state: Eagle3State, rng: jax.Array) -> DraftStep:
        k, head = self.max_draft, ctx.assistant
        branches, selects = self.branches, self.selects  # a tree's siblings per depth; keeping the N most probable
        batch = loop.tokens.shape[0]
        rows = jnp.arange(batch)
        count = jnp.minimum(self.schedule.allowed(state.length, deciding_rows(loop)), room_for_drafts(loop))  # [B]
        count = count.astype(jnp.int32)
        vocab = ctx.target.cfg.vocab_size
        newest = loop.lengths - 2  # [B] the newest committed entry: g at L-2, the token at L-1
        # The window and the catch-up read g: the committed tokens still pending enter it first.
        features, pending = flush_pending(self, state.pending, functools.partial(self._write_features, ctx),
                                          state.features, jnp.any(count > 0))
        state = dataclasses.replace(state, features=features, pending=pending)

        def draw(step: int, outputs, history, step_rng):
            """Draft `step` (0-based, the token at L + step) from an entry's output [B, D] -> (the chain's token [B],
            the candidates kept [B, F], their laws [B, F, V] (F = 1 for a chain) and the step's candidate weights
            [B, F + 1] (a tree with a node budget; else None), the history with the token)."""
            logits = head.target_logits(outputs)  # [B, V]
            processed = ctx.process(logits[:, None], history, loop.lengths + step, loop.prompt_lengths)[:, 0]
            tokens, q = draw_candidates(step_rng, processed, branches, ctx.do_sample, self.keep_probs,
                                        law=draft_distribution)
            weights = candidate_weights(draft_distribution(processed), tokens[:, 0], branches) if selects else None
            kept = (tokens, q, weights)
            return tokens[:, 0], kept, history.at[rows, loop.lengths + step].set(tokens[:, 0], mode="drop")

        def run(carry):
            cache, synced, forwards = carry
            start = newest - k  # [B] the window's first entry
            cache, caught_up = self._catch_up(ctx, loop, state.features, cache, synced, start)
            window = start[:, None] + jnp.arange(k + 1)[None, :]  # [B, K+1]
            out, cache = self._entries(ctx, loop, state.features, cache, window)
            rngs = jax.random.split(rng, k)
            token, kept, history = draw(0, out[:, -1], loop.tokens, rngs[0])
            drafted = jax.tree.map(lambda buffer, first: buffer.at[:, 0].set(first), nothing_drafted(), kept)
            steps = jnp.minimum(jnp.max(count), k)  # the head steps some row drafts: the window's, then width-1 ones

            def extend(step, carry):  # draft `step` >= 1 from the one before; one step compiled, not K - 1
                cache, prev, token, history, drafted = carry
                positions = (newest + step)[:, None]  # [B, 1]
                prev, cache = head.step(_embed(ctx, token[:, None]), prev, positions, cache)
                token, kept, history = draw(step, prev[:, -1], history, rngs[step])
                drafted = jax.tree.map(lambda buffer, new: buffer.at[:, step].set(new), drafted, kept)
                return cache, prev, token, history, drafted

            cache, *_, drafted = jax.lax.fori_loop(1, steps, extend, (cache, out[:, -1:], token, history, drafted))
            # tokens [B, K, F], probs [B, K, F, V] or None, weights [B, K, F + 1] or None; zeros past `steps`
            return (cache, loop.lengths - 1, forwards + caught_up + steps), drafted

        def nothing_drafted():
            probs = jnp.zeros((batch, k, branches, vocab), jnp.float32) if self.keep_probs else None
            weights = jnp.zeros((batch, k, branches + 1), jnp.float32) if selects else None
            return (jnp.zeros((batch, k, branches), jnp.int32), probs, weights)

        def skip(carry):
            return carry, nothing_drafted()

        carry = (state.cache, state.synced, jnp.zeros((), jnp.int32))
        (cache, synced, forwards), (tokens, probs, weights) = inplace.cond(jnp.any(count > 0), run, skip, carry)
        state = dataclasses.replace(state, cache=cache, synced=synced)
        if self.tree is not None:  # the chain with its alternatives at every depth
            branching = self.schedule.branching(state.length, deciding_rows(loop))
            draft = Draft.of_tree(sibling_tree(tokens, count, probs, branching, weights, self.tree.nodes))
        else:
            draft = Draft(tokens=tokens[:, :, 0], count=count, probs=None if probs is None else probs[:, :, 0])
        return DraftStep(draft=draft, state=state, forwards=forwards, target_cache=loop.cache)

    def _entries(self, ctx: Context, loop: DecodeState, features, cache, positions):
        """The head's entries at positions [B, T] (consecutive per row) from stored g and the committed tokens after
        them -> (outputs [B, T, D], cache). Positions below 0 (a window reaching before the prompt) are written past
        the cache, where writes drop."""
        size = loop.tokens.shape[1]
        rows = jnp.arange(positions.shape[0])[:, None]
        g = features[rows, jnp.clip(positions, 0, size - 1)]  # [B, T, D]
        tokens = jnp.take_along_axis(loop.tokens, jnp.clip(positions + 1, 0, size - 1), axis=1)
        positions = jnp.where(positions < 0, size, positions)
        return ctx.assistant.step(_embed(ctx, tokens), g, positions, cache)

    def _catch_up(self, ctx: Context, loop: DecodeState, features, cache, synced, end):
        """Entries [synced, end) of each row, CATCH_UP_WIDTH at a time -> (cache, blocks run). Rows caught up
        already rewrite entries at or past `end`, which the window or a later round rewrites before a committed
        query reads them."""

        def behind(carry):
            return jnp.any(carry[1] < end)

        def block(carry):
            cache, synced, blocks = carry
            positions = synced[:, None] + jnp.arange(CATCH_UP_WIDTH)[None, :]  # [B, W]
            _, cache = self._entries(ctx, loop, features, cache, positions)
            return cache, jnp.maximum(synced, jnp.minimum(synced + CATCH_UP_WIDTH, end)), blocks + 1

        cache, _, blocks = jax.lax.while_loop(behind, block, (cache, synced, jnp.zeros((), jnp.int32)))
        return cache, blocks

    def _write_features(self, ctx: Context, taps, positions, buffer):
        """taps [B, T, 3 D_t] (the tapped layers, sorted) at positions [B, T] -> buffer [B, S, D] with g written
        there."""
        width = ctx.target.cfg.hidden_size
        by_layer = {layer: taps[..., i * width:(i + 1) * width] for i, layer in enumerate(self.feature_layers)}
        g = ctx.assistant.project_features(jnp.concatenate([by_layer[layer] for layer in self.context_layers], -1))
        rows = jnp.arange(buffer.shape[0])[:, None]
        return buffer.at[rows, positions].set(g.astype(buffer.dtype), mode="drop")

    def summary(self, state: Eagle3State) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}


def draft_distribution(processed: jax.Array) -> jax.Array:
    """q of a draft: the distribution `select` draws it from, processed logits [B, V] -> probabilities [B, V]."""
    return jax.nn.softmax(processed, axis=-1)


def _embed(ctx: Context, tokens: jax.Array) -> jax.Array:
    return draft_embedding(ctx.target, ctx.assistant, tokens)


def draft_embedding(target, head, tokens: jax.Array) -> jax.Array:
    """The head's input embedding of tokens [B, T] -> [B, T, D]: its own table, else the target's raw rows (what
    SpecForge copies into the head it trains: unscaled, also for families that scale their own input)."""
    if head.cfg.own_embedding:
        return head.embed_tokens(tokens)
    return I.lookup(I.weight(target, "embed"), tokens, head.dtype)


def is_eagle3_head(model) -> bool:
    return type(getattr(model, "module", None)).__name__ == "Eagle3Head"


def head_draft_cost(head, target) -> float:
    """A draft step in target steps where nothing is measured: the head's weight share (a width-1 step reads every
    head weight but the fc; the window a round starts with reads them once more), jaxspec/costs.py times it
    otherwise."""
    from ..costs import weight_bytes

    return weight_bytes(head.module) / weight_bytes(target.module)


def build(request: BuildRequest) -> StrategyChoice:
    head, target = request.options["assistant_model"], request.model
    head.config.check_target(target.config)
    drafts = request.options.get("num_assistant_tokens") or DEFAULT_DRAFTS
    check_positive_int("num_assistant_tokens", drafts)
    kind = schedule_kind(request.options.get("num_assistant_tokens_schedule") or "adaptive", ("adaptive", "constant"),
                         "EAGLE-3")
    tree = tree_shape(request, "EAGLE-3")
    if tree is not None:  # the head drafts a chain as deep as the tree and keeps N // D candidates at each depth
        drafts = tree.depth
    cost = head_draft_cost(head, target)
    schedule = make_schedule(kind, drafts, drafts, draft_cost=cost, round_cost=cost,
                             **tree_pricing(tree))
    layers = head.config.layer_ids(target.config.num_layers)
    drafter = Eagle3Drafter(max_draft=drafts, schedule=schedule, keep_probs=request.keep_probs, tree=tree,
                            feature_layers=tuple(sorted(layers)), context_layers=tuple(layers))
    return StrategyChoice(EAGLE3, drafter, head)


EAGLE3 = Strategy(
    name="eagle3",
    summary="an EAGLE-3 head drafts from three of the target's layers, one token a step (--assistant PATH)",
    options=(ASSISTANT_MODEL, NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS_SCHEDULE, ASSISTANT_ENSEMBLE_WEIGHT, TREE),
    build=build,
    selected_by="assistant_model",
    claims=lambda request: is_eagle3_head(request.options["assistant_model"]),
)
