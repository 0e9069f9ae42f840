"""The drafter interface, the loop state it reads, and the draft-length schedules every drafter shares.

A strategy is a drafter: a frozen dataclass of static settings with pure functions over its own state pytree.

    init(ctx, batch, size)         -> state     before the prompt is read
    prefill_chunk(ctx, state, chunk) -> state   once per chunk of the prompt the target reads (its hidden states)
    draft(ctx, loop, state, rng)   -> (Draft, state, forwards, target cache)   propose up to K tokens per row
    update(ctx, state, result)     -> state     learn what was committed (roll caches back, adapt the length)

`Draft.probs is None` means deterministic drafts (one-hot q), which is what keeps sampling exact for n-gram drafts.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ..cache import KVCache
from ..processors import History, Processing, process

SCHEDULES = ("adaptive", "constant", "heuristic", "heuristic_transient")
# Adaptive schedule: a row that keeps missing stops drafting for 1, 2, 4, ... rounds, at most this many.
MAX_COOLDOWN = 32


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

    tokens: jax.Array  # [B, S] prompt (left-aligned) + generated tokens
    lengths: jax.Array  # [B]
    prompt_lengths: jax.Array  # [B]
    budget_end: jax.Array  # [B] prompt length + max_new_tokens: a row is done when its length reaches it
    done: jax.Array  # [B] bool
    cache: KVCache
    drafter: Any  # the drafter's own state pytree
    rng: jax.Array
    counters: Counters
    scores: jax.Array | None = None  # [B, N, V] processed target logits of each new token (return_logits only)

    @property
    def last_token(self) -> jax.Array:  # [B]
        return jnp.take_along_axis(self.tokens, self.lengths[:, None] - 1, axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One chunk of the prompt as the target read it (every row reads the same positions)."""

    tokens: jax.Array  # [B, C]
    positions: jax.Array  # [B, C]
    hidden: jax.Array  # [B, C, D] the target's final-normed hidden states
    valid: jax.Array  # [B, C] bool: a prompt position (past a row's prompt the chunk holds padding)


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
    processing: Processing  # run-time logits settings (arrays)
    do_sample: bool
    ngram_slots: int
    draft_inputs: dict[str, jax.Array]  # the drafter's run-time settings (`Drafter.runtime_inputs`)
    head: jax.Array | None = None  # [D, V] the target's head for verifying forwards, on CPU (jaxspec/head.py)

    def process(self, logits: jax.Array, tokens: jax.Array, start: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
        """Processed logits [B, W, V] for positions whose prefix is tokens[b, :start[b] + j]."""
        history = History(tokens=tokens, start=start, prompt_lengths=prompt_lengths)
        return process(logits, history, self.processing, self.do_sample, self.ngram_slots)

    def is_eos(self, tokens: jax.Array) -> jax.Array:
        return jnp.isin(tokens, self.processing.eos)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftLength:
    """Each row's draft-length schedule state."""

    num_tokens: jax.Array  # [B] the row's draft length (constant, heuristic), or the adaptive schedule's last choice
    misses: jax.Array  # [B] adaptive: probes in a row that accepted nothing
    cooldown: jax.Array  # [B] adaptive: rounds until the next probe, while drafting does not pay
    accepted: jax.Array  # [B] float, adaptive: decayed count of accepted drafts (prior pseudo-counts included)
    judged: jax.Array  # [B] float, adaptive: decayed count of drafts verification judged (accepted or the rejected one)


def verify_widths(max_draft: int) -> tuple[int, ...]:
    """The static widths a verify block may have: 1, the powers of two below K + 1, and K + 1. Each compiles once
    (jaxspec.generate picks the narrowest that holds a round's drafts)."""
    k1 = max_draft + 1
    return tuple(sorted({1, k1} | {2**i for i in range(k1.bit_length()) if 2**i < k1}))


def default_verify_costs(widths: tuple[int, ...]) -> tuple[float, ...]:
    """The cost of a verify block of each width, in plain decoding steps (width 1 = 1), as the adaptive schedule
    assumes it where costs are not measured (`JAXSPEC_STEP_COSTS=default`, sharded runs; jaxspec/costs.py measures
    them otherwise, because they move with the machine: a two-token Qwen2.5-Coder-0.5B block cost 1.16 plain steps
    one day and 1.81 another on the same 2-core build machine).

    On a CPU the second token costs most: a plain step's matrix-vector products stream the weights at memory speed,
    while a matrix multiply of 2 rows runs a compute kernel. `python scripts/bench_verify_width.py` (2 idle cores,
    float32, forwards in a compiled loop) gave 1.14 / 1.23 / 1.33 / 1.45 for 2 / 3 / 4 / 8 tokens on SmolLM2-135M
    (with the CPU verify head of jaxspec/head.py) and 1.16 / 1.23 / 1.28 / 1.48 on Qwen2.5-Coder-0.5B on the faster
    day; the default, from an earlier run on SmolLM2 (1.23 / 1.29 / 1.36 / 1.55), errs on the dear side of those. On
    accelerators a few extra tokens are nearly free while decoding is memory-bound."""
    if jax.default_backend() == "cpu":
        return tuple(1.0 if w == 1 else 1.2 + 0.05 * (w - 2) for w in widths)
    return tuple(1.0 + 0.02 * (w - 1) for w in widths)


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a row's draft length follows what verification accepted.

    - "adaptive" (jaxspec's default for every drafter): each row keeps a decayed estimate of the probability that a
      draft is accepted (its `accepted` / `judged` counts, with a prior). Each round it drafts the number of tokens
      that maximises expected tokens per cost: a block of d drafts commits (1 - a^(d+1)) / (1 - a) tokens on average
      and costs `verify_costs` of its width plus `draft_cost` per draft (drafting-model steps, in target steps). When
      no length beats a plain step, the row does not draft, except for a one-draft probe after 1, 2, 4, ... up to
      MAX_COOLDOWN rounds (doubling while probes miss; `probe_spacing` times longer for drafters whose probe costs
      more), so that text which starts to repeat is noticed. On text the drafter cannot predict, drafting therefore
      costs one cheap probe every ~33 rounds; on text it predicts, rows draft the length that pays best.
    - "constant": always K (HF's default for assistants, and what HF's prompt lookup does).
    - "heuristic" / "heuristic_transient": HF's rule, +2 after a round in which every draft was accepted (a round
      without drafts counts, as in HF), else -1, never below 1, capped by K.
    """

    kind: str = "adaptive"
    # The first round's draft length (1..K) of constant and heuristic schedules. A run-time input of the loop
    # (`Drafter.runtime_inputs`), not part of the compiled program: HF's "heuristic" schedule changes it every call.
    initial: int = dataclasses.field(default=1, compare=False)
    widths: tuple[int, ...] = ()  # the verify widths of the loop (adaptive); () means the cap alone decides
    verify_costs: tuple[float, ...] = ()  # the cost of each width, in plain steps
    draft_cost: float = 0.0  # the cost of proposing one draft, in plain steps (0 for copied drafts)

    PRIOR_ACCEPTANCE = 0.6  # before any evidence, a row assumes this acceptance ...
    PRIOR_WEIGHT = 2.0  # ... worth this many judged drafts
    DECAY = 0.8  # evidence from each earlier drafting round counts this much less
    PROBE_UNIT = 0.1  # probes that cost up to this (in plain steps) back off 1, 2, 4, ... MAX_COOLDOWN rounds

    def init(self, batch: int, initial: jax.Array) -> DraftLength:
        zeros = jnp.zeros((batch,), jnp.int32)
        # The prior enters as pseudo-counts that decay like evidence: a row that keeps missing drives its estimate
        # to zero (a fixed prior would keep it above the break-even of cheap verify blocks forever).
        prior = jnp.full((batch,), self.PRIOR_WEIGHT, jnp.float32)
        return DraftLength(num_tokens=jnp.full((batch,), initial, jnp.int32), misses=zeros, cooldown=zeros,
                           accepted=self.PRIOR_ACCEPTANCE * prior, judged=prior)

    @property
    def probe_spacing(self) -> int:
        """How many times longer than 1, 2, 4, ... rounds a row waits between probes: a probe that costs more than
        PROBE_UNIT of a plain step (a draft plus a two-token verify block) comes that many times less often, so
        that idle probing stays within a few percent for any drafter."""
        if 2 not in self.widths:
            return 1
        probe_cost = self.verify_costs[self.widths.index(2)] - 1 + self.draft_cost
        return max(1, math.ceil(probe_cost / self.PROBE_UNIT - 1e-9))

    def acceptance(self, state: DraftLength) -> jax.Array:
        """[B] each row's estimated probability that a draft is accepted."""
        return state.accepted / state.judged

    def allowed(self, state: DraftLength) -> jax.Array:
        """[B] how many drafts each row may propose this round."""
        if self.kind != "adaptive" or not self.widths:
            return state.num_tokens
        best = self.paying_length(state)
        return jnp.where(best > 0, best, jnp.where(state.cooldown == 0, 1, 0))  # else a one-draft probe, at times

    def probing(self, state: DraftLength) -> jax.Array:
        """[B] bool: the row drafts this round only as a probe (adaptive: drafting does not pay, cooldown over)."""
        if self.kind != "adaptive" or not self.widths:
            return jnp.zeros(state.num_tokens.shape, bool)
        return (self.paying_length(state) == 0) & (state.cooldown == 0)

    def paying_length(self, state: DraftLength) -> jax.Array:
        """[B] the draft length with the most expected tokens per cost (adaptive); 0 when drafting does not pay."""
        drafts = jnp.asarray(self.widths, jnp.float32) - 1  # [N] the drafts each width holds
        rate = jnp.clip(self.acceptance(state), 0.0, 0.999)[:, None]  # [B, 1]
        expected = (1 - rate ** (drafts + 1)) / (1 - rate)  # [B, N] tokens a round commits
        cost = jnp.asarray(self.verify_costs, jnp.float32) + self.draft_cost * drafts
        return jnp.asarray(self.widths)[jnp.argmax(expected / cost, axis=-1)] - 1

    def update(self, state: DraftLength, result: RoundResult, cap: int) -> DraftLength:
        """`cap`: K, the static size of the draft buffer."""
        active = result.committed > 0  # finished rows keep their state
        if self.kind == "constant":
            return state
        if self.kind in ("heuristic", "heuristic_transient"):
            grown = jnp.where(result.accepted == result.drafted, state.num_tokens + 2,
                              jnp.maximum(state.num_tokens - 1, 1))
            return dataclasses.replace(state, num_tokens=jnp.where(active, jnp.minimum(grown, cap),
                                                                   state.num_tokens))
        tried = active & (result.drafted > 0)
        judged = result.accepted + (result.accepted < result.drafted)  # the accepted ones, then the rejected one
        accepted = jnp.where(tried, self.DECAY * state.accepted + result.accepted, state.accepted)
        judged = jnp.where(tried, self.DECAY * state.judged + judged, state.judged)
        probed = tried & (result.drafted == 1) & (state.cooldown == 0)  # only a probe can draft one while idle
        missed = probed & (result.accepted == 0)
        misses = jnp.where(missed, state.misses + 1, jnp.where(tried & (result.accepted > 0), 0, state.misses))
        backoff = jnp.minimum(jnp.left_shift(1, jnp.clip(misses - 1, 0, 8)), MAX_COOLDOWN) * self.probe_spacing
        cooldown = jnp.where(missed, backoff,
                             jnp.where(active & ~tried, jnp.maximum(state.cooldown - 1, 0), state.cooldown))
        num_tokens = jnp.where(tried, result.drafted, state.num_tokens)
        return DraftLength(num_tokens=num_tokens, misses=misses, cooldown=cooldown, accepted=accepted, judged=judged)


@dataclasses.dataclass(frozen=True)
class Drafter:
    """Base class: the k = 0 drafter (plain decoding). Subclasses override what they need."""

    max_draft: int = 0  # K, the static size of every draft buffer

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        """Settings that enter the loop as arrays, so new values reuse the executable. A drafter reads them from
        `ctx.draft_inputs`, never from its own fields (which are excluded from the compile key: `compare=False`)."""
        return {}

    def for_prompts(self, prompts: list[np.ndarray], size: int) -> "Drafter":
        """The drafter for one call, on the host before anything compiles: it may read the prompts (each row's
        ids) and the token buffer size. Universal decoding re-encodes the prompts for its assistant here."""
        return self

    def init(self, ctx: Context, batch: int, size: int) -> Any:
        return ()

    def prefill_chunk(self, ctx: Context, state: Any, chunk: PrefillChunk) -> Any:
        return state

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
        return ctx.target(tokens, positions, cache, head=ctx.head)


def room_for_drafts(loop: DecodeState) -> jax.Array:
    """[B] drafts a row can still use: never more than its budget allows after the target's own token."""
    return jnp.where(loop.done, 0, jnp.maximum(loop.budget_end - loop.lengths - 1, 0))
