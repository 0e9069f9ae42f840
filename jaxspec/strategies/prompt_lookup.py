"""Prompt lookup decoding: copy the continuation of an earlier occurrence of the sequence's last n-gram.

Same choice as HF's `PromptLookupCandidateGenerator`, computed in-graph with static shapes for every row at once:
search the row's committed tokens (prompt and output so far) for the last n tokens, n from `max_ngram` down to 1;
the largest n with a match wins, and among its matches the earliest; propose up to K tokens that followed it,
never past the end of the sequence, and stop before an EOS (a continuation that starts with EOS proposes
nothing, without trying another match). No match means a plain decoding step for that row.

The drafts are deterministic (one-hot q), so verification by matching target samples keeps sampling exact.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import Context, DecodeState, Draft, Drafter


def find_continuation(tokens: jax.Array, length: jax.Array, max_ngram: int) -> tuple[jax.Array, jax.Array]:
    """One row: tokens [S], length [] -> (start of the continuation to copy [], whether a match exists []).

    The continuation starts right after the matched n-gram; it must be non-empty, i.e. start < length.
    """
    size = tokens.shape[0]
    starts = jnp.arange(size)  # candidate n-gram start positions j
    found, best = jnp.bool_(False), jnp.int32(0)
    for n in range(max_ngram, 0, -1):  # largest n first; a found larger n blocks smaller ones
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

    def draft(self, ctx: Context, loop: DecodeState, state, rng):
        k = self.max_draft
        start, found = jax.vmap(find_continuation, in_axes=(0, 0, None))(loop.tokens, loop.lengths, self.max_ngram)
        offsets = start[:, None] + jnp.arange(k)[None, :]  # [B, K]
        tokens = jnp.take_along_axis(loop.tokens, jnp.minimum(offsets, loop.tokens.shape[1] - 1), axis=1)
        valid = found[:, None] & (offsets < loop.lengths[:, None])  # never copy past the sequence's end
        if ctx.eos_ids:
            valid &= jnp.cumsum(jnp.isin(tokens, jnp.asarray(ctx.eos_ids)), axis=1) == 0  # stop before an EOS
        count = jnp.sum(jnp.cumprod(valid, axis=1), axis=1).astype(jnp.int32)
        # Drafts past the row's budget could never be committed: do not pay to verify them.
        count = jnp.minimum(count, jnp.maximum(loop.budget_end - loop.lengths - 1, 0))
        return Draft(tokens=tokens, count=count), state, jnp.zeros((), jnp.int32), loop.cache
