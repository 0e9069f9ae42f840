"""benchmarks/bench.py's timing discipline: calls on a prompt run back to back, and speedups are paired ratios."""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest

from tests.fixtures.paths import BENCHMARKS


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, BENCHMARKS)  # bench.py imports its parts as sibling modules
    try:
        spec = importlib.util.spec_from_file_location("bench_script", os.path.join(BENCHMARKS, "bench.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(BENCHMARKS)
    yield module
    sys.modules.pop("bench_script", None)


def fake_call(bench, log: list, key: str, seconds_of):
    """A CallFn that records its order and returns 10 tokens in `seconds_of(prompt, order)` seconds."""

    def call(name: str, ids: np.ndarray):
        log.append((key, name))
        return bench.Call(prompt=name, tokens=list(range(10)), seconds=seconds_of(name, len(log)), compile_seconds=0.0,
                          target_forwards=10, rounds=10, round_tokens=10, drafted=0, accepted=0)

    return call


def test_a_pass_runs_every_strategy_on_a_prompt_back_to_back(bench):
    log = []
    keys = [("jaxspec", "greedy"), ("jaxspec", "prompt_lookup")]
    calls = {key: fake_call(bench, log, key[1], lambda name, order: 1.0) for key in keys}
    prompts = {"a": np.zeros(3), "b": np.zeros(3)}
    bench.measure_all("m", calls, prompts, repeats=3)
    timed = log[4:]  # after the untimed pass of both strategies over both prompts
    assert timed == [("greedy", "a"), ("prompt_lookup", "a"), ("greedy", "b"), ("prompt_lookup", "b")] * 3


def test_speedups_are_per_pass_ratios_of_neighbouring_calls(bench):
    """The machine's speed changes from one prompt's calls to the next (factors 1-4), never within them, as when
    the calls run back to back. Every per-pass ratio, of the whole pass and of each prompt, is then exactly the true
    1.25 (greedy 1.25 s, the strategy 1.0 s per call)."""
    log = []
    factors = [1.0, 1.0, 1.0, 4.0, 2.0, 1.0, 1.0, 3.0]  # per prompt-pair of calls: untimed pass, then 3 timed

    def seconds(base):
        return lambda name, order: base * factors[(order - 1) // 2]

    calls = {("jaxspec", "greedy"): fake_call(bench, log, "greedy", seconds(1.25)),
             ("jaxspec", "prompt_lookup"): fake_call(bench, log, "prompt_lookup", seconds(1.0))}
    results = bench.measure_all("m", calls, {"a": np.zeros(3), "b": np.zeros(3)}, repeats=3)
    greedy, lookup = results[("jaxspec", "greedy")], results[("jaxspec", "prompt_lookup")]
    assert lookup.speedups_over(greedy) == pytest.approx([1.25] * 3)
    assert lookup.speedups_over(greedy, "b") == pytest.approx([1.25] * 3)
    assert bench.paired_speedup(lookup, greedy, "a") == pytest.approx(1.25)
    assert greedy.speedups_over(lookup) == pytest.approx([0.8] * 3)
    assert np.isnan(bench.paired_speedup(None, greedy))
