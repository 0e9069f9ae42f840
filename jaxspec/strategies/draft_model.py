"""Speculative decoding with a smaller assistant model that keeps its own KV cache.

Each round the assistant re-reads the last two committed tokens at positions [L-2, L-1], then drafts one token per
step. Re-reading two tokens is what makes rollback free: whatever was accepted last round, every assistant cache
entry below L-2 holds a committed token (accepted drafts were fed while drafting; the bonus token and, after a
fully accepted round, the last draft were not), and entries at L-2 and above are rewritten now.

Draft length per row: `num_tokens` (adapted by the heuristic schedules), capped by the row's remaining budget,
stopped early after a token whose draft probability is below `confidence_threshold` (that token is kept), or after
an EOS. Rows stop independently; the step loop ends as soon as no row is drafting.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from ..sampling import process_logits, sample
from .base import Context, DecodeState, Draft, Drafter, Prefill, RoundResult

SCHEDULES = ("constant", "heuristic", "heuristic_transient")

# feed(carry, token[B], positions[B, 1], slot) -> (logits[B, V], carry): run the drafting network on one token.
Feed = Callable[[Any, jax.Array, jax.Array, int], tuple[jax.Array, Any]]


@dataclasses.dataclass(frozen=True)
class AutoregressiveDrafter(Drafter):
    """Shared by drafters that run a network one token at a time: draft-length settings, the step loop, and the
    heuristic schedule. `num_tokens` in the state is each row's current draft length."""

    num_assistant_tokens: int = 20
    schedule: str = "constant"
    confidence_threshold: float = 0.4
    keep_probs: bool = False  # q is needed for speculative sampling and ensemble verification only

    def initial_num_tokens(self, batch: int) -> jax.Array:
        return jnp.full((batch,), min(self.num_assistant_tokens, self.max_draft), jnp.int32)

    def draft_loop(self, ctx: Context, loop: DecodeState, num_tokens, first_logits, feed: Feed, carry, rng):
        """Draft from `first_logits` ([B, V], predicting position L), feeding each draft back through `feed`.

        Returns (Draft, carry, forwards), where forwards counts `feed` calls plus the one that made first_logits.
        """
        k, batch = self.max_draft, loop.lengths.shape[0]
        rows = jnp.arange(batch)
        # HF: never draft more than the row can still commit, keeping one slot for the target's own token.
        limit = jnp.where(loop.done, 0, jnp.minimum(num_tokens, loop.budget_end - loop.lengths - 1))  # [B]
        eos_ids = jnp.asarray(ctx.eos_ids or (-1,), jnp.int32)
        rngs = jax.random.split(rng, k)

        def next_token(logits, step_rng):  # [B, V] -> token [B], q(token) [B], q [B, V]
            processed = process_logits(logits, ctx.sampling)
            probs = jax.nn.softmax(processed, axis=-1)
            token = sample(step_rng, processed) if ctx.sampling.do_sample else jnp.argmax(logits, -1).astype(jnp.int32)
            return token, probs[rows, token], probs

        def record(i, logits, tokens, probs, active, count):
            """Draft token i; keep it for rows still drafting; decide which rows draft again."""
            token, q_token, q = next_token(logits, rngs[i])
            tokens = tokens.at[:, i].set(jnp.where(active, token, 0))
            if probs is not None:
                probs = probs.at[:, i].set(q)
            count = count + active
            keep_going = (q_token >= self.confidence_threshold) & ~jnp.isin(token, eos_ids) & (count < limit)
            return token, tokens, probs, active & keep_going, count

        tokens = jnp.zeros((batch, k), jnp.int32)  # [B, K]
        probs = jnp.zeros((batch, k, first_logits.shape[-1]), jnp.float32) if self.keep_probs else None
        token, tokens, probs, active, count = record(0, first_logits, tokens, probs, limit > 0, jnp.zeros_like(limit))

        def cond(state):
            i, _, _, _, _, active, _ = state
            return (i < k) & jnp.any(active)

        def step(state):
            i, carry, token, tokens, probs, active, count = state
            positions = (loop.lengths - 1 + i)[:, None]  # draft i sits at position L - 1 + i
            logits, carry = feed(carry, token, positions, i)
            token, tokens, probs, active, count = record(i, logits, tokens, probs, active, count)
            return i + 1, carry, token, tokens, probs, active, count

        state = (1, carry, token, tokens, probs, active, count)
        forwards, carry, _, tokens, probs, _, count = jax.lax.while_loop(cond, step, state)
        return Draft(tokens=tokens, count=count, probs=probs), carry, jnp.asarray(forwards, jnp.int32)

    def update(self, ctx: Context, state: Any, result: RoundResult) -> Any:
        if self.schedule == "constant":
            return state
        # HF's heuristic: +2 after a round in which every draft was accepted, else -1, never below 1. The growth is
        # capped by the static draft buffer K (max_assistant_tokens).
        grown = jnp.where(result.accepted == result.drafted, state.num_tokens + 2, jnp.maximum(state.num_tokens - 1, 1))
        num_tokens = jnp.where(result.committed > 0, jnp.minimum(grown, self.max_draft), state.num_tokens)
        return dataclasses.replace(state, num_tokens=num_tokens)

    def summary(self, state: Any) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.num_tokens}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftModelState:
    cache: Any  # the assistant's KV cache
    num_tokens: jax.Array  # [B]


@dataclasses.dataclass(frozen=True)
class DraftModelDrafter(AutoregressiveDrafter):
    def init(self, ctx: Context, prefill: Prefill) -> DraftModelState:
        loop = prefill.state
        batch, bucket = loop.tokens.shape[0], prefill.hidden.shape[1]
        cache = ctx.assistant.init_cache(batch, loop.tokens.shape[1])
        positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
        _, cache = ctx.assistant.run_layers(ctx.assistant.embed_tokens(loop.tokens[:, :bucket]), positions, cache)
        return DraftModelState(cache=cache, num_tokens=self.initial_num_tokens(batch))

    def draft(self, ctx: Context, loop: DecodeState, state: DraftModelState, rng):
        assistant = ctx.assistant
        # Step 0 re-reads the last two committed tokens (see the module docstring).
        two_positions = loop.lengths[:, None] + jnp.array([-2, -1])  # [B, 2]
        two_tokens = jnp.take_along_axis(loop.tokens, two_positions, axis=1)
        logits, _, cache = assistant(two_tokens, two_positions, state.cache)

        def feed(cache, token, positions, slot):
            logits, _, cache = assistant(token[:, None], positions, cache)
            return logits[:, 0], cache

        draft, cache, forwards = self.draft_loop(ctx, loop, state.num_tokens, logits[:, -1], feed, cache, rng)
        return draft, dataclasses.replace(state, cache=cache), forwards, loop.cache
