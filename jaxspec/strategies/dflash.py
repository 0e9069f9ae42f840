"""DFlash block drafting (`assistant_model=` a DFlash drafter; transformers' `speculation_type="dflash"`).

The drafter's context is the target's own hidden states at `target_layer_ids` (feature taps, jaxspec/strategies/
base.py), projected by the drafter and written into its position-indexed context cache at committed positions only:
from the prompt's chunks, then from each verified round's committed tokens, which wait in a ring until a round drafts
or the ring is full (`base.PendingFeatures`: a round that drafts nothing projects nothing). So rollback is a length, as
for every cache, and nothing a rejected draft produced is ever read. One drafter forward over `[last, mask x K]` at
positions L-1 .. L-1+K (L the row's committed length; the context covers the positions below L-1) drafts a whole
block; the drafts' logits come from the target's LM head (its rows for the drafter's draft vocabulary only, where the
checkpoint has one: models/dflash.py).

Exact sampling: draft j is drawn from the drafter's logits at block position j processed with the prefix it extends
(the committed tokens and drafts 1..j-1, as the target's logits are when verifying), and q_j is that distribution.
The block's logits do not depend on which tokens were drawn (the block holds mask tokens), so drawing each position
from its own q_j, one after another, is the drafter's distribution; the usual speculative verify with those q_j
keeps the output the target's. Both references do the same at batch 1, as far as their code reads:
transformers 5.23's `DFlashTokenCandidateGenerator` draws drafts one by one from the processed logits and returns
them as q; the dflash package's `dflash_generate` draws from and verifies with the same temperature / top-p / top-k
warping (it applies no other processor).

How much of the block a row verifies follows the shared schedule (adaptive by default): the block costs one drafter
forward whatever its length (`Schedule.round_cost`), its drafts a pass through the target's head each (only as many
as the round may propose: `BlockDrafter.drafts_drawn`), and a verify block of each width costs what was measured.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..costs import weight_bytes
from ..head import for_rows
from ..models import int8 as I
from ..models.layers import spread_to_vocab
from ..schedule import DraftLength, Schedule, make_schedule, verify_widths
from ..tree import candidate_weights, draw_candidates, sibling_tree
from .base import (Context, DecodeState, Draft, Drafter, DraftStep, PendingFeatures, PrefillChunk, RoundResult,
                   deciding_rows, defer_committed, flush_pending, pending_features, room_for_drafts)
from .spec import (ASSISTANT_ENSEMBLE_WEIGHT, ASSISTANT_MODEL, NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS_SCHEDULE,
                   TREE, BuildRequest, Option, Strategy, StrategyChoice, check_positive_int, schedule_kind,
                   tree_pricing, tree_shape)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class BlockState:
    cache: Any  # the drafter's context cache: each layer's keys and values of the context, by position
    pending: PendingFeatures  # committed tokens' features not yet projected into `cache`
    length: DraftLength
    draft_head: Any  # [V', D] the target head's rows for the drafter's draft vocabulary, gathered once per call;
    # None for a drafter without one


@dataclasses.dataclass(frozen=True)
class BlockDrafter(Drafter):
    schedule: Schedule = Schedule()
    keep_probs: bool = False
    # The context's layers in the drafter's order (target_layer_ids); feature_layers holds them sorted and unique,
    # as the loop taps them. `final_layer`: the target's last layer, whose tap enters the context final-normed
    # (transformers' hidden_states[-1] is).
    context_layers: tuple[int, ...] = ()
    final_layer: int = -1

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        return {"initial_draft_length": np.int32(self.schedule.initial)}

    def init(self, ctx: Context, batch: int, size: int) -> BlockState:
        width = len(self.feature_layers) * ctx.target.cfg.hidden_size
        vocab_ids = getattr(ctx.assistant, "vocab_ids", None)
        return BlockState(cache=ctx.assistant.init_cache(batch, size),
                          pending=pending_features(self, batch, width, ctx.target.dtype, drop=size),
                          length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]),
                          draft_head=None if vocab_ids is None else I.head_rows(ctx.target, vocab_ids[...]))

    def prefill_chunk(self, ctx: Context, state: BlockState, chunk: PrefillChunk) -> BlockState:
        positions = jnp.where(chunk.valid, chunk.positions, state.cache.size)  # padding past a prompt: dropped
        return dataclasses.replace(state, cache=self._write(ctx, chunk.features, positions, state.cache))

    def draft(self, ctx: Context, loop: DecodeState, state: BlockState, rng: jax.Array) -> DraftStep:
        limit = jnp.minimum(self.schedule.allowed(state.length, deciding_rows(loop)), room_for_drafts(loop))  # [B]
        branches, selects = self.branches, self.selects  # a tree's siblings per depth; keeping the N most probable
        batch, vocab, k = loop.lengths.shape[0], ctx.target.cfg.vocab_size, self.max_draft
        # The block reads the whole context: the committed tokens still pending enter the cache first.
        cache, pending = flush_pending(self, state.pending, functools.partial(self._write, ctx), state.cache,
                                       jnp.any(limit > 0))
        state = dataclasses.replace(state, cache=cache, pending=pending)

        def padded(tokens, probs, weights):  # [B, n, ...] -> [B, K, ...], zero past the n drafts drawn
            def pad(x):
                return None if x is None else jnp.pad(x, ((0, 0), (0, k - x.shape[1])) + ((0, 0),) * (x.ndim - 2))
            return pad(tokens), pad(probs), pad(weights)

        def skip(_):
            probs = jnp.zeros((batch, k, branches, vocab), jnp.float32) if self.keep_probs else None
            weights = jnp.zeros((batch, k, branches + 1), jnp.float32) if selects else None
            return (jnp.zeros((batch, k, branches), jnp.int32), probs, weights), jnp.zeros((), jnp.int32)

        def run(_):
            hidden = self._block_hidden(ctx, loop, state.cache)  # [B, W, D]: one forward, whatever a row drafts

            def draw(drafts: int):
                return padded(*self._draw(ctx, loop, hidden, state.draft_head, rng, drafts, branches, selects))

            # The fewest of `drafts_drawn` that hold every row's limit.
            index = jnp.sum(jnp.asarray(self.drafts_drawn) < jnp.max(limit))
            drafted = jax.lax.switch(index, [functools.partial(draw, n) for n in self.drafts_drawn])
            return drafted, jnp.ones((), jnp.int32)

        (tokens, probs, weights), forwards = jax.lax.cond(jnp.any(limit > 0), run, skip, None)
        count = limit.astype(jnp.int32)
        if self.tree is not None:  # the block's drafts with their alternatives at every position, as leaves
            branching = self.schedule.branching(state.length, deciding_rows(loop))
            draft = Draft.of_tree(sibling_tree(tokens, count, probs, branching, weights, self.tree.nodes))
        else:
            draft = Draft(tokens=tokens[:, :, 0], count=count, probs=None if probs is None else probs[:, :, 0])
        return DraftStep(draft=draft, state=state, forwards=forwards, target_cache=loop.cache)

    @property
    def drafts_drawn(self) -> tuple[int, ...]:
        """How many of the block's positions a round puts through the target's head and draws, by the most any row
        may draft: 1, and the draft counts of the verify widths (`schedule.verify_widths`, K the widest). The block
        is one forward whatever a round drafts, but its head is a product per position, and K of them can cost as
        much as a plain step (docs/design.md, 'The trained heads in batches'): a round drawing one draft pays for
        one."""
        return tuple(sorted({1} | {width - 1 for width in verify_widths(self.max_draft) if width > 1}))

    def _block_hidden(self, ctx: Context, loop: DecodeState, cache) -> jax.Array:
        """One drafter forward over its block [last, mask x (W-1)] -> final-normed hidden [B, W, D]; entry j >= 1
        drafts the token at position L - 1 + j."""
        drafter, target = ctx.assistant, ctx.target
        block = drafter.block_tokens(loop.last_token)  # [B, W]: the whole block, whatever K uses of it (W >= K + 1)
        embedded = target.embed_tokens(block)[..., : target.cfg.hidden_size] * drafter.cfg.input_embedding_scale
        positions = (loop.lengths - 1)[:, None] + jnp.arange(block.shape[1])[None, :]  # [B, W]
        return drafter.draft_block(embedded, positions, cache, loop.lengths - 1)

    def _draw(self, ctx: Context, loop: DecodeState, hidden: jax.Array, draft_head, rng, drafts: int, branches: int,
              selects: bool):
        """The block's first `drafts` positions through the target's head (through `draft_head`'s rows [V', D] only,
        where the drafter has a draft vocabulary), each drawn from its processed distribution, with `branches` - 1
        alternatives each (jaxspec.tree.draw_candidates) -> (tokens [B, n, F], their laws [B, n, F, V] or None, and
        with `selects` each position's candidate weights [B, n, F + 1]) for n = `drafts`."""
        batch, drafting = loop.lengths.shape[0], hidden[:, 1:drafts + 1]  # entry j drafts position L + j
        if draft_head is not None:
            # One product over the V' rows [B, n, V'], placed in the vocabulary a position at a time: placed whole,
            # the compiled round laid the [B, n, V] result out vocabulary-major for n > 1 (XLA:CPU), against the
            # [B, V] rows the processing reads.
            reduced, ids = ctx.assistant.draft_vocab_logits(drafting, draft_head), ctx.assistant.vocab_ids[...]

            def position_logits(j):  # -> [B, 1, V], -inf outside the draft vocabulary
                return spread_to_vocab(jax.lax.dynamic_slice_in_dim(reduced, j, 1, axis=1), ids,
                                       ctx.target.cfg.vocab_size)
        else:
            head = for_rows(ctx.head, batch * drafts)
            logits = ctx.assistant.logits(drafting, I.head_weight(ctx.target) if head is None else head)  # [B, n, V]

            def position_logits(j):
                return jax.lax.dynamic_slice_in_dim(logits, j, 1, axis=1)
        rows = jnp.arange(batch)

        def draw_position(j, carry):  # each draft's processing sees the drafts before it, in `history`
            tokens, probs, weights, history = carry
            processed = ctx.process(position_logits(j), history, loop.lengths + j, loop.prompt_lengths)[:, 0]
            candidates, laws = draw_candidates(jax.random.fold_in(rng, j), processed, branches, ctx.do_sample,
                                               self.keep_probs, law=draft_distribution)  # [B, F], [B, F, V]
            history = history.at[rows, loop.lengths + j].set(candidates[:, 0], mode="drop")
            tokens = tokens.at[:, j].set(candidates)
            if self.keep_probs:
                probs = probs.at[:, j].set(laws)
            if selects:
                weights = weights.at[:, j].set(
                    candidate_weights(draft_distribution(processed), candidates[:, 0], branches))
            return tokens, probs, weights, history

        # A loop over the positions, not unrolled: the round's draw branches (`drafts_drawn`, 1 + 3 + 7 positions
        # for a block of 8) then compile one position's processing and draw each (docs/design.md, 'Compile time').
        vocab = ctx.target.cfg.vocab_size
        carry = (jnp.zeros((batch, drafts, branches), jnp.int32),
                 jnp.zeros((batch, drafts, branches, vocab), jnp.float32) if self.keep_probs else None,
                 jnp.zeros((batch, drafts, branches + 1), jnp.float32) if selects else None, loop.tokens)
        tokens, probs, weights, _ = jax.lax.fori_loop(0, drafts, draw_position, carry)
        return tokens, probs, weights

    def update(self, ctx: Context, state: BlockState, result: RoundResult) -> BlockState:
        """The committed tokens' features join the pending ring, projected into the context when a round drafts."""
        cache, pending = defer_committed(self, result, state.pending, functools.partial(self._write, ctx),
                                         state.cache)
        return dataclasses.replace(state, cache=cache, pending=pending,
                                   length=self.schedule.update(state.length, result, self.max_draft))

    def _write(self, ctx: Context, features: jax.Array, positions: jax.Array, cache):
        """features [B, T, F*D] (the tapped layers, sorted) -> the drafter's context written at positions [B, T]."""
        width = ctx.target.cfg.hidden_size
        taps = {layer: features[..., i * width:(i + 1) * width] for i, layer in enumerate(self.feature_layers)}
        if self.final_layer in taps:
            taps[self.final_layer] = ctx.target.final_hidden(taps[self.final_layer])
        context = ctx.assistant.project_context(jnp.concatenate([taps[layer] for layer in self.context_layers], -1))
        return ctx.assistant.write_context(context, positions, cache)

    def summary(self, state: BlockState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}


def draft_distribution(processed: jax.Array) -> jax.Array:
    """q of a draft: the distribution `select` draws it from, processed logits [B, V] -> probabilities [B, V]."""
    return jax.nn.softmax(processed, axis=-1)


def is_block_drafter(model) -> bool:
    return hasattr(getattr(model, "module", None), "draft_block")


SPECULATION_TYPE = Option("speculation_type", "transformers' name for the strategy: 'dflash'", type=str,
                          choices=("dflash",), flag="--speculation-type")


def build(request: BuildRequest) -> StrategyChoice:
    drafter_model, target = request.options["assistant_model"], request.model
    cfg = drafter_model.config
    cfg.check_target(target.config)
    _check_draft_vocab(drafter_model.module, target.config.vocab_size)
    block = cfg.block_size - 1  # drafts per block: the most a round can verify
    drafts = request.options.get("num_assistant_tokens") or block
    check_positive_int("num_assistant_tokens", drafts)
    if drafts > block:
        raise ValueError(f"num_assistant_tokens ({drafts}) exceeds the DFlash drafter's block of {block} drafts "
                         f"(block_size {cfg.block_size}).")
    kind = schedule_kind(request.options.get("num_assistant_tokens_schedule") or "adaptive", ("adaptive", "constant"),
                         "DFlash")
    # A block costs one drafter forward, however long it is: its weights' share of a target step where nothing is
    # measured (jaxspec/costs.py times the round's drafting work otherwise, the target's head over the drafts too).
    block_cost = weight_bytes(drafter_model.module) / weight_bytes(target.module)
    tree = tree_shape(request, "DFlash")
    if tree is not None:  # the block's first D drafts, with N // D candidates at each position
        if tree.depth > block:
            raise ValueError(f"tree depth {tree.depth} exceeds the DFlash drafter's block of {block} drafts.")
        drafts = tree.depth
    schedule = make_schedule(kind, drafts, drafts, draft_cost=0.0, round_cost=block_cost,
                             **tree_pricing(tree))
    drafter = BlockDrafter(max_draft=drafts, schedule=schedule, keep_probs=request.keep_probs, tree=tree,
                           feature_layers=tuple(sorted(set(cfg.target_layer_ids))),
                           context_layers=tuple(cfg.target_layer_ids), final_layer=target.config.num_layers - 1)
    return StrategyChoice(DFLASH, drafter, drafter_model)


def _check_draft_vocab(module, vocab_size: int) -> None:
    """Raise unless the drafter's draft vocabulary (if any) names tokens of the target's vocabulary: a config that
    does not say the vocabulary's size (HF muse's) leaves this to the pair."""
    ids = getattr(module, "vocab_ids", None)
    if ids is None:
        return
    largest = int(np.max(np.asarray(ids[...].addressable_data(0))))
    if largest >= vocab_size:
        raise ValueError(f"the DFlash drafter's draft vocabulary (d2t) names token {largest}, outside the target's "
                         f"vocabulary of {vocab_size} tokens.")


DFLASH = Strategy(
    name="dflash",
    summary="a DFlash drafter drafts a block from the target's hidden states in one forward (--assistant PATH)",
    options=(ASSISTANT_MODEL, SPECULATION_TYPE, NUM_ASSISTANT_TOKENS, NUM_ASSISTANT_TOKENS_SCHEDULE,
             ASSISTANT_ENSEMBLE_WEIGHT, TREE),
    build=build,
    selected_by="assistant_model",
    claims=lambda request: is_block_drafter(request.options["assistant_model"]),  # a DFlash checkpoint
)
