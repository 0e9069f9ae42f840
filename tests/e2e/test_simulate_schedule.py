"""benchmarks/simulate_schedule.py drives the real adaptive schedule on the host: what it reports is what the
schedule decides, so a batch whose drafts do not pay probes rarely, and a row whose drafts pay drafts most rounds."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from tests.fixtures.paths import BENCHMARKS

# The users' verify widths, not the suite's two (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_verify_widths")


@pytest.fixture(scope="module")
def simulation():
    spec = importlib.util.spec_from_file_location("simulate_schedule",
                                                  os.path.join(BENCHMARKS, "simulate_schedule.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up while it executes
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_a_batch_whose_drafts_do_not_pay_probes_rarely(simulation):
    """Eight rows at 0.25-0.67 acceptance where a one-draft round costs 1.57 plain steps (it pays above 0.57): the
    rows' occasional hits must not keep the batch probing (before 95cf9d8: about 13 probes in 30 rounds)."""
    name, rates, verify_costs, draft_cost = simulation.SCENARIOS[0]
    runs = simulation.simulate(rates, verify_costs, draft_cost, tokens=32, seeds=range(3))
    assert all(run.probes <= 6 and run.drafting <= 8 for run in runs), [describe(run) for run in runs]
    assert all(32 / run.cost > 0.9 for run in runs)


def test_a_row_whose_drafts_pay_drafts_most_rounds(simulation):
    """Means over seeds: a run whose first drafts miss by chance drafts less of its 32 tokens (2 seeds in 12 draft
    in two thirds of their rounds), and still does not lose."""
    runs = simulation.simulate((0.5,), (1.0, 1.15, 1.25), 0.07, tokens=32, seeds=range(12))
    assert np.mean([run.drafting / run.rounds for run in runs]) >= 0.85
    assert np.mean([32 / run.cost for run in runs]) > 1.15 and min(32 / run.cost for run in runs) > 1.0


def test_probes_that_can_pay_teach_a_costly_pair_to_draft(simulation, monkeypatch):
    """The 1.5B + 0.5B pair's prices on a CPU, where a one-draft round can never pay (Schedule.probe_length), at the
    pair's measured acceptance of 0.89: with probes of 3 drafts the row learns to draft; probing with one draft, it
    hardly drafts. (The pair pays at most 1.08x at 0.89, with 4 drafts, and a decayed estimate of the acceptance
    wanders across the 0.85 where drafting starts to pay, so single runs vary: their mean over seeds is asserted.)"""
    name, rates, verify_costs, draft_cost, max_draft = next(
        scenario for scenario in simulation.SCENARIOS if scenario[0] == "1.5B + 0.5B prices, batch 1 at 0.89")

    def mean_over_seeds(shadow_probes="never") -> tuple[float, float]:  # -> (speedup, rounds that drafted)
        runs = simulation.simulate(rates, verify_costs, draft_cost, 256, range(6), max_draft,
                                   shadow_probes=shadow_probes)
        return sum(256 / run.cost for run in runs) / 6, sum(run.drafting / run.rounds for run in runs) / 6

    # Every probe verified: what the probes' length alone does. Probes judged in the shadow, a row's first and those
    # after a miss (the schedule's rule), learn from one-draft evidence too; with them the pair still learns to draft.
    assert mean_over_seeds("first-and-after-miss")[0] > 1.0
    speedup, drafting = mean_over_seeds()
    from jaxspec.schedule import Schedule

    monkeypatch.setattr(Schedule, "probe_length", lambda self: 1)
    one_draft_speedup, one_draft_drafting = mean_over_seeds()
    assert speedup > 1.02 and one_draft_speedup < 1.0 and drafting > 3 * one_draft_drafting


def test_probes_in_the_shadow_cost_only_their_draft(simulation):
    """For a drafter that is never accepted (DFlash's CPU prices at batch 1), every round commits one token, and every
    probe is judged in the shadow: the first, before any evidence, and those after it, each following a miss. Each
    costs a plain step and one draft's work (the block forward, 0.49, and 0.02). Verified, a probe costs its block of
    4 with 3 drafts (2.3 + 0.55 plain steps): the first one was under the rule before 2026-12-07 ("after-miss"), and
    every one is with none in the shadow ("never")."""
    name, rates, verify_costs, draft_cost, max_draft, round_cost = next(
        scenario for scenario in simulation.SCENARIOS if scenario[0] == "CPU DFlash, batch 1 at 0")
    runs = {rule: simulation.simulate(rates, verify_costs, draft_cost, 64, range(3), max_draft, round_cost,
                                      shadow_probes=rule) for rule in ("first-and-after-miss", "after-miss", "never")}
    verified_probe, shadow_probe = 2.3 + 3 * draft_cost + round_cost, 1 + draft_cost + round_cost
    for rule, verified in (("first-and-after-miss", 0), ("after-miss", 1)):
        for run in runs[rule]:
            assert run.rounds == 64 and run.probes == run.drafting > 1, describe(run)
            plain_rounds = run.rounds - run.probes
            expected = plain_rounds + verified * verified_probe + (run.probes - verified) * shadow_probe
            assert run.cost == pytest.approx(expected), (rule, describe(run))
    assert all(a.probes == b.probes == c.probes for a, b, c in zip(*runs.values()))
    cost = {rule: sum(run.cost for run in rule_runs) for rule, rule_runs in runs.items()}
    assert cost["first-and-after-miss"] < cost["after-miss"] < cost["never"]
    from jaxspec.schedule import Schedule

    assert Schedule.SHADOW_PROBES == "first-and-after-miss"  # the what-ifs leave the schedule as they found it


def test_the_script_prints_its_table(simulation, capsys):
    assert simulation.main(["--tokens", "8", "--seeds", "1"]) == 0
    table = capsys.readouterr().out
    rows = [line for line in table.splitlines() if line.startswith("|")]
    assert len(rows) == len(simulation.SCENARIOS) + 2  # header, rule, a row per scenario


def describe(run) -> str:
    return f"rounds {run.rounds} drafting {run.drafting} probes {run.probes} cost {run.cost:.1f}"
