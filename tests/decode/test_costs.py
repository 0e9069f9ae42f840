"""Step costs measured on the machine (jaxspec/costs.py): the adaptive schedule's prices, timed by running the
compiled loop itself at forced verify widths and draft lengths, and entering it as run-time inputs."""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import costs, loop
from jaxspec.prompts import PromptBatch
from jaxspec.schedule import make_schedule
from jaxspec.settings import SamplingConfig
from jaxspec.sharding import ShardingRules
from jaxspec.strategies import DraftingConfig, choose_strategy, default_prefill_chunk

# The users' verify widths, not the suite's two (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("default_verify_widths")

GENERATE = sys.modules["jaxspec.generate"]  # the module (jaxspec.generate is also the function)
IDS = np.array([[5, 17, 29, 41, 53, 65, 77, 89]], np.int32)


@pytest.fixture
def measuring(tmp_path, monkeypatch):
    """Users' setting (measure), with the cache file in a fresh folder."""
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measure")
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tiny_llama_draft_dir):
    return jaxspec.load(tiny_llama_dir), jaxspec.load(tiny_llama_draft_dir)


def _spy(monkeypatch, module, name):
    """Record what module.name returns (and how many executables were traced while it ran)."""
    real, calls = getattr(module, name), []

    def spy(*args, **kwargs):
        before = loop.trace_count()
        result = real(*args, **kwargs)
        calls.append((result, loop.trace_count() - before))
        return result

    monkeypatch.setattr(module, name, spy)
    return calls


def _stored_parts(folder) -> dict[str, float]:
    """The cache file's entries by what they price ('verify|2', 'draft', ...), keyed by the batch bucket too."""
    stored = json.loads((folder / costs.CACHE_FILE).read_text())
    return {key.split("|loop|")[1].split("|", 1)[1]: ms for key, ms in stored.items()}


def _host(leaf) -> np.ndarray:
    """A state's leaf as numbers to compare (a PRNG key as its key data)."""
    return np.asarray(jax.random.key_data(leaf) if jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key) else leaf)


def _fake_call(monkeypatch):
    """(call, prefill) for `costs.time_loop` with a fake rounds function: one row, a 64-token buffer, and each timed
    configuration's inputs being its verify floor."""
    import types

    monkeypatch.setattr(costs, "timing_inputs", lambda inputs, drafts, floor: floor)
    tokens, prompt_lengths, budget = jnp.zeros((1, 64), jnp.int32), jnp.asarray([8]), jnp.asarray([4])
    call = types.SimpleNamespace(prefill_args=(None, None, tokens, prompt_lengths, budget, None, None, None),
                                 spec=types.SimpleNamespace(drafter=types.SimpleNamespace(draft_slots=4)),
                                 inputs=None, target_state=None, assistant_state=None)
    return call, lambda *args: {"cache": jnp.zeros(3)}


def test_a_round_is_timed_without_what_a_call_costs_besides_its_rounds(monkeypatch):
    """time_loop subtracts the time of a call that runs no round from a call of several rounds: a fixed cost per
    call (dispatch, reading the counters back; several ms on a GPU) is not spread over the rounds. A fake loop whose
    call costs 40 ms plus 5 ms a round (10 ms at width 2) is priced at 5 and 10 ms, not 10 and 15."""
    import time
    import types

    per_call_s, per_round_s = 0.040, {1: 0.005, 2: 0.010}

    def rounds(target_state, assistant_state, state, timed, max_rounds):
        ran = int(max_rounds)
        time.sleep(per_call_s + per_round_s[timed] * ran)
        return types.SimpleNamespace(counters=types.SimpleNamespace(rounds=jnp.asarray(ran),
                                                                    drafted=jnp.zeros((1,), jnp.int32)))

    measured = costs.time_loop(*_fake_call(monkeypatch), rounds, (1, 2), (), prefix="p", runs=2)
    assert measured["p|verify|1"] == pytest.approx(5.0, rel=0.2), measured
    assert measured["p|verify|2"] == pytest.approx(10.0, rel=0.2), measured


def test_a_third_timed_call_runs_only_where_the_first_two_disagree(monkeypatch):
    """time_loop times each configuration in LOOP_MIN_RUNS calls, and in up to `runs` only while some configuration's
    calls differ by more than LOOP_AGREEMENT: a fake loop whose calls take the same time is timed twice a
    configuration (after one warm round), one whose width-2 calls slow down by a fifth three times, every
    configuration taking its turn."""
    import types

    def timed_calls(slowdown: float) -> dict[int, int]:
        clock, calls = [0.0], {1: 0, 2: 0}

        def rounds(target_state, assistant_state, state, width, max_rounds):
            ran = int(max_rounds)
            if ran > 1:
                calls[width] += 1
            clock[0] += 0.005 * width * ran * (1 + slowdown * (width == 2 and calls[width] == 2))
            return types.SimpleNamespace(counters=types.SimpleNamespace(rounds=jnp.asarray(ran),
                                                                        drafted=jnp.zeros((1,), jnp.int32)))

        monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
        measured = costs.time_loop(*_fake_call(monkeypatch), rounds, (1, 2), (), prefix="p", runs=3, min_runs=2)
        assert measured == {"p|verify|1": pytest.approx(5.0), "p|verify|2": pytest.approx(10.0)}
        return calls

    assert costs.LOOP_AGREEMENT < 0.2
    assert timed_calls(slowdown=0.0) == {1: 2, 2: 2}
    assert timed_calls(slowdown=0.2) == {1: 3, 2: 3}


def test_after_the_first_run_each_configuration_is_timed_in_calls_as_long_as_the_units(monkeypatch):
    """time_loop's first run times every configuration in calls of `rounds_per_run` rounds; later runs give each as
    many rounds as last about as long as the unit's call (a round at width 1), at least LOOP_MIN_ROUNDS: a fake
    loop whose rounds cost 5 ms at width 1, 10 at width 2 and 40 at width 8 is timed in calls of 4, 2 and 2 after
    the first. Prices are per round, so they are unchanged; with `match_durations=False` every call runs 4."""
    import types

    def rounds_called(match_durations: bool) -> dict[int, list[int]]:
        clock, called = [0.0], {1: [], 2: [], 8: []}
        per_round_s = {1: 0.005, 2: 0.010, 8: 0.040}

        def rounds(target_state, assistant_state, state, width, max_rounds):
            ran = int(max_rounds)
            if ran > 1:
                called[width].append(ran)
            clock[0] += per_round_s[width] * ran
            return types.SimpleNamespace(counters=types.SimpleNamespace(rounds=jnp.asarray(ran),
                                                                        drafted=jnp.zeros((1,), jnp.int32)))

        monkeypatch.setattr(costs.time, "perf_counter", lambda: clock[0])
        measured = costs.time_loop(*_fake_call(monkeypatch), rounds, (1, 2, 8), (), prefix="p", rounds_per_run=4,
                                   runs=3, min_runs=3, match_durations=match_durations)
        assert measured == {"p|verify|1": pytest.approx(5.0), "p|verify|2": pytest.approx(10.0),
                            "p|verify|8": pytest.approx(40.0)}
        return called

    assert costs.LOOP_MIN_ROUNDS == 2
    copies = []
    real_copy = costs.jnp.copy
    monkeypatch.setattr(costs.jnp, "copy", lambda x: copies.append(1) or real_copy(x))
    assert rounds_called(match_durations=True) == {1: [4, 4, 4], 2: [4, 2, 2], 8: [4, 2, 2]}
    # The prefilled state (one array here) is copied for each warm round and each timed call of rounds; a call of
    # no round takes the state the call before it left.
    assert len(copies) == 3 + 3 * 3
    assert rounds_called(match_durations=False) == {1: [4, 4, 4], 2: [4, 4, 4], 8: [4, 4, 4]}


def test_matched_rounds_keep_within_their_bounds():
    """A configuration as fast as the unit keeps `rounds_per_run`; one slower than the unit by any factor keeps
    LOOP_MIN_ROUNDS; one that ran no round (inf) keeps `rounds_per_run`; a budget below the minimum is the budget."""
    seconds = {"unit": 0.010, "same": 0.009, "half": 0.021, "slow": 1.0, "none": float("inf")}
    assert costs.matched_rounds(seconds, unit="unit", rounds_per_run=8) == {
        "unit": 8, "same": 8, "half": 4, "slow": 2, "none": 8}
    assert costs.matched_rounds(seconds, unit="unit", rounds_per_run=1) == dict.fromkeys(seconds, 1)


def test_prices_are_timed_in_the_compiled_loop_once_per_machine(measuring, pair, monkeypatch):
    """The first measuring call times rounds of its own executables (compiling nothing more), stores milliseconds per
    round, and decodes with the prices they give; a later call reads the file; the output equals plain greedy."""
    target, assistant = pair
    plain = jaxspec.generate(target, IDS, max_new_tokens=12)
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "default")
    jaxspec.generate(target, IDS, max_new_tokens=12, assistant_model=assistant, num_assistant_tokens=4)
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measure")
    timings, priced = _spy(monkeypatch, costs, "time_loop"), _spy(monkeypatch, GENERATE, "price_loop")
    forced, timing_inputs = [], costs.timing_inputs

    def recorded_timing_inputs(inputs, drafts, floor):
        forced.append((drafts, floor))
        return timing_inputs(inputs, drafts, floor)

    monkeypatch.setattr(costs, "timing_inputs", recorded_timing_inputs)
    before = loop.trace_count()
    assisted = jaxspec.generate(target, IDS, max_new_tokens=12, assistant_model=assistant, num_assistant_tokens=4)
    assert loop.trace_count() == before  # the measured prices are inputs of the executables the default prices ran
    np.testing.assert_array_equal(assisted.sequences, plain.sequences)
    assert len(timings) == 1
    # Every verify width with no drafts, then 1 and K drafts: the configurations take turns, run after run, so that
    # a machine that drifts while they are timed moves them all alike.
    assert forced == [(0, 1), (0, 2), (0, 4), (0, 5), (1, 1), (4, 1)]
    parts = _stored_parts(measuring)
    # Every width of the loop's (1, 2, 4, 5): on a CPU a block's cost is not linear in its width, so none is
    # interpolated; a draft and a drafting round's fixed work.
    assert sorted(parts) == ["1x|draft", "1x|round", "1x|verify|1", "1x|verify|2", "1x|verify|4", "1x|verify|5"]
    schedule = choose_strategy(target, DraftingConfig(assistant_model=assistant, num_assistant_tokens=4),
                               do_sample=False).drafter.schedule
    expected = costs.loop_prices(schedule, {w: parts[f"1x|verify|{w}"] for w in (1, 2, 4, 5)}, parts["1x|draft"],
                                 parts["1x|round"])
    prices = priced[0][0]
    assert prices.on_host() == expected.on_host()
    # (A tiny assistant's draft may time at 0 beside a loaded machine's noise: its sign is all that is certain.)
    assert prices.verify_costs[0] == 1.0 and np.all(np.diff(prices.verify_costs) >= 0) and prices.draft_cost >= 0

    # The next call reads the file: nothing is timed again, and it decodes with the same prices.
    monkeypatch.setattr(costs, "time_loop", lambda *args, **kwargs: pytest.fail("step costs were timed again"))
    again = jaxspec.generate(target, IDS, max_new_tokens=12, assistant_model=assistant, num_assistant_tokens=4)
    np.testing.assert_array_equal(again.sequences, plain.sequences)
    assert priced[1][0].on_host() == prices.on_host()


def test_one_prefill_serves_every_timed_configuration(measuring, pair, monkeypatch):
    """time_loop reads the prompts once and starts every timed call from a copy of that state. That holds because
    what a configuration forces (the drafts of every round, the narrowest verify block) is read by the rounds alone:
    the states the prefill gives under each configuration's inputs are equal, leaf by leaf."""
    target, assistant = pair
    checked, real = [], costs.time_loop

    def checking(call, prefill, rounds, widths, drafts, prefix="", **kwargs):
        configs = [(0, w) for w in widths] + [(d, 1) for d in drafts]
        states = [prefill(*call.prefill_args[:6], costs.timing_inputs(call.inputs, *config), *call.prefill_args[7:])
                  for config in configs]
        for state in states[1:]:
            jax.tree.map(np.testing.assert_array_equal, *(jax.tree.map(_host, s) for s in (states[0], state)))
        checked.append(configs)
        return real(call, prefill, rounds, widths, drafts, prefix, **kwargs)

    monkeypatch.setattr(costs, "time_loop", checking)
    jaxspec.generate(target, IDS, max_new_tokens=12, assistant_model=assistant, num_assistant_tokens=4)
    assert checked == [[(0, 1), (0, 2), (0, 4), (0, 5), (1, 1), (4, 1)]]


def test_forced_rounds_and_verify_floors_keep_greedy_output(pair):
    """How costs.py times the loop: every round forced to draft d, or to verify a block wider than its drafts (with
    no EOS and no confidence threshold). All are run-time inputs of one executable, and none changes what greedy
    decoding commits."""
    target, assistant = pair
    choice = choose_strategy(target, DraftingConfig(assistant_model=assistant, num_assistant_tokens=4),
                             do_sample=False)
    settings = SamplingConfig(max_new_tokens=12).resolve(target)
    prompts = PromptBatch.parse(np.concatenate([IDS, IDS[:, ::-1]]), None, settings.pad_id, settings.eos_ids)
    call = GENERATE._lay_out(target, choice.assistant, prompts, choice.drafter, settings, mesh=None,
                             rules=ShardingRules(), chunk=default_prefill_chunk(), ensemble_weight=None,
                             return_logits=False)
    prefill, rounds = call.compile()
    traced = loop.trace_count()

    def run(drafts: int, floor: int):
        inputs = costs.timing_inputs(call.inputs, drafts, floor)
        args = call.prefill_args[:6] + (inputs,) + call.prefill_args[7:]
        state = rounds(call.target_state, call.assistant_state, prefill(*args), inputs, jnp.asarray(99, jnp.int32))
        return np.asarray(state.tokens), np.asarray(state.counters.drafted), int(state.counters.rounds)

    reference, _, _ = run(-1, 1)
    for drafts, floor in ((0, 5), (0, 2), (1, 1), (4, 1)):
        tokens, drafted, ran = run(drafts, floor)
        np.testing.assert_array_equal(tokens, reference)
        # Each row drafts what it was told while its budget lasts (its last d rounds have room for fewer).
        assert drafts * (ran - drafts) <= drafted.min() and drafted.max() <= drafts * ran
    assert loop.trace_count() == traced


def test_prices_from_the_loop_timings():
    """Widths relative to a round that drafts nothing; widths between the measured ones interpolated; a wider block
    never priced below a narrower one; draft prices kept where drafts are not timed; a tree also prices its chain."""
    schedule = make_schedule("adaptive", 1, 4, draft_cost=0.25)
    assert schedule.widths == (1, 2, 4, 5)
    prices = costs.loop_prices(schedule, {1: 10.0, 2: 16.0, 5: 22.0}, 4.0, 1.0).on_host()
    # Width 4 lies two thirds of the way from 2 to 5: 16 + (22 - 16) * 2 / 3 = 20 ms.
    assert prices.verify_costs == (1.0, 1.6, 2.0, 2.2) and (prices.draft_cost, prices.round_cost) == (0.4, 0.1)
    busy = costs.loop_prices(schedule, {1: 10.0, 2: 16.0, 5: 9.0}).on_host()
    assert busy.verify_costs == (1.0, 1.6, 1.6, 1.6) and (busy.draft_cost, busy.round_cost) == (0.25, 0.0)
    tree = make_schedule("adaptive", 1, 2, draft_cost=0.1, entries_per_draft=3)  # depths 1, 2: blocks of 4 and 7
    assert tree.widths == (1, 2, 3) and tree.entry_widths == (1, 4, 7)
    prices = costs.loop_prices(tree, {1: 10.0, 2: 12.0, 7: 22.0}).on_host()
    assert prices.verify_costs == (1.0, 1.6, 2.2) and prices.chain_costs == (1.0, 1.2, 1.4)


def test_drafting_is_fitted_through_the_drafts_really_proposed():
    """A round of d drafts = its verify block + d drafts + the round's fixed work; a drafter that proposed fewer than
    it was asked is fitted at what it proposed; a busy run makes no part negative."""
    verify = {1: 10.0, 2: 16.0, 5: 22.0}
    assert costs.fit_drafting(verify, [(1.0, 16 + 4 + 1), (4.0, 22 + 16 + 1)]) == pytest.approx((4.0, 1.0))
    assert costs.fit_drafting(verify, [(1.0, 21.0), (3.0, 20 + 12 + 1)]) == pytest.approx((4.0, 1.0))  # width 4
    assert costs.fit_drafting(verify, [(1.0, 30.0), (4.0, 30.0)]) == pytest.approx((0.0, 14.0))
    assert costs.fit_drafting(verify, [(1.0, 15.0)]) == (0.0, 0.0)


def test_costs_are_measured_at_the_batch_that_decodes(measuring, pair, monkeypatch):
    """A verify block is priced at the call's batch (stored for its power-of-two bucket): a [8, W] block costs more
    plain steps than a [1, W] one on a CPU, and batch-1 figures would make a batch draft where it does not pay."""
    target, _ = pair
    seen = []

    def timed(call, prefill, rounds, widths, drafts, prefix, **kwargs):
        batch = call.prefill_args[2].shape[0]
        seen.append(batch)
        # Alone, a CPU-like curve: the step from 2 to 4 dearer than from 4 to 5 (a line through 2 and 5 says 20.3
        # at 4, so width 4 must have been timed); batched, a line.
        alone = {1: 10.0, 2: 15.0, 4: 22.0, 5: 23.0}
        return {f"{prefix}|verify|{w}": alone[w] if batch == 1 else 10.0 + (w - 1) * 8.0 for w in widths}

    monkeypatch.setattr(costs, "time_loop", timed)
    priced = _spy(monkeypatch, GENERATE, "price_loop")
    for rows in (1, 2, 2):
        jaxspec.generate(target, np.repeat(IDS, rows, axis=0), max_new_tokens=8, prompt_lookup_num_tokens=4)
    assert seen == [1, 2] and costs.cost_batch(5) == 8 and costs.cost_batch(1000) == costs.MAX_COST_BATCH
    alone, batched, stored = (prices.on_host().verify_costs for prices, _ in priced)
    assert alone == (1.0, 1.5, 2.2, 2.3) and batched == stored == (1.0, 1.8, 3.4, 4.2)
    # Every width at each batch bucket; copied drafts: no draft price.
    assert sorted(_stored_parts(measuring)) == [f"{b}x|verify|{w}" for b in (1, 2) for w in (1, 2, 4, 5)]


def test_remeasure_overwrites_and_what_measurement_leaves_alone(measuring, pair, monkeypatch):
    target, assistant = pair
    monkeypatch.setattr(costs, "time_loop", lambda call, prefill, rounds, widths, drafts, prefix, **kwargs:
                        {f"{prefix}|verify|{w}": 10.0 + w for w in widths})
    jaxspec.generate(target, IDS, max_new_tokens=8, prompt_lookup_num_tokens=4)
    monkeypatch.setattr(costs, "time_loop", lambda call, prefill, rounds, widths, drafts, prefix, **kwargs:
                        {f"{prefix}|verify|{w}": 20.0 + w for w in widths})
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "remeasure")
    jaxspec.generate(target, IDS, max_new_tokens=8, prompt_lookup_num_tokens=4)
    assert _stored_parts(measuring)["1x|verify|5"] == 25.0

    # Nothing to price: a constant schedule, the fixed figures, a sharded run.
    monkeypatch.setattr(costs, "time_loop", lambda *args, **kwargs: pytest.fail("timed what is not priced"))
    priced = _spy(monkeypatch, GENERATE, "price_loop")
    jaxspec.generate(target, IDS, max_new_tokens=8, assistant_model=assistant,
                     num_assistant_tokens_schedule="constant")
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "default")
    jaxspec.generate(target, IDS, max_new_tokens=8, prompt_lookup_num_tokens=4)
    assert [prices for prices, _ in priced] == [None, None]


def test_a_misspelt_mode_is_named_before_anything_compiles(measuring, pair, monkeypatch):
    target, assistant = pair
    monkeypatch.setenv("JAXSPEC_STEP_COSTS", "measured")
    monkeypatch.setattr(costs, "time_loop", lambda *args, **kwargs: pytest.fail("timed with a bad mode"))
    traced = loop.trace_count()
    with pytest.raises(ValueError, match="JAXSPEC_STEP_COSTS='measured' is not one of measure, default"):
        jaxspec.generate(target, np.array([[5, 17, 29]], np.int32), max_new_tokens=4, assistant_model=assistant)
    assert loop.trace_count() == traced


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
    # What a round took, the prefill excluded: what the benchmarks set beside a plain step.
    assert out.seconds_per_round == pytest.approx((out.decode_seconds - out.prefill_seconds) / out.rounds)
    assert 0 < out.seconds_per_round < out.decode_seconds


