"""Speculative decoding with a smaller assistant model that keeps its own KV cache.

The assistant's cache is position-indexed like the target's, and `synced[b]` says how many positions of row b it
holds valid. Each drafting round first catches up: it feeds the committed tokens [synced, L) (after a normal round
one or two: the token the target produced, and the last accepted draft, which was never fed), which also yields
the logits of the first draft; then it drafts one token per step. Rollback after a rejection is a length: `synced`
drops to the last accepted position, and stale entries past it are rewritten before any query can see them.

Catching up from any distance is what lets a row stop drafting while the assistant keeps missing (the adaptive
schedule) without paying an assistant forward per token, and it reads the prompt the same way on the first round:
in a one- or two-token block after a normal round, in the narrowest of 8, 16 or 32 that covers a gap left by idle
rounds, in chunks of the prefill width when further behind (`catch_up_widths`).

Draft length per row: the schedule's length (jaxspec/schedule.py), capped by the row's remaining budget,
stopped early at a token whose draft probability is below `confidence_threshold` (that token is proposed, then
drafting stops, as in HF; the adaptive schedule drops a doubted first draft: `drops_doubted_first`), or after an
EOS. Rows stop independently; the step loop ends as soon as no row is drafting, and a round in which no row drafts
does not run the assistant at all.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import inplace
from ..costs import weight_bytes
from ..sampling import select
from ..schedule import DraftLength, Schedule
from ..tree import candidate_laws, candidate_weights, sibling_tree
from .base import Context, DecodeState, Draft, Drafter, DraftStep, RoundResult, deciding_rows, room_for_drafts
from .spec import (ASSISTANT_MODEL, ASSISTANT_TOKENIZER, DRAFT_LENGTH_OPTIONS, TREE, BuildRequest, Strategy,
                   StrategyChoice, check_assistant, default_prefill_chunk, draft_length, persist_heuristic_length,
                   tree_schedule, tree_shape)

# feed(carry, token[B], positions[B, 1], slot) -> (logits[B, V], carry): run the drafting network on draft `slot`
# (1-based; it sits at position L - 1 + slot) and return its logits, which predict the next draft.
Feed = Callable[[Any, jax.Array, jax.Array, int], tuple[jax.Array, Any]]

# After a round that ends in a rejection the assistant is one committed token behind (the target's correction);
# after one whose drafts were all accepted, two (the last draft, never fed, and the bonus token).
STEADY_CATCH_UP_WIDTHS = (1, 2)
MIDDLE_CATCH_UP_WIDTHS = (8, 16, 32)  # blocks for gaps left by idle rounds (`catch_up_widths`)


def catch_up_widths(chunk: int) -> tuple[int, ...]:
    """The block widths a catch-up chooses from (ascending): 1 and 2 after a normal round, 8, 16, 32, then `chunk`
    for the far behind.

    A row that sat out rounds (the adaptive schedule's idle rows) is as far behind as it sat out, and on a CPU a
    block's cost grows with its width long before the chunk, so the narrowest block that covers the gap is much
    cheaper than a chunk-wide one (`python benchmarks/bench_verify_width.py --widths 1,2,8,16,32,64` times them).
    Most rounds end in a rejection, which leaves one token to catch up on: hence width 1.
    """
    return (*(w for w in (*STEADY_CATCH_UP_WIDTHS, *MIDDLE_CATCH_UP_WIDTHS) if w < chunk), chunk)


@dataclasses.dataclass(frozen=True)
class AutoregressiveDrafter(Drafter):
    """Shared by drafters that run a network one token at a time: the schedule, the confidence stop, the step loop."""

    schedule: Schedule = Schedule()
    confidence_threshold: float = dataclasses.field(default=0.4, compare=False)  # a run-time input
    keep_probs: bool = False  # q is needed for speculative sampling and ensemble verification only

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        return {"initial_draft_length": np.int32(self.schedule.initial),
                "confidence_threshold": np.float32(self.confidence_threshold)}

    @property
    def drops_doubted_first(self) -> bool:
        """Whether a first draft below the confidence threshold is dropped instead of proposed (the adaptive schedule).

        HF proposes a doubted draft, then stops; its schedules here keep that rule. The adaptive schedule keeps it for
        later drafts, whose forward is paid already and which widen the verify block by one token, but drops a
        doubted first draft: proposing it would turn a plain step into a two-token verify block (0.2 of a step on a
        CPU) for a token that is rarely accepted. Such a round proposes nothing, yet paid a drafting step, so the
        schedule counts it as one rejected draft (`update_length`). A sampled first draft is then judged by q
        restricted to the confident tokens, the law it was drawn from."""
        return self.schedule.kind == "adaptive"

    def draft_limit(self, loop: DecodeState, length: DraftLength) -> jax.Array:
        """[B] drafts each row may propose this round: its schedule's length, within its budget."""
        return jnp.minimum(self.schedule.allowed(length, deciding_rows(loop)), room_for_drafts(loop))

    def draft_loop(self, ctx: Context, loop: DecodeState, limit, first_logits, feed: Feed, carry, rng,
                   branching: jax.Array | None = None):
        """Draft from `first_logits` ([B, V], predicting position L), feeding each draft back through `feed`.

        Returns (Draft, carry, feeds); with a tree, the chain and its alternatives, `branching` ([]) per depth. Draft
        i is chosen from the drafter's logits processed with the prefix it extends (committed tokens and drafts
        1..i-1), exactly as the target's logits are processed when verifying.
        """
        k, batch = self.max_draft, loop.lengths.shape[0]
        rows = jnp.arange(batch)

        def step(state):
            i, carry, logits, buffer, tokens, probs, weights, active, count, feeds = state
            processed = ctx.process(logits[:, None], buffer, loop.lengths + i, loop.prompt_lengths)[:, 0]  # [B, V]
            q = jax.nn.softmax(processed, axis=-1)
            key = jax.random.fold_in(rng, i)
            token = select(key, processed, ctx.do_sample)
            confident = q[rows, token] >= ctx.draft_inputs["confidence_threshold"]
            kept = active & (confident | (i > 0) | (not self.drops_doubted_first))
            token = jnp.where(kept, token, 0)
            # A kept first draft under drops_doubted_first was drawn from q conditioned on being confident:
            # verification must judge it by that distribution (q over the confident tokens, renormalised), and a
            # tree's alternatives to it are drawn from it too, for sampling to stay exact.
            doubting = self.drops_doubted_first & (i == 0)
            if self.tree is None:
                candidates = token[:, None]  # [B, 1]
            else:
                candidates = self._alternatives(key, processed, q, token, doubting, ctx)  # [B, F], token first
            tokens = tokens.at[:, i].set(jnp.where(kept[:, None], candidates, 0))
            buffer = buffer.at[rows, loop.lengths + i].set(token, mode="drop")
            if probs is not None or weights is not None:
                if self.drops_doubted_first:
                    confident_q = jnp.where(q >= ctx.draft_inputs["confidence_threshold"], q, 0.0)
                    confident_q = confident_q / jnp.maximum(jnp.sum(confident_q, axis=-1, keepdims=True),
                                                            jnp.finfo(q.dtype).tiny)
                    q = jnp.where(i == 0, confident_q, q)
            if probs is not None:
                probs = probs.at[:, i].set(candidate_laws(q, candidates))
            if weights is not None:
                weights = weights.at[:, i].set(candidate_weights(q, token, self.branches))
            count = count + kept
            active = kept & confident & ~ctx.is_eos(token) & (count < limit)
            # Draft i + 1 needs draft i run through the network; skip that when no row drafts again.
            go_on = jnp.any(active) & (i + 1 < k)

            def feed_draft(carry):
                next_logits, carry = feed(carry, token, (loop.lengths + i)[:, None], i + 1)
                return carry, next_logits

            carry, logits = inplace.cond(go_on, feed_draft, lambda carry: (carry, logits), carry)
            return i + 1, carry, logits, buffer, tokens, probs, weights, active, count, feeds + go_on

        def cond(state):
            i, active = state[0], state[7]
            return (i < k) & jnp.any(active)

        branches = self.branches
        tokens = jnp.zeros((batch, k, branches), jnp.int32)  # [B, K, F]: a chain keeps F = 1 candidate a step
        probs = jnp.zeros((batch, k, branches, first_logits.shape[-1]), jnp.float32) if self.keep_probs else None
        # What a tree with a node budget ranks each depth's candidates by (jaxspec.tree.select_by_probability).
        weights = jnp.zeros((batch, k, branches + 1), jnp.float32) if self.selects else None
        state = (0, carry, first_logits, loop.tokens, tokens, probs, weights, limit > 0, jnp.zeros_like(limit),
                 jnp.zeros((), jnp.int32))
        _, carry, _, _, tokens, probs, weights, _, count, feeds = jax.lax.while_loop(cond, step, state)
        return self._proposal(tokens, count, probs, branching, weights), carry, feeds

    def _alternatives(self, key, processed, q, token, doubting, ctx: Context) -> jax.Array:
        """[B, F]: the step's token, then F - 1 alternatives drawn without replacement from the law it was drawn
        from (q, or q over the confident tokens for a doubted first draft) with it removed: the top F - 1 of those
        logits plus fresh Gumbel noise are exactly such sequential draws (jaxspec.tree.draw_candidates). Greedy: the
        next best tokens."""
        law = jnp.where(doubting & (q < ctx.draft_inputs["confidence_threshold"]), -jnp.inf, processed)
        noise = jax.random.gumbel(jax.random.fold_in(key, 1), processed.shape, jnp.float32) if ctx.do_sample else 0.0
        ranked = (law + noise).at[jnp.arange(token.shape[0]), token].set(jnp.inf)  # the chain's token first
        return jax.lax.top_k(ranked, self.branches)[1].astype(jnp.int32)

    def _proposal(self, tokens, count, probs, branching=None, weights=None) -> Draft:
        """A chain's Draft from [B, K, 1] candidates, or the tree of the chain and its alternatives."""
        if self.tree is not None:
            return Draft.of_tree(sibling_tree(tokens, count, probs, branching, weights, self.tree.nodes))
        return Draft(tokens=tokens[:, :, 0], count=count, probs=None if probs is None else probs[:, :, 0])

    def no_draft(self, loop: DecodeState, vocab: int) -> Draft:
        batch, k, branches = loop.lengths.shape[0], self.max_draft, self.branches
        probs = jnp.zeros((batch, k, branches, vocab), jnp.float32) if self.keep_probs else None
        weights = jnp.zeros((batch, k, branches + 1), jnp.float32) if self.selects else None
        return self._proposal(jnp.zeros((batch, k, branches), jnp.int32), jnp.zeros((batch,), jnp.int32), probs,
                              weights=weights)

    def update_length(self, length: DraftLength, result: RoundResult) -> DraftLength:
        if self.drops_doubted_first:
            # A row that meant to draft but doubted its first token proposed nothing, yet paid a drafting step: the
            # schedule counts it as one rejected draft (for an idle row, a missed probe), or a drafter that keeps
            # doubting would run every round and learn nothing.
            running = result.committed > 0
            doubted = (self.schedule.allowed(length, result.rows_deciding()) > 0) & (result.drafted == 0) & running
            result = dataclasses.replace(result, drafted=jnp.where(doubted, 1, result.drafted))
        return self.schedule.update(length, result, self.max_draft)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftModelState:
    cache: Any  # the assistant's KV cache
    synced: jax.Array  # [B] positions [0, synced) of the assistant cache hold committed tokens
    length: DraftLength


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(AutoregressiveDrafter):
    catch_up_width: int = 64  # the chunk width when the assistant is far behind (the prompt, after skipped rounds)

    def init(self, ctx: Context, batch: int, size: int) -> DraftModelState:
        return DraftModelState(cache=ctx.assistant.init_cache(batch, size), synced=jnp.zeros((batch,), jnp.int32),
                               length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]))

    def draft(self, ctx: Context, loop: DecodeState, state: DraftModelState, rng):
        assistant = ctx.assistant
        limit = self.draft_limit(loop, state.length)

        def run(state: DraftModelState):
            logits, cache, catch_up_forwards = catch_up(ctx.assistant, loop.tokens, state.synced, loop.lengths,
                                                        state.cache, catch_up_widths(self.catch_up_width))

            def feed(cache, token, positions, slot):
                logits, _, cache = assistant(token[:, None], positions, cache)
                return logits[:, 0], cache

            branching = self.schedule.branching(state.length, deciding_rows(loop))
            draft, cache, feeds = self.draft_loop(ctx, loop, limit, logits, feed, cache, rng, branching)
            # Valid if every draft is accepted: the committed tokens, then drafts 1..count-1 (the last one is never
            # fed; a tree's count is its nodes, F per drafted step). `update` lowers this to what was accepted.
            synced = loop.lengths + jnp.maximum(draft.count // self.branches - 1, 0)
            return dataclasses.replace(state, cache=cache, synced=synced), (draft, catch_up_forwards + feeds)

        def skip(state: DraftModelState):
            return state, (self.no_draft(loop, ctx.target.cfg.vocab_size), jnp.zeros((), jnp.int32))

        state, (draft, forwards) = inplace.cond(jnp.any(limit > 0), run, skip, state)
        return DraftStep(draft=draft, state=state, forwards=forwards, target_cache=loop.cache)

    def update(self, ctx: Context, state: DraftModelState, result: RoundResult) -> DraftModelState:
        # The entry at the new L-1 holds a rejected draft (or nothing): only positions below it stay valid; after a
        # tree's alternative was committed, only the chain's drafts before it (`on_chain`) are the row's tokens.
        first = result.lengths - result.committed  # the round's first committed position
        synced = jnp.minimum(state.synced, jnp.minimum(result.lengths - 1, first + result.on_chain))
        return dataclasses.replace(state, synced=synced, length=self.update_length(state.length, result))

    def summary(self, state: DraftModelState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}


def catch_up(assistant, tokens: jax.Array, synced: jax.Array, lengths: jax.Array, cache, widths: tuple[int, ...]):
    """Feed `tokens` [B, S] at positions [synced, lengths) to `assistant`, whose cache holds [0, synced):
    -> (its logits at position lengths - 1 [B, V], cache, forwards).

    Each step runs a block of the narrowest width in `widths` (ascending) that covers the row furthest behind, or
    the last width when it is further behind than that; rows that are done rewrite their entries at or past their
    length, which the position-indexed cache overwrites before any query reads them.

    The LM head runs once, on each row's last hidden state, not on every position of every block: on SmolLM2 the
    head is a fifth of the network, and a catch-up block is compute-bound on a CPU.
    """
    batch, size = tokens.shape
    rows = jnp.arange(batch)

    def block(width: int):
        def run(carry):
            cache, synced, last_hidden = carry
            positions = synced[:, None] + jnp.arange(width)[None, :]  # [B, W]
            block_tokens = jnp.take_along_axis(tokens, jnp.clip(positions, 0, size - 1), axis=1)
            _, hidden, cache = assistant(block_tokens, positions, cache)  # the unread logits are dead code
            has_last = (lengths - 1 >= synced) & (lengths - 1 < synced + width)
            last = hidden[rows, jnp.clip(lengths - 1 - synced, 0, width - 1)]  # [B, D]
            return (cache, jnp.minimum(synced + width, lengths), jnp.where(has_last[:, None], last, last_hidden)), ()

        return run

    def body(carry):
        forwards, *inner = carry
        behind = jnp.max(lengths - inner[1])
        index = jnp.minimum(jnp.searchsorted(jnp.asarray(widths[:-1]), behind), len(widths) - 1)
        inner, _ = inplace.switch(index, [block(w) for w in widths], tuple(inner))
        return (forwards + 1, *inner)

    hidden = jax.eval_shape(lambda t: assistant.final_hidden(assistant.embed_tokens(t)), tokens[:, :1])  # [B, 1, D]
    start = (jnp.zeros((), jnp.int32), cache, synced, jnp.zeros((batch, hidden.shape[-1]), hidden.dtype))
    forwards, cache, _, last_hidden = jax.lax.while_loop(lambda c: jnp.any(c[2] < lengths), body, start)
    return assistant.logits(last_hidden), cache, forwards


def assistant_settings(request: BuildRequest) -> dict:
    """The drafter settings of an assistant with its own KV cache (this strategy and universal decoding)."""
    assistant = request.options["assistant_model"]
    check_assistant(assistant)
    cost = weight_bytes(assistant.module) / weight_bytes(request.model.module)
    max_draft, schedule, threshold = draft_length(assistant, request, cost)
    return dict(max_draft=max_draft, schedule=schedule, confidence_threshold=threshold,
                keep_probs=request.keep_probs, catch_up_width=request.prefill_chunk or default_prefill_chunk())


def build(request: BuildRequest) -> StrategyChoice:
    settings = assistant_settings(request)
    tree = tree_shape(request, "speculative decoding")
    if tree is not None:  # the assistant drafts a chain as deep as the tree, keeping N // D candidates per step
        settings |= dict(max_draft=tree.depth, tree=tree, schedule=tree_schedule(settings["schedule"], tree))
    return StrategyChoice(SPECULATIVE, DraftModelDrafter(**settings), request.options["assistant_model"])


SPECULATIVE = Strategy(
    name="speculative",
    summary="a smaller assistant model with the target's tokenizer drafts (--assistant PATH)",
    selected_by="assistant_model",
    options=(ASSISTANT_MODEL, ASSISTANT_TOKENIZER, *DRAFT_LENGTH_OPTIONS, TREE),
    build=build,
    persist=persist_heuristic_length,
)

