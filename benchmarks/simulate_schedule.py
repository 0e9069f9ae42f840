"""The adaptive schedule's decisions without the machine's noise: its own `Schedule`, driven on the host.

    python benchmarks/simulate_schedule.py [--tokens 32] [--seeds 12] [--only "CPU MTP"] [--probe-unit 0.05]
                                           [--shadow-probes after-miss] [--depth-rates pooled]

Each scenario is a batch of rows that accept each draft with a fixed probability (or, for text that repeats in bursts, a
probability that follows the row's position: so many tokens at one rate, then so many at another, over and over; or, for
drafters whose later drafts land more or less often than their first, a probability for each depth, given the drafts
before it were accepted: `ByDepth`), and the prices of a loop at that batch (each verify width and one draft, in plain
steps: what jaxspec/costs.py measures). Every round asks the schedule how many drafts the batch proposes (for its rows
furthest from done, as the loop's `deciding_rows` does), draws each row's accepted drafts, and updates the schedule with
the round, as the compiled loop does, until every row has its tokens; the batch then ends with its slowest row, as a
static batch does. The table shows rounds, rounds that drafted and how many of them were probes, and the speedup the
prices give over plain decoding (one plain step per token). On a CPU whose speed moves by 0.3 between passes, this is
how a change to the schedule's rule shows what it does to its decisions (docs/design.md, 'Batches').
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import numpy as np


@dataclasses.dataclass(frozen=True)
class ByDepth:
    """A row's acceptance at each draft depth 1, 2, ... (given the drafts before it were accepted); the last one holds
    for every depth past the tuple."""

    rates: tuple[float, ...]


# (name, rows' acceptance rates, verify costs of each width, draft cost[, K[, a drafting round's fixed cost]]), all in
# plain steps; K (the longest draft) is 2, widths 1, 2 and 3, unless a scenario names it
SCENARIOS = (
    ("MTP, free text, batch 8", (0.3, 0.25, 0.35, 0.67) * 2, (1.0, 1.18, 1.27), 0.39),
    ("same, a cheaper draft", (0.3, 0.25, 0.35, 0.67) * 2, (1.0, 1.24, 1.4), 0.17),
    ("MTP, code edits, batch 8", (0.6, 0.3, 0.45, 0.7) * 2, (1.0, 1.24, 1.4), 0.17),
    ("batch 8, every row at 0.6", (0.6,) * 8, (1.0, 1.24, 1.4), 0.17),
    ("batch 8, every row at 0.75", (0.75,) * 8, (1.0, 1.24, 1.4), 0.17),
    ("batch 1 at 0.25", (0.25,), (1.0, 1.15, 1.25), 0.07),
    ("batch 1 at 0.36", (0.36,), (1.0, 1.15, 1.25), 0.07),
    ("batch 1 at 0.5", (0.5,), (1.0, 1.15, 1.25), 0.07),
    # The shipped MTP layers' prices on the 2-core CPU, 2026-12-04 (benchmarks/results/
    # device_check-cpu-batch1-mtp-eagle3-20261204T1425Z.txt): what exploring costs a drafter that cannot help.
    ("CPU MTP prices, batch 1 at 0", (0.0,), (1.0, 1.50, 2.21), 0.10),
    ("CPU MTP prices, batch 1 at 0.38", (0.38,), (1.0, 1.50, 2.21), 0.10),
    ("CPU MTP prices, batch 1 at 0.5", (0.5,), (1.0, 1.50, 2.21), 0.10),
    # Bursts: a row's text turns predictable for a stretch (a quoted block, a repeated identifier) and back, what
    # the probes are there to notice. (tokens, rate) segments, repeated.
    ("CPU MTP prices, bursts: 48 at 0.2, 16 at 0.9", (((48, 0.2), (16, 0.9)),), (1.0, 1.50, 2.21), 0.10),
    ("CPU MTP prices, bursts: 24 at 0.3, 8 at 0.9", (((24, 0.3), (8, 0.9)),), (1.0, 1.50, 2.21), 0.10),
    # A long answer that turns to repeated text (run it with --tokens 256): how soon a backed-off row notices.
    ("CPU MTP prices, 160 at 0.1, then 96 at 0.9", (((160, 0.1), (96, 0.9)),), (1.0, 1.50, 2.21), 0.10),
    ("batch 8, bursts: 48 at 0.2, 16 at 0.9", tuple(((16 * i, 0.2), (16, 0.9), (48 - 16 * i, 0.2))
                                                  for i in (0, 1, 2, 3)) * 2, (1.0, 1.24, 1.4), 0.17),
    # Qwen2.5-Coder-1.5B drafted by the 0.5B on the 2-core CPU (K = 4: widths 1, 2, 4, 5), with the large-weight
    # few-row kernel: a block of 2 costs more than 2 tokens are worth, so only 3 or 4 drafts can pay.
    # transformers measured the pair's acceptance at 0.89 (docs/design.md, 'A real assistant on this CPU').
    ("1.5B + 0.5B prices, batch 1 at 0.89", (0.89,), (1.0, 2.39, 2.30, 2.43), 0.32, 4),
    ("1.5B + 0.5B prices, batch 1 at 0.7", (0.7,), (1.0, 2.39, 2.30, 2.43), 0.32, 4),
    ("1.5B + 0.5B prices, batch 1 at 0", (0.0,), (1.0, 2.39, 2.30, 2.43), 0.32, 4),
    ("1.5B + int8 0.5B prices, batch 1 at 0.89", (0.89,), (1.0, 2.39, 2.30, 2.43), 0.15, 4),
    # The shipped drafters of SmolLM2-135M at batch 1 on the 2-core CPU, prices rounded from docs/design.md ('Trained
    # drafters on a CPU', 'Batches'): verify blocks of 2, 4 and 8 at 1.55, 2.3 and 3.0 plain steps (5 at 2.5);
    # prompt lookup's drafts are free, DFlash's block forward is a drafting round's fixed cost (0.49), EAGLE-3's
    # head costs 0.06 a draft and 0.04 a round. Acceptance: DFlash's and EAGLE-3's held-out first-draft rates.
    ("CPU prompt lookup, batch 1, nothing to copy", (0.0,), (1.0, 1.55, 2.3, 2.5), 0.0, 3),
    ("CPU DFlash, batch 1 at 0.36", (0.36,), (1.0, 1.55, 2.3, 3.0), 0.02, 7, 0.49),
    ("CPU DFlash, batch 1 at 0", (0.0,), (1.0, 1.55, 2.3, 3.0), 0.02, 7, 0.49),
    ("CPU EAGLE-3, batch 1 at 0.45", (0.45,), (1.0, 1.55, 2.3, 2.5), 0.06, 4, 0.04),
    # The same drafters with their held-out acceptance at each depth, replayed with 4 drafts a round (each asset's
    # training.json), and their prices on 2026-12-07's Intel Xeon host (jaxspec/costs.py's stored prices, in plain
    # steps of 28.4 ms): DFlash's later drafts land less often than its first, EAGLE-3's more often. Scaled up
    # (`x1.6`, `x2.5`): text the drafters predict better.
    ("CPU DFlash by depth, batch 1, held out", (ByDepth((0.34, 0.20, 0.21, 0.14)),), (1.0, 1.89, 1.92, 2.2), 0.03,
     7, 0.32),
    ("CPU DFlash by depth, batch 1, held out x1.6", (ByDepth((0.54, 0.32, 0.34, 0.22)),), (1.0, 1.89, 1.92, 2.2),
     0.03, 7, 0.32),
    ("CPU DFlash by depth, batch 1, held out x2.5", (ByDepth((0.85, 0.5, 0.52, 0.35)),), (1.0, 1.89, 1.92, 2.2),
     0.03, 7, 0.32),
    ("CPU EAGLE-3 by depth, batch 1, held out", (ByDepth((0.41, 0.47, 0.62, 0.47)),), (1.0, 1.86, 1.96, 2.02), 0.065,
     4, 0.05),
    ("CPU EAGLE-3 by depth, batch 1, held out x1.6", (ByDepth((0.66, 0.75, 0.98, 0.75)),), (1.0, 1.86, 1.96, 2.02),
     0.065, 4, 0.05),
    # The same acceptance at an accelerator's prices: a Llama-3.1-8B-shaped target at batch 8 on an H200 verified a
    # block of 4 for 1.19 plain steps (docs/design.md, 'The second lease'); wider blocks here grow at the same rate,
    # and a DFlash forward is taken as 0.15 of a step.
    ("GPU-like prices, DFlash by depth, held out", (ByDepth((0.34, 0.20, 0.21, 0.14)),) * 8,
     (1.0, 1.06, 1.19, 1.45), 0.01, 7, 0.15),
    ("GPU-like prices, DFlash by depth, held out x1.6", (ByDepth((0.54, 0.32, 0.34, 0.22)),) * 8,
     (1.0, 1.06, 1.19, 1.45), 0.01, 7, 0.15),
    ("GPU-like prices, EAGLE-3 by depth, held out", (ByDepth((0.41, 0.47, 0.62, 0.47)),) * 8,
     (1.0, 1.06, 1.19, 1.25), 0.03, 4, 0.02),
)


def rate_at(rate, position: int, depth: int = 1) -> float:
    """A row's acceptance of its `depth`-th draft (from 1) at its `position`-th new token: a fixed rate, one for each
    depth (`ByDepth`), or (tokens, rate) segments repeated."""
    if isinstance(rate, float):
        return rate
    if isinstance(rate, ByDepth):
        return rate.rates[min(depth, len(rate.rates)) - 1]
    position %= sum(length for length, _ in rate)
    for length, value in rate:
        if position < length:
            return value
        position -= length
    raise AssertionError("unreachable")


@dataclasses.dataclass
class Run:
    rounds: int = 0
    drafting: int = 0  # rounds in which the batch drafted
    probes: int = 0  # of those, rounds that drafted only to probe
    cost: float = 0.0  # plain steps


def simulate(rates, verify_costs, draft_cost: float, tokens: int, seeds, max_draft: int = 2, round_cost: float = 0.0,
             shadow_probes: str = "first-and-after-miss", depth_rates: str = "per-depth") -> list[Run]:
    """Batches decoded to `tokens` new tokens a row, one per seed in `seeds`, with drafts accepted at `rates` ([B],
    each `rate_at`). The schedule's decision and update are compiled once for all seeds: run eagerly, dispatching
    their many small ops one at a time was most of the simulation's time.

    A probe judged in the shadow (`Schedule.in_shadow`: a row's first one, and one that follows a missed probe) drafts
    one draft but commits one token, the plain step's, at the plain step's price and the draft's work
    (`Schedule.shadow_price`); the schedule learns whether each row's draft was that token, as the loop hands it over.
    `shadow_probes` (one of `Schedule.SHADOW_RULES`): the schedule's rule, or the what-ifs of only probes after a miss
    in the shadow (as before 2026-12-07) and of every probe verified (as before 2026-12-06). `depth_rates` (one of
    `Schedule.DEPTH_RULES`): the schedule's estimate of each depth's acceptance, or the what-if of one rate pooled
    over depths (as before 2026-12-07).
    """
    from jaxspec.schedule import Schedule

    # read when `decide` and `update` trace
    defaults = Schedule.SHADOW_PROBES, Schedule.DEPTH_RATES
    Schedule.SHADOW_PROBES, Schedule.DEPTH_RATES = shadow_probes, depth_rates
    try:
        return _simulate(rates, verify_costs, draft_cost, tokens, seeds, max_draft, round_cost)
    finally:
        Schedule.SHADOW_PROBES, Schedule.DEPTH_RATES = defaults


def _simulate(rates, verify_costs, draft_cost: float, tokens: int, seeds, max_draft: int, round_cost: float):
    import jax
    import jax.numpy as jnp

    from jaxspec.schedule import make_schedule
    from jaxspec.strategies.base import RoundResult

    schedule = make_schedule("adaptive", 1, max_draft, draft_cost, round_cost)
    schedule = dataclasses.replace(schedule, verify_costs=tuple(verify_costs[:len(schedule.widths)]))
    batch = len(rates)

    @jax.jit
    def decide(state, deciding):  # -> (drafts the batch proposes, whether only to probe, in the shadow, its price)
        drafts = schedule.allowed(state, deciding)[0]
        probing = schedule.probing(state, deciding)
        in_shadow = schedule.in_shadow(state, deciding) & (drafts > 0)
        price = jnp.where(in_shadow, schedule.shadow_price(drafts), schedule.round_price(drafts))
        return drafts, probing, in_shadow, price

    @jax.jit
    def update(state, drafted, accepted, committed, deciding, in_shadow, shadow_hits):
        result = RoundResult(drafted=drafted, accepted=accepted, committed=committed, tokens=None, hidden=None,
                             lengths=None, deciding=deciding, in_shadow=in_shadow, shadow_hits=shadow_hits)
        return schedule.update(state, result, max_draft)

    runs = []
    for seed in seeds:
        rng = np.random.default_rng(seed)
        state = schedule.init(batch, jnp.ones((batch,), jnp.int32))
        done = np.zeros(batch, np.int64)
        run = Run()
        while done.min() < tokens:
            running = done < tokens
            remaining = np.where(running, tokens - done, -1)
            deciding = running & (remaining == remaining.max())  # the loop's `deciding_rows`
            drafts, probing, in_shadow, price = (np.asarray(x) for x in decide(state, deciding))
            drafts = int(drafts)
            accepted = np.zeros(batch, np.int32)  # [B] the leading drafts each row's target agrees with
            for row in range(batch):
                while accepted[row] < drafts and rng.random() < rate_at(rates[row], done[row] + accepted[row],
                                                                         accepted[row] + 1):
                    accepted[row] += 1
            if in_shadow:  # the plain step's token; the first draft judged against it
                shadow_hits, accepted = accepted > 0, np.zeros(batch, np.int32)
            else:
                shadow_hits = np.zeros(batch, bool)
            committed = np.where(running, accepted + 1, 0).astype(np.int32)
            state = update(state, np.where(running, drafts, 0).astype(np.int32), accepted, committed, deciding,
                           in_shadow, shadow_hits)
            run.cost += float(price)
            run.rounds += 1
            run.drafting += drafts > 0
            run.probes += bool(probing)
            done += committed
        runs.append(run)
    return runs


def main(argv=None) -> int:
    from jaxspec.schedule import Schedule

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32, help="new tokens a row")
    parser.add_argument("--seeds", type=int, default=12, help="batches simulated a scenario (their mean is shown)")
    parser.add_argument("--probe-unit", type=float, default=None,
                        help="what-if: Schedule.PROBE_UNIT for this run (a smaller unit spaces costly probes further)")
    parser.add_argument("--only", default="", help="run only the scenarios whose name contains this")
    parser.add_argument("--shadow-probes", choices=Schedule.SHADOW_RULES, default=Schedule.SHADOW_PROBES,
                        help="which probes run a plain step and judge their draft against its token: the schedule's "
                             "rule (a row's first probe and those after a missed one), or the what-ifs of only those "
                             "after a miss and of every probe verified (`simulate`)")
    parser.add_argument("--depth-rates", choices=Schedule.DEPTH_RULES, default=Schedule.DEPTH_RATES,
                        help="how a row's acceptance is estimated: the schedule's rule (each draft depth from its own "
                             "counts) or the what-if of one rate pooled over depths (`simulate`)")
    args = parser.parse_args(argv)
    if args.probe_unit is not None:
        Schedule.PROBE_UNIT = args.probe_unit  # read on the host when the schedule spaces its probes
    print(f"{args.tokens} tokens a row, mean of {args.seeds} seeds\n")
    print("| scenario | rounds | drafting rounds | probes | speedup the prices give |")
    print("|---|---:|---:|---:|---:|")
    for name, rates, verify_costs, draft_cost, *extra in SCENARIOS:
        if args.only not in name:
            continue
        runs = simulate(rates, verify_costs, draft_cost, args.tokens, range(args.seeds), *extra,
                        shadow_probes=args.shadow_probes, depth_rates=args.depth_rates)
        mean = {field: np.mean([getattr(r, field) for r in runs]) for field in ("rounds", "drafting", "probes")}
        speedup = np.mean([args.tokens / r.cost for r in runs])
        print(f"| {name} | {mean['rounds']:.1f} | {mean['drafting']:.1f} | {mean['probes']:.1f} | {speedup:.3f}x |",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
