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

With `tree=(N, D)` the row proposes the continuations of up to F = N // D matches at once, as a trie (shared
prefixes merge, so siblings differ): matches ranked as above (longer n-grams first, then earlier), each continuation
start once, the first being the chain's. Every branch is a deterministic candidate, which tree verification accepts
exactly (jaxspec/tree.py).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..schedule import DraftLength, Schedule, make_schedule
from ..tree import ROOT, DraftTree
from .base import Context, DecodeState, Draft, Drafter, DraftStep, RoundResult, deciding_rows, room_for_drafts
from .spec import (NUM_ASSISTANT_TOKENS_SCHEDULE, TREE, BuildRequest, Option, Strategy, StrategyChoice,
                   check_positive_int, schedule_kind, tree_pricing, tree_shape)


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


def find_continuations(tokens: jax.Array, length: jax.Array, max_ngram: int, min_ngram: int,
                       count: int) -> tuple[jax.Array, jax.Array]:
    """One row: the starts of up to `count` continuations to copy -> (starts [M], found [M]), best first: longer
    n-grams first, earlier matches first, each continuation start once (a match of n tokens at j and one of n - 1 at
    j + 1 continue alike). The first is `find_continuation`'s."""
    size = tokens.shape[0]
    starts = jnp.arange(size)
    never = jnp.iinfo(jnp.int32).max
    priority = jnp.full((size,), never, jnp.int32)  # by continuation start: the best match's rank, smaller is better
    for n in range(max_ngram, min_ngram - 1, -1):
        matches = (starts + n < length) & (n <= length - 1)
        for m in range(n):
            matches &= jnp.roll(tokens, -m) == tokens[length - n + m]
        rank = (max_ngram - n) * size + starts
        priority = priority.at[jnp.where(matches, starts + n, size)].min(rank, mode="drop")
    best, order = jax.lax.top_k(-priority, count)
    return order.astype(jnp.int32), best > -never


def continuation_trie(candidates: jax.Array, lengths: jax.Array) -> DraftTree:
    """Candidates [B, M, D] (the first lengths [B, M] tokens of each valid) -> their trie as a DraftTree of M * D
    nodes: candidate m's token at depth d is a node unless an earlier candidate has the same first d + 1 tokens, whose
    node it then shares. In candidate-major order a node's parent comes before it, and stays before it once the
    nodes are packed to the front; siblings are ranked by candidate."""
    batch, m, depth = candidates.shape
    exists = jnp.arange(depth)[None, None, :] < lengths[:, :, None]  # [B, M, D]
    same_prefix = jnp.cumprod(candidates[:, :, None, :] == candidates[:, None, :, :], axis=-1) > 0  # [B, M, M', D]
    same_prefix &= exists[:, :, None, :] & exists[:, None, :, :]
    owner = jnp.argmax(same_prefix, axis=2)  # [B, M, D] the first candidate with this prefix (itself if none earlier)
    is_node = exists & (owner == jnp.arange(m)[None, :, None])
    flat = lambda x: x.reshape(batch, m * depth)  # noqa: E731
    packed = jnp.cumsum(flat(is_node), axis=1) - 1  # [B, M*D] each node's index once packed
    nodes = m * depth
    target = jnp.where(flat(is_node), packed, nodes)  # non-nodes are dropped
    # The parent of (m, d) is the node of the candidate owning its first d tokens, at depth d - 1.
    parent_flat = jnp.roll(owner, 1, axis=2) * depth + jnp.arange(depth)[None, None, :] - 1  # [B, M, D]
    parent_index = jnp.take_along_axis(packed, jnp.maximum(flat(parent_flat), 0), axis=1).reshape(parent_flat.shape)
    parent = jnp.where(jnp.arange(depth)[None, None, :] == 0, ROOT, parent_index)
    rows = jnp.arange(batch)[:, None]
    tokens = jnp.zeros((batch, nodes), jnp.int32).at[rows, target].set(flat(candidates), mode="drop")
    parents = jnp.full((batch, nodes), ROOT, jnp.int32).at[rows, target].set(flat(parent), mode="drop")
    count = jnp.sum(is_node, axis=(1, 2)).astype(jnp.int32)
    valid = jnp.arange(nodes)[None, :] < count[:, None]
    earlier_sibling = (parents[:, None, :] == parents[:, :, None]) & valid[:, None, :] & (
        jnp.arange(nodes)[None, None, :] < jnp.arange(nodes)[None, :, None])  # [B, i, j]: j < i shares i's parent
    ranks = jnp.sum(earlier_sibling, axis=2).astype(jnp.int32)
    return DraftTree(tokens=tokens, parents=parents, ranks=ranks, count=count)


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
        if self.tree is not None:
            return self._draft_tree(ctx, loop, state)
        k = self.max_draft
        start, found = jax.vmap(find_continuation, in_axes=(0, 0, None, None))(loop.tokens, loop.lengths,
                                                                             self.max_ngram, self.min_ngram)
        offsets = start[:, None] + jnp.arange(k)[None, :]  # [B, K]
        tokens = jnp.take_along_axis(loop.tokens, jnp.minimum(offsets, loop.tokens.shape[1] - 1), axis=1)
        valid = found[:, None] & (offsets < loop.lengths[:, None])  # never copy past the sequence's end
        valid &= jnp.cumsum(ctx.is_eos(tokens), axis=1) == 0  # stop before an EOS
        # Drafts past the row's budget could never be committed: do not pay to verify them.
        count = jnp.minimum(jnp.sum(jnp.cumprod(valid, axis=1), axis=1), room_for_drafts(loop)).astype(jnp.int32)
        # The schedule knows what each row has to copy before it chooses the batch's length (Schedule.with_available).
        state = Schedule.with_available(state, count)
        count = jnp.minimum(count, self.schedule.allowed(state, deciding_rows(loop)))
        return DraftStep(draft=Draft(tokens=tokens, count=count), state=state, forwards=jnp.zeros((), jnp.int32),
                         target_cache=loop.cache)

    def _draft_tree(self, ctx: Context, loop: DecodeState, state: DraftLength) -> DraftStep:
        """The continuations of the row's best F matches, D tokens deep at most, as a trie."""
        depth, branches = self.max_draft, self.tree.branching
        starts, found = jax.vmap(find_continuations, in_axes=(0, 0, None, None, None))(
            loop.tokens, loop.lengths, self.max_ngram, self.min_ngram, branches)  # [B, F]
        offsets = starts[:, :, None] + jnp.arange(depth)[None, None, :]  # [B, F, D]
        size = loop.tokens.shape[1]
        candidates = jnp.take_along_axis(loop.tokens[:, None, :], jnp.minimum(offsets, size - 1), axis=2)
        valid = found[:, :, None] & (offsets < loop.lengths[:, None, None])
        valid &= jnp.cumsum(ctx.is_eos(candidates), axis=2) == 0
        lengths = jnp.minimum(jnp.sum(jnp.cumprod(valid, axis=2), axis=2), room_for_drafts(loop)[:, None])  # [B, F]
        state = Schedule.with_available(state, jnp.max(lengths, axis=1))  # the deepest match, as for a chain
        # The schedule's branching this round: the best match alone (a chain), or all of them.
        deciding = deciding_rows(loop)
        lengths = jnp.where(jnp.arange(branches)[None, :] < self.schedule.branching(state, deciding), lengths, 0)
        allowed = self.schedule.allowed(state, deciding)  # [B] depth
        tree = continuation_trie(candidates, jnp.minimum(lengths, allowed[:, None]).astype(jnp.int32))
        if self.tree.selects:  # a budget below F D keeps the nodes of the best-ranked matches (a prefix is a tree)
            tree = tree.truncated(self.tree.nodes)
        return DraftStep(draft=Draft.of_tree(tree), state=state, forwards=jnp.zeros((), jnp.int32),
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
    tree = tree_shape(request, "prompt lookup")
    if tree is not None:  # the tree's depth is the most tokens a branch copies
        k = tree.depth
    drafter = PromptLookupDrafter(max_draft=k, max_ngram=ngram, min_ngram=shortest, tree=tree,
                                  schedule=make_schedule(kind, k, k, draft_cost=0.0,
                                                         **tree_pricing(tree)))
    return StrategyChoice(PROMPT_LOOKUP, drafter)


PROMPT_LOOKUP = Strategy(
    name="prompt_lookup",
    summary="copy the continuation of an n-gram match in the prompt and output so far",
    selected_by="prompt_lookup_num_tokens",
    options=(PROMPT_LOOKUP_NUM_TOKENS, MAX_MATCHING_NGRAM_SIZE, MIN_MATCHING_NGRAM_SIZE,
             NUM_ASSISTANT_TOKENS_SCHEDULE, TREE),
    build=build,
)
