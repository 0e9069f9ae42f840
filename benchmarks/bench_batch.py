"""Every strategy against plain decoding of the same batch, at batch 1, 8 and 32: one table, measured side by side.

    python benchmarks/bench_batch.py [--model smollm2-135m] [--strategies prompt_lookup,early_exit,mtp,dflash,eagle3]
        [--batch-sizes 1,8,32] [--kinds copy,free] [--max-new-tokens 48] [--passes 3]

The promise is "never slower than plain decoding": in the engines users compare jaxspec with, a drafter that gains at
batch 1 can lose at batch 8, where a verify block is one forward for the whole batch and costs what its widest row
asks. Two kinds of prompts: `copy`, code edits whose answers repeat the prompt (drafts pay), and `free`, stories,
chat and explanations (drafts rarely pay: what must not be slower). A batch of B rows cycles through its kind's
prompts, so a batch mixes several prompts.

Timing: each (kind, batch, strategy) runs once untimed (compiles, and measures the step costs of that batch the first
time; jaxspec/costs.py), then `--passes` timed passes; in each pass plain decoding and every strategy run back to
back on the same batch, and a strategy's speedup is its paired ratio to plain decoding of that pass: the rounds'
seconds (the decode time after the prefill, which both share) of plain over the strategy's. The table shows the
median over passes with the range (min-max), the strategy's acceptance and tokens per round, and the speedup that the
adaptive schedule's cost model expected for the rounds it ran (`GenerateOutput.modelled_speedup`): where the two
differ, the cost model misses a cost. Every row's greedy output is checked against plain decoding's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

COPY_PROMPTS = (
    'Rewrite this function so that it returns a list instead of printing:\ndef evens(n):\n    for i in range(n):\n'
    '        if i % 2 == 0:\n            print(i)',
    'Rename the variable `total` to `running_sum` in this code and reply with the whole code:\ndef add_all(values):\n'
    '    total = 0\n    for value in values:\n        total = total + value\n    return total',
    'Add type hints to this function and reply with the whole function:\ndef scale(points, factor):\n'
    '    return [(x * factor, y * factor) for x, y in points]',
    'Fix the bug in this function and reply with the corrected function:\ndef last_item(items):\n'
    '    if len(items) == 0:\n        return None\n    return items[len(items)]',
)
FREE_PROMPTS = (
    "Tell me a short story about a fox who learns to sail.",
    "What are three practical tips for sleeping better?",
    "Explain in simple words why the sky is blue.",
    "Write a friendly note inviting a neighbour to a garden party.",
)
KINDS = {"copy": COPY_PROMPTS, "free": FREE_PROMPTS}
STRATEGY_KWARGS = {
    "prompt_lookup": dict(prompt_lookup_num_tokens=10),
    "early_exit": None,  # assistant_early_exit: half the target's layers (set in main)
    "mtp": dict(use_mtp=True),
    # The drafters jaxspec ships for SmolLM2 (catalogue names, loaded by strategy_arguments)
    "dflash": dict(assistant_model="smollm2-135m-dflash"),
    "eagle3": dict(assistant_model="smollm2-135m-eagle3"),
}


def strategy_arguments(name: str, model) -> dict:
    """`jaxspec.generate`'s arguments that run strategy `name` (a key of STRATEGY_KWARGS) on `model`: early exit at
    half its layers, and the catalogue drafters loaded."""
    import jaxspec

    arguments = dict(STRATEGY_KWARGS[name] or dict(assistant_early_exit=model.config.num_layers // 2))
    if isinstance(arguments.get("assistant_model"), str):  # a catalogue name
        arguments["assistant_model"] = jaxspec.load(arguments["assistant_model"])
    return arguments


def batch_ids(tokenizer, prompts: tuple[str, ...], batch: int) -> list[list[int]]:
    """`batch` chat-templated rows, cycling through `prompts`."""
    rows = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                          return_dict=False) for p in prompts]
    return [list(rows[b % len(rows)]) for b in range(batch)]


def rounds_seconds(out) -> float:
    return out.decode_seconds - out.prefill_seconds


def measure(model, ids, strategies: dict[str, dict], max_new_tokens: int, passes: int) -> dict[str, dict]:
    """{strategy: figures} for one batch; "greedy" is plain decoding."""
    import jaxspec

    calls = {"greedy": {}} | strategies

    def run(kwargs):
        return jaxspec.generate(model, ids, max_new_tokens=max_new_tokens, **kwargs)

    first = {name: run(kwargs) for name, kwargs in calls.items()}  # compiles (and prices the schedule)
    seconds = {name: [] for name in calls}
    for _ in range(passes):
        for name, kwargs in calls.items():
            seconds[name].append(rounds_seconds(run(kwargs)))
    plain = first["greedy"]
    figures = {}
    for name, out in first.items():
        ratios = [p / s for p, s in zip(seconds["greedy"], seconds[name])]
        figures[name] = dict(
            speedup=statistics.median(ratios), low=min(ratios), high=max(ratios),
            modelled=getattr(out, "modelled_speedup", float("nan")), acceptance=out.acceptance_rate,
            per_round=out.mean_accepted_length, compile=out.compile_seconds,
            identical=out.sequences.shape == plain.sequences.shape and bool((out.sequences == plain.sequences).all()),
            rows_drafting=_rows_drafting(out),
        )
    return figures


def _rows_drafting(out) -> str:
    """How many rows drafted at all, of the batch."""
    return f"{int((out.drafted > 0).sum())}/{len(out.drafted)}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--strategies", default="prompt_lookup,early_exit,mtp,dflash,eagle3")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--kinds", default="copy,free")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--passes", type=int, default=3)
    args = parser.parse_args(argv)

    import jaxspec

    jaxspec.enable_compilation_cache()
    model = jaxspec.load(args.model)
    strategies = {}
    for name in args.strategies.split(","):
        if name not in STRATEGY_KWARGS:
            parser.error(f"--strategies: {name!r} is not one of {', '.join(STRATEGY_KWARGS)}")
        strategies[name] = strategy_arguments(name, model)
    started = time.perf_counter()
    print(f"{args.model}, {args.max_new_tokens} new tokens, {args.passes} timed passes; speedup over plain decoding "
          "of the same batch (median, range), the cost model's expectation, acceptance, tokens per round\n")
    print("| kind | batch | strategy | speedup | range | modelled | acceptance | tokens/round | rows drafting "
          "| identical |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    all_identical = True
    for kind in args.kinds.split(","):
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            ids = batch_ids(model.tokenizer, KINDS[kind], batch)
            figures = measure(model, ids, strategies, args.max_new_tokens, args.passes)
            for name, f in figures.items():
                if name == "greedy":
                    continue
                all_identical &= f["identical"]
                print(f"| {kind} | {batch} | {name} | {f['speedup']:.2f}x | {f['low']:.2f}-{f['high']:.2f} | "
                      f"{f['modelled']:.2f}x | {f['acceptance']:.2f} | {f['per_round']:.2f} | {f['rows_drafting']} | "
                      f"{f['identical']} |", flush=True)
    print(f"\n{time.perf_counter() - started:.0f} s in all")
    if not all_identical:
        print("error: some strategy gave other tokens than plain greedy decoding", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
