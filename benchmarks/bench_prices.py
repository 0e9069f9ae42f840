"""How precisely the adaptive schedule's prices are timed, and what timing them costs a first run: jaxspec/costs.py's
`time_loop` run again and again on one call's compiled loop, with each setting of rounds per timed call and timed
calls taking turns.

    python benchmarks/bench_prices.py [--model smollm2-135m] [--strategies prompt_lookup,dflash,eagle3]
        [--settings 4x2-3f,4x2-3] [--trials 5] [--batch 1] [--results benchmarks/results]

Per strategy, one `generate` call (the chat prompt below in each of `--batch` rows, 16 new tokens) with a fresh
step-cost file, so that it prices its schedule at that batch; that pricing runs once untimed (it warms what the first
pricing in a process pays), then `--trials` times per setting, the settings taking turns. A setting `RxC` times each
configuration in C calls (`costs.LOOP_RUNS`); `RxM-C`, in M to C calls, stopping after M where every configuration's
calls agree (`costs.LOOP_MIN_RUNS`, `LOOP_AGREEMENT`). The first call of each runs R rounds (`costs.LOOP_ROUNDS`), later
ones as many as last about as long as R rounds at width 1 (`costs.matched_rounds`); a setting ending in `f` (`4x2-3f`)
runs R rounds in every call, as before 2026-12-07's evening. Printed: each price in plain steps
(the loop's round at width 1), mean and standard deviation over the trials, and the seconds one pricing took. `dflash`
and `eagle3` draft with the drafters jaxspec ships for the model (`jaxspec.catalog.shipped_drafter`), `mtp` with its
attached MTP layers.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from _record import Record, add_results_argument

PROMPT = "What are three practical tips for making a small Python script easier for a colleague to read?"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--strategies", default="prompt_lookup,dflash,eagle3")
    p.add_argument("--settings", default="4x2-3f,4x2-3",
                   help="RxC: C timed calls per configuration, the first of R rounds and the others as long; RxM-C: M "
                        "to C calls, stopping after M where the calls agree; a trailing f: R rounds in every call")
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--batch", type=int, default=1, help="rows in the priced call (prices are per batch size bucket)")
    add_results_argument(p)
    args = p.parse_args(argv)
    settings = [_setting(text) for text in args.settings.split(",")]
    if args.trials < 2:
        p.error("--trials: at least 2 (a standard deviation needs two)")
    if args.batch < 1:
        p.error("--batch: at least 1")
    record = Record("bench_prices", __file__, argv, args.results)

    import jax

    import jaxspec

    target = jaxspec.load(args.model)
    ids = list(target.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False))
    rows = []
    title = f"price spread: {args.model}, {jax.default_backend()}, batch {args.batch}, {args.trials} trials a setting"
    print(f"# {title}\n")
    for strategy in args.strategies.split(","):
        trials = _trials(target, [ids] * args.batch, _drafting(jaxspec, args.model, strategy), settings, args.trials)
        prices = [name for name in trials[settings[0]][0] if name != "seconds"]
        print(f"\n## {strategy}\n\n| rounds x calls | " + " | ".join(prices) + " | seconds |")
        print("|---|" + "---:|" * (len(prices) + 1))
        for setting in settings:
            cells = [_mean_sd([trial[name] for trial in trials[setting]]) for name in prices + ["seconds"]]
            print(f"| {_label(setting)} | " + " | ".join(cells) + " |")
            rows += [{"strategy": strategy, "rounds": setting[0], "calls": setting[2], "min_calls": setting[1],
                      "matched_durations": setting[3], "trial": i, **trial}
                     for i, trial in enumerate(trials[setting])]
    record.write(rows, [args.model], title=title,
                 settings={"strategies": args.strategies, "settings": args.settings, "trials": args.trials,
                           "batch": args.batch})


def _setting(text: str) -> tuple[int, int, int, bool]:
    """'RxC' -> (R, C, C, True); 'RxM-C' -> (R, M, C, True): rounds of a first call, the fewest and the most calls,
    and whether later calls match the unit's duration (a trailing 'f': False, R rounds in every call)."""
    matched = not text.endswith("f")
    rounds, _, calls = text.removesuffix("f").partition("x")
    fewest, _, most = calls.partition("-")
    most = most or fewest
    if not all(n.isdigit() and int(n) > 0 for n in (rounds, fewest, most)) or int(fewest) > int(most):
        raise SystemExit(f"--settings: {text!r} is not ROUNDSxCALLS or ROUNDSxFEWEST-MOST with positive integers "
                         f"(e.g. 4x3 or 4x2-3), with an optional trailing f (4x2-3f)")
    return int(rounds), int(fewest), int(most), matched


def _label(setting: tuple[int, int, int, bool]) -> str:
    rounds, fewest, most, matched = setting
    calls = f"{rounds} x {fewest}" if fewest == most else f"{rounds} x {fewest}-{most}"
    return calls + (", matched" if matched else ", fixed")


def _drafting(jaxspec, model: str, strategy: str) -> dict:
    """generate()'s drafting arguments for `strategy`, with the adaptive schedule (the one that is priced)."""
    if strategy == "prompt_lookup":
        drafting = {"prompt_lookup_num_tokens": 10}
    elif strategy == "mtp":
        drafting = {"use_mtp": True}
    elif strategy in ("dflash", "eagle3"):
        from jaxspec.catalog import shipped_drafter

        drafter = shipped_drafter(model, strategy)
        if drafter is None:
            raise SystemExit(f"--strategies: jaxspec ships no {strategy} drafter for {model}")
        drafting = {"assistant_model": jaxspec.load(drafter)}
    else:
        raise SystemExit(f"--strategies: {strategy!r} is not one of prompt_lookup, mtp, dflash, eagle3")
    return drafting | {"num_assistant_tokens_schedule": "adaptive"}


def _trials(target, rows, drafting: dict, settings, trials: int) -> dict[tuple, list[dict[str, float]]]:
    """{setting: [{price name: plain steps, "seconds": one pricing}, one per trial]} from the loop of one call of
    `rows` (token id lists)."""
    import jaxspec
    from jaxspec import costs

    timed = {setting: [] for setting in settings}
    time_loop = costs.time_loop

    def repeated(call, prefill, rounds, widths, drafts, prefix="", **_):
        measured = time_loop(call, prefill, rounds, widths, drafts, prefix)  # untimed: warms the process
        for _ in range(trials):
            for setting in settings:
                rounds_per_call, fewest, most, matched = setting
                start = time.perf_counter()
                measured = time_loop(call, prefill, rounds, widths, drafts, prefix, rounds_per_run=rounds_per_call,
                                     runs=most, min_runs=fewest, match_durations=matched)
                seconds = time.perf_counter() - start
                unit = measured[f"{prefix}|verify|1"]
                prices = {key[len(prefix) + 1:]: ms / unit for key, ms in measured.items()
                          if key != f"{prefix}|verify|1"}
                timed[setting].append(prices | {"seconds": seconds})
        return measured

    saved = {name: os.environ.get(name) for name in ("JAXSPEC_CACHE", "JAXSPEC_STEP_COSTS")}
    with tempfile.TemporaryDirectory() as cache:
        os.environ.update(JAXSPEC_CACHE=cache, JAXSPEC_STEP_COSTS="measure")  # a fresh file: the call prices
        costs.time_loop = repeated
        try:
            jaxspec.generate(target, rows, max_new_tokens=16, **drafting)
        finally:
            costs.time_loop = time_loop
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
    if not timed[settings[0]]:
        raise SystemExit("the call did not price its schedule (every row ended in the prefill?)")
    return timed


def _mean_sd(values: list[float]) -> str:
    return f"{statistics.mean(values):.3f} ± {statistics.stdev(values):.3f}"


if __name__ == "__main__":
    main()
