"""Step costs measured on the machine (jaxspec/costs.py): what the adaptive schedule prices drafts with."""

from __future__ import annotations

import json

import numpy as np
import pytest

import jaxspec
from jaxspec import costs
from jaxspec.strategies import DraftingConfig, choose_strategy


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """Users' setting (measure), with the cache file in a fresh folder."""
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measure")
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tiny_llama_draft_dir):
    return jaxspec.load(tiny_llama_dir), jaxspec.load(tiny_llama_draft_dir)


def test_measured_costs_price_the_schedule_once_per_machine(measuring, pair, monkeypatch):
    target, assistant = pair
    choice = choose_strategy(target, DraftingConfig(assistant_model=assistant, num_assistant_tokens=4), do_sample=False)
    assert choice.drafter.schedule.widths == (1, 2, 4, 5)
    priced = costs.price_schedule(choice.drafter, target, choice.assistant)

    stored = json.loads((measuring / costs.CACHE_FILE).read_text())
    verify = {int(key.rsplit("|", 1)[1]): ms for key, ms in stored.items() if "|verify|" in key}
    draft = [ms for key, ms in stored.items() if "|draft|" in key]
    assert sorted(verify) == [1, 2, 5] and len(draft) == 1  # width 4 is interpolated, not compiled
    schedule = priced.schedule
    # Relative to width 1, width 4 interpolated between 2 and 5, and never below a narrower width's price.
    relative = [1.0, verify[2] / verify[1], (verify[2] + 2 * verify[5]) / 3 / verify[1], verify[5] / verify[1]]
    assert schedule.verify_costs == pytest.approx(tuple(np.maximum.accumulate(relative)), abs=0.006)
    assert schedule.draft_cost == pytest.approx(draft[0] / verify[1], abs=0.0006)

    # The next call reads the file: nothing is timed again.
    def no_timing(*args, **kwargs):
        raise AssertionError("step costs were measured again")

    monkeypatch.setattr(costs, "time_forwards", no_timing)
    assert costs.price_schedule(choice.drafter, target, choice.assistant) == priced


def test_remeasure_overwrites_and_widths_between_are_interpolated(measuring, pair, monkeypatch):
    target, assistant = pair
    choice = choose_strategy(target, DraftingConfig(assistant_model=assistant, num_assistant_tokens=4), do_sample=False)
    costs.price_schedule(choice.drafter, target, choice.assistant)  # stored
    timed = {True: {1: 10.0, 2: 16.0, 5: 22.0}, False: {1: 4.0}}  # target (verifying), assistant (drafting)
    monkeypatch.setattr(costs, "time_forwards",
                        lambda model, widths, head=None, batch=1: {w: timed[model is target][w] for w in widths})
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "remeasure")
    schedule = costs.price_schedule(choice.drafter, target, choice.assistant).schedule
    # Width 4 lies two thirds of the way from 2 to 5: 16 + (22 - 16) * 2 / 3 = 20 ms.
    assert schedule.verify_costs == (1.0, 1.6, 2.0, 2.2)
    assert schedule.draft_cost == 0.4
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measure")  # the file now holds the new figures
    assert costs.price_schedule(choice.drafter, target, choice.assistant).schedule == schedule


def test_costs_are_measured_at_the_batch_that_decodes(measuring, pair, monkeypatch):
    """A verify block is priced at the call's batch (rounded up to a power of two): a [8, W] block costs more plain
    steps than a [1, W] one on a CPU, and batch-1 figures would make a batch draft where it does not pay."""
    target, assistant = pair
    seen = []

    def timed(model, widths, head=None, batch=1):
        seen.append(batch)
        return {w: 10.0 + (w - 1) * (1.0 if batch == 1 else 8.0) for w in widths}

    monkeypatch.setattr(costs, "time_forwards", timed)
    lookup = choose_strategy(target, DraftingConfig(prompt_lookup_num_tokens=4), do_sample=False).drafter
    alone = costs.price_schedule(lookup, target, None, batch=1).schedule
    batched = costs.price_schedule(lookup, target, None, batch=5).schedule
    assert seen == [1, 8] and costs.cost_batch(5) == 8 and costs.cost_batch(1000) == costs.MAX_COST_BATCH
    assert alone.verify_costs == (1.0, 1.1, 1.3, 1.4) and batched.verify_costs == (1.0, 1.8, 3.4, 4.2)
    stored = json.loads((measuring / costs.CACHE_FILE).read_text())
    assert sorted(key.rsplit("|", 1)[1] for key in stored) == ["1", "2", "5", "8x1", "8x2", "8x5"]
    assert costs.price_schedule(lookup, target, None, batch=7).schedule == batched and seen == [1, 8]  # stored


def test_a_wider_block_is_never_priced_below_a_narrower_one(measuring, pair, monkeypatch):
    """A busy machine can time a narrow block slower than a wide one; the wide one holds the narrow one's work, so
    its price is raised to it (a stored bargain would make every later call draft where it does not pay)."""
    target, _ = pair
    monkeypatch.setattr(costs, "time_forwards",
                        lambda model, widths, head=None, batch=1: {w: {1: 10.0, 2: 16.0, 5: 9.0}[w] for w in widths})
    lookup = choose_strategy(target, DraftingConfig(prompt_lookup_num_tokens=4), do_sample=False).drafter
    assert costs.price_schedule(lookup, target, None).schedule.verify_costs == (1.0, 1.6, 1.6, 1.6)


def test_what_measurement_leaves_alone(measuring, pair, monkeypatch):
    target, assistant = pair
    monkeypatch.setattr(costs, "time_forwards", lambda model, widths, head=None, batch=1: {w: 10.0 + w for w in widths})
    lookup = choose_strategy(target, DraftingConfig(prompt_lookup_num_tokens=4), do_sample=False).drafter
    priced = costs.price_schedule(lookup, target, None).schedule
    assert priced.draft_cost == 0.0 and priced.verify_costs == (1.0, 1.09, 1.27, 1.36)  # copied drafts cost nothing
    early_exit = choose_strategy(target, DraftingConfig(assistant_early_exit=2), do_sample=False).drafter
    assert costs.price_schedule(early_exit, target, None).schedule.draft_cost == early_exit.schedule.draft_cost
    constant = choose_strategy(target, DraftingConfig(assistant_model=assistant,
                                                      num_assistant_tokens_schedule="constant"), do_sample=False).drafter
    assert costs.price_schedule(constant, target, assistant) is constant  # nothing to price
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "default")
    assert costs.price_schedule(lookup, target, None) is lookup


def test_generate_measures_costs_and_still_equals_plain_greedy(measuring, pair):
    target, assistant = pair
    ids = np.array([[5, 17, 29, 41, 53, 65, 77, 89]], np.int32)
    plain = jaxspec.generate(target, ids, max_new_tokens=12)
    assisted = jaxspec.generate(target, ids, max_new_tokens=12, assistant_model=assistant)
    np.testing.assert_array_equal(assisted.sequences, plain.sequences)
    assert (measuring / costs.CACHE_FILE).exists()


def test_a_misspelt_mode_is_named_before_anything_compiles(measuring, pair, monkeypatch):
    target, assistant = pair
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measured")
    monkeypatch.setattr(costs, "time_forwards", lambda *args, **kwargs: pytest.fail("timed with a bad mode"))
    with pytest.raises(ValueError, match="JAXSPEC_STEP_COSTS='measured' is not one of measure, default"):
        jaxspec.generate(target, np.array([[5, 17, 29]], np.int32), max_new_tokens=4, assistant_model=assistant)


def test_the_cost_model_prices_each_round_as_the_schedule_does():
    """The loop adds each round's price by the schedule's own cost model: the verify width the round ran (the
    narrowest holding its longest draft), a draft cost per draft of that row and the round's fixed cost."""
    from jaxspec.loop import _priced_round
    from jaxspec.schedule import Schedule
    from jaxspec.strategies.prompt_lookup import PromptLookupDrafter

    schedule = Schedule("adaptive", widths=(1, 2, 4, 5), verify_costs=(1.0, 1.2, 1.3, 1.35), draft_cost=0.1,
                        round_cost=0.05)
    drafter = PromptLookupDrafter(max_draft=4, schedule=schedule)
    priced = {tuple(count): float(_priced_round(drafter, np.array(count))) for count in ([0, 0], [1, 0], [3, 1],
                                                                                       [0, 4])}
    assert priced == pytest.approx({(0, 0): 1.0, (1, 0): 1.2 + 0.1 + 0.05, (3, 1): 1.3 + 0.3 + 0.05,
                                    (0, 4): 1.35 + 0.4 + 0.05})
    unpriced = PromptLookupDrafter(max_draft=4, schedule=Schedule("constant"))
    assert float(_priced_round(unpriced, np.array([3, 1]))) == 0.0


def test_generate_reports_the_speedup_its_cost_model_expected(pair):
    """`modelled_speedup`: plain steps the longest row needed over the priced rounds; nan where nothing is priced."""
    target, _ = pair
    ids = [[5, 17, 29, 5, 17, 29, 5, 17, 29]]
    out = jaxspec.generate(target, ids, max_new_tokens=16, prompt_lookup_num_tokens=4)
    assert out.rounds <= out.priced_steps <= out.rounds * 1.35
    assert out.modelled_speedup == pytest.approx((int(out.num_new_tokens.max()) - 1) / out.priced_steps)
    assert out.counters()["modelled_speedup"] == out.modelled_speedup
    constant = jaxspec.generate(target, ids, max_new_tokens=16, prompt_lookup_num_tokens=4,
                                num_assistant_tokens_schedule="constant")
    assert constant.priced_steps == 0 and np.isnan(constant.modelled_speedup)


def test_an_mtp_draft_is_priced_by_timing_its_depth_step(measuring, tmp_path_factory, monkeypatch):
    """A draft of MTP layers is one depth step over the last K + 1 positions and its draft head: timed on the
    machine (a thin layer's fixed costs on a CPU are not its share of the weights), once, then read from the file."""
    from tests.fixtures.moe import FAMILIES, save_checkpoint

    folder = save_checkpoint("glm4_moe", str(tmp_path_factory.mktemp("glm")), 2, 2, FAMILIES["glm4_moe"], seed=2)
    target = jaxspec.load(folder)
    drafter = choose_strategy(target, DraftingConfig(use_mtp=True), do_sample=False).drafter
    assert drafter.drafts_with_mtp_steps and drafter.max_draft == 2
    step_ms = costs.time_mtp_steps(target, drafter.max_draft + 1, runs=1)  # the real step compiles and runs
    assert step_ms > 0
    monkeypatch.setattr(costs, "time_forwards", lambda model, widths, head=None, batch=1: {w: 10.0 for w in widths})
    monkeypatch.setattr(costs, "time_mtp_steps", lambda model, window, batch=1: 2.5 * window)
    priced = costs.price_schedule(drafter, target, None).schedule
    assert priced.draft_cost == 0.75  # 7.5 ms of a 10 ms step
    monkeypatch.setattr(costs, "time_mtp_steps", lambda *args, **kwargs: pytest.fail("timed again"))
    assert costs.price_schedule(drafter, target, None).schedule == priced


def test_a_dflash_round_is_priced_by_timing_its_drafting_work(measuring, pair, tmp_path_factory, monkeypatch):
    """A DFlash round's drafting work (the context write, the block forward and the target's head over the drafts)
    is timed once as the schedule's round cost; the drafter's weight share alone leaves out the head it reads."""
    from tests.fixtures import dflash as dflash_fixtures
    from tests.strategies.test_dflash import DRAFTER

    target, _ = pair
    folder = str(tmp_path_factory.mktemp("dflash_costs"))
    dflash_fixtures.muse(DRAFTER, seed=3).save_pretrained(folder)
    block_drafter = jaxspec.load(folder)
    drafter = choose_strategy(target, DraftingConfig(assistant_model=block_drafter), do_sample=False).drafter
    assert drafter.drafts_with_block_forward and drafter.max_draft == DRAFTER["block_size"] - 1
    assert costs.time_block_drafts(target, block_drafter, drafter.max_draft, runs=1) > 0  # the real round runs
    monkeypatch.setattr(costs, "time_forwards", lambda model, widths, head=None, batch=1: {w: 10.0 for w in widths})
    monkeypatch.setattr(costs, "time_block_drafts", lambda target, drafter, drafts, batch=1: 4.0)
    priced = costs.price_schedule(drafter, target, block_drafter).schedule
    assert (priced.round_cost, priced.draft_cost) == (0.4, 0.0)
    monkeypatch.setattr(costs, "time_block_drafts", lambda *args, **kwargs: pytest.fail("timed again"))
    assert costs.price_schedule(drafter, target, block_drafter).schedule == priced


def test_an_eagle3_round_is_priced_by_its_window_and_its_steps(measuring, pair, tmp_path_factory, monkeypatch):
    """An EAGLE-3 round is timed with one draft and with K: the difference is K - 1 head steps (a draft's cost), the
    rest the round's own (the fc over the new states and the head over its window of K + 1 entries)."""
    from tests.fixtures import eagle3 as eagle3_fixtures

    target, _ = pair
    head = jaxspec.load(eagle3_fixtures.save(eagle3_fixtures.reference(seed=3),
                                             tmp_path_factory.mktemp("eagle3_costs")))
    drafter = choose_strategy(target, DraftingConfig(assistant_model=head, num_assistant_tokens=3),
                              do_sample=False).drafter
    assert drafter.drafts_with_head_steps and drafter.max_draft == 3
    assert costs.time_head_rounds(target, head, 3, runs=1, window=4) > 0  # the real round runs
    monkeypatch.setattr(costs, "time_forwards", lambda model, widths, head=None, batch=1: {w: 10.0 for w in widths})
    timed = {1: 3.0, 3: 4.0}  # milliseconds: a 2.5 ms window and 0.5 ms a draft
    monkeypatch.setattr(costs, "time_head_rounds", lambda target, head, drafts, batch=1, window=None: timed[drafts])
    priced = costs.price_schedule(drafter, target, head).schedule
    assert (priced.round_cost, priced.draft_cost) == (0.25, 0.05)
    monkeypatch.setattr(costs, "time_head_rounds", lambda *args, **kwargs: pytest.fail("timed again"))
    assert costs.price_schedule(drafter, target, head).schedule == priced
