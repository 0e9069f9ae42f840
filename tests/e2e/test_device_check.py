"""benchmarks/device_check.py, the script a person runs once on a freshly lent GPU or TPU: its `--tiny` mode end to
end in a subprocess, as CI runs it on a CPU (so the script cannot rot between accelerator loans), and the token
comparison that makes it exit 1, on arrays that differ."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from tests.fixtures.paths import BENCHMARKS, REPO_ROOT

SCRIPT = os.path.join(BENCHMARKS, "device_check.py")
# The suite's own settings (tests/conftest.py), dropped from the script's environment: it runs as users run it.
SUITE_SETTINGS = ("JAXSPEC_MIN_BUFFER", "JAXSPEC_PREFILL_CHUNK", "JAXSPEC_VERIFY_WIDTHS")
TINY_STRATEGIES = ("greedy", "prompt_lookup", "early_exit")
BATCH_SIZES = ("1", "8")
COLUMNS = ("model", "strategy", "settings", "batch", "tok/s", "speedup", "modelled", "compile s", "acceptance",
           "tokens/round", "identical")


@pytest.fixture(scope="module")
def device_check():
    import device_check  # benchmarks/ is on sys.path (pyproject's pythonpath), as for the other benchmark tests

    return device_check


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """The script's whole CI run, once. The users' buffer sizes and verify widths (the suite's are dropped): both
    prompts then fit one cache bucket, so batch 1 compiles one loop per strategy, not two. XLA's fast-compile flags,
    since compiling is nearly all of the run; no compilation cache, so every loop really compiles."""
    env = {key: value for key, value in os.environ.items() if key not in SUITE_SETTINGS}
    env |= {"JAX_PLATFORMS": "cpu", "JAXSPEC_STEP_COSTS": "default", "JAXSPEC_COMPILATION_CACHE": "off",
            "JAXSPEC_CACHE": str(tmp_path_factory.mktemp("jaxspec-cache")),
            "XLA_FLAGS": "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"}
    command = [sys.executable, SCRIPT, "--tiny", "--max-new-tokens", "16", "--repeats", "1", "--bandwidth-mb", "16"]
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                          check=False)


def table_rows(stdout: str) -> dict[tuple[str, str], dict[str, str]]:
    """The table's rows by (strategy, batch)."""
    rows = {}
    for line in stdout.splitlines():
        if line.startswith("| tiny-llama |"):
            cells = dict(zip(COLUMNS, (cell.strip() for cell in line.strip("|").split("|")), strict=True))
            rows[cells["strategy"], cells["batch"]] = cells
    return rows


@pytest.mark.slow
def test_tiny_mode_runs_every_strategy_at_every_batch_size_identically(tiny_run):
    assert tiny_run.returncode == 0, tiny_run.stdout + tiny_run.stderr[-4000:]
    rows = table_rows(tiny_run.stdout)
    assert set(rows) == {(s, b) for s in TINY_STRATEGIES for b in BATCH_SIZES}, tiny_run.stdout
    for (strategy, batch), cells in rows.items():
        assert cells["identical"] == "True", (strategy, batch)
        assert float(cells["tok/s"]) > 0 and cells["speedup"].endswith("x")
        if strategy != "greedy":  # drafts were proposed, so the comparison with plain decoding is not vacuous
            assert cells["acceptance"] != "-", (strategy, batch)
            assert f"rounds tiny-llama batch {batch} {strategy}: " in tiny_run.stdout
        else:
            assert cells["modelled"] == "-"
    assert rows["prompt_lookup", "1"]["modelled"].endswith("x")  # the adaptive schedule priced its rounds
    for batch in BATCH_SIZES:
        assert f"roofline tiny-llama batch {batch}: " in tiny_run.stdout
    assert "of measured" in tiny_run.stdout and "nominal n/a" in tiny_run.stdout  # a CPU is not in the table
    assert "skipped dflash (tiny-llama): tiny mode loads no drafter checkpoint" in tiny_run.stdout
    assert "every greedy output equals plain greedy decoding token for token" in tiny_run.stdout


def test_rounds_are_set_beside_what_the_cost_model_priced(device_check):
    """The figures that locate a speedup below the modelled one: a strategy's rounds in plain steps as measured
    (prefill excluded), beside the model's price for them, and the modelled speedup over the calls."""
    from types import SimpleNamespace

    def out(rounds, decode, prefill, priced, new_tokens):
        return SimpleNamespace(rounds=rounds, decode_seconds=decode, prefill_seconds=prefill, priced_steps=priced,
                               num_new_tokens=np.array(new_tokens), accepted_hist=np.array([[0, rounds]]))

    # Two calls: 40 rounds in 0.100 s and 20 in 0.050 s (2.5 ms a round), priced at 1.2 steps a round.
    strategy = device_check.Run([("a",), ("b",)], [out(40, 0.110, 0.010, 48.0, [61]),
                                                   out(20, 0.055, 0.005, 24.0, [31])], seconds=0.2)
    assert strategy.round_milliseconds == pytest.approx(2.5)
    assert strategy.priced_steps_per_round == pytest.approx(1.2)
    assert strategy.modelled_speedup == pytest.approx((60 + 30) / 72.0)
    case = device_check.Case("mtp", "3 layers", {})
    row = device_check.Row("m", case, 1, strategy, [strategy], 0.8, None)
    line = device_check.rounds_line("m", row, plain_ms=2.0)
    assert line.startswith("rounds m batch 1 mtp: 2.50 ms a round, 1.25 plain steps of 2.00 ms measured, 1.20 priced")
    unpriced = device_check.Run([("a",)], [out(40, 0.110, 0.010, 0.0, [61])], seconds=0.1)
    assert np.isnan(unpriced.modelled_speedup) and np.isnan(unpriced.priced_steps_per_round)


def test_first_mismatch_finds_the_first_differing_token(device_check):
    plain = [np.array([5, 6, 7, 8]), np.array([1, 2, 3, 4])]
    assert device_check.first_mismatch(plain, [row.copy() for row in plain]) is None
    mismatch = device_check.first_mismatch(plain, [plain[0], np.array([1, 2, 9, 4])])
    assert (mismatch.row, mismatch.position, mismatch.expected, mismatch.got) == (1, 2, 3, 9)
    assert "row 1 differs first at new token 2" in str(mismatch)


def test_first_mismatch_counts_a_row_cut_short(device_check):
    """A row that stopped early (an EOS where plain decoding had none) differs even where its tokens agree."""
    mismatch = device_check.first_mismatch([[1, 2, 3]], [[1, 2]])
    assert (mismatch.row, mismatch.position, mismatch.expected, mismatch.got) == (0, 2, 3, None)
    with pytest.raises(ValueError):
        device_check.first_mismatch([[1]], [[1], [2]])


def test_batches_take_the_prompts_in_turn(device_check):
    assert device_check.batch_calls(["edit", "summary"], 1) == [("edit",), ("summary",)]
    assert device_check.batch_calls(["edit", "summary"], 8) == [("edit", "summary") * 4]
    assert device_check.batch_calls(["edit", "summary"], 3) == [("edit", "summary", "edit")]


def test_catalogue_mode_runs_every_drafter_shipped_for_smollm2(device_check, monkeypatch):
    """With SmolLM2 installed (and no Qwen), its plan runs MTP and the shipped DFlash and EAGLE-3 drafters, each
    loaded as the `assistant_model` of its own strategy; the Qwen pairs are skipped with their pip command."""
    from jaxspec import catalog

    def find_part_files(entry):
        if entry.name != device_check.SMOLLM2:
            raise FileNotFoundError(entry.name)
        return []

    monkeypatch.setattr(catalog, "find_part_files", find_part_files)
    plans, skips = device_check.catalog_plans()
    (plan,) = plans
    assert plan.strategies == ("greedy", "prompt_lookup", "early_exit", "mtp", "dflash", "eagle3")
    assert dict(plan.drafters) == {"dflash": "smollm2-135m-dflash", "eagle3": "smollm2-135m-eagle3"}
    assert {(s.model, s.strategy) for s in skips} == {(device_check.CODER, "speculative"),
                                                      (device_check.CODER_SMALL, "universal")}
    case = device_check.case_for("dflash", None, plan, tiny=False)
    assert case.kwargs == {} and case.settings == "assistant smollm2-135m-dflash"


def test_prices_line_reads_what_the_first_call_timed(device_check):
    """The step-cost entries a call added, in plain steps (a round of width 1); entries stored earlier are not."""
    prefix = "host|gpu:NVIDIA H200|0.11.2|arch|code|verify|loop|abc|8x"
    before = {"other|verify|1": 9.0}
    after = before | {f"{prefix}|verify|1": 2.0, f"{prefix}|verify|2": 2.1, f"{prefix}|verify|8": 2.5,
                      f"{prefix}|draft": 0.2, f"{prefix}|round": 0.4}
    line = device_check.prices_line("m", 8, "dflash", before, after)
    assert line == ("prices m batch 8 dflash: a plain step 2.00 ms; verify width 2: 1.05, 8: 1.25 steps; a draft "
                    "0.10, a drafting round's fixed work 0.20 steps")
    assert "none timed in this run" in device_check.prices_line("m", 8, "dflash", after, after)


def test_settings_side_by_side_from_each_run_s_table(device_check):
    """--compare-settings reads each run's printed table back and lays the runs side by side, marking a run whose
    tokens differed from plain greedy decoding's."""
    def run_output(lookup_tok_s: str, identical: str) -> str:
        return "\n".join(["# jaxspec device check", "| " + " | ".join(COLUMNS) + " |", "|---|---|",
                          "| m | greedy | plain decoding | 1 | 100.0 | 1.00x | - | 2.0 | - | 1.00 | True |",
                          f"| m | prompt_lookup | K=10 | 1 | {lookup_tok_s} | 1.50x | 1.60x | 5.0 | 0.5 | 2.00 | "
                          f"{identical} |",
                          "roofline m batch 1: ..."])

    runs = {"default": device_check.table_cells(run_output("150.0", "True")),
            "lax branches": device_check.table_cells(run_output("160.0", "False")), "both": {}}
    assert set(runs["default"]) == {("m", "greedy", "1"), ("m", "prompt_lookup", "1")}
    assert device_check.settings_table(runs).splitlines() == [
        "| model | strategy | batch | default | lax branches | both |", "|---|---|---:|---:|---:|---:|",
        "| m | greedy | 1 | 100.0 (1.00x) | 100.0 (1.00x) | - |",
        "| m | prompt_lookup | 1 | 150.0 (1.50x) | 160.0 (1.50x) ≠ | - |"]


@pytest.mark.slow
def test_compare_settings_runs_the_check_under_each_setting(tmp_path):
    """The tiny check under each of SETTINGS, each process with its variables: one line per strategy with a figure
    from every setting, all identical to plain greedy decoding."""
    env = {key: value for key, value in os.environ.items() if key not in SUITE_SETTINGS}
    env |= {"JAX_PLATFORMS": "cpu", "JAXSPEC_STEP_COSTS": "default", "JAXSPEC_COMPILATION_CACHE": "off",
            "JAXSPEC_CACHE": str(tmp_path), "XLA_FLAGS": "--xla_backend_optimization_level=0"}
    command = [sys.executable, SCRIPT, "--tiny", "--max-new-tokens", "8", "--repeats", "1", "--batch-sizes", "1",
               "--strategies", "prompt_lookup", "--bandwidth-mb", "16", "--compare-settings"]
    done = subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    lines = done.stdout.splitlines()
    assert "| model | strategy | batch | default | lax branches | widths 1, K+1 | both |" in lines
    (lookup,) = [line for line in lines if line.startswith("| tiny-llama | prompt_lookup | 1 |")]
    assert lookup.count("x)") == 4 and "≠" not in lookup and " - " not in lookup  # every setting ran, identically
    for name in ("JAXSPEC_BRANCHES=lax", "JAXSPEC_VERIFY_WIDTHS=ends"):
        assert name in done.stderr


def test_nominal_bandwidth_by_device_kind(device_check):
    assert device_check.nominal_bandwidth("NVIDIA H200") == pytest.approx(4.8e12)
    assert device_check.nominal_bandwidth("TPU v5 lite") == pytest.approx(0.82e12)
    assert device_check.nominal_bandwidth("cpu") is None
