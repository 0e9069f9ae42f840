"""What a verify block of W tokens costs against a plain decoding step (one token), for the target alone: the
figures behind the adaptive schedule's verify costs (`jaxspec.strategies.base.default_verify_costs`, and what
`generate` measures for itself: jaxspec/costs.py, whose timing loop this script runs).

    python benchmarks/bench_verify_width.py [--model smollm2-135m] [--widths 1,2,3,4,8] [--steps 20]
        [--quantization int8] [--results benchmarks/results]

Per width, one jitted loop of `--steps` target forwards at batch 1 that writes a 512-position cache in place (as
the decode loop does; the cache is donated), from position 200; best of 4 runs, printed as milliseconds per forward
and as the ratio to width 1, side by side in one run. Where `generate` verifies with a contiguous copy of a tied
head (on CPU: jaxspec/head.py), both heads are timed: the tied embedding read through a transpose, and the copy that
decoding uses. Timing single calls instead would add a copy of the whole cache and a dispatch to every width, which
hides most of the difference. On a CPU the ratio shows what leaving the memory-bound matrix-vector path costs (the
LM head's matrix multiply at 2 rows costs about twice its 1-row product); on an accelerator it stays near 1.
`--quantization int8` adds a column for the same model through `jaxspec.quantize` (int8 weights and activations:
what an int8 assistant's forward costs, with the model's own head, as an assistant drafts), and its one-token forward
over the float model's. The table also goes to a JSON record in `--results` (benchmarks/_record.py, a sibling
module: run it as a script).
"""

from __future__ import annotations

import argparse
import sys

from _record import Record, add_results_argument


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--widths", default="1,2,3,4,8")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--quantization", default=None, choices=("int8",))
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_verify_width", __file__, argv, args.results)

    import jax
    from flax import nnx

    import jaxspec
    from jaxspec.costs import time_forwards
    from jaxspec.head import verify_head

    model = jaxspec.load(args.model)
    copy = verify_head(model, nnx.split(model.module)[1], None)  # None where generate verifies with the model's head
    heads = {"model's head": (model, None)} if copy is None else {"tied view": (model, None),
                                                                   "contiguous copy (generate)": (model, copy)}
    if args.quantization:
        heads[args.quantization] = (jaxspec.quantize(model, args.quantization), None)
    widths = tuple(sorted({1} | {int(w) for w in args.widths.split(",")}))
    milliseconds = {name: time_forwards(timed, widths, head, steps=args.steps, runs=4)
                    for name, (timed, head) in heads.items()}
    title = f"verify width cost: {args.model}, {jax.default_backend()}, {model.dtype}, batch 1"
    print(f"# {title}\n")
    print("| width | " + " | ".join(f"{name}: ms | vs one token" for name in heads) + " |")
    print("|---:|" + "---:|---:|" * len(heads))
    for w in widths:
        cells = [f"{milliseconds[name][w]:.2f} | {milliseconds[name][w] / milliseconds[name][1]:.2f}" for name in heads]
        print(f"| {w} | " + " | ".join(cells) + " |")
    rows = [{"table": "widths", "model": args.model, "head": name, "width": w, "ms": milliseconds[name][w],
             "vs_one_token": milliseconds[name][w] / milliseconds[name][1]} for w in widths for name in heads]
    if args.quantization:
        floating = milliseconds[next(iter(heads))][1]
        ratio = milliseconds[args.quantization][1] / floating
        print(f"\n{args.quantization} one-token forward / float one: {ratio:.2f}")
        rows.append({"table": "quantization", "model": args.model, "quantization": args.quantization,
                     "one_token_vs_float": ratio})
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


if __name__ == "__main__":
    sys.exit(main())
