"""Plain greedy step time on a CPU with the decoder layers' projections stored [out, in] (what `jaxspec.load` does
on one CPU device, jaxspec/layout.py) against the same weights in the model code's [in, out] layout, side by side in
one process.

    python benchmarks/bench_weight_layout.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--batch-sizes 1,8]
        [--sides all] [--new-tokens 48] [--repeats 3] [--passes 2] [--results benchmarks/results]

The sides share one loaded model (float32); `--sides` picks some by their numbers (0,4: the model as loaded and
`unfused`), the first always timed as the reference:
- `[out, in]`: the model as `jaxspec.load` returns it;
- `[in, out]`: its projections put back in the model code's layout (`jaxspec.layout.standard_layout`);
- `[in, out], copy`: that, with the verifying forwards multiplying by the CPU head copy at every block size, as
  before the copy was kept to blocks of up to 4 rows (`jaxspec.head.COPY_MAX_ROWS`): the layout before both changes;
- `matrix head`: the model as loaded, its tied head multiplied by matrix products at every row count (the copy's up
  to 4 rows), as before 3-32 rows took an elementwise product and a sum (models/int8.py, `_multiply_reduce`);
- `unfused`: the model as loaded, but each projection in its own array and product, as before a layer's q, k and v,
  and its gate and up, were fused into one buffer and one product each (`jaxspec.layout.FUSED_GROUPS`);
- `large weights only`: the model as loaded, with the elementwise product and sum kept to weights of 2^23 elements or
  more from 3 rows on, as before every weight took it from 2 rows (models/int8.py, `multiply_reduce_pays`);
- `step at the loop's top`: the model as loaded, plain decoding's step at the top of the rounds loop rather than nested
  in a branch, as before 2026-12-07 (jaxspec/loop.py, `NESTED_PLAIN_STEP`).

Per model and batch size (rows from benchmarks/bench.py's prompts, ragged), each side decodes `--new-tokens` tokens
with no end-of-sequence stop. A step is one target forward: (decode seconds - prefill seconds) / (new tokens - 1),
the median over `--repeats` calls after one call that compiles. The sides take turns for `--passes` passes, so a
drifting machine moves them alike; the table gives each side's median step and its ratio to `[out, in]`, and the
roofline: the bytes a step must read (every weight once) over its time, as a fraction of the read bandwidth
measured here first (benchmarks/_bench_timing.py). Every side must decode the same tokens, or the script fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys

from _record import Record, add_results_argument

SIDES = ("[out, in]", "[in, out]", "[in, out], copy", "matrix head", "unfused", "large weights only",
         "step at the loop's top")
BANDWIDTH_MB = 512


def twins(model, copy_rows: int, chosen) -> dict:
    """{side: (model, head copy rows, first row count of the multiply-reduce, its last for small weights, whether the
    plain step is nested)} for the `chosen` sides of one loaded model, each built only when chosen: the sides share
    every array but the projections. `copy_rows`: the package's own `COPY_MAX_ROWS`."""
    from flax import nnx

    from _bench_plans import unfused
    from jaxspec.layout import standard_layout
    from jaxspec.models import int8 as I

    @functools.cache
    def standard():  # one copy for the two sides that read it
        graphdef, state = nnx.split(model.module)
        return dataclasses.replace(model, module=nnx.merge(graphdef, standard_layout(state)))

    reduce = (I.MULTIPLY_REDUCE_MIN_ROWS, I.SMALL_WEIGHT_MAX_ROWS, True)
    never = (1 << 30, 0, True)
    build = {SIDES[0]: lambda: (model, copy_rows, *reduce), SIDES[1]: lambda: (standard(), copy_rows, *reduce),
             SIDES[2]: lambda: (standard(), 1 << 30, *never), SIDES[3]: lambda: (model, 4, 1 << 30, 0, True),
             SIDES[4]: lambda: (unfused(model), copy_rows, *reduce), SIDES[5]: lambda: (model, copy_rows, 3, 0, True),
             SIDES[6]: lambda: (model, copy_rows, *reduce[:2], False)}
    return {side: build[side]() for side in chosen}


def step_seconds(model, rows, new_tokens: int, repeats: int) -> tuple[float, list]:
    """(median seconds per step over `repeats` calls, the first call's token rows), after a compiling call."""
    import jaxspec

    first = jaxspec.generate(model, rows, max_new_tokens=new_tokens, eos_token_id=[])
    steps = []
    for _ in range(repeats):
        out = jaxspec.generate(model, rows, max_new_tokens=new_tokens, eos_token_id=[])
        steps.append((out.decode_seconds - out.prefill_seconds) / (new_tokens - 1))
    return statistics.median(steps), first.sequences.tolist()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--sides", default="all", help="side numbers to time (0 is always timed), or all")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--passes", type=int, default=2)
    add_results_argument(parser)
    args = parser.parse_args(argv)
    record = Record("bench_weight_layout", __file__, argv, args.results)

    import jax

    import jaxspec
    from _bench_plans import weight_bytes_per_token
    from _bench_prompts import PROMPTS
    from _bench_timing import measure_read_bandwidth
    from jaxspec import head, loop
    from jaxspec.models import int8 as I

    def set_rules(rules):  # each read while tracing
        head.COPY_MAX_ROWS, I.MULTIPLY_REDUCE_MIN_ROWS, I.SMALL_WEIGHT_MAX_ROWS, loop.NESTED_PLAIN_STEP = rules

    package_rules = head.COPY_MAX_ROWS, I.MULTIPLY_REDUCE_MIN_ROWS, I.SMALL_WEIGHT_MAX_ROWS, loop.NESTED_PLAIN_STEP
    copy_rows = head.COPY_MAX_ROWS
    chosen = SIDES if args.sides == "all" else [SIDES[0]] + [SIDES[int(i)] for i in args.sides.split(",") if i != "0"]
    bandwidth = measure_read_bandwidth(BANDWIDTH_MB)
    models = args.models.split(",")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    rows_out = []
    print(f"read bandwidth {bandwidth:.1f} GB/s; step ms, median of {args.repeats} calls, median over "
          f"{args.passes} passes")
    others = chosen[1:]
    print(f"| model | batch | {' | '.join(f'{s} ms' for s in chosen)} "
          f"| {' | '.join(f'{s} / {SIDES[0]}' for s in others)} | {' | '.join(f'roofline {s}' for s in chosen)} |")
    print("|---|---:|" + "---:|" * (3 * len(chosen) - 1))
    for name in models:
        model = jaxspec.load(name)
        _, weight_bytes = weight_bytes_per_token(model.module)
        tok = model.tokenizer
        texts = list(PROMPTS.values())
        for batch in batch_sizes:
            rows = [tok(texts[i % len(texts)], add_special_tokens=False)["input_ids"] for i in range(batch)]
            times = {side: [] for side in chosen}
            tokens = {}
            sides = twins(model, copy_rows, chosen)
            for _ in range(args.passes):
                for side, (twin, *rules) in sides.items():
                    set_rules(rules)
                    jax.clear_caches()
                    loop._compiled.clear()
                    seconds, sequences = step_seconds(twin, rows, args.new_tokens, args.repeats)
                    times[side].append(seconds)
                    tokens.setdefault(side, sequences)
            set_rules(package_rules)
            del sides
            if any(tokens[side] != tokens[SIDES[0]] for side in chosen):
                sys.exit(f"{name} batch {batch}: the layouts decoded different tokens")
            ms = {side: 1e3 * statistics.median(times[side]) for side in chosen}
            roofline = {side: weight_bytes / (ms[side] / 1e3) / 1e9 / bandwidth for side in chosen}
            print(f"| {name} | {batch} | {' | '.join(f'{ms[s]:.1f}' for s in chosen)} "
                  f"| {' | '.join(f'{ms[s] / ms[SIDES[0]]:.2f}' for s in others)} "
                  f"| {' | '.join(f'{roofline[s]:.2f}' for s in chosen)} |", flush=True)
            rows_out.append({"model": name, "batch": batch, "step_ms": ms, "per_pass_s": times,
                             "roofline": roofline})
        del model
    record.write(rows_out, models, bandwidth_gb_s=bandwidth, new_tokens=args.new_tokens, repeats=args.repeats,
                 passes=args.passes, sides=list(chosen))


if __name__ == "__main__":
    main()
