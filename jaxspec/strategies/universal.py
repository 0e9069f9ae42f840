"""Universal assisted decoding: an assistant with another tokenizer drafts in the compiled loop, with no host step
per round.

The host builds the tables once per tokenizer pair (jaxspec/vocab_map.py) and re-encodes each prompt for the
assistant once per call (`for_prompts`). Inside the loop the assistant lives in its own token space:

- Context. The assistant keeps its own token buffer and per-row length. Each round first appends the assistant
  tokens of the target tokens committed since the last round (`expansion(t)`, at most K+1 target tokens, each at
  most `max_expansion` assistant tokens), then catches its cache up on them (DraftModelDrafter's scheme, in the
  assistant's positions).
- Drafts. The assistant's logits are read over the target's vocabulary through `draft_source`: target token t
  gets the logit of the assistant token with t's bytes, and every other target token -inf. Drafting is therefore
  restricted to the shared tokens and q is renormalised over them; the target's processors then apply as for any
  assistant (AutoregressiveDrafter's step loop, schedule and confidence stop), so q is the exact distribution the
  drafts were drawn from, zero outside the shared tokens, and speculative sampling stays exact. Greedy drafts are
  the argmax over the shared tokens, verified by the target as any draft is: greedy output is plain greedy's.
- Rollback. A drafted token expands to its own draft source, so after verification the cache entries of the
  accepted drafts stay valid: rollback lowers `synced` to the last accepted draft, a length as elsewhere.

A row whose assistant buffer would overflow (expansions far longer than its text) stops drafting; decoding then
goes on plainly for that row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .. import inplace
from ..vocab_map import VocabMap, same_vocabulary, vocab_map
from .base import Context, DecodeState, DraftLength, RoundResult
from .draft_model import AutoregressiveDrafter, catch_up

CATCH_UP_WIDTHS = (2, 8)  # block widths of the catch-up after a round; the prefill chunk width when far behind
MIN_ASSISTANT_BUFFER = 256
ASSISTANT_ROOM = 1.5  # assistant buffer room per target position of generation room (expansions are ~1 token)


def tokenizer_pair(target, assistant, tokenizer=None, assistant_tokenizer=None):
    """(target tokenizer, assistant tokenizer) when the assistant reads another vocabulary, else None.

    Tokenizers come from the arguments, else from the models. Vocabularies of different sizes are different (HF's
    rule). Equal sizes can still hide different ids (two tokenizers trained apart), so when both tokenizers are
    known, their token -> id tables decide; without them, an assistant of the same size is taken to share the
    target's tokenizer, as HF does.
    """
    pair = (tokenizer if tokenizer is not None else target.tokenizer,
            assistant_tokenizer if assistant_tokenizer is not None else assistant.tokenizer)
    missing = [f"{whose} tokenizer ({argument}=)" for whose, argument, value in
               zip(("the target's", "the assistant's"), ("tokenizer", "assistant_tokenizer"), pair) if value is None]
    sizes = target.config.vocab_size, assistant.config.vocab_size
    if missing and (sizes[0] != sizes[1] or assistant_tokenizer is not None):
        raise ValueError(
            f"The assistant's vocabulary ({sizes[1]} ids) may differ from the target's ({sizes[0]}): universal "
            f"assisted decoding maps one onto the other through both tokenizers, and {' and '.join(missing)} is "
            "missing. Pass tokenizer= and assistant_tokenizer=, or load models that carry their tokenizers.")
    if missing or (sizes[0] == sizes[1] and same_vocabulary(*pair)):
        return None
    return pair


def universal_drafter(target, assistant, target_tokenizer, assistant_tokenizer, **settings) -> "UniversalDrafter":
    """The drafter for an assistant with another tokenizer (tables built once per tokenizer pair)."""
    tables = vocab_map(target_tokenizer, assistant_tokenizer, target.config.vocab_size, assistant.config.vocab_size)
    return UniversalDrafter(vocab_map=tables, max_expansion=tables.max_expansion, **settings)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class UniversalState:
    cache: Any  # the assistant's KV cache, indexed by the assistant's positions
    tokens: jax.Array  # [B, S_a] assistant tokens: the re-encoded prompt, then expansions of committed target tokens
    length: jax.Array  # [B] assistant tokens standing for the target tokens [0, expanded)
    expanded: jax.Array  # [B] target tokens whose expansions are in `tokens`
    synced: jax.Array  # [B] assistant cache positions [0, synced) hold `tokens`
    schedule: DraftLength


@dataclasses.dataclass(frozen=True)
class UniversalDrafter(AutoregressiveDrafter):
    max_expansion: int = 1  # static: the longest expansion of a target token, in assistant tokens
    catch_up_width: int = 64
    vocab_map: VocabMap | None = dataclasses.field(default=None, compare=False)
    # Set per call by `for_prompts` (run-time inputs, so a new prompt of the same bucket does not recompile).
    prompt_inputs: dict[str, np.ndarray] = dataclasses.field(default_factory=dict, compare=False)

    def for_prompts(self, prompts: list[np.ndarray], size: int) -> "UniversalDrafter":
        """The prompts re-encoded by the assistant's tokenizer, in a buffer of static size S_a."""
        encoded = [self.vocab_map.assistant_prompt(p) for p in prompts]
        room = size - max(len(p) for p in prompts)  # the target's room for generated and drafted tokens
        needed = max(len(e) for e in encoded) + int(ASSISTANT_ROOM * room)
        size_a = max(MIN_ASSISTANT_BUFFER, 1 << (needed - 1).bit_length())
        tokens = np.zeros((len(prompts), size_a), np.int32)  # [B, S_a]
        for row, ids in enumerate(encoded):
            tokens[row, : len(ids)] = ids
        inputs = {"assistant_tokens": tokens,
                  "assistant_lengths": np.array([len(e) for e in encoded], np.int32),
                  "target_prompt_lengths": np.array([len(p) for p in prompts], np.int32)}
        return dataclasses.replace(self, prompt_inputs=inputs)

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        tables = {"draft_source": self.vocab_map.draft_source, "expansion_offsets": self.vocab_map.expansion_offsets,
                  "expansion_ids": self.vocab_map.expansion_ids}
        return super().runtime_inputs() | tables | self.prompt_inputs

    def init(self, ctx: Context, batch: int, size: int) -> UniversalState:
        inputs = ctx.draft_inputs
        tokens = inputs["assistant_tokens"]
        return UniversalState(cache=ctx.assistant.init_cache(batch, tokens.shape[1]), tokens=tokens,
                              length=inputs["assistant_lengths"], expanded=inputs["target_prompt_lengths"],
                              synced=jnp.zeros((batch,), jnp.int32),
                              schedule=self.schedule.init(batch, inputs["initial_draft_length"]))

    def draft(self, ctx: Context, loop: DecodeState, state: UniversalState, rng):
        state = self._expand(ctx, loop, state)
        size_a = state.tokens.shape[1]
        fits = state.length + self.max_draft < size_a  # the drafts fed back must fit the buffer too
        limit = jnp.where(fits & (state.length > 0), self.draft_limit(loop, state.schedule), 0)
        source = ctx.draft_inputs["draft_source"]  # [V]

        def over_target_vocabulary(logits):  # [B, V_a] -> [B, V], -inf where the assistant cannot draft
            return jnp.where(source >= 0, jnp.take(logits, jnp.maximum(source, 0), axis=-1), -jnp.inf)

        def run(state: UniversalState):
            # Rows that cannot draft any more are not caught up.
            target_length = jnp.where(fits, state.length, state.synced)
            logits, cache, catch_up_forwards = catch_up(ctx.assistant, state.tokens, state.synced, target_length,
                                                        state.cache, (*CATCH_UP_WIDTHS, self.catch_up_width))

            def feed(cache, token, positions, slot):  # draft `slot` sits at assistant position length - 1 + slot
                positions = (state.length - 1 + slot)[:, None]
                logits, _, cache = ctx.assistant(jnp.maximum(source[token], 0)[:, None], positions, cache)
                return over_target_vocabulary(logits[:, 0]), cache

            draft, cache, feeds = self.draft_loop(ctx, loop, limit, over_target_vocabulary(logits), feed, cache, rng)
            synced = jnp.where(fits, state.length + jnp.maximum(draft.count - 1, 0), state.synced)
            return dataclasses.replace(state, cache=cache, synced=synced), (draft, catch_up_forwards + feeds)

        def skip(state: UniversalState):
            return state, (self.no_draft(loop, ctx.target.cfg.vocab_size), jnp.zeros((), jnp.int32))

        state, (draft, forwards) = inplace.cond(jnp.any(limit > 0), run, skip, state)
        return draft, state, forwards, loop.cache

    def _expand(self, ctx: Context, loop: DecodeState, state: UniversalState) -> UniversalState:
        """Append the expansions of the target tokens committed since the last round, [expanded, L).

        At most K+1 tokens: the prefill commits one, and each round at most K+1, and this runs every round.
        """
        inputs = ctx.draft_inputs
        offsets, flat = inputs["expansion_offsets"], inputs["expansion_ids"]
        batch, size = loop.tokens.shape
        size_a = state.tokens.shape[1]
        window = state.expanded[:, None] + jnp.arange(self.max_draft + 1)[None, :]  # [B, K+1] target positions
        new = window < loop.lengths[:, None]
        tokens = jnp.take_along_axis(loop.tokens, jnp.clip(window, 0, size - 1), axis=1)
        start = offsets[tokens]
        count = jnp.where(new, offsets[tokens + 1] - start, 0)  # [B, K+1] assistant tokens per target token
        ends = jnp.cumsum(count, axis=1)
        piece = jnp.arange(self.max_expansion)[None, None, :]  # [1, 1, M]
        ids = flat[jnp.clip(start[..., None] + piece, 0, flat.shape[0] - 1)]  # [B, K+1, M]
        at = state.length[:, None, None] + (ends - count)[..., None] + piece
        at = jnp.where(piece < count[..., None], at, size_a)  # padding pieces land past the buffer: dropped
        rows = jnp.arange(batch)[:, None, None]
        buffer = state.tokens.at[rows, at].set(ids, mode="drop")
        return dataclasses.replace(state, tokens=buffer, length=state.length + ends[:, -1], expanded=loop.lengths)

    def update(self, ctx: Context, state: UniversalState, result: RoundResult) -> UniversalState:
        # The accepted drafts are committed as their draft sources, which sit at length, length + 1, ...: those
        # entries stay valid, the rest were rejected (a budget or EOS crop can commit fewer than were accepted).
        kept = jnp.minimum(result.accepted, result.committed)
        synced = jnp.minimum(state.synced, state.length + kept)
        return dataclasses.replace(state, synced=synced, schedule=self.update_length(state.schedule, result))

    def summary(self, state: UniversalState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.schedule.num_tokens, "assistant_length": state.length}
