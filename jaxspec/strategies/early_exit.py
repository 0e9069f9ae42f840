"""Self-speculative early exit (LayerSkip): the target's first E layers and its own LM head draft.

Draft logits are `lm_head(final_norm(h_E))`, with h_E the output of decoder layer E, exactly as HF's
`assistant_early_exit`; no weight is copied. Unlike HF, which gives the draft its own E-layer cache, drafting
writes the target's own cache for layers [0, E): those entries are the same computation verification would do,
so verification starts at layer E from the saved h_E of `[last, d_1 .. d_c]` and the first E layers never run
twice on a token. Rejected drafts leave stale entries past the committed length, which the next round overwrites
before any query can see them (the cache is position-indexed, see jaxspec.cache).

What is shared: layers [0, E) cache entries and their computation for every token of the round. What is not:
layers [E, L) run once per round on the verify block, as in any strategy. Numerically, h_E is computed one token
at a time instead of in one block; the two agree to float round-off.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .base import Context, DecodeState, Prefill
from .draft_model import AutoregressiveDrafter


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EarlyExitState:
    exit_hidden: jax.Array  # [B, K+1, D] h_E of [last, d_1 .. d_K] this round (slot i = position L - 1 + i)
    num_tokens: jax.Array  # [B]


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(AutoregressiveDrafter):
    exit_layer: int = 1  # E: the number of layers that draft

    def init(self, ctx: Context, prefill: Prefill) -> EarlyExitState:
        batch, _, width = prefill.hidden.shape
        return EarlyExitState(
            exit_hidden=jnp.zeros((batch, self.max_draft + 1, width), ctx.target.dtype),
            num_tokens=self.initial_num_tokens(batch),
        )

    def _first_layers(self, ctx: Context, token, positions, cache):
        """Layers [0, E) on one token per row: -> (h_E [B, D], draft logits [B, V], cache)."""
        target = ctx.target
        x, cache = target.run_layers(target.embed_tokens(token[:, None]), positions, cache, 0, self.exit_layer)
        return x[:, 0], target.logits(target.final_hidden(x[:, 0])), cache

    def draft(self, ctx: Context, loop: DecodeState, state: EarlyExitState, rng):
        rows = jnp.arange(loop.lengths.shape[0])
        h, logits, cache = self._first_layers(ctx, loop.last_token, (loop.lengths - 1)[:, None], loop.cache)
        exit_hidden = state.exit_hidden.at[:, 0].set(h)

        def feed(carry, token, positions, slot):
            cache, exit_hidden = carry
            h, logits, cache = self._first_layers(ctx, token, positions, cache)
            return logits, (cache, exit_hidden.at[:, slot].set(h))

        draft, (cache, exit_hidden), forwards = self.draft_loop(
            ctx, loop, state.num_tokens, logits, feed, (cache, exit_hidden), rng
        )
        # The last draft of each row was never fed; verification needs its h_E too. Rows without drafts re-run
        # their last token, which rewrites identical values.
        last_draft = jnp.where(draft.count > 0, draft.tokens[rows, jnp.maximum(draft.count - 1, 0)], loop.last_token)
        h, _, cache = self._first_layers(ctx, last_draft, (loop.lengths - 1 + draft.count)[:, None], cache)
        exit_hidden = exit_hidden.at[rows, draft.count].set(h)
        state = dataclasses.replace(state, exit_hidden=exit_hidden)
        return draft, state, forwards + 1, cache

    def target_forward(self, ctx: Context, tokens, positions, cache, state: EarlyExitState):
        """Verification from layer E on: the first E layers already ran on this block while drafting."""
        target = ctx.target
        x = state.exit_hidden[:, : tokens.shape[1]]
        x, cache = target.run_layers(x, positions, cache, self.exit_layer, None)
        hidden = target.final_hidden(x)
        return target.logits(hidden), hidden, cache
