"""Self-speculative early exit (LayerSkip): the target's first E layers and its own LM head draft.

Draft logits are `lm_head(final_norm(h_E))`, with h_E the output of decoder layer E, exactly as HF's
`assistant_early_exit`; no weight is copied. Unlike HF, which gives the draft its own E-layer cache, drafting
writes the target's own cache for layers [0, E): those entries are the same computation verification would do,
so verification starts at layer E from the saved h_E of `[last, d_1 .. d_c]` and the first E layers never run
twice on a token. Rejected drafts leave stale entries past the committed length, which the next round overwrites
before any query can see them (the cache is position-indexed, see jaxspec.cache).

What is shared: layers [0, E) cache entries and their computation for every token of the round. What is not:
layers [E, L) run once per round on the verify block, as in any strategy. Numerically, h_E is computed one token
at a time instead of in one block; the two agree to float round-off. A round in which no row drafts runs layers
[0, E) on the last token only (verification needs them) and skips the LM head.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .. import inplace
from ..costs import head_share
from ..head import for_rows
from ..schedule import DraftLength
from .base import Context, DecodeState, DraftStep, RoundResult, TargetOutput
from .draft_model import AutoregressiveDrafter
from .spec import DRAFT_LENGTH_OPTIONS, BuildRequest, Option, Strategy, StrategyChoice, draft_length


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class EarlyExitState:
    exit_hidden: jax.Array  # [B, K+1, D] h_E of [last, d_1 .. d_K] this round (slot i = position L - 1 + i)
    length: DraftLength


@dataclasses.dataclass(frozen=True)
class EarlyExitDrafter(AutoregressiveDrafter):
    exit_layer: int = 1  # E: the number of layers that draft

    def init(self, ctx: Context, batch: int, size: int) -> EarlyExitState:
        width = ctx.target.cfg.hidden_size
        return EarlyExitState(exit_hidden=jnp.zeros((batch, self.max_draft + 1, width), ctx.target.dtype),
                              length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]))

    def _first_layers(self, ctx: Context, token, positions, cache):
        """Layers [0, E) on one token per row: -> (h_E [B, D], cache)."""
        target = ctx.target
        x, cache = target.run_layers(target.embed_tokens(token[:, None]), positions, cache, 0, self.exit_layer)
        return x[:, 0], cache

    def _draft_logits(self, ctx: Context, h):
        return ctx.target.logits(ctx.target.final_hidden(h))

    def draft(self, ctx: Context, loop: DecodeState, state: EarlyExitState, rng):
        rows = jnp.arange(loop.lengths.shape[0])
        h, cache = self._first_layers(ctx, loop.last_token, (loop.lengths - 1)[:, None], loop.cache)
        exit_hidden = state.exit_hidden.at[:, 0].set(h)
        limit = self.draft_limit(loop, state.length)

        def run(operands):
            cache, exit_hidden = operands

            def feed(carry, token, positions, slot):
                cache, exit_hidden = carry
                h, cache = self._first_layers(ctx, token, positions, cache)
                return self._draft_logits(ctx, h), (cache, exit_hidden.at[:, slot].set(h))

            draft, (cache, exit_hidden), feeds = self.draft_loop(
                ctx, loop, limit, self._draft_logits(ctx, h), feed, (cache, exit_hidden), rng)
            # The last draft of each row was never fed; verification needs its h_E too. Rows without drafts re-run
            # their last token, which rewrites identical values.
            last = jnp.where(draft.count > 0, draft.tokens[rows, jnp.maximum(draft.count - 1, 0)], loop.last_token)
            h_last, cache = self._first_layers(ctx, last, (loop.lengths - 1 + draft.count)[:, None], cache)
            return (cache, exit_hidden.at[rows, draft.count].set(h_last)), (draft, feeds + 2)

        def skip(operands):
            return operands, (self.no_draft(loop, ctx.target.cfg.vocab_size), jnp.ones((), jnp.int32))

        (cache, exit_hidden), (draft, forwards) = inplace.cond(jnp.any(limit > 0), run, skip, (cache, exit_hidden))
        return DraftStep(draft=draft, state=dataclasses.replace(state, exit_hidden=exit_hidden), forwards=forwards,
                         target_cache=cache)

    def update(self, ctx: Context, state: EarlyExitState, result: RoundResult) -> EarlyExitState:
        return dataclasses.replace(state, length=self.update_length(state.length, result))

    def summary(self, state: EarlyExitState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}

    def target_forward(self, ctx: Context, tokens, positions, cache, state: EarlyExitState) -> TargetOutput:
        """Verification from layer E on: the first E layers already ran on this block while drafting."""
        target = ctx.target
        x = state.exit_hidden[:, : tokens.shape[1]]
        x, cache = target.run_layers(x, positions, cache, self.exit_layer, None)
        hidden = target.final_hidden(x)
        return TargetOutput(target.logits(hidden, for_rows(ctx.head, tokens.size)), hidden, cache)


ASSISTANT_EARLY_EXIT = Option("assistant_early_exit", "E: the first E layers and the LM head draft (LayerSkip)",
                              flag="--assistant-early-exit")


def build(request: BuildRequest) -> StrategyChoice:
    model = request.model
    exit_layer, layers = request.options.get("assistant_early_exit"), model.config.num_layers
    if isinstance(exit_layer, bool) or not isinstance(exit_layer, int) or not 1 <= exit_layer <= layers - 1:
        raise ValueError(f"assistant_early_exit must be a layer count in 1..{layers - 1} (the model has {layers} "
                         f"layers), got {exit_layer!r}.")
    head = head_share(model)  # a draft runs the first E layers and the LM head
    max_draft, schedule, threshold = draft_length(model, request, head + (1 - head) * exit_layer / layers)
    return StrategyChoice(EARLY_EXIT, EarlyExitDrafter(max_draft=max_draft, schedule=schedule,
                                                       confidence_threshold=threshold, keep_probs=request.keep_probs,
                                                       exit_layer=exit_layer))


EARLY_EXIT = Strategy(
    name="early_exit",
    summary="self-speculative early exit (LayerSkip): the target's first E layers and its LM head draft",
    selected_by="assistant_early_exit",
    options=(ASSISTANT_EARLY_EXIT, *DRAFT_LENGTH_OPTIONS),
    build=build,
)
