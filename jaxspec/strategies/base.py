"""The drafter interface and the loop state it reads.

A strategy is a drafter: a frozen dataclass of static settings with pure functions over its own state pytree.
The decode loop calls, each round:

    draft(ctx, loop, state, rng) -> (Draft, state, forwards, target cache)   propose up to K tokens per row
    update(ctx, state, result)   -> state                 learn what was committed (roll caches back, adapt K)

and `init(ctx, prefill)` once after the target has read the prompt. `Draft.probs is None` means deterministic
drafts (one-hot q), which is what keeps sampling exact for n-gram and argmax drafters.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from ..cache import KVCache
from ..sampling import SamplingParams


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    tokens: jax.Array  # [B, K] proposed tokens; entries at or past `count` are padding
    count: jax.Array  # [B] int32, number of valid drafts per row (0 means a plain decoding step)
    probs: jax.Array | None = None  # [B, K, V] processed draft distribution q, or None for deterministic drafts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Counters:
    rounds: jax.Array  # [] verification rounds (target forwards after the prefill)
    draft_forwards: jax.Array  # [] drafter network forwards (0 for model-free drafters)
    drafted: jax.Array  # [B] valid draft tokens proposed to each row
    accepted: jax.Array  # [B] draft tokens the target accepted
    accepted_hist: jax.Array  # [B, K+1] rounds in which a row accepted exactly i drafts

    @staticmethod
    def zeros(batch: int, max_draft: int) -> "Counters":
        zero = jnp.zeros((), jnp.int32)
        return Counters(
            rounds=zero,
            draft_forwards=zero,
            drafted=jnp.zeros((batch,), jnp.int32),
            accepted=jnp.zeros((batch,), jnp.int32),
            accepted_hist=jnp.zeros((batch, max_draft + 1), jnp.int32),
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The while_loop carry. Invariant: row b has committed tokens[b, :lengths[b]]; the target cache holds
    positions [0, lengths[b] - 1) (the newest token is fed in the next round)."""

    tokens: jax.Array  # [B, S] prompt (left-aligned) + generated tokens, pad after lengths
    lengths: jax.Array  # [B]
    prompt_lengths: jax.Array  # [B]
    budget_end: jax.Array  # [B] prompt length + max_new_tokens: a row is done when its length reaches it
    done: jax.Array  # [B] bool
    cache: KVCache
    drafter: Any  # the drafter's own state pytree
    rng: jax.Array
    counters: Counters

    @property
    def last_token(self) -> jax.Array:  # [B]
        return jnp.take_along_axis(self.tokens, self.lengths[:, None] - 1, axis=1)[:, 0]


@dataclasses.dataclass(frozen=True)
class Prefill:
    """What the target produced reading the prompt: final-normed hidden states [B, Tp, D], and the state."""

    hidden: jax.Array
    state: DecodeState


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundResult:
    """One verified round, per row: what was accepted and committed, and the target's view of it."""

    drafted: jax.Array  # [B] valid drafts the row proposed this round
    accepted: jax.Array  # [B] drafts accepted by verification (before the budget / EOS crop)
    committed: jax.Array  # [B] tokens appended this round (0 for finished rows)
    tokens: jax.Array  # [B, K+1] the round's verified tokens (accepted drafts, then the target's token)
    hidden: jax.Array  # [B, K+1, D] target final-normed hidden states at [last, d_1 .. d_K] (padded)
    lengths: jax.Array  # [B] lengths after the commit


@dataclasses.dataclass(frozen=True)
class Context:
    """Everything a drafter may read that is not loop state. Built inside the traced function."""

    target: nnx.Module
    assistant: nnx.Module | None
    sampling: SamplingParams
    eos_ids: tuple[int, ...]
    pad_id: int


@dataclasses.dataclass(frozen=True)
class Drafter:
    """Base class: the k = 0 drafter (plain decoding). Subclasses override what they need."""

    max_draft: int = 0  # K, the static size of every draft buffer
    provides_probs: bool = False

    def init(self, ctx: Context, prefill: Prefill) -> Any:
        return ()

    def draft(self, ctx: Context, loop: DecodeState, state: Any, rng: jax.Array):
        """-> (draft, new state, drafter network forwards this round, target cache).

        Only drafters that run the target's own layers (early exit) return a changed target cache.
        """
        batch = loop.lengths.shape[0]
        empty = Draft(tokens=jnp.zeros((batch, self.max_draft), jnp.int32), count=jnp.zeros((batch,), jnp.int32))
        return empty, state, jnp.zeros((), jnp.int32), loop.cache

    def update(self, ctx: Context, state: Any, result: RoundResult) -> Any:
        return state

    def summary(self, state: Any) -> dict[str, jax.Array]:
        """Small per-row arrays worth returning to the caller (e.g. the adapted draft length)."""
        return {}

    def target_forward(self, ctx: Context, tokens, positions, cache, state):
        """The verifying forward: `(logits, hidden, cache)`. Early exit overrides it to reuse its layers."""
        return ctx.target(tokens, positions, cache)
