"""MTP drafting with the multi-token-prediction layers stored in the target checkpoint (DeepSeek-V3, GLM-4.5).

Definition (HF `MTPCandidateGenerator`, checked against it): a round's drafts equal a from-scratch MTP chain over
the committed sequence t_0..t_{L-1}. Depth 0's entry at position i combines Emb(t_i) with the main model's
final-normed hidden state at i-1; depth k's entry at i combines Emb(token at i) with depth k-1's output at i-1,
where tokens past L-1 are this round's drafts. Depth k's entry at L-1+k yields draft k+1.

Caching: each depth keeps a position-indexed cache. Only entries below L-1 survive a round unchanged (those at or
past L-1 embedded a draft or a stale state), and at most K+1 new tokens were committed, so each round recomputes
a fixed window of K+1 entries per depth, [L-1-K+k, L-1+k]: it covers everything new or stale, and the entries it
recomputes needlessly come out identical. The main model's hidden states live in a position-indexed buffer that
each verification writes, the same rollback-by-length rule as the KV cache. The prompt's entries are computed chunk
by chunk as the target reads the prompt.

Every depth runs every round (the window must stay covered); the schedule only decides how many of the K drafts a
row hands to verification, which is what a wide verify block costs.

With more drafts than MTP layers (`num_assistant_tokens` > `num_nextn_predict_layers`), the extra depths reuse the
last layer's weights, each with its own cache (as vLLM does); off by default. A model with a reduced draft
vocabulary (`draft_logits`) heads its drafts with those tokens only: q is zero elsewhere, which keeps sampling exact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..sampling import select
from .base import (Context, DecodeState, Draft, Drafter, DraftLength, PrefillChunk, RoundResult, Schedule,
                   room_for_drafts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MtpState:
    caches: Any  # one cache per depth, stacked on the leading axis
    main_hidden: jax.Array  # [B, S, D] the target's final-normed hidden state at each position
    chunk_tail: jax.Array  # [K, B, D] each depth's output at the last position of the previous prompt chunk
    length: DraftLength


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
            chunk_tail=jnp.zeros((self.max_draft, batch, width), target.dtype),
            length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]),
        )

    def prefill_chunk(self, ctx: Context, state: MtpState, chunk: PrefillChunk) -> MtpState:
        """Every depth over the chunk's positions, so each row's entries below L-1 are valid from the start."""
        rows = jnp.arange(chunk.tokens.shape[0])[:, None]
        first = chunk.positions[:, :1]  # [B, 1]
        before = state.main_hidden[rows, jnp.maximum(first - 1, 0)]  # [B, 1, D] the state at the chunk's start - 1
        before = jnp.where((first > 0)[..., None], before, 0)
        main_hidden = state.main_hidden.at[rows, chunk.positions].set(chunk.hidden.astype(state.main_hidden.dtype))
        prev = jnp.concatenate([before, chunk.hidden[:, :-1]], axis=1)  # entry i reads the state at i-1
        caches, tails = state.caches, []
        for depth in range(self.max_draft):
            out, _, caches = ctx.target.mtp_step(depth, chunk.tokens, prev, chunk.positions, caches,
                                                 layer=self.layer(depth))
            prev = jnp.concatenate([state.chunk_tail[depth][:, None], out[:, :-1]], axis=1)
            tails.append(out[:, -1])
        return dataclasses.replace(state, caches=caches, main_hidden=main_hidden, chunk_tail=jnp.stack(tails))

    def draft(self, ctx: Context, loop: DecodeState, state: MtpState, rng):
        target, k = ctx.target, self.max_draft
        batch, size = loop.tokens.shape
        rows = jnp.arange(batch)[:, None]
        window = loop.lengths[:, None] - 1 - k + jnp.arange(k + 1)[None, :]  # [B, K+1] depth 0's positions
        # Tokens at positions L-1-K .. L-1+K: committed ones from the buffer, then the drafts as they come.
        sequence = jnp.take_along_axis(loop.tokens, jnp.clip(window, 0, size - 1), axis=1)
        sequence = jnp.concatenate([sequence, jnp.zeros((batch, k), jnp.int32)], axis=1)  # [B, 2K+1]
        prev = state.main_hidden[rows, jnp.clip(window - 1, 0, size - 1)]  # [B, K+1, D]
        # A model with a draft vocabulary heads its drafts with those V' tokens only (zero q elsewhere).
        draft_logits = getattr(target, "draft_logits", target.logits)
        caches, buffer = state.caches, loop.tokens
        drafts, probs = [], []
        for depth, step_rng in enumerate(jax.random.split(rng, k)):
            # Entries below position depth+1 do not exist; clipping sends them to slots attention never reads.
            positions = jnp.clip(window + depth, 0, size - 1)
            out, _, caches = target.mtp_step(depth, sequence[:, depth: depth + k + 1], prev, positions, caches,
                                             layer=self.layer(depth))
            logits = draft_logits(out[:, -1])  # [B, V]: predicts position L + depth
            processed = ctx.process(logits[:, None], buffer, loop.lengths + depth, loop.prompt_lengths)[:, 0]
            token = select(step_rng, processed, ctx.do_sample)
            sequence = sequence.at[:, k + 1 + depth].set(token)
            buffer = buffer.at[rows[:, 0], loop.lengths + depth].set(token, mode="drop")
            drafts.append(token)
            if self.keep_probs:
                probs.append(jax.nn.softmax(processed, axis=-1))
            prev = out  # depth+1's entry at i reads depth's output at i-1: the same window, shifted by one
        count = jnp.minimum(self.schedule.allowed(state.length), room_for_drafts(loop))
        draft = Draft(tokens=jnp.stack(drafts, axis=1), count=count.astype(jnp.int32),
                      probs=jnp.stack(probs, axis=1) if self.keep_probs else None)
        return draft, dataclasses.replace(state, caches=caches), jnp.asarray(k, jnp.int32), loop.cache

    def update(self, ctx: Context, state: MtpState, result: RoundResult) -> MtpState:
        """Keep the verify block's main hidden states at their positions; rejected ones get overwritten later."""
        start = result.lengths - result.committed - 1  # the block began at the old L-1
        positions = start[:, None] + jnp.arange(result.hidden.shape[1])[None, :]
        rows = jnp.arange(positions.shape[0])[:, None]
        main_hidden = state.main_hidden.at[rows, positions].set(result.hidden, mode="drop")
        length = self.schedule.update(state.length, result, self.max_draft)
        return dataclasses.replace(state, main_hidden=main_hidden, length=length)

    def summary(self, state: MtpState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}
