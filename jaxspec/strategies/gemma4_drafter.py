"""The Gemma 4 MTP drafter (`assistant_model=` a `Gemma4AssistantForCausalLM`): drafts from the target's own KV cache.

Definition (HF `SinglePositionMultiTokenCandidateGenerator` in transformers/generation/candidate_generator.py): with the row's
committed tokens t_0..t_{L-1}, draft 1 comes from the drafter fed [Emb(t_{L-1}), h_{L-2}] (the target's scaled
embedding, and its final-normed hidden state at L-2), attending to the target's store-layer keys and values at
positions below L-1; draft i+1 comes from [Emb(draft i), the drafter's projected state of step i], same keys, same
query position L-1. The drafter has no cache, so nothing rolls back: the hidden state at L-2 is kept per row
(written from the prompt's chunks and from each verified block), and the target cache is read where it is valid.

Where jaxspec differs from transformers 5.23, on purpose:
- q is the drafter's processed distribution and drafts are drawn from it (the shared step loop of
  `AutoregressiveDrafter`), so sampling is exact; 5.23 drafts argmax and verifies against raw logits.
- Keys at or past L-1 are never read. 5.23 slices the full-attention cache to L entries, so after a rejection the
  first rejected draft's entry at L-1 is read, and its sliding window still holds every rejected draft.
- Batches, with rows of any length (5.23: batch 1).
- `tree=(N, D)`: the drafter keeps N // D candidates at each step, verified as a tree (jaxspec/tree.py); 5.23 drafts a
  chain.
- The draft length follows the shared schedules (adaptive by default); 5.23 always drafts `num_assistant_tokens`,
  which it requires in the assistant's generation_config. Here it comes from the call, else that generation_config,
  else `DEFAULT_NUM_ASSISTANT_TOKENS`. No confidence stop unless `assistant_confidence_threshold` is given.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ..costs import weight_bytes
from ..schedule import DraftLength
from .base import Context, DecodeState, DraftStep, PrefillChunk, RoundResult, deciding_rows
from .draft_model import AutoregressiveDrafter
from .spec import (ASSISTANT_MODEL, DRAFT_LENGTH_OPTIONS, TREE, BuildRequest, Strategy, StrategyChoice, draft_length,
                   tree_schedule, tree_shape)

# 5.23 has no default (it fails without one); the drafter's steps are cheap next to a target forward.
DEFAULT_NUM_ASSISTANT_TOKENS = 4
# HF's Gemma 4 generator has no confidence stop, so the drafter's default threshold is 0 (off).
DRAFT_DEFAULTS = {"num_assistant_tokens": DEFAULT_NUM_ASSISTANT_TOKENS, "num_assistant_tokens_schedule": "adaptive",
                  "assistant_confidence_threshold": 0.0}


def is_gemma4_drafter(model) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) == "gemma4_assistant"


def check_pair(target, drafter) -> None:
    """Every reason a Gemma 4 drafter cannot serve `target`, as one clear error before anything compiles."""
    cfg, text = getattr(target, "config", None), drafter.config.text
    if getattr(cfg, "model_type", None) != "gemma4_text":
        kind = getattr(cfg, "model_type", type(cfg).__name__)
        raise ValueError(f"A Gemma 4 drafter (gemma4_assistant) drafts from a Gemma 4 target's KV cache; this target "
                         f"is {kind!r}.")
    if not cfg.num_kv_shared_layers:
        raise ValueError("The target has no KV sharing (num_kv_shared_layers=0), so it stores no shared keys and "
                         "values for a Gemma 4 drafter to read; use a Gemma 4 with num_kv_shared_layers > 0.")
    if drafter.config.vocab_size != cfg.vocab_size:
        raise ValueError(f"The Gemma 4 drafter's vocabulary ({drafter.config.vocab_size}) differs from the target's "
                         f"({cfg.vocab_size}); a drafter must be trained for its target.")
    if drafter.config.backbone_hidden_size != cfg.hidden_size:
        raise ValueError(f"The Gemma 4 drafter reads hidden states of width {drafter.config.backbone_hidden_size} "
                         f"(backbone_hidden_size), but the target's are {cfg.hidden_size} wide.")
    for layer_type in sorted(set(text.layer_types)):
        store = cfg.kv_store_layer(layer_type)
        want = text.sliding if layer_type == "sliding_attention" else text.full
        have = None if store is None else cfg.kind(store)
        if have is None or (have.head_dim, have.num_kv_heads) != (want.head_dim, want.num_kv_heads):
            raise ValueError(f"The Gemma 4 drafter's {layer_type} layers read keys and values of head_dim "
                             f"{want.head_dim} with {want.num_kv_heads} kv heads, which the target's {layer_type} "
                             f"store layer does not provide ({'none' if have is None else have}).")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Gemma4DrafterState:
    hidden: jax.Array  # [B, D_t] the target's final-normed hidden state at each row's position L-2
    length: DraftLength


@dataclasses.dataclass(frozen=True)
class Gemma4Drafter(AutoregressiveDrafter):
    def init(self, ctx: Context, batch: int, size: int) -> Gemma4DrafterState:
        target = ctx.target
        return Gemma4DrafterState(hidden=jnp.zeros((batch, target.cfg.hidden_size), target.dtype),
                                  length=self.schedule.init(batch, ctx.draft_inputs["initial_draft_length"]))

    def prefill_chunk(self, ctx: Context, state: Gemma4DrafterState, chunk: PrefillChunk) -> Gemma4DrafterState:
        """Keep the hidden state at the last prompt position (L-2 once the prefill has picked token L-1)."""
        count = jnp.sum(chunk.valid, axis=1)  # [B] prompt positions in this chunk (a prefix of it)
        last = chunk.hidden[jnp.arange(count.shape[0]), jnp.maximum(count - 1, 0)]  # [B, D_t]
        return dataclasses.replace(state, hidden=jnp.where((count > 0)[:, None], last, state.hidden))

    def draft(self, ctx: Context, loop: DecodeState, state: Gemma4DrafterState, rng):
        target, drafter = ctx.target, ctx.assistant
        limit = self.draft_limit(loop, state.length)
        positions = (loop.lengths - 1)[:, None]  # [B, 1] every draft step queries from position L-1
        shared = {t: target.shared_kv(loop.cache, t) for t in set(drafter.cfg.layer_types)}  # valid below L-1

        def step(hidden, token):
            """[B] token, [B, D_t] state -> (logits [B, V], next state [B, D_t])."""
            inputs = jnp.concatenate([target.input_embeddings(token[:, None]), hidden[:, None]], axis=-1)
            logits, projected = drafter(inputs, positions, shared)
            return logits[:, 0], projected[:, 0]

        def run(_):
            logits, hidden = step(state.hidden, loop.last_token)
            branching = None if self.tree is None else self.schedule.branching(state.length, deciding_rows(loop))
            draft, _, feeds = self.draft_loop(ctx, loop, limit, logits, lambda h, token, *_: step(h, token), hidden,
                                              rng, branching)
            return draft, feeds + 1

        def skip(_):
            return self.no_draft(loop, target.cfg.vocab_size), jnp.zeros((), jnp.int32)

        draft, forwards = jax.lax.cond(jnp.any(limit > 0), run, skip, None)
        return DraftStep(draft=draft, state=state, forwards=forwards, target_cache=loop.cache)

    def update(self, ctx: Context, state: Gemma4DrafterState, result: RoundResult) -> Gemma4DrafterState:
        """The block began at the old L-1, so the new L-2 is its entry `committed - 1` (finished rows keep theirs)."""
        rows = jnp.arange(result.committed.shape[0])
        last = result.hidden[rows, jnp.maximum(result.committed - 1, 0)]  # [B, D_t]
        hidden = jnp.where((result.committed > 0)[:, None], last.astype(state.hidden.dtype), state.hidden)
        return Gemma4DrafterState(hidden=hidden, length=self.update_length(state.length, result))

    def summary(self, state: Gemma4DrafterState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.length.num_tokens}


def build(request: BuildRequest) -> StrategyChoice:
    drafter_model = request.options["assistant_model"]
    check_pair(request.model, drafter_model)
    cost = weight_bytes(drafter_model.module) / weight_bytes(request.model.module)
    max_draft, schedule, threshold = draft_length(drafter_model, request, cost, DRAFT_DEFAULTS)
    tree = tree_shape(request, "the Gemma 4 drafter")
    if tree is not None:  # the drafter drafts a chain as deep as the tree, keeping N // D candidates per step
        max_draft, schedule = tree.depth, tree_schedule(schedule, tree)
    drafter = Gemma4Drafter(max_draft=max_draft, schedule=schedule, confidence_threshold=threshold,
                            keep_probs=request.keep_probs, tree=tree)
    return StrategyChoice(MTP_DRAFTER, drafter, drafter_model)


MTP_DRAFTER = Strategy(
    name="mtp_drafter",
    summary="a separate MTP drafter checkpoint (Gemma 4 assistant) drafts from the target's KV cache "
            "(--assistant PATH)",
    selected_by="assistant_model",
    claims=lambda request: is_gemma4_drafter(request.options["assistant_model"]),
    options=(ASSISTANT_MODEL, *DRAFT_LENGTH_OPTIONS, TREE),
    build=build,
)
