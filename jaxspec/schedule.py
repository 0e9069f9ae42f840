"""The draft-length schedules every drafter shares, and the cost model the adaptive one decides with.

A row's draft length follows what verification accepted. The adaptive schedule prices each verify width (in plain
decoding steps) and each draft, and drafts the length with the most expected tokens per cost; jaxspec/costs.py
measures those prices on the decoding machine. See docs/design.md, 'The adaptive schedule'.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np

from .prompts import choice_setting

if TYPE_CHECKING:
    from .strategies.base import RoundResult

SCHEDULES = ("adaptive", "constant", "heuristic", "heuristic_transient")
NO_LIMIT = 2**30  # DraftLength.available where the drafter does not know how many drafts it has before drafting
# Adaptive schedule: a row that keeps missing stops drafting for 1, 2, 4, ... rounds, at most this many.
MAX_COOLDOWN = 32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftLength:
    """Each row's draft-length schedule state."""

    num_tokens: jax.Array  # [B] the row's draft length (constant, heuristic), or the adaptive schedule's last choice
    misses: jax.Array  # [B] adaptive: probes in a row that did not pay (or that the row sat out, with no draft)
    cooldown: jax.Array  # [B] adaptive: rounds until the next probe, while drafting does not pay
    # [B, D] float, adaptive: decayed counts of the drafts at each depth 1..D (D: the longest draft the widths hold)
    # that verification accepted, and that it judged (accepted or the rejected one); the prior's pseudo-counts are
    # the first depth's (`Schedule.acceptance`)
    accepted: jax.Array
    judged: jax.Array
    # A tree drafter's chain and its alternatives: accepted / judged count the chain's drafts (RoundResult.on_chain);
    # these count, in rounds that drafted a tree, the depths at which the chain's token or an alternative was accepted
    # and the depths judged (adaptive, tree schedules)
    branch_accepted: jax.Array
    branch_judged: jax.Array
    # [B] the most drafts each row can propose this round, where the drafter knows it before the schedule decides
    # (prompt lookup: its match's length; `with_available`); NO_LIMIT otherwise. A row that cannot draft gains
    # nothing from a wide block, so it neither buys one nor probes.
    available: jax.Array
    # [B] bool, adaptive: the row's last probe was judged in the shadow and its first draft was the token, so its
    # next probe, due at once, is verified
    verify_next: jax.Array
    # [B] bool, adaptive: some draft of the row was judged, verified or in the shadow. Before that the row has no
    # evidence, and its first probe is judged in the shadow (`SHADOW_PROBES`)
    judged_any: jax.Array


WIDTH_RULES = ("powers", "ends")
WIDTH_RULE = choice_setting("JAXSPEC_VERIFY_WIDTHS", WIDTH_RULES)  # read once: widths are in every loop's compile key


def verify_widths(max_draft: int) -> tuple[int, ...]:
    """The static widths a verify block may have: 1, the powers of two below K + 1, and K + 1. Each compiles once
    (jaxspec.generate picks the narrowest that holds a round's drafts).

    `JAXSPEC_VERIFY_WIDTHS=ends` keeps 1 and K + 1 only. On a CPU every draft then pays for the widest block; on an
    accelerator, where a block of K + 1 can cost about one step, fewer widths are fewer copies of the forward to
    compile and fewer branches to wait on in a round (docs/design.md, 'On a GPU'): an A/B for a device."""
    k1 = max_draft + 1
    if WIDTH_RULE == "ends":
        return tuple(sorted({1, k1}))
    return tuple(sorted({1, k1} | {2**i for i in range(k1.bit_length()) if 2**i < k1}))


def default_verify_costs(widths: tuple[int, ...]) -> tuple[float, ...]:
    """The cost of a verify block of each width, in plain decoding steps (width 1 = 1), where costs are not
    measured (`JAXSPEC_STEP_COSTS=default`, sharded runs; jaxspec/costs.py measures them otherwise).

    On a CPU the second token costs most: a plain step streams the weights through matrix-vector products, while a
    block of two rows runs a matrix-multiply kernel; the default errs on the dear side of what
    `python benchmarks/bench_verify_width.py` measures. On accelerators a few extra tokens are nearly free while
    decoding is memory-bound. See docs/design.md, 'Verify widths and the CPU head copy'."""
    if jax.default_backend() == "cpu":
        return tuple(1.0 if w == 1 else 1.2 + 0.05 * (w - 2) for w in widths)
    return tuple(1.0 + 0.02 * (w - 1) for w in widths)


def _price(default=()):
    """A field the compile key leaves out: its value enters the loop as an array (`Prices`)."""
    return dataclasses.field(default=default, compare=False)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prices:
    """The adaptive schedule's prices as the loop's run-time inputs (`Schedule.prices`, `Schedule.with_prices`)."""

    verify_costs: jax.Array  # [N] float32
    chain_costs: jax.Array  # [N] float32 (a tree schedule's chain blocks; else equal to verify_costs)
    draft_cost: jax.Array  # [] float32
    round_cost: jax.Array  # [] float32
    forced_drafts: jax.Array  # [] int32

    def on_host(self) -> Prices:
        """The prices as Python numbers (tuples for widths), as a Schedule holds them outside the loop (float32
        arrays read back to the 6 decimals they hold)."""
        def number(x):
            return round(float(x), 6)

        return Prices(verify_costs=tuple(map(number, np.asarray(self.verify_costs))),
                      chain_costs=tuple(map(number, np.asarray(self.chain_costs))),
                      draft_cost=number(self.draft_cost), round_cost=number(self.round_cost),
                      forced_drafts=int(self.forced_drafts))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How a row's draft length follows what verification accepted.

    - "adaptive" (jaxspec's default for every drafter): each row keeps a decayed estimate of the probability that its
      draft at each depth is accepted (`acceptance`: its `accepted` / `judged` counts, with a prior). A round's verify
      block is one forward for the whole batch, as wide as its longest draft, so the batch decides together: each round
      it drafts the length with the most expected tokens per cost summed over its deciding rows, the running rows
      furthest from done (`strategies.base.deciding_rows`: a batch ends with its last row, so drafts for rows ahead buy
      nothing). A block of d drafts commits 1 + a_1 + a_1 a_2 + ... + a_1 ... a_d tokens on average to a row, and costs
      `verify_costs` of its width (measured at the batch it runs: a [8, 4] block does not cost what a [1, 4] block
      costs) plus `draft_cost` per draft (drafting-model steps, in target steps). Every row then drafts that length (a
      width already paid verifies a row's extra drafts for nothing). When no length beats a plain step, the batch does
      not draft, except for a probe whenever a row's cooldown is over (`probe_length`: one draft where a block of 2
      could pay; only where some length could pay at all: `drafting_can_pay`); the cooldown follows 1, 2, 4, ... up to
      MAX_COOLDOWN rounds (doubling while probes miss; a row's hit counts only where the probe's tokens paid for the
      batch's round; `probe_spacing` times longer for drafters whose probe costs more), so that text which starts to
      repeat is noticed. Rows probe together, so their cooldowns stay in step and a batch probes no more often than one
      row would. On text the drafter cannot predict, drafting therefore costs one cheap probe every ~33 rounds; on text
      it predicts, the batch drafts the length that pays best.
    - "constant": always K (HF's default for assistants, and what HF's prompt lookup does).
    - "heuristic" / "heuristic_transient": HF's rule, +2 after a round in which every draft was accepted (a round
      without drafts counts, as in HF), else -1, never below 1, capped by K.
    """

    kind: str = "adaptive"
    # The first round's draft length (1..K) of constant and heuristic schedules. A run-time input of the loop
    # (`Drafter.runtime_inputs`), not part of the compiled program: HF's "heuristic" schedule changes it every call.
    initial: int = dataclasses.field(default=1, compare=False)
    widths: tuple[int, ...] = ()  # the verify widths of the loop (adaptive); () means the cap alone decides
    # The prices, in plain steps. Run-time inputs of the loop (`Prices`), not part of the compiled program: costs
    # measured on another machine or day reuse the executable, and jaxspec/costs.py measures them by running it.
    verify_costs: tuple[float, ...] = _price()  # the cost of each width
    draft_cost: float = _price(0.0)  # the cost of proposing one draft (0 for copied drafts)
    # The cost of any round that drafts at all, however many drafts it verifies: a block drafter (DFlash) drafts its
    # whole block in one forward; an autoregressive one pays its first step's fixed work.
    round_cost: float = _price(0.0)
    # Verify-block entries per draft: 1 for a chain; a tree that keeps F candidates at each depth verifies F per
    # depth, so its "drafts" are depths and width w's cost (`verify_costs`) is that of a block of F (w - 1) + 1
    # entries. Such a schedule also prices the chain alone at each depth (`chain_costs`, blocks of w entries) and
    # picks, each round, the depth and whether to branch.
    entries_per_draft: int = 1
    chain_costs: tuple[float, ...] = _price()
    node_budget: int = 0  # a tree's N where it keeps fewer than F per depth (its block: min(F d, N) + 1); 0: none
    # Whether the loop can judge a probe in the shadow for this drafter (`in_shadow`): not a tree's (its first
    # entry is not the only candidate for the token) nor universal decoding's (its drafts are re-encoded)
    shadow: bool = True
    # When >= 0 (a run-time input, -1 otherwise), every round drafts this many, chains only, and never probes: how
    # jaxspec/costs.py times a drafting round of the compiled loop itself.
    forced_drafts: int = _price(-1)

    PRIOR_ACCEPTANCE = 0.6  # before any evidence, a row assumes this acceptance ...
    PRIOR_WEIGHT = 2.0  # ... worth this many judged drafts
    # A deeper draft's acceptance (given the drafts before it accepted) leans on the depth above it with this many
    # judged drafts' weight, so that a depth with little evidence of its own is priced like the one above it
    DEPTH_PRIOR_WEIGHT = 1.0
    # How a row's acceptance is estimated (`acceptance`): "per-depth", each depth from its own counts; "pooled", one
    # rate from all depths' counts (the rule until 2026-12-07). Read when the loop is traced: what-ifs of
    # benchmarks/simulate_schedule.py (`--depth-rates`)
    DEPTH_RATES = "per-depth"
    DEPTH_RULES = ("per-depth", "pooled")
    DECAY = 0.8  # evidence from each earlier drafting round counts this much less
    # Which probes are judged in the shadow (`in_shadow`): "first-and-after-miss", a row's first probe and those after
    # a missed one; "after-miss", only those (the rule until 2026-12-07); "never", every probe verified. Read when the
    # loop is traced: what-ifs of benchmarks/simulate_schedule.py (`--shadow-probes`)
    SHADOW_PROBES = "first-and-after-miss"
    SHADOW_RULES = ("first-and-after-miss", "after-miss", "never")
    PROBE_UNIT = 0.1  # probes that cost up to this (in plain steps) back off 1, 2, 4, ... MAX_COOLDOWN rounds

    @property
    def depths(self) -> int:
        """D: the depths whose acceptance a row estimates, one for each draft the widest verify block holds (a tree's
        depths); 1 where the schedule does not price widths."""
        return max(self.widths) - 1 if self.priced else 1

    def init(self, batch: int, initial: jax.Array) -> DraftLength:
        zeros = jnp.zeros((batch,), jnp.int32)
        # The prior enters as pseudo-counts that decay like evidence: a row that keeps missing drives its estimate
        # to zero (a fixed prior would keep it above the break-even of cheap verify blocks forever).
        prior = jnp.full((batch,), self.PRIOR_WEIGHT, jnp.float32)
        first_depth = jnp.zeros((batch, self.depths), jnp.float32).at[:, 0].set(1.0)  # [B, D]
        return DraftLength(num_tokens=jnp.full((batch,), initial, jnp.int32), misses=zeros, cooldown=zeros,
                           accepted=self.PRIOR_ACCEPTANCE * prior[:, None] * first_depth,
                           judged=prior[:, None] * first_depth,
                           branch_accepted=self.PRIOR_ACCEPTANCE * prior, branch_judged=prior,
                           available=jnp.full((batch,), NO_LIMIT, jnp.int32), verify_next=jnp.zeros((batch,), bool),
                           judged_any=jnp.zeros((batch,), bool))

    @staticmethod
    def with_available(state: DraftLength, available: jax.Array) -> DraftLength:
        """`state` for a round in which each row can propose at most `available` ([B]) drafts, known before the
        schedule decides; the drafter returns this state, so that `update` judges the round by the same choice."""
        return dataclasses.replace(state, available=available.astype(jnp.int32))

    @property
    def priced(self) -> bool:
        """Whether the schedule decides by prices (adaptive, with verify widths to choose among)."""
        return self.kind == "adaptive" and bool(self.widths)

    def prices(self) -> Prices | None:
        """The prices as arrays for the loop's run-time inputs (None where the schedule is not priced)."""
        if not self.priced:
            return None
        return Prices(verify_costs=np.asarray(self.verify_costs, np.float32),
                      chain_costs=np.asarray(self._chain_costs, np.float32),
                      draft_cost=np.float32(self.draft_cost), round_cost=np.float32(self.round_cost),
                      forced_drafts=np.int32(self.forced_drafts))

    def with_prices(self, prices: Prices | None) -> Schedule:
        """This schedule deciding by `prices` (traced arrays inside the loop; host values from costs.py)."""
        if prices is None:
            return self
        chain = prices.chain_costs if self.branches else ()
        return dataclasses.replace(self, verify_costs=prices.verify_costs, chain_costs=chain,
                                   draft_cost=prices.draft_cost, round_cost=prices.round_cost,
                                   forced_drafts=prices.forced_drafts)

    @property
    def forced(self) -> jax.Array:
        """[] bool: the rounds draft `forced_drafts` (costs.py timing the loop)."""
        return jnp.asarray(self.forced_drafts) >= 0

    @property
    def probe_spacing(self) -> jax.Array:
        """[] int32: how many times longer than 1, 2, 4, ... rounds a row waits between probes: a probe that costs
        more than PROBE_UNIT of a plain step (its verify block and drafts, less the plain step it replaces) comes that
        many times less often, so that idle probing stays within a few percent for any drafter."""
        if not self.priced:
            return jnp.ones((), jnp.int32)
        probe_cost = self.round_price(self.probe_length()) - 1
        return jnp.maximum(1, jnp.ceil(probe_cost / self.PROBE_UNIT - 1e-6)).astype(jnp.int32)

    def probe_length(self) -> jax.Array:
        """[] int32: how many drafts a probe proposes: one where a one-draft round could pay on text the drafter
        predicts perfectly (two tokens for `round_price(1)`), as for the small models here; otherwise the fewest that
        fill a verify width whose round could (d drafts committing d + 1 tokens); 1 where none could
        (`drafting_can_pay` then keeps the batch from probing at all).

        Where a block of 2 costs more than its two tokens (a 1.5B target on a CPU, drafted by a 0.5B assistant), a
        one-draft probe could never pay for its round: every probe would count as a miss, and the schedule would
        never learn an acceptance that pays at 3-4 drafts. Lengths that fill their width, since a block has room for
        them for no more than their drafting; a shorter probe in the same block would only just pay, and simulated,
        did worse (docs/design.md, 'Probes that can pay, and the kernel again')."""
        candidates = sorted({1} | {w - 1 for w in self.widths if w > 1})
        drafts = jnp.asarray(candidates, jnp.int32)  # [C]
        can_pay = drafts + 1 > self.round_price(drafts)  # [C]
        return jnp.where(jnp.any(can_pay), drafts[jnp.argmax(can_pay)], 1).astype(jnp.int32)

    @property
    def entry_widths(self) -> tuple[int, ...]:
        """The verify block's entries at each of `widths` (they are the widths themselves for a chain)."""
        return tuple(tree_entries(w - 1, self.entries_per_draft, self.node_budget) for w in self.widths)

    @property
    def branches(self) -> bool:
        """Whether the schedule chooses each round between a chain and a tree (an adaptive tree schedule)."""
        return self.entries_per_draft > 1 and self.priced

    @property
    def _chain_costs(self) -> tuple[float, ...]:
        return self.chain_costs if self.branches else self.verify_costs

    def acceptance(self, state: DraftLength) -> jax.Array:
        """[B, D] each row's estimated probability that its draft at each depth (a tree's chain token) is accepted,
        given that the drafts before it were.

        Drafters are not geometric: a block drafter's later drafts, predicted without their predecessors, land less
        often than its first (the shipped DFlash drafter, held out: 0.34, then 0.20, 0.21, 0.14), an EAGLE-3 head's
        and copied drafts more often (0.41, then 0.47, 0.62). One rate pooled over depths is mostly the first draft's,
        so it overrates a block drafter's deep drafts and underrates the others'. Each depth's own counts decide
        where it has evidence; where it has little, the depth above it does (`DEPTH_PRIOR_WEIGHT`)."""
        if self.DEPTH_RATES == "pooled":
            rate = jnp.sum(state.accepted, axis=1) / jnp.sum(state.judged, axis=1)  # [B]
            return jnp.broadcast_to(rate[:, None], state.accepted.shape)
        rates = [state.accepted[:, 0] / state.judged[:, 0]]
        for depth in range(1, state.accepted.shape[1]):
            rates.append((state.accepted[:, depth] + self.DEPTH_PRIOR_WEIGHT * rates[-1])
                         / (state.judged[:, depth] + self.DEPTH_PRIOR_WEIGHT))
        return jnp.stack(rates, axis=1)

    def branch_acceptance(self, state: DraftLength) -> jax.Array:
        """[B] a tree schedule's estimated probability that a depth of a tree accepts its chain token or an
        alternative."""
        return state.branch_accepted / state.branch_judged

    def branching(self, state: DraftLength, active: jax.Array | None = None) -> jax.Array:
        """[] int32: the candidates per depth a tree drafter keeps this round: the schedule's choice (1, the chain
        alone, or entries_per_draft), or all of them where the schedule does not choose."""
        if not self.branches or self.kind != "adaptive":
            return jnp.asarray(self.entries_per_draft, jnp.int32)
        active = _all_rows(state) if active is None else active
        depth, branching = self.choice(state, active)
        return jnp.where((depth > 0) & ~self.forced, branching, 1).astype(jnp.int32)  # a probe drafts the chain
    def allowed(self, state: DraftLength, active: jax.Array | None = None) -> jax.Array:
        """[B] how many drafts each row may propose this round. `active`: [B] bool, the rows the batch's choice is
        for (all when None: `deciding_rows` in the loop); it prices their expected tokens only."""
        if not self.priced:
            return state.num_tokens
        active = _all_rows(state) if active is None else active
        best = self.paying_length(state, active)
        # Nothing pays: a probe for the whole batch when some row that can draft is out of its cooldown; one draft
        # where it is judged in the shadow, which judges only the first.
        due = self._due(state, active)
        probe = jnp.where(jnp.any(due), jnp.where(self._shadow_due(state, due), 1, self.probe_length()), 0)
        chosen = jnp.where(self.forced, self.forced_drafts, jnp.where(best > 0, best, probe))
        return jnp.broadcast_to(chosen, state.num_tokens.shape).astype(jnp.int32)

    def probing(self, state: DraftLength, active: jax.Array | None = None) -> jax.Array:
        """[] bool: the batch drafts this round only as a probe (adaptive: drafting does not pay, a cooldown is
        over)."""
        if not self.priced:
            return jnp.zeros((), bool)
        active = _all_rows(state) if active is None else active
        return (self.paying_length(state, active) == 0) & jnp.any(self._due(state, active)) & ~self.forced

    def in_shadow(self, state: DraftLength, active: jax.Array | None = None) -> jax.Array:
        """[] bool: this round's probe is judged in the shadow. It drafts, but the loop runs the plain step instead of
        verifying, and the schedule learns whether each row's first draft was the token that step committed. Such a
        probe costs its drafts' work, not a verify block (0.5-2 plain steps more than a plain one on a CPU), but a
        hit commits one token, not its drafts. So a probe goes in the shadow where the rows it is for have shown no
        hit to verify: a row's first probe, before any of its drafts was judged, and one that follows a missed probe.
        A hit there makes the next probe, due at once, verified (docs/design.md, 'Probes judged in the shadow')."""
        active = _all_rows(state) if active is None else active
        return self.probing(state, active) & self._shadow_due(state, self._due(state, active))

    def _shadow_due(self, state: DraftLength, due: jax.Array) -> jax.Array:
        """[] bool: every row due to probe has no hit to verify: it missed its last probe, or (`SHADOW_PROBES`) no
        draft of it was judged yet; and no hit in the shadow asked for a verified probe."""
        if self.SHADOW_PROBES == "never" or not self.shadow:
            return jnp.zeros((), bool)
        unproven = state.misses > 0
        if self.SHADOW_PROBES == "first-and-after-miss":
            unproven |= ~state.judged_any
        return jnp.all(jnp.where(due, unproven & ~state.verify_next, True))

    def shadow_price(self, drafts: jax.Array) -> jax.Array:
        """The cost in plain steps of a round judged in the shadow whose longest row drafts `drafts`: a plain step
        (the width-1 block) and the drafts' work."""
        return self.round_price(jnp.zeros_like(drafts)) + self.draft_cost * drafts + self.round_cost * (drafts > 0)

    def _due(self, state: DraftLength, active: jax.Array) -> jax.Array:
        """[B] rows that would probe: running, out of their cooldown, with something to propose, and only where some
        draft length could pay at all."""
        return active & (state.cooldown == 0) & (state.available > 0) & self.drafting_can_pay()

    def drafting_can_pay(self) -> jax.Array:
        """[] bool: whether any draft length would pay on text the drafter predicts perfectly, where d drafts commit
        d + 1 tokens. Where not even that beats d + 1 plain steps (an assistant that costs more than the target it
        drafts for, with its catch-up: docs/design.md, 'Probes'), a probe can find nothing worth drafting."""
        return jnp.any(jnp.asarray(self.widths) > self.round_costs())

    def paying_length(self, state: DraftLength, active: jax.Array | None = None) -> jax.Array:
        """[] the draft length with the most expected tokens per cost over the batch's `active` rows (adaptive); 0
        when drafting does not pay."""
        active = _all_rows(state) if active is None else active
        return self.choice(state, active)[0]

    def choice(self, state: DraftLength, active: jax.Array) -> tuple[jax.Array, jax.Array]:
        """([] depth, [] branching): the round with the most expected tokens per cost over the `active` rows.

        With a_i the acceptance at depth i (`acceptance`), the chain reaches depth i with probability
        r_i = a_1 ... a_i, so a chain of d drafts commits 1 + r_1 + ... + r_d tokens on average. A tree keeps its
        chain and F - 1 alternatives at each depth, the alternatives being leaves: its walk reaches depth i + 1 only
        along the chain (r_i), and there accepts some candidate with the branch acceptance b, so it commits
        1 + b (1 + r_1 + ... + r_(d-1)). Each is priced at its own verify block."""
        # [B, N] the drafts (depths) each width holds for each row: no more than the row has to propose
        drafts = jnp.minimum(jnp.asarray(self.widths) - 1, state.available[:, None])
        reach = jnp.cumprod(jnp.clip(self.acceptance(state), 0.0, 1.0), axis=1)  # [B, D] r_1 .. r_D
        reached = jnp.pad(jnp.cumsum(reach, axis=1), ((0, 0), (1, 0)))  # [B, D + 1] r_1 + ... + r_d for d = 0 .. D
        chain = 1 + jnp.take_along_axis(reached, drafts, axis=1)  # [B, N] tokens a round commits to each row
        # [B, N] expected depths reached past the first: 1 + r_1 + ... + r_(d-1), none without drafts
        along_chain = jnp.where(drafts > 0, 1 + jnp.take_along_axis(reached, jnp.maximum(drafts - 1, 0), axis=1), 0)
        value = jnp.sum(jnp.where(active[:, None], chain, 0.0), axis=0) / self.round_costs()  # [N] over the batch
        if not self.branches:
            return jnp.asarray(self.widths)[jnp.argmax(value)] - 1, jnp.asarray(self.entries_per_draft, jnp.int32)
        branch = jnp.clip(self.branch_acceptance(state), 0.0, 0.999)[:, None]
        tree = jnp.sum(jnp.where(active[:, None], 1 + branch * along_chain, 0.0), axis=0)
        values = jnp.stack([value, tree / self.round_costs(self.entries_per_draft)])  # [2, N]: chain, tree
        best = jnp.argmax(values.reshape(-1))  # ties go to the chain, the cheaper to draft
        depth = jnp.asarray(self.widths)[best % len(self.widths)] - 1
        return depth, jnp.where(best >= len(self.widths), self.entries_per_draft, 1).astype(jnp.int32)

    def round_costs(self, branching: int = 1) -> jax.Array:
        """[N] the cost of a round at each verify width, in plain steps, holding as many drafts as it can (a tree
        schedule: the chain's, or with `branching` > 1 the tree's)."""
        return self.round_price(jnp.asarray(self.widths) - 1, branching)

    def round_price(self, drafts: jax.Array, branching: jax.Array | int = 1) -> jax.Array:
        """The cost in plain steps of a round whose longest row drafts `drafts` (any shape; a tree: its depth): the
        verify block of the narrowest width that holds them (a tree schedule's: the chain's, or the tree's where
        `branching` > 1), a draft cost per draft, and the fixed cost of a drafting round."""
        width_index = jnp.searchsorted(jnp.asarray(self.widths), drafts + 1)
        block = jnp.asarray(self._chain_costs, jnp.float32)[width_index]
        if self.branches:
            block = jnp.where(jnp.asarray(branching) > 1, jnp.asarray(self.verify_costs, jnp.float32)[width_index],
                              block)
        return block + self.draft_cost * drafts + self.round_cost * (drafts > 0)

    def update(self, state: DraftLength, result: RoundResult, cap: int) -> DraftLength:
        """`cap`: K, the static size of the draft buffer."""
        active = result.committed > 0  # finished rows keep their state
        if self.kind == "constant":
            return state
        if self.kind in ("heuristic", "heuristic_transient"):
            grown = jnp.where(result.accepted == result.drafted, state.num_tokens + 2,
                              jnp.maximum(state.num_tokens - 1, 1))
            return dataclasses.replace(state, num_tokens=jnp.where(active, jnp.minimum(grown, cap),
                                                                   state.num_tokens))
        if result.in_shadow is not None:  # a probe judged in the shadow judged each row's first draft
            hits = jnp.where(result.in_shadow, result.shadow_hits.astype(jnp.int32), result.accepted)
            result = dataclasses.replace(
                result, drafted=jnp.where(result.in_shadow, jnp.minimum(result.drafted, 1), result.drafted),
                accepted=hits, on_chain=None if result.on_chain is None else jnp.where(result.in_shadow, hits,
                                                                                       result.on_chain))
        tried = active & (result.drafted > 0)
        # A tree's chain tokens judge the chain's acceptance: those accepted along the chain, then the one rejected.
        on_chain = result.accepted if result.on_chain is None else result.on_chain
        judged = on_chain + (on_chain < result.drafted)  # the accepted ones, then the rejected one
        column = jnp.arange(state.accepted.shape[1])[None, :]  # [1, D]: depth d + 1's column
        # [B, D] the depths this round judged. Only their evidence ages: a depth that rounds of fewer drafts leave
        # alone keeps what it last learned (simulated, this paid as well as ageing every depth each drafting round,
        # which the pooled rate keeps, as before)
        judged_depths = tried[:, None] & (column < judged[:, None])
        learned = tried[:, None] if self.DEPTH_RATES == "pooled" else judged_depths
        accepted = jnp.where(learned, self.DECAY * state.accepted + (column < on_chain[:, None]), state.accepted)
        # The round's choice, made from this same state for the same rows: a round that drafted only because nothing
        # paid was a probe, for every row that drafted in it, so that the rows' cooldowns stay in step.
        deciding = result.rows_deciding()
        if self.priced:
            depth, branching = self.choice(state, deciding)
        else:  # no widths to choose among: the cap alone decides, so no round is a probe
            depth, branching = jnp.int32(cap), jnp.int32(self.entries_per_draft)
        # A tree round's depths reached along the chain each accepted the chain's token or an alternative, or neither.
        branched = tried & (depth > 0) & (branching > 1)
        branch_accepted = jnp.where(branched, self.DECAY * state.branch_accepted + result.accepted,
                                    state.branch_accepted)
        branch_judged = jnp.where(branched, self.DECAY * state.branch_judged + judged, state.branch_judged)
        judged = jnp.where(learned, self.DECAY * state.judged + judged_depths, state.judged)
        # A probe is judged by what the batch (its deciding rows) got from it, as any round is: a row's hit in a probe
        # whose tokens did not pay for the batch's round still counts as a miss, so the rows back off together. Were a
        # hit to make its row due again at once, a batch of rows that each hit now and then would probe nearly every
        # round (docs/design.md, 'Batches'). A running row that had nothing to propose in a probe (prompt lookup's row
        # without a match) backs off with the rest: were it due whenever it next matched, a batch whose rows match at
        # different times would probe more often than one row. At batch 1 a hit's two tokens pay for any probe that
        # costs less than two plain steps, so a lone row that hits probes again at once.
        probe_round = jnp.any(tried) & (depth == 0)
        probe_tokens = jnp.sum(jnp.where(deciding, jnp.where(tried, result.accepted, 0) + 1, 0))
        probe_paid = (probe_tokens >= self.round_price(self.probe_length()) * jnp.sum(deciding)
                      if self.priced else True)
        hit = tried & (result.accepted > 0)
        missed = active & probe_round & ~(hit & probe_paid)
        misses = jnp.where(missed, state.misses + 1, jnp.where(hit, 0, state.misses))
        verify_next = jnp.where(active & probe_round, False, state.verify_next)
        if result.in_shadow is not None:
            # A hit in the shadow committed nothing, so it pays nothing: the row keeps its misses (a verified probe
            # that then misses backs off further, as it would have without the shadow) and is due at once, for a
            # verified probe. A row that missed backs off as after a verified miss.
            shadow_hit = result.in_shadow & hit
            missed = jnp.where(result.in_shadow, active & probe_round & ~hit, missed)
            misses = jnp.where(result.in_shadow, jnp.where(missed, state.misses + 1, state.misses), misses)
            verify_next = jnp.where(result.in_shadow, shadow_hit, verify_next)
        backoff = jnp.minimum(jnp.left_shift(1, jnp.clip(misses - 1, 0, 8)), MAX_COOLDOWN) * self.probe_spacing
        cooldown = jnp.where(missed, backoff, jnp.where(active, jnp.maximum(state.cooldown - 1, 0), state.cooldown))
        num_tokens = jnp.where(tried, result.drafted, state.num_tokens)
        return DraftLength(num_tokens=num_tokens, misses=misses, cooldown=cooldown, accepted=accepted, judged=judged,
                           branch_accepted=branch_accepted, branch_judged=branch_judged, available=state.available,
                           verify_next=verify_next, judged_any=state.judged_any | tried)


def _all_rows(state: DraftLength) -> jax.Array:
    return jnp.ones(state.num_tokens.shape, bool)


def tree_entries(depth: int, entries_per_draft: int, node_budget: int = 0) -> int:
    """The verify block's entries for `depth` drafts (a tree: depths of `entries_per_draft` candidates each, at most
    `node_budget` nodes where it is set), the root included."""
    entries = entries_per_draft * depth
    return (min(entries, node_budget) if node_budget else entries) + 1


def make_schedule(kind: str, initial: int, max_draft: int, draft_cost: float, round_cost: float = 0.0,
                  entries_per_draft: int = 1, node_budget: int = 0, shadow: bool = True) -> Schedule:
    """A schedule; the adaptive one gets the loop's verify widths, their default costs, the cost of one draft and
    the fixed cost of a drafting round. A tree drafter's drafts are depths, each `entries_per_draft` entries (at
    most `node_budget` in all, where it is set)."""
    if kind != "adaptive":  # a tree then drafts all its candidates every round
        return Schedule(kind, initial=initial, entries_per_draft=entries_per_draft, node_budget=node_budget)
    widths = verify_widths(max_draft)
    entries = tuple(tree_entries(w - 1, entries_per_draft, node_budget) for w in widths)
    return Schedule(kind, initial=initial, widths=widths, verify_costs=default_verify_costs(entries),
                    draft_cost=round(float(draft_cost), 3), round_cost=round(float(round_cost), 3),
                    entries_per_draft=entries_per_draft, node_budget=node_budget, shadow=shadow,
                    chain_costs=default_verify_costs(widths) if entries_per_draft > 1 else ())
