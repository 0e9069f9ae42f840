"""Time to the first token: what compiling the decode loop costs a user of the CLI, and where it goes, for this
checkout beside another commit, in one run.

    python benchmarks/bench_compile.py [--model smollm2-135m] [--strategies prompt_lookup,mtp,dflash,eagle3]
        [--baseline HEAD] [--passes 1] [--no-chat] [--results benchmarks/results]

**As a user meets it** (`cli` table): `scripts/generate.py --chat --max-new-tokens 16` (without `--chat` for a base
model that has no chat template, such as gemma3-270m: `--no-chat`) in fresh processes that share
one fresh compilation cache, one fresh step-cost file and one fresh conversion cache, in the order a new user goes:
the first strategy on one prompt (`first run`: the model is converted, which the CLI counts as load time, everything
compiles, step costs are measured), the same strategy on a prompt of another length (`new prompt`: the executables
come from the cache, but the loop is traced and lowered again to find them), the next strategy (`new strategy`), and
that one on the other prompt. The figure is the CLI's own `compile ... s` (loading the compiled loop, or compiling
it, plus measuring step costs, less what ran beside the prefill), with its `load ... s`, its `first token ... s` (the
prefill picks it; since 2026-12-05 the round loop compiles while the prefill runs, so it comes before the loop's
compile has finished) and the process's wall time beside it. Converting in the first run matters: a converted
model's arrays are uncommitted and a restored one's committed, and the loops compiled for the one once missed the
persistent cache for the other.

**Where it goes** (`phases` table), in one process per strategy: the rounds executable (the while loop of
jaxspec/loop.py) and the prefill executable, each traced (`jax.jit(...).trace`), lowered, compiled by XLA,
serialized (its size, and its fusions in the optimized HLO) and deserialized again (what a persistent-cache hit
pays). Then `plain step ms`: a step of plain greedy decoding (64 new tokens, median of 5 calls after one that
compiles), so that a change that compiles faster shows what it costs a step.

`--baseline REF`: commit REF's jaxspec/, models/ and convert/ measured too, each side a copy taken at the start
(benchmarks/bench_cache_layout.py's `snapshot`), in alternating passes; the two sides must write the same tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from _record import REPO, Record, add_results_argument

HERE = "this checkout"
CODE = ("jaxspec", "models", "convert")
# The CLI's report line (jaxspec/cli/generate.py `print_report`): the first call's prefill, load, compile and first
# token; a baseline older than 2026-12-05 prints no first token (it came after load, compile and the prefill).
CLI_REPORT = re.compile(r"prefill ([\d.]+)s of it; load ([\d.]+)s, compile ([\d.]+)s apart(?:; first token ([\d.]+)s)?")
PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain in two sentences why the sky is blue, then give one everyday example of the same effect in a kitchen.",
)


# ------------------------------------------------------------------------------------------------------------------
# One side's phases: runs in its own process (the code under test is whichever jaxspec this process imports)


def measure_phases(model_name: str, strategy: str) -> dict:
    """Trace / lower / compile / serialize / deserialize seconds of the loop's two executables for `strategy`, and a
    plain step's milliseconds."""
    os.environ["JAXSPEC_STEP_COSTS"] = "default"  # pricing compiles too; the CLI table counts it, this one does not
    import jax
    from jax.experimental import serialize_executable

    import jaxspec
    from jaxspec import loop

    phases = {}

    def compile_and_time(spec, which, args):
        fn = jax.jit(functools.partial(loop._prefill if which == "prefill" else loop._rounds, spec))
        started = time.perf_counter()
        traced = fn.trace(*args)
        traced_at = time.perf_counter()
        lowered = traced.lower()
        lowered_at = time.perf_counter()
        executable = lowered.compile()
        compiled_at = time.perf_counter()
        blob, in_tree, out_tree = serialize_executable.serialize(executable)
        loaded_at = time.perf_counter()
        serialize_executable.deserialize_and_load(blob, in_tree, out_tree)
        phases[which] = {
            "trace": traced_at - started, "lower": lowered_at - traced_at, "xla": compiled_at - lowered_at,
            "deserialize": time.perf_counter() - loaded_at, "megabytes": len(blob) / 1e6,
            "fusions": len(re.findall(r"^  %\S+ = \S+ fusion\(", executable.as_text(), re.MULTILINE)),
        }
        return executable

    model = jaxspec.load(model_name)
    ids = model.tokenizer(PROMPTS[0])["input_ids"]
    if strategy in ("dflash", "eagle3"):  # the drafters jaxspec ships, as the CLI's --strategy loads them
        options = {"assistant_model": jaxspec.load(f"smollm2-135m-{strategy}")}
    else:
        options = {"prompt_lookup": {"prompt_lookup_num_tokens": 10}, "mtp": {"use_mtp": True}}[strategy]
    # Since 2026-12-05 every compile goes through `compile_in_background` (-> a function that waits for it); a
    # baseline before that compiled in `compile_loop`.
    entry = "compile_in_background" if hasattr(loop, "compile_in_background") else "compile_loop"
    real_compile = getattr(loop, entry)

    def timed_compile(spec, which, args):
        executable = compile_and_time(spec, which, args)
        if entry == "compile_loop":
            return executable
        # Since 2026-12-07's evening `compile_in_background` returns a `loop.Compiling` (the outputs' shapes are read
        # before the executable); before, a function that waited for it.
        return loop.Compiling.done(executable) if hasattr(loop, "Compiling") else (lambda: executable)

    setattr(loop, entry, timed_compile)
    try:
        first = jaxspec.generate(model, [ids], max_new_tokens=64, eos_token_id=[], **options)
    finally:
        setattr(loop, entry, real_compile)
    # A plain greedy step (its own loop, compiled here untimed), so a change that compiles faster shows what it costs a
    # step: the prefill picks the first token, each later one is a step.
    steps = []
    for _ in range(6):
        out = jaxspec.generate(model, [ids], max_new_tokens=64, eos_token_id=[])
        steps.append((out.decode_seconds - out.prefill_seconds) / (int(out.num_new_tokens[0]) - 1))
    return {"phases": phases, "step_ms": 1e3 * statistics.median(steps[1:]), "tokens": first.sequences[0].tolist()}


# ------------------------------------------------------------------------------------------------------------------
# The CLI as a user runs it


def cli_runs(pythonpath: str, model: str, strategies: list[str], tmp: str, chat: bool = True) -> list[dict]:
    """The CLI's compile seconds for the user's sequence of commands, in fresh caches under `tmp`."""
    cache = os.path.join(tmp, "jaxspec-cache")  # empty: the first run converts the model, as a new user's does
    os.makedirs(cache)
    env = dict(os.environ, PYTHONPATH=pythonpath, JAXSPEC_CACHE=cache,
               JAXSPEC_COMPILATION_CACHE=os.path.join(tmp, "xla"))
    env.pop("JAXSPEC_STEP_COSTS", None)
    runs = []
    for index, strategy in enumerate(strategies):
        for prompt_index in (0, 1) if index % 2 == 0 else (1, 0):
            what = ("first run" if index == 0 else "new strategy") if not runs or runs[-1]["strategy"] != strategy \
                else "new prompt"
            command = [sys.executable, os.path.join(REPO, "scripts", "generate.py"), "--model", model,
                       *(["--chat"] if chat else []), "--strategy", strategy, "--max-new-tokens", "16",
                       "--prompt", PROMPTS[prompt_index]]
            started = time.perf_counter()
            done = subprocess.run(command, env=env, cwd=tmp, capture_output=True, text=True, check=False)
            wall = time.perf_counter() - started
            report = CLI_REPORT.search(done.stdout + done.stderr)
            if done.returncode != 0 or report is None:
                raise SystemExit(f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}")
            prefill, load, compile_s = (float(group) for group in report.groups()[:3])
            first_token = float(report.group(4)) if report.group(4) else load + compile_s + prefill
            runs.append({"strategy": strategy, "run": what, "compile": compile_s, "load": load,
                         "first_token": first_token, "wall": wall})
    return runs


# ------------------------------------------------------------------------------------------------------------------
# The run


def snapshot(folder: str, ref: str | None) -> str:
    """This checkout's (or commit `ref`'s) jaxspec/, models/ and convert/ under `folder`, laid out as the installed
    package is; -> the folder to put on PYTHONPATH."""
    os.makedirs(folder)
    if ref:
        archive = subprocess.run(["git", "archive", ref, *CODE], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    else:
        for package in CODE:
            shutil.copytree(os.path.join(REPO, package), os.path.join(folder, package),
                            ignore=shutil.ignore_patterns("__pycache__"))
    for package in ("models", "convert"):
        link = os.path.join(folder, "jaxspec", package)
        if not os.path.lexists(link):
            os.symlink(f"../{package}", link)
    return folder


def run_side(pythonpath: str, args, strategy: str) -> dict:
    env = dict(os.environ, PYTHONPATH=pythonpath)
    command = [sys.executable, os.path.abspath(__file__), "--side", strategy, "--model", args.model]
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--strategies", default="prompt_lookup,mtp")
    p.add_argument("--baseline", default=None, help="a git ref whose code to measure beside this checkout's")
    p.add_argument("--passes", type=int, default=1, help="alternating passes over the sides")
    p.add_argument("--no-chat", dest="chat", action="store_false",
                   help="prompts as plain text: for a base model without a chat template (gemma3-270m)")
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # internal: one strategy's phases as JSON
    add_results_argument(p)
    args = p.parse_args(argv)
    if args.side:
        print(json.dumps(measure_phases(args.model, args.side)))
        return
    strategies = args.strategies.split(",")
    record = Record("bench_compile", __file__, argv, args.results)
    with tempfile.TemporaryDirectory() as tmp:
        sides = {HERE: snapshot(os.path.join(tmp, "here"), None)}
        if args.baseline:
            sides = {args.baseline: snapshot(os.path.join(tmp, "baseline"), args.baseline)} | sides
        cli = {side: [] for side in sides}
        phases = {side: {s: [] for s in strategies} for side in sides}
        for n in range(args.passes):
            for side, path in sides.items():
                folder = os.path.join(tmp, f"cli-{n}-{len(cli[side])}-{side[:4]}")
                cli[side].append(cli_runs(path, args.model, strategies, folder, args.chat))
                for strategy in strategies:
                    phases[side][strategy].append(run_side(path, args, strategy))

    rows = []
    print(f"\n# The CLI's compile seconds, as a new user meets them ({args.model}, cpu; median of {args.passes} "
          f"pass(es))\n")
    print("| strategy | run | " + " | ".join(f"{side}: compile s (load s, first token s, wall s)" for side in sides)
          + " |")
    print("|---|---|" + "---:|" * len(sides))
    for i, first in enumerate(cli[HERE][0]):
        cells = []
        for side in sides:
            compile_s, load, first_token, wall = (statistics.median(runs[i][key] for runs in cli[side])
                                                  for key in ("compile", "load", "first_token", "wall"))
            cells.append(f"{compile_s:.1f} ({load:.1f}, {first_token:.1f}, {wall:.1f})")
            rows.append({"table": "cli", "code": side, "strategy": first["strategy"], "run": first["run"],
                         "compile_seconds": compile_s, "load_seconds": load, "first_token_seconds": first_token,
                         "wall_seconds": wall})
        print(f"| {first['strategy']} | {first['run']} | " + " | ".join(cells) + " |")

    print(f"\n# Where it goes: trace, lower, XLA compile and persistent-cache load, seconds (median of "
          f"{args.passes})\n")
    print("| strategy | code | executable | trace | lower | XLA | deserialize | MB | fusions | plain step ms |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for strategy in strategies:
        for side in sides:
            passes = phases[side][strategy]
            step = statistics.median(run["step_ms"] for run in passes)
            for which in ("rounds", "prefill"):
                figures = {key: statistics.median(run["phases"][which][key] for run in passes)
                           for key in passes[0]["phases"][which]}
                rows.append({"table": "phases", "code": side, "strategy": strategy, "executable": which,
                             **figures, "step_ms": step})
                print(f"| {strategy} | {side} | {which} | {figures['trace']:.2f} | {figures['lower']:.2f} | "
                      f"{figures['xla']:.2f} | {figures['deserialize']:.2f} | {figures['megabytes']:.1f} | "
                      f"{figures['fusions']:.0f} | {step if which == 'rounds' else float('nan'):.2f} |")
        tokens = {tuple(phases[side][strategy][0]["tokens"]) for side in sides}
        if len(tokens) > 1:
            raise SystemExit(f"{strategy}: the sides wrote different tokens")
    record.write(rows, [args.model], title="compile seconds as a user meets them, and their phases",
                 settings={"strategies": strategies, "passes": args.passes, "baseline": args.baseline,
                           "chat": args.chat})


if __name__ == "__main__":
    sys.exit(main())
