"""The drafter interface and the loop state it reads.

A strategy is a drafter: a frozen dataclass of static settings with pure functions over its own state pytree.

    init(ctx, batch, size)           -> state       before the prompt is read
    prefill_chunk(ctx, state, chunk) -> state       once per chunk of the prompt the target reads (its hidden states)
    draft(ctx, loop, state, rng)     -> DraftStep   propose up to K tokens per row
    update(ctx, state, result)       -> state       learn what was committed (roll caches back, adapt the length)

`Draft.probs is None` means deterministic drafts (one-hot q), which is what keeps sampling exact for n-gram drafts.
A drafter with a `tree` shape proposes a `DraftTree` (`Draft.of_tree`) of up to N nodes and D deep; its K is D.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from .. import inplace
from ..cache import KVCache
from ..head import for_rows
from ..model_interface import CausalLM
from ..processors import History, Processing, process
from ..schedule import DraftLength, verify_widths
from ..tree import DraftTree, TreeBlock, TreeShape


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Draft:
    tokens: jax.Array  # [B, K] proposed tokens; entries at or past `count` are padding
    count: jax.Array  # [B] int32, number of valid drafts per row (0 means a plain decoding step)
    probs: jax.Array | None = None  # [B, K, V] processed draft distribution q, or None for deterministic drafts
    # A tree drafter's proposal (jaxspec/tree.py), whose tokens, count and probs are also the fields above (over its
    # N nodes instead of K chain positions); None for a chain.
    tree: DraftTree | None = None

    @staticmethod
    def of_tree(tree: DraftTree) -> "Draft":
        return Draft(tokens=tree.tokens, count=tree.count, probs=tree.probs, tree=tree)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftStep:
    """What `Drafter.draft` returns: the round's proposal and everything it changed."""

    draft: Draft
    state: Any  # the drafter's new state pytree
    forwards: jax.Array  # [] int32 drafter network forwards this round (0 for copied drafts)
    target_cache: Any  # the target's cache: changed only by drafters that run the target's own layers (early exit)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Counters:
    rounds: jax.Array  # [] verification rounds (target forwards after the prefill)
    draft_forwards: jax.Array  # [] drafter network forwards (0 for model-free drafters)
    drafted: jax.Array  # [B] valid draft tokens proposed to each row
    accepted: jax.Array  # [B] draft tokens the target accepted
    accepted_hist: jax.Array  # [B, K+1] rounds in which a row accepted exactly i drafts
    # [] float32: the rounds' price in plain decoding steps by the adaptive schedule's cost model (loop.py
    # `_priced_round`); 0 where the schedule prices nothing
    priced_steps: jax.Array
    tree_rounds: jax.Array  # [] int32 rounds whose verify block held alternatives beside the chain (a tree)

    @staticmethod
    def zeros(batch: int, max_draft: int) -> "Counters":
        zero = jnp.zeros((), jnp.int32)
        return Counters(
            rounds=zero,
            draft_forwards=zero,
            drafted=jnp.zeros((batch,), jnp.int32),
            accepted=jnp.zeros((batch,), jnp.int32),
            accepted_hist=jnp.zeros((batch, max_draft + 1), jnp.int32),
            priced_steps=jnp.zeros((), jnp.float32),
            tree_rounds=zero,
        )


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """The while_loop carry. Invariant: row b has committed tokens[b, :lengths[b]]; the target cache holds
    positions [0, lengths[b] - 1) (the newest token is fed in the next round)."""

    tokens: jax.Array  # [B, S] prompt (left-aligned) + generated tokens
    lengths: jax.Array  # [B]
    prompt_lengths: jax.Array  # [B]
    budget_end: jax.Array  # [B] prompt length + max_new_tokens: a row is done when its length reaches it
    done: jax.Array  # [B] bool
    cache: KVCache
    drafter: Any  # the drafter's own state pytree
    rng: jax.Array
    counters: Counters
    scores: jax.Array | None = None  # [B, N, V] processed target logits of each new token (return_logits only)

    @property
    def last_token(self) -> jax.Array:  # [B]
        return jnp.take_along_axis(self.tokens, self.lengths[:, None] - 1, axis=1)[:, 0]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefillChunk:
    """One chunk of the prompt as the target read it (every row reads the same positions)."""

    tokens: jax.Array  # [B, C]
    positions: jax.Array  # [B, C]
    hidden: jax.Array  # [B, C, D] the target's final-normed hidden states
    valid: jax.Array  # [B, C] bool: a prompt position (past a row's prompt the chunk holds padding)
    features: jax.Array | None = None  # [B, C, F*D] the tapped layers' outputs (Drafter.feature_layers), or None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class RoundResult:
    """One verified round, per row: what was accepted and committed, and the target's view of it."""

    drafted: jax.Array  # [B] valid drafts the row proposed this round (a tree: its depth)
    accepted: jax.Array  # [B] drafts accepted by verification (before the budget / EOS crop)
    committed: jax.Array  # [B] tokens appended this round (0 for finished rows)
    tokens: jax.Array  # [B, K+1] the round's verified tokens (accepted drafts, then the target's token)
    hidden: jax.Array  # [B, K+1, D] target final-normed hidden states at [last, d_1 .. d_K] (padded)
    lengths: jax.Array  # [B] lengths after the commit
    # [B, K+1, F*D] the tapped layers' outputs at [last, d_1 .. d_K] (padded), or None without taps. Slot j sits at
    # position lengths - committed - 1 + j; slots j < committed hold committed tokens.
    features: jax.Array | None = None
    # [B] the accepted drafts that are the drafter's own chain, leading (all of them for a chain; a tree's path
    # leaves the chain at the first alternative it takes): a drafter that fed its chain through its own cache keeps
    # those entries only
    on_chain: jax.Array | None = None
    # [B] bool: the rows the round's draft length was chosen for (`deciding_rows` before the round), or None (every
    # row that committed), so that `Schedule.update` judges the round by the choice that made it
    deciding: jax.Array | None = None
    # [] bool, or None where the drafter has no adaptive schedule: the round was a probe judged in the shadow
    # (`Schedule.in_shadow`). It verified nothing: for the drafter it drafted and had its first draft rejected
    # (accepted 0, one token committed, the plain step's); the schedule learns from `shadow_hits` instead.
    in_shadow: jax.Array | None = None
    shadow_hits: jax.Array | None = None  # [B] bool: the row's first draft was the token its plain step committed

    def rows_deciding(self) -> jax.Array:
        """[B] bool: `deciding`, or where it is unset every row that committed (every row that was running)."""
        return self.committed > 0 if self.deciding is None else self.deciding


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TargetOutput:
    """One target forward, as verification and the prefill use it."""

    logits: jax.Array  # [B, T, V]
    hidden: jax.Array  # [B, T, D] final-normed
    cache: Any
    features: jax.Array | None = None  # [B, T, F*D] outputs of the tapped decoder layers, concatenated; or None


def run_target(target: CausalLM, tokens: jax.Array, positions: jax.Array, cache, head: jax.Array | None,
               feature_layers: tuple[int, ...] = (), tree: TreeBlock | None = None) -> TargetOutput:
    """The target's forward over tokens [B, T], tapping `feature_layers` when a drafter reads them (`tree`: a
    tree-shaped block, jaxspec/tree.py)."""
    head = for_rows(head, tokens.size)
    if not feature_layers:
        if tree is None:  # families without tree attention keep their call signature's default
            logits, hidden, cache = target(tokens, positions, cache, head=head)
        else:
            logits, hidden, cache = target(tokens, positions, cache, head=head, tree=tree)
        return TargetOutput(logits, hidden, cache)
    x, cache, features = run_tapped_layers(target, target.embed_tokens(tokens), positions, cache, feature_layers,
                                           tree=tree)
    hidden = target.final_hidden(x)
    return TargetOutput(target.logits(hidden, head), hidden, cache, features)


def run_tapped_layers(target: CausalLM, x: jax.Array, positions: jax.Array, cache,
                      feature_layers: tuple[int, ...], tree: TreeBlock | None = None
                      ) -> tuple[jax.Array, Any, jax.Array]:
    """Every decoder layer on x (`embed_tokens` output), in segments that end at each tapped layer:
    -> (last layer's output [B, T, D], cache, the tapped layers' outputs concatenated [B, T, F*D]).

    Layer l's output is what transformers returns as `hidden_states[l + 1]` with `output_hidden_states=True`. The
    segments compute exactly what one run would (run_layers resumes at any layer), so taps cost no extra work. A
    family whose layers run as a loop (`looped_taps`, Llama's) runs one loop that keeps the taps instead: looped,
    each segment would be a loop of its own to compile."""
    extra = {} if tree is None else {"tree": tree}
    if hasattr(target, "looped_taps"):
        looped = target.looped_taps(x, positions, cache, feature_layers, **extra)
        if looped is not None:
            return looped
    taps, start = [], 0
    for layer in feature_layers:
        x, cache = target.run_layers(x, positions, cache, start, layer + 1, **extra)
        taps.append(x)
        start = layer + 1
    x, cache = target.run_layers(x, positions, cache, start, None, **extra)
    return x, cache, jnp.concatenate(taps, axis=-1)


@dataclasses.dataclass(frozen=True)
class Context:
    """Everything a drafter may read that is not loop state. Built inside the traced function."""

    target: CausalLM
    assistant: Any  # the assistant's module (a CausalLM, or the Gemma 4 drafter), or None
    processing: Processing  # run-time logits settings (arrays)
    do_sample: bool
    ngram_slots: int
    draft_inputs: dict[str, jax.Array]  # the drafter's run-time settings (`Drafter.runtime_inputs`)
    head: jax.Array | None = None  # [D, V] the target's head for verifying forwards, on CPU (jaxspec/head.py)

    def process(self, logits: jax.Array, tokens: jax.Array, start: jax.Array, prompt_lengths: jax.Array) -> jax.Array:
        """Processed logits [B, W, V] for positions whose prefix is tokens[b, :start[b] + j]."""
        history = History(tokens=tokens, start=start, prompt_lengths=prompt_lengths)
        return process(logits, history, self.processing, self.do_sample, self.ngram_slots)

    def is_eos(self, tokens: jax.Array) -> jax.Array:
        return jnp.isin(tokens, self.processing.eos)


@dataclasses.dataclass(frozen=True)
class Drafter:
    """Base class: the k = 0 drafter (plain decoding). Subclasses override what they need."""

    max_draft: int = 0  # K, the static size of every draft buffer (a tree drafter: its depth D)
    # A tree's static budget (jaxspec/tree.py): the drafter proposes a DraftTree of up to tree.nodes nodes, verified
    # in one tree-shaped forward; None: a chain of up to K drafts.
    tree: TreeShape | None = None
    # Decoder layers (0-based, ascending) whose outputs the drafter reads (block and EAGLE-style drafters): the loop
    # taps them in every target forward and hands them over with the prompt's chunks and each verified round.
    feature_layers: tuple[int, ...] = ()

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """The static widths of the loop's verify blocks: 1, the powers of two below K + 1, and K + 1 for a chain
        (`schedule.verify_widths`); for a tree, also the blocks of those depths with F entries per depth (N at most),
        so that the schedule's price of a depth, chain or tree, is the block the loop runs for it."""
        widths = verify_widths(self.max_draft)
        if self.tree is None:
            return widths
        # A round may verify the chain alone (the adaptive schedule's choice), or the tree.
        return tuple(sorted(set(widths) | {self.tree.entries(w - 1) for w in widths}))

    @property
    def branches(self) -> int:
        """Candidates kept per draft step: a tree's F at every depth, 1 for a chain."""
        return 1 if self.tree is None else self.tree.branching

    @property
    def selects(self) -> bool:
        """Whether the drafter keeps the most probable of its candidates (a tree whose budget is below D F)."""
        return self.tree is not None and self.tree.selects

    @property
    def draft_slots(self) -> int:
        """The most entries a verify block holds after the row's newest token: K for a chain, N for a tree."""
        return self.tree.nodes if self.tree is not None else self.max_draft

    def schedule_state(self, state) -> DraftLength | None:
        """The schedule's state within the drafter's `state` (the state itself, or its `length`), for the loop to ask
        whether a probe is judged in the shadow; None where the drafter has none (plain decoding)."""
        if isinstance(state, DraftLength):
            return state
        length = getattr(state, "length", None)
        return length if isinstance(length, DraftLength) else None

    def runtime_inputs(self) -> dict[str, np.ndarray]:
        """Settings that enter the loop as arrays, so new values reuse the executable. A drafter reads them from
        `ctx.draft_inputs`, never from its own fields (which are excluded from the compile key: `compare=False`)."""
        return {}

    def for_prompts(self, prompts: list[np.ndarray], size: int) -> "Drafter":
        """The drafter for one call, on the host before anything compiles: it may read the prompts (each row's
        ids) and the token buffer size. Universal decoding re-encodes the prompts for its assistant here."""
        return self

    def init(self, ctx: Context, batch: int, size: int) -> Any:
        return ()

    def prefill_chunk(self, ctx: Context, state: Any, chunk: PrefillChunk) -> Any:
        return state

    def draft(self, ctx: Context, loop: DecodeState, state: Any, rng: jax.Array) -> DraftStep:
        """Propose up to K tokens per row (none, for the plain step)."""
        batch = loop.lengths.shape[0]
        empty = Draft(tokens=jnp.zeros((batch, self.max_draft), jnp.int32), count=jnp.zeros((batch,), jnp.int32))
        return DraftStep(draft=empty, state=state, forwards=jnp.zeros((), jnp.int32), target_cache=loop.cache)

    def update(self, ctx: Context, state: Any, result: RoundResult) -> Any:
        return state

    def summary(self, state: Any) -> dict[str, jax.Array]:
        """Small per-row arrays worth returning to the caller (e.g. the adapted draft length)."""
        return {}

    def target_forward(self, ctx: Context, tokens, positions, cache, state, tree: TreeBlock | None = None
                       ) -> TargetOutput:
        """The verifying forward (`tree`: a tree-shaped block). Early exit overrides it to reuse its layers."""
        return run_target(ctx.target, tokens, positions, cache, ctx.head, self.feature_layers, tree=tree)


def deciding_rows(loop: DecodeState) -> jax.Array:
    """[B] bool: the running rows furthest from their budget, the ones whose progress the batch's draft length is
    chosen for (`Schedule.allowed`).

    A batch's rounds run until its last row is done. Drafts that speed only rows already ahead do not bring that end
    nearer, while every row pays for the wider verify block, so the batch drafts where the estimates of the rows
    furthest behind pay (the budget is what the loop knows of a row's end; one that stops at EOS counts until then).
    At the start all rows tie and all decide. Weighing every running row instead drafted free-text batches at a loss,
    while batches that copy in bursts give up a little at batch 8 (docs/design.md, 'The rows a batch drafts for')."""
    remaining = jnp.where(loop.done, -1, loop.budget_end - loop.lengths)  # [B]
    return ~loop.done & (remaining == jnp.max(remaining))


def room_for_drafts(loop: DecodeState) -> jax.Array:
    """[B] drafts a row can still use: never more than its budget allows after the target's own token."""
    return jnp.where(loop.done, 0, jnp.maximum(loop.budget_end - loop.lengths - 1, 0))


# A drafter's pending ring holds this many rounds of committed slots (K + 1 each) before it must project them.
PENDING_ROUNDS = 4


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PendingFeatures:
    """Committed tokens' tapped features that a drafter has not yet projected into its own cache (DFlash's context,
    EAGLE-3's g): each row's first `count` slots, at `positions`.

    Projecting the one token a plain round commits reads the drafter's projection weights for one row, every round,
    also where the schedule declines to draft: a cost in every idle round, the unit the schedule's prices are
    measured in, so one its model cannot see (figures: docs/design.md, 'Feature writes deferred'). The drafter reads
    its cache only when it drafts, so the rounds append the committed slots here (a copy of their features) and the
    projection runs for all of them at once: before a round that drafts, or when the ring could not hold another
    round. Rollback is unaffected: only committed tokens enter."""

    features: jax.Array  # [B, P, F*D] P = PENDING_ROUNDS * (K + 1)
    positions: jax.Array  # [B, P] int32, the position of each filled slot
    count: jax.Array  # [B] int32 slots filled
    drop: int = dataclasses.field(metadata=dict(static=True))  # a position past the drafter's cache: writes drop it


def pending_features(drafter: Drafter, batch: int, width: int, dtype, drop: int) -> PendingFeatures:
    """An empty ring for `drafter` (K = its max_draft) of features `width` wide (F*D); `drop`: a position the
    drafter's writes drop (its cache's size)."""
    slots = PENDING_ROUNDS * (drafter.max_draft + 1)
    return PendingFeatures(features=jnp.zeros((batch, slots, width), dtype),
                           positions=jnp.full((batch, slots), drop, jnp.int32),
                           count=jnp.zeros((batch,), jnp.int32), drop=drop)


def defer_committed(drafter: Drafter, result: RoundResult, pending: PendingFeatures,
                    write: Callable[[jax.Array, jax.Array, Any], Any], state: Any
                    ) -> tuple[Any, PendingFeatures]:
    """The round's committed slots appended to `pending`; projected with the rest (`flush_pending`) where the ring
    could not hold another round's K + 1. result.features [B, K+1, F*D]: slot j sits at position
    lengths - committed - 1 + j, and slots j < committed hold committed tokens."""
    batch, slots = result.committed.shape[0], result.features.shape[1]
    capacity = pending.positions.shape[1]
    offsets = jnp.arange(slots)[None, :]  # [1, K+1]
    first = result.lengths - result.committed - 1  # [B]
    index = jnp.where(offsets < result.committed[:, None], pending.count[:, None] + offsets, capacity)  # [B, K+1]
    rows = jnp.arange(batch)[:, None]
    pending = dataclasses.replace(
        pending, features=pending.features.at[rows, index].set(result.features.astype(pending.features.dtype),
                                                               mode="drop"),
        positions=pending.positions.at[rows, index].set(first[:, None] + offsets, mode="drop"),
        count=pending.count + result.committed)
    return flush_pending(drafter, pending, write, state, jnp.max(pending.count) > capacity - slots)


def flush_pending(drafter: Drafter, pending: PendingFeatures, write: Callable[[jax.Array, jax.Array, Any], Any],
                  state: Any, when: jax.Array) -> tuple[Any, PendingFeatures]:
    """`write(features, positions, state) -> state` over the pending slots when `when` ([] bool) and any are
    pending, then an empty ring. The projection runs over K + 1 slots where no row has more pending (a round that
    drafts after a round that drafted), else over the whole ring; slots past a row's count are dropped."""
    narrow, wide = drafter.max_draft + 1, pending.positions.shape[1]
    most = jnp.max(pending.count)
    index = jnp.where(when & (most > 0), (most > narrow).astype(jnp.int32), -1)  # -1: no branch runs

    def flush(width: int):
        filled = jnp.arange(width)[None, :] < pending.count[:, None]  # [B, width]
        positions = jnp.where(filled, pending.positions[:, :width], pending.drop)
        return lambda s: (write(pending.features[:, :width], positions, s), ())

    state, _ = inplace.switch(index, [flush(narrow), flush(wide)], state)
    return state, dataclasses.replace(pending, count=jnp.where(index >= 0, 0, pending.count))
