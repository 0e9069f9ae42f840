"""Plain greedy step time against the memory-bandwidth roofline, and what the attention cache's layout costs: this
checkout's layout against another commit's, side by side in one run.

    python benchmarks/bench_cache_layout.py [--models smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m]
        [--new-tokens 64] [--repeats 5] [--passes 2] [--baseline HEAD] [--results benchmarks/results]

Per model: float32, batch 1, the chat prompt of benchmarks/bench.py (in the model's chat template where it has one),
`--new-tokens` tokens of plain greedy decoding (no end-of-sequence stop, so every call decodes as many steps), after
one untimed call that compiles. A step is one target forward of one token: `step ms` = (decode seconds - prefill
seconds) / (new tokens - 1), median over `--repeats` calls (the prefill picks the first token; each later token is
one step).

`bytes / step` is what a step must read at least: every weight once (a tied embedding once, as the head; an untied
input embedding not at all: one row per token) and the part of the attention cache that attention reads (the live
prefix that `models/layers.attend_live` chooses for the middle of the answer; the whole cache below its
PREFIX_FROM). `roofline` = bytes / step / step time, as a fraction of the read bandwidth measured here: XLA's
matrix-vector product over a 512 MB float32 matrix (benchmarks/_bench_timing.py), which is how decoding reads every
weight, timed in each measuring process before its models, the best kept. (A sum over a large array reads more
slowly on XLA:CPU than decoding itself does, which would put steps above their roofline.) `layer copies` counts the
arrays in the compiled decode loop (optimized HLO) with the axes of one layer's keys or values, copied there from the
stacked cache: transposed (attention that reads the cache in another layout than it is stored in pays one per
layer and step), or sliced as they lie (XLA:CPU copies a slice of a stacked array before a matrix product reads it,
as it does for stacked weights; see docs/design.md).

`--baseline REF` measures the cache layout of commit REF too: this checkout's code with REF's models/,
jaxspec/cache.py and jaxspec/layout.py (`LAYOUT_FILES`, from `git archive`) in their place, so that nothing but the
layout differs. Each side is a copy of the code taken at the start (`snapshot`), imported from PYTHONPATH ahead of
the installed package. The sides run in `--passes` alternating passes, a subprocess each, so both see the same
machine load, and must write the same tokens; the ratio is the median over passes of the step time of REF's
layout over this checkout's. Without it, only this checkout is measured. The figures also go to a JSON record in
`--results` (benchmarks/_record.py; run this file as a script so its sibling modules import).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

from _record import REPO, Record, add_results_argument

MODELS = "smollm2-135m,qwen2.5-coder-0.5b,gemma3-270m"
# What defines the cache layout and the attention that reads it, and the weights' CPU layout that models/ reads
LAYOUT_FILES = ("models", "jaxspec/cache.py", "jaxspec/layout.py")
BANDWIDTH_MB = 512  # the matrix the read bandwidth is timed on: far larger than any CPU cache
HERE = "this checkout"


# ------------------------------------------------------------------------------------------------------------------
# One side: runs in its own process (the code under test is whichever jaxspec this process imports)


def measure_side(models: list[str], new_tokens: int, repeats: int) -> dict:
    """{"bandwidth_gb_s": read bandwidth, "models": {model: figures}} of plain greedy with the jaxspec this process
    imports."""
    import functools

    import jax

    import jaxspec
    from _bench_plans import weight_bytes_per_token
    from _bench_prompts import PROMPTS
    from _bench_timing import measure_read_bandwidth
    from jaxspec import loop
    from jaxspec.prompts import buffer_size
    from jaxspec.strategies import default_prefill_chunk

    out = {}
    bandwidth = measure_read_bandwidth(BANDWIDTH_MB)
    for name in models:
        model = jaxspec.load(name)
        tok = model.tokenizer
        text = PROMPTS["chat"]
        if tok.chat_template:  # an instruct model's own format; Gemma 3 270M is a base model and has none
            text = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                           add_generation_prompt=True)
        ids = [tok(text, add_special_tokens=False)["input_ids"]]  # a list of rows: no padding to infer
        loop._compiled.clear()
        first = jaxspec.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[])  # compiles
        steps = []
        for _ in range(repeats):
            o = jaxspec.generate(model, ids, max_new_tokens=new_tokens, eos_token_id=[])
            steps.append((o.decode_seconds - o.prefill_seconds) / (int(o.num_new_tokens[0]) - 1))
        (hlo,) = [c.as_text() for c in loop.compiled("rounds")]
        size = buffer_size(len(ids[0]) + new_tokens + 1, default_prefill_chunk())  # as generate() sizes it
        cache = jax.eval_shape(functools.partial(model.module.init_cache, 1, size))
        _, weights = weight_bytes_per_token(model.module)
        out[name] = {
            "step_seconds": steps, "weight_bytes": weights, "cache_entries": size, "prompt_tokens": len(ids[0]),
            "cache_bytes_read": _cache_bytes_read(cache, size, len(ids[0]) + new_tokens // 2),
            "cache_copies": _layer_cache_copies(hlo, cache), "tokens": first.sequences[0].tolist(),
            "compile_seconds": first.compile_seconds,
        }
        del model
        loop._compiled.clear()
        jax.clear_caches()
    return {"bandwidth_gb_s": bandwidth, "models": out}


def _cache_bytes_read(cache, size: int, position: int) -> int:
    """Bytes of every cache leaf that attention reads at `position`: the prefix `attend_live` chooses."""
    import jax

    from jaxspec.models import layers

    extent = next(e for e in layers.key_extents(size) if e > position) if position < size else size
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache)) * extent // size


def _layer_cache_copies(hlo: str, cache) -> dict[str, int]:
    """Arrays in `hlo` with the axes of one layer's slice of a cache leaf (unit axes aside, in any order), made by a
    copy or by a fusion: {"transposed": made by a transpose or a copy (a layer's keys or values rearranged into
    another layout), "sliced": made by a fusion that only slices (a layer's slice of the stacked cache copied as it
    lies, which XLA:CPU does before handing it to a matrix product)}."""
    import jax

    def axes(dims):
        return tuple(sorted(int(d) for d in dims.split(",") if int(d) > 1))

    layers = {axes(",".join(map(str, x.shape[1:]))) for x in jax.tree.leaves(cache) if x.ndim >= 4}
    computations = dict(re.findall(r"^(?:ENTRY )?(%\S+) \([^\n]*\{\n(.*?)\n\}", hlo, re.M | re.S))
    fused = set(re.findall(r"kind=k\w+, calls=(%[\w.\-]+)", hlo))  # bodies of fusions: counted with their fusion
    counts = {"transposed": 0, "sliced": 0}
    for name, text in computations.items():
        if name in fused:
            continue
        for dims, op, rest in re.findall(r"^  %\S+ = f32\[([\d,]+)\]\{[^}]*\} (copy|fusion)\((.*)$", text, re.M):
            if axes(dims) not in layers:
                continue
            body = computations.get(m.group(1), "") if (m := re.search(r"calls=(%[\w.\-]+)", rest)) else ""
            if op == "copy" or "transpose(" in body or " copy(" in body:
                counts["transposed"] += 1
            elif "slice(" in body:
                counts["sliced"] += 1
    return counts


# ------------------------------------------------------------------------------------------------------------------
# The run: sides in alternating subprocesses, the bandwidth, the table


def snapshot(folder: str, layout_ref: str | None = None) -> str:
    """This checkout's jaxspec/, models/ and convert/ copied under `folder`, laid out as the installed package is
    (models/ and convert/ are jaxspec.models and jaxspec.convert), with commit `layout_ref`'s `LAYOUT_FILES` in place
    of this checkout's if given; -> the folder to put on PYTHONPATH. Both sides are copies taken at the start, so an
    edit made to the checkout during the run changes neither."""
    skip = shutil.ignore_patterns("__pycache__")
    for package in ("jaxspec", "models", "convert"):
        shutil.copytree(os.path.join(REPO, package), os.path.join(folder, package), ignore=skip)
    if layout_ref:
        shutil.rmtree(os.path.join(folder, "models"))
        archive = subprocess.run(["git", "archive", layout_ref, *LAYOUT_FILES], cwd=REPO, check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    os.symlink("../models", os.path.join(folder, "jaxspec", "models"))
    os.symlink("../convert", os.path.join(folder, "jaxspec", "convert"))
    return folder


def run_side(pythonpath: str, args) -> dict[str, dict]:
    """One side's figures, measured in a fresh process whose `import jaxspec` finds `pythonpath` first."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pythonpath, os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    command = [sys.executable, os.path.abspath(__file__), "--side", "--models", args.models,
               "--new-tokens", str(args.new_tokens), "--repeats", str(args.repeats)]
    done = subprocess.run(command, env=env, check=True, stdout=subprocess.PIPE, text=True, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=MODELS)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per model and pass")
    p.add_argument("--passes", type=int, default=2, help="alternating passes over both sides (with --baseline)")
    p.add_argument("--baseline", default=None, help="a git ref whose code to measure beside this checkout's")
    p.add_argument("--side", action="store_true", help=argparse.SUPPRESS)  # internal: measure and print JSON
    add_results_argument(p)
    args = p.parse_args(argv)
    models = args.models.split(",")
    if args.side:
        print(json.dumps(measure_side(models, args.new_tokens, args.repeats)))
        return
    record = Record("bench_cache_layout", __file__, argv, args.results)

    with tempfile.TemporaryDirectory() as tmp:
        sides = {HERE: snapshot(os.path.join(tmp, "here"))}
        if args.baseline:
            sides = {args.baseline: snapshot(os.path.join(tmp, "baseline"), args.baseline)} | sides
        runs = {side: [] for side in sides}
        for _ in range(args.passes if args.baseline else 1):
            for side, path in sides.items():
                runs[side].append(run_side(path, args))
    bandwidth = max(run["bandwidth_gb_s"] for passes in runs.values() for run in passes)
    runs = {side: [run["models"] for run in passes] for side, passes in runs.items()}

    rows, notes = [], []
    print(f"\n# Plain greedy step against the read-bandwidth roofline (cpu, float32, batch 1, {args.new_tokens} new "
          f"tokens; read bandwidth {bandwidth:.1f} GB/s)\n")
    print("| model | code | cache entries | step ms | tokens/s | bytes / step | roofline | layer copies: transposed, "
          "sliced |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for name in models:
        for side, passes in runs.items():
            first = passes[0][name]
            step = statistics.median(s for run in passes for s in run[name]["step_seconds"])
            nbytes, copies = first["weight_bytes"] + first["cache_bytes_read"], first["cache_copies"]
            row = {"table": "steps", "model": name, "code": side, "cache_entries": first["cache_entries"],
                   "step_ms": step * 1e3, "tokens_per_second": 1 / step, "bytes_per_step": nbytes,
                   "weight_bytes": first["weight_bytes"], "cache_bytes_read": first["cache_bytes_read"],
                   "roofline_fraction": nbytes / step / 1e9 / bandwidth,
                   "layer_copies_transposed": copies["transposed"], "layer_copies_sliced": copies["sliced"],
                   "compile_seconds": first["compile_seconds"]}
            rows.append(row)
            print(f"| {name} | {side} | {row['cache_entries']} | {row['step_ms']:.2f} | {row['tokens_per_second']:.1f} "
                  f"| {nbytes / 1e6:.1f} MB | {row['roofline_fraction']:.2f} | {copies['transposed']}, "
                  f"{copies['sliced']} |")
        tokens = {side: passes[0][name]["tokens"] for side, passes in runs.items()}
        if len({tuple(t) for t in tokens.values()}) > 1:
            raise SystemExit(f"{name}: the two sides wrote different tokens")
        if args.baseline:
            ratio = statistics.median(statistics.median(old[name]["step_seconds"])
                                      / statistics.median(new[name]["step_seconds"])
                                      for old, new in zip(runs[args.baseline], runs[HERE]))  # paired by pass
            notes.append(f"{name}: a step with this checkout's layout is {ratio:.2f}x as fast as with "
                         f"{args.baseline}'s")
            rows.append({"table": "ratios", "model": name, "baseline": args.baseline, "speedup": ratio})
    for note in notes:
        print(f"\n{note}", end="")
    print()
    record.write(rows, models, bandwidth_gb_s=bandwidth, notes=notes,
                 title="plain greedy step against the read-bandwidth roofline, by cache layout",
                 settings={"new_tokens": args.new_tokens, "repeats": args.repeats, "passes": args.passes,
                           "baseline": args.baseline})


if __name__ == "__main__":
    sys.exit(main())
