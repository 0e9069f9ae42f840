"""MTP drafting with the multi-token-prediction layers stored in the target checkpoint (DeepSeek-V3, GLM-4.5).

Definition (HF `MTPCandidateGenerator`, checked against it): a round's drafts equal a from-scratch MTP chain over
the committed sequence t_0..t_{L-1}. Depth 0's entry at position i combines Emb(t_i) with the main model's
final-normed hidden state at i-1; depth k's entry at i combines Emb(token at i) with depth k-1's output at i-1,
where tokens past L-1 are this round's drafts. Depth k's entry at L-1+k yields draft k+1.

Caching: each depth keeps a position-indexed cache, and a position-indexed buffer of its outputs (what the next
depth reads). `synced[k]` says below which position depth k's entries are committed ones, which never change.
Entries at or past L-1 embedded a draft or a stale state, and at most K+1 tokens were committed since the depth last
ran, so a round recomputes a fixed window of K+1 entries per depth, [L-1-K+k, L-1+k]: it covers everything new or
stale, and the entries it recomputes needlessly come out identical. The main model's hidden states live in a
position-indexed buffer that each verification writes, the same rollback-by-length rule as the KV cache. The
prompt's entries are computed chunk by chunk as the target reads the prompt.

Only the depths a round drafts from run: a round in which no row drafts (the adaptive schedule's idle rows) runs no
MTP layer at all, and depth k runs only when some row drafts more than k tokens. A depth that was idle first
catches its committed entries up, in blocks of CATCH_UP_WIDTH positions from `synced[k]` to where its window
starts, reading the previous depth's stored outputs; so a draft costs one depth step (and its head) whatever K is,
and the drafts still equal a from-scratch MTP chain.

With more drafts than MTP layers (`num_assistant_tokens` > `num_nextn_predict_layers`), the extra depths reuse the
last layer's weights, each with its own cache (as vLLM does); off by default. A model with a reduced draft
vocabulary (`draft_logits`) heads its drafts with those tokens only: q is zero elsewhere, which keeps sampling exact.

With `tree=(N, D)` each depth keeps N // D candidates (`jaxspec.tree.draw_candidates`, the first continuing the
chain), the alternatives being leaves, at no MTP work beyond the chain's; with `tree=(N, D, F)` the N most probable
of D F (`jaxspec.tree.select_by_probability`). The window recomputed every round makes the layers indifferent to
which branch was committed.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import inplace
from ..costs import mtp_draft_cost
from ..schedule import DraftLength, Schedule, make_schedule
from ..tree import candidate_weights, draw_candidates, sibling_tree
from .base import (Context, DecodeState, Draft, Drafter, DraftStep, PrefillChunk, RoundResult, deciding_rows,
                   room_for_drafts)
from .spec import (ASSISTANT_ENSEMBLE_WEIGHT, NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS_SCHEDULE, TREE, BuildRequest,
                   Option, Strategy, StrategyChoice, check_positive_int, schedule_kind, tree_pricing, tree_shape)


CATCH_UP_WIDTH = 16  # positions per block when an idle depth catches its committed entries up


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MtpState:
    caches: Any  # one cache per depth, stacked on the leading axis
    main_hidden: jax.Array  # [B, S, D] the target's final-normed hidden state at each position
    outputs: jax.Array  # [K, B, S, D] each depth's normed output at each position (the next depth's input)
    synced: jax.Array  # [K, B] depth k's cache entries and outputs below synced[k] are committed entries
    length: DraftLength
    draft_head: jax.Array | None  # [V', D] the draft vocabulary's head rows, gathered once per call; None without


@dataclasses.dataclass(frozen=True)
class MtpDrafter(Drafter):
    num_layers: int = 1  # MTP layers in the checkpoint; depths >= num_layers reuse the last one
    keep_probs: bool = False
    schedule: Schedule = Schedule()

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        return {"initial_draft_length": np.int32(self.schedule.initial)}

    def layer(self, depth: int) -> int:
        return min(depth, self.num_layers - 1)

    def init(self, ctx: Context, batch: int, size: int) -> MtpState:
        target = ctx.target
        width = target.cfg.hidden_size
        return MtpState(
            caches=target.init_mtp_cache(batch, size, depths=self.max_draft),
            main_hidden=jnp.zeros((batch, size, width), target.dtype),
            outputs=jnp.zeros((self.max_draft, batch, size, width), target.dtype),
            synced=jnp.zeros((self.max_draft, batch), jnp.int32),
            length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]),
            draft_head=target.draft_head() if getattr(target.cfg, "draft_vocab_size", 0) else None,
        )

    def prefill_chunk(self, ctx: Context, state: MtpState, chunk: PrefillChunk) -> MtpState:
        """Every depth over the chunk's positions: each row's entries below its prompt length are committed ones
        from the start (`synced`)."""
        main_hidden = _write(state.main_hidden, chunk.positions, chunk.hidden)
        caches, outputs = state.caches, state.outputs
        for depth in range(self.max_draft):
            prev = _input_states(main_hidden, outputs, depth, chunk.positions)
            out, _, caches = ctx.target.mtp_step(depth, chunk.tokens, prev, chunk.positions, caches,
                                                 layer=self.layer(depth))
            outputs = _write_output(outputs, depth, chunk.positions, out)
        prompt_end = jnp.max(jnp.where(chunk.valid, chunk.positions + 1, 0), axis=1)  # [B]
        synced = jnp.maximum(state.synced, prompt_end[None, :])
        return dataclasses.replace(state, caches=caches, main_hidden=main_hidden, outputs=outputs, synced=synced)

    def draft(self, ctx: Context, loop: DecodeState, state: MtpState, rng):
        target, k = ctx.target, self.max_draft
        batch, size = loop.tokens.shape
        rows = jnp.arange(batch)
        allowed = self.schedule.allowed(state.length, deciding_rows(loop))
        count = jnp.minimum(allowed, room_for_drafts(loop)).astype(jnp.int32)  # [B]
        depths_needed = jnp.max(count)
        window = loop.lengths[:, None] - 1 - k + jnp.arange(k + 1)[None, :]  # [B, K+1] depth 0's positions
        # Tokens at positions L-1-K .. L-1+K: committed ones from the buffer, then the drafts as they come.
        sequence = jnp.take_along_axis(loop.tokens, jnp.clip(window, 0, size - 1), axis=1)
        sequence = jnp.concatenate([sequence, jnp.zeros((batch, k), jnp.int32)], axis=1)  # [B, 2K+1]
        # A model with a draft vocabulary heads its drafts with those V' tokens only (zero q elsewhere).
        if state.draft_head is not None:
            draft_logits = functools.partial(target.draft_logits, head=state.draft_head)
        else:
            draft_logits = target.logits
        vocab = target.cfg.vocab_size
        branches, selects = self.branches, self.selects  # a tree's siblings per depth; keeping the N most probable
        carry = (state.caches, state.outputs, state.synced, sequence, loop.tokens,
                 _input_states(state.main_hidden, state.outputs, 0, window),  # [B, K+1, D] depth 0's input
                 jnp.zeros((), jnp.int32))
        depth_rngs = jax.random.split(rng, k)

        def run_depth(carry, depth: int):
            caches, outputs, synced, sequence, buffer, prev, forwards = carry
            # Positions below the window's start that this depth has not run on since it last drafted.
            caches, outputs, caught_up = self._catch_up(ctx, loop, state.main_hidden, caches, outputs,
                                                        synced[depth], window[:, 0] + depth, depth)
            # Entries below position depth+1 do not exist; clipping sends them to slots attention never reads.
            positions = jnp.clip(window + depth, 0, size - 1)
            out, _, caches = target.mtp_step(depth, sequence[:, depth: depth + k + 1], prev, positions, caches,
                                             layer=self.layer(depth))
            outputs = _write_output(outputs, depth, positions, out)
            synced = synced.at[depth].set(loop.lengths)  # the window reached L-1: every committed entry
            logits = draft_logits(out[:, -1])  # [B, V]: predicts position L + depth
            processed = ctx.process(logits[:, None], buffer, loop.lengths + depth, loop.prompt_lengths)[:, 0]
            # The chain's token first (a chain: `select`'s draw), then a tree's alternatives.
            candidates, q = draw_candidates(depth_rngs[depth], processed, branches, ctx.do_sample,
                                            self.keep_probs)
            token = candidates[:, 0]
            weights = candidate_weights(jax.nn.softmax(processed), token, branches) if selects else None
            sequence = sequence.at[:, k + 1 + depth].set(token)
            buffer = buffer.at[rows, loop.lengths + depth].set(token, mode="drop")
            # depth+1's entry at i reads depth's output at i-1: the same window, shifted by one
            return (caches, outputs, synced, sequence, buffer, out, forwards + 1 + caught_up), (candidates, q,
                                                                                               weights)

        def skip_depth(carry):
            q = jnp.zeros((batch, branches, vocab), jnp.float32) if self.keep_probs else None
            weights = jnp.zeros((batch, branches + 1), jnp.float32) if selects else None
            return carry, (jnp.zeros((batch, branches), jnp.int32), q, weights)

        def stacked(drafted):  # per depth (candidates [B, F], laws [B, F, V] or None, weights [B, F+1] or None)
            return jax.tree.map(lambda *depths: jnp.stack(depths, axis=1), *drafted)  # -> [B, K, F, ..]

        def run_depths(carry):
            carry, first = run_depth(carry, 0)
            drafted = [first]
            for depth in range(1, k):
                carry, candidates = inplace.cond(depths_needed > depth, functools.partial(run_depth, depth=depth),
                                                 skip_depth, carry)
                drafted.append(candidates)
            return carry, stacked(drafted)

        def skip_depths(carry):
            return carry, stacked([skip_depth(carry)[1]] * k)

        # A round in which no row drafts enters one branch, not one per depth: entering every depth's branch to skip
        # it made such a round dearer than a plain step, a cost the schedule's prices (in idle rounds) cannot see
        # (docs/design.md, 'A round that drafts nothing').
        carry, (tokens, probs, weights) = inplace.cond(depths_needed > 0, run_depths, skip_depths, carry)
        caches, outputs, synced, *_, forwards = carry
        if self.tree is not None:  # the chain with its alternatives at every depth
            branching = self.schedule.branching(state.length, deciding_rows(loop))
            draft = Draft.of_tree(sibling_tree(tokens, count, probs, branching, weights, self.tree.nodes))
        else:
            draft = Draft(tokens=tokens[:, :, 0], count=count, probs=None if probs is None else probs[:, :, 0])
        state = dataclasses.replace(state, caches=caches, outputs=outputs, synced=synced)
        return DraftStep(draft=draft, state=state, forwards=forwards, target_cache=loop.cache)

    def _catch_up(self, ctx: Context, loop: DecodeState, main_hidden, caches, outputs, synced, end, depth: int):
        """Run depth `depth` on the committed positions [synced, end) of each row, CATCH_UP_WIDTH at a time, reading
        the previous depth's stored outputs (which reach `end - 1`: that depth ran first). -> (caches, outputs,
        blocks run). Rows already caught up rewrite positions at or past `end`, which this round's window or a
        later one rewrites before any query reads them."""
        target = ctx.target
        size = loop.tokens.shape[1]

        def behind(carry):
            return jnp.any(carry[2] < end)

        def block(carry):
            caches, outputs, synced, blocks = carry
            positions = synced[:, None] + jnp.arange(CATCH_UP_WIDTH)[None, :]  # [B, W]
            tokens = jnp.take_along_axis(loop.tokens, jnp.clip(positions, 0, size - 1), axis=1)
            out, _, caches = target.mtp_step(depth, tokens, _input_states(main_hidden, outputs, depth, positions),
                                             positions, caches, layer=self.layer(depth))
            outputs = _write_output(outputs, depth, positions, out)
            return caches, outputs, jnp.maximum(synced, jnp.minimum(synced + CATCH_UP_WIDTH, end)), blocks + 1

        caches, outputs, _, blocks = jax.lax.while_loop(behind, block, (caches, outputs, synced,
                                                                        jnp.zeros((), jnp.int32)))
        return caches, outputs, blocks

    def update(self, ctx: Context, state: MtpState, result: RoundResult) -> MtpState:
        """Keep the verify block's main hidden states at their positions; rejected ones get overwritten later.
        Entries below each depth's `synced` stay committed whatever was accepted: nothing rolls back."""
        start = result.lengths - result.committed - 1  # the block began at the old L-1
        positions = start[:, None] + jnp.arange(result.hidden.shape[1])[None, :]
        main_hidden = _write(state.main_hidden, positions, result.hidden)
        length = self.schedule.update(state.length, result, self.max_draft)
        return dataclasses.replace(state, main_hidden=main_hidden, length=length)

    def summary(self, state: MtpState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}


def _write(buffer: jax.Array, positions: jax.Array, values: jax.Array) -> jax.Array:
    """buffer [B, S, D] with values [B, T, D] at positions [B, T]; positions past the buffer are dropped."""
    rows = jnp.arange(buffer.shape[0])[:, None]
    return buffer.at[rows, positions].set(values.astype(buffer.dtype), mode="drop")


def _write_output(outputs: jax.Array, depth: int, positions: jax.Array, values: jax.Array) -> jax.Array:
    """outputs [K, B, S, D] with depth's values [B, T, D] at positions [B, T] (in place; past the buffer: dropped)."""
    rows = jnp.arange(outputs.shape[1])[:, None]
    return outputs.at[depth, rows, positions].set(values.astype(outputs.dtype), mode="drop")


def _input_states(main_hidden: jax.Array, outputs: jax.Array, depth: int, positions: jax.Array) -> jax.Array:
    """[B, T, D]: what depth `depth`'s entries at `positions` read, the state at positions - 1: the main model's
    hidden state for depth 0, depth - 1's output otherwise (zeros at position 0, which has no state before it)."""
    rows = jnp.arange(positions.shape[0])[:, None]
    before = jnp.clip(positions - 1, 0, main_hidden.shape[1] - 1)
    states = main_hidden[rows, before] if depth == 0 else outputs[depth - 1, rows, before]
    return jnp.where((positions > 0)[..., None], states, 0)


USE_MTP = Option("use_mtp", "draft with the checkpoint's own MTP layers", type=None,
                 default=True)  # what naming the strategy (DraftingConfig(strategy="mtp")) implies


def build(request: BuildRequest) -> StrategyChoice:
    model = request.model
    layers = getattr(model.module, "num_mtp_layers", 0)
    if not layers:
        raise ValueError(
            f"use_mtp=True needs multi-token-prediction layers, but this {model.config.__class__.__name__} has none "
            "(config.json's num_nextn_predict_layers is 0 or absent, or the family has no MTP layers)."
        )
    # Unless the caller sets it: the draft length the layers' config recommends (a trained set records the K that
    # benchmarks/bench_mtp.py measured best), else one draft per MTP layer.
    recommended = model.hf_config.get("mtp_num_assistant_tokens")
    if recommended is not None:
        check_positive_int("config.json's mtp_num_assistant_tokens", recommended)
    drafts = request.options.get("num_assistant_tokens") or recommended or layers
    check_positive_int("num_assistant_tokens", drafts)
    kind = schedule_kind(request.options.get("num_assistant_tokens_schedule") or "adaptive", ("adaptive", "constant"),
                         "use_mtp")
    tree = tree_shape(request, "use_mtp")
    if tree is not None:  # the layers draft a chain as deep as the tree and keep N // D candidates at each depth
        drafts = tree.depth
    schedule = make_schedule(kind, int(drafts), int(drafts), draft_cost=mtp_draft_cost(model), **tree_pricing(tree))
    return StrategyChoice(MTP, MtpDrafter(max_draft=int(drafts), num_layers=layers, keep_probs=request.keep_probs,
                                          schedule=schedule, tree=tree))


MTP = Strategy(
    name="mtp",
    summary="the checkpoint's own multi-token-prediction layers draft (DeepSeek-V3, GLM-4.5, trained sets)",
    selected_by="use_mtp",
    options=(USE_MTP, NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS_SCHEDULE, ASSISTANT_ENSEMBLE_WEIGHT, TREE),
    build=build,
)
