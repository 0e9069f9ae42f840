"""Universal assisted decoding: an assistant with another tokenizer drafts in the compiled loop, with no host step
per round.

The host builds the tables once per tokenizer pair (jaxspec/vocab_map.py) and re-encodes each prompt for the
assistant once per call (`for_prompts`). Inside the loop the assistant lives in its own token space:

- Context. The assistant keeps its own token buffer and per-row length. Each round first appends the assistant
  tokens of the target tokens committed since the last round (`expansion(t)`, at most K+1 target tokens, each at
  most `max_expansion` assistant tokens), then catches its cache up on them (DraftModelDrafter's scheme, in the
  assistant's positions).
- Drafts, as text. The assistant drafts its own greedy tokens over its whole vocabulary. Each one is written in
  target tokens (`spelling`), and adjacent target tokens are merged while their joined bytes are one target token
  (`merge`), so the drafted text reaches the target tokenized roughly as the target would write it. A row stops
  after `limit` target tokens (the schedule's length; one assistant step further when the last one could still
  merge, `_draft_text`), at a token the assistant is not confident of (proposed, then the row stops; a doubted
  first one is dropped: AutoregressiveDrafter.drops_doubted_first), after an EOS, or before an assistant token the
  target cannot write. At most 2K assistant steps run per round.
- Verification. The drafts are a deterministic function of the assistant's context, so they are verified as
  one-hot drafts (accept d with probability p(d); after a rejection draw from p without d), which keeps sampling
  exact whatever drafted them, and greedy output equal to plain greedy. The target's logits processors judge the
  drafts as they judge any token; the assistant's own choice is not processed.
- Rollback. The assistant's cache stays valid for the leading drafts that are one shared token each, not merged
  (a drafted assistant token that is also what the committed target token expands to); past them the committed
  tokens' expansions can differ from what the assistant drafted, so `synced` stops there and the next round's
  catch-up rewrites the rest (in the narrowest block of `catch_up_widths` that covers it).

How this departs from the token-level intersection (drafting only tokens both vocabularies share, with q
renormalised over them): where the target writes a token the assistant spells in pieces (Qwen's `):\n` against
SmolLM2's `):` + `\n   `), the intersection cannot propose it at all; text drafts can. The price is that sampled
drafts are judged one-hot, as prompt lookup's are, instead of by min(1, p/q).

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
from ..verify import leading_true
from ..vocab_map import MAX_SPELLING, VocabMap, merge_hash, same_vocabulary, vocab_map
from ..schedule import DraftLength
from .base import Context, DecodeState, Draft, DraftStep, RoundResult, room_for_drafts
from .draft_model import AutoregressiveDrafter, assistant_settings, catch_up, catch_up_widths
from .spec import (ASSISTANT_MODEL, ASSISTANT_TOKENIZER, DRAFT_LENGTH_OPTIONS, BuildRequest, Strategy, StrategyChoice,
                   persist_heuristic_length)

MIN_ASSISTANT_BUFFER = 256
ASSISTANT_ROOM = 1.5  # assistant buffer room per target position of generation room (expansions are ~1 token)
STEPS_PER_DRAFT = 2  # assistant steps a round may run per target draft (merged steps add no target token)
MERGE_CASCADE = 2  # merges tried per pushed target token (`):` + `\n` -> `):\n`, then with the token before)


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
    if "schedule" in settings:  # its probes are all verified (`Schedule.shadow`)
        settings["schedule"] = dataclasses.replace(settings["schedule"], shadow=False)
    return UniversalDrafter(vocab_map=tables, max_expansion=tables.max_expansion, merge_probes=tables.merges.probes,
                            assistant_merge_probes=tables.assistant_merges.probes,
                            **settings | {"keep_probs": False})  # one-hot drafts: no q to keep


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
    merge_probes: int = 1  # static: the longest probe sequence of the target's merge table
    assistant_merge_probes: int = 1  # ... and of the assistant's
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
        tables = self.vocab_map
        tables = {"spelling": tables.spelling, "spelled_alone": tables.spelled_alone,
                  "expansion_offsets": tables.expansion_offsets, "expansion_ids": tables.expansion_ids,
                  "heal_index": tables.healing.index, "heal_extensions": tables.healing.extensions,
                  "heal_suffix_spelling": tables.healing.suffix_spelling, "heal_spellable": tables.healing.spellable,
                  "extensible": tables.extensible,
                  **merge_inputs("target_merges", tables.merges), **merge_inputs("assistant_merges",
                                                                                 tables.assistant_merges)}
        return super().runtime_inputs() | tables | self.prompt_inputs

    def init(self, ctx: Context, batch: int, size: int) -> UniversalState:
        inputs = ctx.draft_inputs
        tokens = inputs["assistant_tokens"]
        return UniversalState(cache=ctx.assistant.init_cache(batch, tokens.shape[1]), tokens=tokens,
                              length=inputs["assistant_lengths"], expanded=inputs["target_prompt_lengths"],
                              synced=jnp.zeros((batch,), jnp.int32),
                              schedule=self.schedule.init(batch, inputs["initial_draft_length"]))

    @property
    def max_steps(self) -> int:
        return STEPS_PER_DRAFT * self.max_draft

    def draft(self, ctx: Context, loop: DecodeState, state: UniversalState, rng):
        state = self._expand(ctx, loop, state)
        size_a = state.tokens.shape[1]
        fits = state.length + self.max_steps < size_a  # the drafts fed back must fit the buffer too
        limit = jnp.where(fits & (state.length > 0), self.draft_limit(loop, state.schedule), 0)

        # A row whose context ends with healable whitespace drafts its first token at that token's position.
        last = jnp.take_along_axis(state.tokens, jnp.maximum(state.length - 1, 0)[:, None], axis=1)[:, 0]
        heal_row = ctx.draft_inputs["heal_index"][last]  # [B]
        healing = (heal_row >= 0) & (limit > 0) & (state.length > 1)
        start = state.length - healing  # the position of the first drafted assistant token

        def run(state: UniversalState):
            # Rows that cannot draft any more are not caught up; the others need the logits at start - 1.
            target_length = jnp.where(fits, start, state.synced)
            synced = jnp.where(fits, jnp.minimum(state.synced, start - 1), state.synced)
            logits, cache, catch_up_forwards = catch_up(ctx.assistant, state.tokens, synced, target_length,
                                                        state.cache, catch_up_widths(self.catch_up_width))
            most = jnp.minimum(jnp.minimum(limit + 1, room_for_drafts(loop)), self.max_draft)  # with a look-ahead
            most = jnp.where(limit > 0, most, 0)
            draft, cache, valid, feeds = self._draft_text(ctx, start, limit, most, logits, cache,
                                                          jnp.where(healing, heal_row, -1))
            synced = jnp.where(fits, start + valid, synced)
            return dataclasses.replace(state, cache=cache, synced=synced), (draft, catch_up_forwards + feeds)

        def skip(state: UniversalState):
            return state, (self.no_draft(loop, ctx.target.cfg.vocab_size), jnp.zeros((), jnp.int32))

        state, (draft, forwards) = inplace.cond(jnp.any(limit > 0), run, skip, state)
        return DraftStep(draft=draft, state=state, forwards=forwards, target_cache=loop.cache)

    def _draft_text(self, ctx: Context, start, limit, most, first_logits, cache, heal_row):
        """Draft `limit` [B] target tokens per row (`most` [B] with a look-ahead draft) from the assistant's greedy
        tokens, the first at assistant position `start` [B], from its logits at start - 1 ([B, V_a]). A row with
        `heal_row` >= 0 replaces the token at `start` with one that extends it (vocab_map.Healing) and drafts the
        bytes past it. -> (Draft, cache, valid [B], feeds): the assistant's cache holds its context and drafts at
        [start, start + valid) that committed drafts keep valid (module docstring).

        Look-ahead: a row that reaches its limit on a target token that merges with some token after it (`_`, which
        `intervals` turns into Qwen's `_intervals`; vocab_map.VocabMap.extensible) runs one more assistant step. If
        that token merges, the draft ends as the target would cut it; if not, it is kept as one more draft (its
        forward is paid, and one more verify position costs little). Without it, a one-draft probe of `_` where the
        target writes `_intervals` is rejected for where it cut, not for what it said: on a Qwen2.5-Coder code
        completion with SmolLM2, most rejected drafts were such prefixes."""
        inputs = ctx.draft_inputs
        spelling, alone = inputs["spelling"], inputs["spelled_alone"]  # [V_a, M], [V_a]
        extensions = inputs["heal_extensions"][jnp.maximum(heal_row, 0)]  # [B, E]
        k, batch = self.max_draft, limit.shape[0]
        width = k + MAX_SPELLING  # room for the last step's pieces past the limit; they are cut
        rows = jnp.arange(batch)

        def step(carry):
            i, cache, logits, drafts, alone_slots, count, active, fed = carry
            choice = jnp.argmax(logits, axis=-1)  # [B] the assistant's token
            probability = jax.nn.softmax(logits, axis=-1)[rows, choice]
            pieces, spellable, token_alone = spelling[choice], spelling[choice, 0] >= 0, alone[choice]  # [B, M]
            # Healing rows choose among the extensions of their last token, and draft only the bytes past it.
            heal = (heal_row >= 0) & (i == 0)
            extension_logits = jnp.where(extensions >= 0, jnp.take_along_axis(logits, jnp.maximum(extensions, 0),
                                                                              axis=1), -jnp.inf)  # [B, E]
            best = jnp.argmax(extension_logits, axis=-1)
            choice = jnp.where(heal, extensions[rows, best], choice)
            probability = jnp.where(heal, jax.nn.softmax(extension_logits, axis=-1)[rows, best], probability)
            pieces = jnp.where(heal[:, None], inputs["heal_suffix_spelling"][heal_row, best], pieces)
            spellable = jnp.where(heal, inputs["heal_spellable"][heal_row, best], spellable)
            token_alone = token_alone & ~heal

            confident = probability >= inputs["confidence_threshold"]
            # A token the target cannot write ends the row's draft; so does one the assistant doubts, after it (or
            # before it, if it is the first: `drops_doubted_first`).
            active = active & spellable & (confident | (i > 0) | (not self.drops_doubted_first))
            for j in range(MAX_SPELLING):
                drafts, alone_slots, count = push_draft(inputs, self.merge_probes, drafts, alone_slots, count,
                                                        pieces[:, j], active & (pieces[:, j] >= 0), token_alone)
            last = jnp.take_along_axis(drafts, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
            ended = (pieces[:, 0] >= 0) & ctx.is_eos(last)  # (a healed token may add no bytes: nothing to check)
            # At its limit, a row whose last draft could merge with the next token looks one assistant step
            # further (`_draft_text`).
            looking = (count < limit) | ((count == limit) & inputs["extensible"][last])
            active = active & confident & ~ended & looking
            go_on = jnp.any(active) & (i + 1 < self.max_steps)

            def feed(cache):  # the next draft needs this one run through the assistant, at position start + i
                next_logits, _, cache = ctx.assistant(choice[:, None], (start + i)[:, None], cache)
                return cache, next_logits[:, 0]

            cache, logits = inplace.cond(go_on, feed, lambda cache: (cache, logits), cache)
            return i + 1, cache, logits, drafts, alone_slots, count, active, fed + (active & go_on)

        zeros = jnp.zeros((batch,), jnp.int32)
        initial = (0, cache, first_logits, jnp.zeros((batch, width), jnp.int32), jnp.zeros((batch, width), bool),
                   zeros, limit > 0, zeros)
        steps, cache, _, drafts, alone_slots, count, _, fed = jax.lax.while_loop(
            lambda c: (c[0] < self.max_steps) & jnp.any(c[6]), step, initial)
        count = jnp.minimum(count, most)
        # Draft j of the all-alone prefix is assistant step j's token, fed at position start + j (a healing row's
        # first token is never alone; if it added no bytes the prefix is one position short: safe).
        alone_prefix = leading_true(alone_slots[:, :k] & (jnp.arange(k)[None, :] < count[:, None]))
        feeds = jnp.maximum(steps - 1, 0)
        return Draft(tokens=drafts[:, :k], count=count), cache, jnp.minimum(alone_prefix, fed), feeds

    def _expand(self, ctx: Context, loop: DecodeState, state: UniversalState) -> UniversalState:
        """Append the expansions of the target tokens committed since the last round, [expanded, L).

        At most K+1 tokens: the prefill commits one, and each round at most K+1, and this runs every round. Each
        expansion's first token is merged into the token before it while their joined bytes are one assistant token
        (`\n` + `   ` -> `\n   `), so the assistant reads code as its own tokenizer writes it, not as the target
        cut it; a merge into a position its cache holds lowers `synced` there.
        """
        inputs = ctx.draft_inputs
        offsets, flat = inputs["expansion_offsets"], inputs["expansion_ids"]
        batch, size = loop.tokens.shape
        size_a = state.tokens.shape[1]
        rows = jnp.arange(batch)
        window = state.expanded[:, None] + jnp.arange(self.max_draft + 1)[None, :]  # [B, K+1] target positions
        new = window < loop.lengths[:, None]
        tokens = jnp.take_along_axis(loop.tokens, jnp.clip(window, 0, size - 1), axis=1)
        start = offsets[tokens]
        count = jnp.where(new, offsets[tokens + 1] - start, 0)  # [B, K+1] assistant tokens per target token
        piece = jnp.arange(self.max_expansion)  # [M]
        ids = flat[jnp.clip(start[..., None] + piece, 0, flat.shape[0] - 1)]  # [B, K+1, M]

        def append(j, carry):
            buffer, length, synced = carry
            pieces, n = ids[:, j], count[:, j]  # [B, M], [B]
            first = pieces[:, 0]
            for _ in range(MERGE_CASCADE):
                previous = buffer[rows, jnp.maximum(length - 1, 0)]
                merged = merge(inputs, "assistant_merges", self.assistant_merge_probes, previous, first)
                merging = (n > 0) & (length > 0) & (merged >= 0)
                first, length = jnp.where(merging, merged, first), length - merging
                synced = jnp.where(merging, jnp.minimum(synced, length), synced)
            at = jnp.where(piece[None, :] < n[:, None], length[:, None] + piece[None, :], size_a)  # padding: dropped
            buffer = buffer.at[rows[:, None], at].set(pieces.at[:, 0].set(first), mode="drop")
            return buffer, length + n, synced

        buffer, length, synced = jax.lax.fori_loop(0, self.max_draft + 1, append,
                                                   (state.tokens, state.length, state.synced))
        return dataclasses.replace(state, tokens=buffer, length=length, synced=synced, expanded=loop.lengths)

    def update(self, ctx: Context, state: UniversalState, result: RoundResult) -> UniversalState:
        # The accepted drafts are committed as their draft sources, which sit at length, length + 1, ...: those
        # entries stay valid, the rest were rejected (a budget or EOS crop can commit fewer than were accepted).
        kept = jnp.minimum(result.accepted, result.committed)
        synced = jnp.minimum(state.synced, state.length + kept)
        # The schedule judges the drafts it asked for; a look-ahead draft past them is evidence it did not pay for
        # (and a probe stays a one-draft probe).
        allowed = self.schedule.allowed(state.schedule, result.rows_deciding())
        asked = dataclasses.replace(result, drafted=jnp.minimum(result.drafted, allowed),
                                    accepted=jnp.minimum(result.accepted, allowed))
        return dataclasses.replace(state, synced=synced, schedule=self.update_length(state.schedule, asked))

    def summary(self, state: UniversalState) -> dict[str, jax.Array]:
        return {"num_assistant_tokens": state.schedule.num_tokens, "assistant_length": state.length}


def push_draft(inputs, probes: int, drafts, alone_slots, count, token, pushed, token_alone):
    """Append target token [B] to the drafts [B, W] of the rows where `pushed`, merged into the drafts before it
    while their joined bytes are one target token. `alone_slots` [B, W] marks drafts that are one assistant token
    standing alone (not merged); `count` [B] is each row's number of drafts. -> (drafts, alone_slots, count)."""
    rows = jnp.arange(drafts.shape[0])
    merged_any = jnp.zeros_like(pushed)
    for _ in range(MERGE_CASCADE):
        previous = jnp.take_along_axis(drafts, jnp.maximum(count - 1, 0)[:, None], axis=1)[:, 0]
        merged = merge(inputs, "target_merges", probes, previous, token)
        merging = pushed & (count > 0) & (merged >= 0)
        token, count, merged_any = jnp.where(merging, merged, token), count - merging, merged_any | merging
    at = jnp.where(pushed, count, drafts.shape[1])  # rows not pushing write past the buffer: dropped
    drafts = drafts.at[rows, at].set(token, mode="drop")
    alone_slots = alone_slots.at[rows, at].set(token_alone & ~merged_any, mode="drop")
    return drafts, alone_slots, count + pushed


def merge_inputs(prefix: str, table) -> dict[str, np.ndarray]:
    """A vocab_map.MergeTable as run-time inputs of the loop."""
    return {f"{prefix}_first": table.first, f"{prefix}_second": table.second, f"{prefix}_merged": table.merged}


def merge(inputs, prefix: str, probes: int, first: jax.Array, second: jax.Array) -> jax.Array:
    """[B] the token whose bytes are `first`'s then `second`'s, or -1: a probe of the merge table `prefix`."""
    table_first, table_second = inputs[f"{prefix}_first"], inputs[f"{prefix}_second"]
    size = table_first.shape[0]
    slot = merge_hash(first.astype(jnp.uint32), second.astype(jnp.uint32), size, jnp)
    at = (slot[:, None] + jnp.arange(probes)[None, :]) & (size - 1)  # [B, P]
    hit = (table_first[at] == first[:, None]) & (table_second[at] == second[:, None])
    return jnp.max(jnp.where(hit, inputs[f"{prefix}_merged"][at], -1), axis=1)


def _pair(request: BuildRequest):
    return tokenizer_pair(request.model, request.options["assistant_model"], request.tokenizer,
                          request.options.get("assistant_tokenizer"))


def build(request: BuildRequest) -> StrategyChoice:
    pair = _pair(request)
    if pair is None:
        raise ValueError("strategy 'universal' needs an assistant with another tokenizer; this assistant shares the "
                         "target's vocabulary: use strategy 'speculative'.")
    if request.options.get("assistant_ensemble_weight") is not None:
        raise NotImplementedError(
            "assistant_ensemble_weight with an assistant of another tokenizer: its drafts are its text re-tokenized "
            "for the target, with no draft distribution over the target's vocabulary to mix with the target's. Use "
            "the ensemble with an assistant that shares the target's tokenizer.")
    assistant = request.options["assistant_model"]
    drafter = universal_drafter(request.model, assistant, *pair, **assistant_settings(request))
    return StrategyChoice(UNIVERSAL, drafter, assistant)


UNIVERSAL = Strategy(
    name="universal",
    summary="an assistant model with another tokenizer drafts; drafts are re-tokenized (--assistant PATH)",
    selected_by="assistant_model",
    claims=lambda request: _pair(request) is not None,  # the assistant reads another vocabulary
    options=(ASSISTANT_MODEL, ASSISTANT_TOKENIZER, *DRAFT_LENGTH_OPTIONS),
    build=build,
    persist=persist_heuristic_length,
)
