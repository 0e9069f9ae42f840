"""MTP drafting with the multi-token-prediction layers stored in the target checkpoint (DeepSeek-V3, GLM-4.5).

Definition (HF `MTPCandidateGenerator`, checked against it): a round's drafts equal a from-scratch MTP chain over
the committed sequence t_0..t_{L-1}. Depth 0's entry at position i combines Emb(t_i) with the main model's
final-normed hidden state at i-1; depth k's entry at i combines Emb(token at i) with depth k-1's output at i-1,
where tokens past L-1 are this round's drafts. Depth k's entry at L-1+k yields draft k+1.

Caching: each depth keeps a position-indexed cache. Only entries below L-1 survive a round unchanged (those at or
past L-1 embedded a draft or a stale state), and at most K+1 new tokens were committed, so each round recomputes
a fixed window of K+1 entries per depth, [L-1-K+k, L-1+k]: it covers everything new or stale, and the entries it
recomputes needlessly come out identical. The main model's hidden states live in a position-indexed buffer that
each verification writes, the same rollback-by-length rule as the KV cache.

With more drafts than MTP layers (`num_assistant_tokens` > `num_nextn_predict_layers`), the extra depths reuse the
last layer's weights, each with its own cache (as vLLM does); off by default.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from ..sampling import process_logits, sample
from .base import Context, DecodeState, Draft, Drafter, Prefill, RoundResult


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MtpState:
    caches: Any  # one cache per depth, stacked on the leading axis
    main_hidden: jax.Array  # [B, S, D] the target's final-normed hidden state at each position


@dataclasses.dataclass(frozen=True)
class MtpDrafter(Drafter):
    num_layers: int = 1  # MTP layers in the checkpoint; depths >= num_layers reuse the last one
    keep_probs: bool = False

    def layer(self, depth: int) -> int:
        return min(depth, self.num_layers - 1)

    def init(self, ctx: Context, prefill: Prefill) -> MtpState:
        target, loop = ctx.target, prefill.state
        batch, bucket, width = prefill.hidden.shape
        size = loop.tokens.shape[1]
        main_hidden = jnp.zeros((batch, size, width), prefill.hidden.dtype).at[:, :bucket].set(prefill.hidden)
        caches = target.init_mtp_cache(batch, size, depths=self.max_draft)
        # Every depth over the prompt bucket, so that each row's entries below L-1 are valid from the start.
        positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
        tokens = loop.tokens[:, :bucket]
        prev = _shift_right(prefill.hidden)  # entry i reads the state at i-1
        for depth in range(self.max_draft):
            out, _, caches = target.mtp_step(depth, tokens, prev, positions, caches, layer=self.layer(depth))
            prev = _shift_right(out)
        return MtpState(caches=caches, main_hidden=main_hidden)

    def draft(self, ctx: Context, loop: DecodeState, state: MtpState, rng):
        target, k = ctx.target, self.max_draft
        batch, size = loop.tokens.shape
        rows = jnp.arange(batch)[:, None]
        window = loop.lengths[:, None] - 1 - k + jnp.arange(k + 1)[None, :]  # [B, K+1] depth 0's positions
        # Tokens at positions L-1-K .. L-1+K: committed ones from the buffer, then the drafts as they come.
        sequence = jnp.take_along_axis(loop.tokens, jnp.clip(window, 0, size - 1), axis=1)
        sequence = jnp.concatenate([sequence, jnp.zeros((batch, k), jnp.int32)], axis=1)  # [B, 2K+1]
        prev = state.main_hidden[rows, jnp.clip(window - 1, 0, size - 1)]  # [B, K+1, D]
        caches = state.caches
        drafts, probs = [], []
        for depth, step_rng in enumerate(jax.random.split(rng, k)):
            # Entries below position depth+1 do not exist; clipping sends them to slots attention never reads.
            positions = jnp.clip(window + depth, 0, size - 1)
            out, logits, caches = target.mtp_step(depth, sequence[:, depth: depth + k + 1], prev, positions, caches,
                                                  layer=self.layer(depth))
            processed = process_logits(logits[:, -1], ctx.sampling)  # [B, V]
            token = sample(step_rng, processed) if ctx.sampling.do_sample else jnp.argmax(logits[:, -1], -1)
            token = token.astype(jnp.int32)
            sequence = sequence.at[:, k + 1 + depth].set(token)
            drafts.append(token)
            if self.keep_probs:
                probs.append(jax.nn.softmax(processed, axis=-1))
            prev = out  # depth+1's entry at i reads depth's output at i-1: the same window, shifted by one
        count = jnp.where(loop.done, 0, jnp.clip(loop.budget_end - loop.lengths - 1, 0, k)).astype(jnp.int32)
        draft = Draft(tokens=jnp.stack(drafts, axis=1), count=count,
                      probs=jnp.stack(probs, axis=1) if self.keep_probs else None)
        return draft, dataclasses.replace(state, caches=caches), jnp.asarray(k, jnp.int32), loop.cache

    def update(self, ctx: Context, state: MtpState, result: RoundResult) -> MtpState:
        """Keep the verify block's main hidden states at their positions; rejected ones get overwritten later."""
        start = result.lengths - result.committed - 1  # the block began at the old L-1
        positions = start[:, None] + jnp.arange(result.hidden.shape[1])[None, :]
        rows = jnp.arange(positions.shape[0])[:, None]
        main_hidden = state.main_hidden.at[rows, positions].set(result.hidden, mode="drop")
        return dataclasses.replace(state, main_hidden=main_hidden)


def _shift_right(x: jax.Array) -> jax.Array:
    """[B, T, D] -> [B, T, D] with x[:, i-1] at i (zeros at 0)."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
