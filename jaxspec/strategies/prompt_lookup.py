"""Prompt lookup decoding: copy the continuation of an earlier occurrence of the sequence's last n-gram.

Same choice as HF's `PromptLookupCandidateGenerator`, computed in-graph with static shapes for every row at once:
search the row's committed tokens (prompt and output so far) for the last n tokens, n from `max_ngram` down to
`min_ngram` (1 in HF; a larger minimum ignores short matches, which on free text propose more than they land);
the largest n with a match wins, and among its matches the earliest; propose the tokens that followed it, never
past the end of the sequence, and stop before an EOS (a continuation that starts with EOS proposes nothing, without
trying another match). No match means a plain decoding step for that row.

How many tokens to propose follows the row's schedule (jaxspec/schedule.py). HF has no schedule here: it always
proposes up to `prompt_lookup_num_tokens` (jaxspec's "constant"). jaxspec's default, "adaptive", proposes fewer
after misses and more after hits, and stops proposing while a row keeps missing, because a wide verify block costs
more than a one-token step on a CPU: copying then never makes text that does not copy slower than plain decoding.

The drafts are deterministic (one-hot q), so verification by matching target samples keeps sampling exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..schedule import DraftLength, Schedule, make_schedule
from .base import Context, DecodeState, Draft, Drafter, DraftStep, RoundResult, room_for_drafts
from .spec import (NUM_ASSISTANT_TOKENS_SCHEDULE, BuildRequest, Option, Strategy, StrategyChoice, check_positive_int,
                   schedule_kind)


def find_continuation(tokens: jax.Array, length: jax.Array, max_ngram: int,
                      min_ngram: int = 1) -> tuple[jax.Array, jax.Array]:
    """One row: tokens [S], length [] -> (start of the continuation to copy [], whether a match exists []).

    The continuation starts right after the matched n-gram; it must be non-empty, i.e. start < length.
    """
    size = tokens.shape[0]
    starts = jnp.arange(size)  # candidate n-gram start positions j
    found, best = jnp.bool_(False), jnp.int32(0)
    for n in range(max_ngram, min_ngram - 1, -1):  # largest n first; a found larger n blocks smaller ones
        matches = (starts + n < length) & (n <= length - 1)  # non-empty continuation; HF: n <= length - 1
        for m in range(n):
            shifted = jnp.roll(tokens, -m)  # shifted[j] = tokens[j + m] (wraps only where j + n >= length)
            matches &= shifted == tokens[length - n + m]
        first = jnp.argmax(matches)  # earliest match
        take = ~found & jnp.any(matches)
        best = jnp.where(take, first + n, best)
        found = found | take
    return best, found


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
    max_ngram: int = 2
    min_ngram: int = 1
    schedule: Schedule = Schedule()

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        return {"initial_draft_length": np.int32(self.schedule.initial)}

    def init(self, ctx: Context, batch: int, size: int) -> DraftLength:
        return self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"])

    def draft(self, ctx: Context, loop: DecodeState, state: DraftLength, rng):
        k = self.max_draft
        start, found = jax.vmap(find_continuation, in_axes=(0, 0, None, None))(loop.tokens, loop.lengths,
                                                                             self.max_ngram, self.min_ngram)
        offsets = start[:, None] + jnp.arange(k)[None, :]  # [B, K]
        tokens = jnp.take_along_axis(loop.tokens, jnp.minimum(offsets, loop.tokens.shape[1] - 1), axis=1)
        valid = found[:, None] & (offsets < loop.lengths[:, None])  # never copy past the sequence's end
        valid &= jnp.cumsum(ctx.is_eos(tokens), axis=1) == 0  # stop before an EOS
        count = jnp.sum(jnp.cumprod(valid, axis=1), axis=1).astype(jnp.int32)
        # Drafts past the row's budget could never be committed: do not pay to verify them.
        count = jnp.minimum(count, jnp.minimum(self.schedule.allowed(state, ~loop.done), room_for_drafts(loop)))
        return DraftStep(draft=Draft(tokens=tokens, count=count), state=state, forwards=jnp.zeros((), jnp.int32),
                         target_cache=loop.cache)

    def update(self, ctx: Context, state: DraftLength, result: RoundResult) -> DraftLength:
        return self.schedule.update(state, result, self.max_draft)

    def summary(self, state: DraftLength) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.num_tokens}


PROMPT_LOOKUP_NUM_TOKENS = Option("prompt_lookup_num_tokens", "most tokens copied per round (K)", default=10)
MAX_MATCHING_NGRAM_SIZE = Option("max_matching_ngram_size", "longest n-gram matched (transformers' default 2)")
MIN_MATCHING_NGRAM_SIZE = Option("min_matching_ngram_size", "shortest n-gram matched (default 1, as transformers)")


def build(request: BuildRequest) -> StrategyChoice:
    k = request.get(PROMPT_LOOKUP_NUM_TOKENS)
    check_positive_int("prompt_lookup_num_tokens", k)
    ngram = request.options.get("max_matching_ngram_size") or 2  # HF: `or 2`, so 0 also means 2
    check_positive_int("max_matching_ngram_size", ngram)
    shortest = request.options.get("min_matching_ngram_size", 1)
    check_positive_int("min_matching_ngram_size", shortest)
    if shortest > ngram:
        raise ValueError(f"min_matching_ngram_size ({shortest}) exceeds max_matching_ngram_size ({ngram}).")
    kind = schedule_kind(request.options.get("num_assistant_tokens_schedule") or "adaptive", ("adaptive", "constant"),
                         "prompt lookup")
    drafter = PromptLookupDrafter(max_draft=k, max_ngram=ngram, min_ngram=shortest,
                                  schedule=make_schedule(kind, k, k, draft_cost=0.0))
    return StrategyChoice(PROMPT_LOOKUP, drafter)


PROMPT_LOOKUP = Strategy(
    name="prompt_lookup",
    summary="copy the continuation of an n-gram match in the prompt and output so far",
    selected_by="prompt_lookup_num_tokens",
    options=(PROMPT_LOOKUP_NUM_TOKENS, MAX_MATCHING_NGRAM_SIZE, MIN_MATCHING_NGRAM_SIZE,
             NUM_ASSISTANT_TOKENS_SCHEDULE),
    build=build,
)
