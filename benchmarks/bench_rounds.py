"""Where a strategy's time goes against plain decoding, prompt by prompt: the prefill, the rounds, and what the
adaptive schedule's cost model priced those rounds at.

    python benchmarks/bench_rounds.py [--model smollm2-135m] [--strategy mtp] [--max-new-tokens 64] [--passes 3]
        [--prompts code_editing,...] [--assistant qwen2.5-coder-0.5b]

Strategies: mtp (the shipped layers), eagle3 and dflash (the shipped drafters, or the `--assistant` drafter),
prompt_lookup (K = 10), speculative (the `--assistant` model, K = 4). Every prompt of benchmarks/_bench_prompts.py (or
those named), batch 1, greedy, as a chat message; each pass runs plain decoding and the strategy back to back. Columns:

- speedup: the median over passes of plain decoding's call time over the strategy's (prefill included);
- modelled: the speedup the cost model expected for the rounds the strategy ran (`GenerateOutput.modelled_speedup`);
- prefill ms, plain and strategy: a drafter that reads the prompt too (MTP layers, a head's features) pays here;
- round in steps: the strategy's milliseconds a round over plain decoding's a step, prefill excluded; priced: the
  model's price of those rounds (in the loop's rounds of width 1, which cost about a plain step);
- tokens/round and acceptance: what the rounds committed.

Reading it: rounds that measure dearer than priced hide a cost inside the loop; rounds as priced with a speedup below
the modelled one put the loss in the rest of the call (the prefill); a modelled speedup below 1 is the schedule's own
choice (its probes: benchmarks/simulate_schedule.py). The table also goes to a JSON record in `--results`.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _bench_prompts import PROMPTS, chat_ids
from _record import Record, add_results_argument

STRATEGIES = {"mtp": {"use_mtp": True}, "prompt_lookup": {"prompt_lookup_num_tokens": 10},
              "eagle3": {"assistant_model": "smollm2-135m-eagle3"},
              "dflash": {"assistant_model": "smollm2-135m-dflash"},
              "speculative": {"num_assistant_tokens": 4}}  # and --assistant


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--strategy", default="mtp", choices=sorted(STRATEGIES))
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--prompts", default=",".join(PROMPTS), help=", ".join(PROMPTS))
    p.add_argument("--assistant", default=None,
                   help="the assistant of --strategy speculative, or a drafter of --strategy dflash / eagle3 other "
                        "than the shipped one (a catalogue name or a path)")
    add_results_argument(p)
    args = p.parse_args(argv)
    if args.passes < 1 or args.max_new_tokens < 2:
        p.error("--passes must be at least 1 and --max-new-tokens at least 2")
    prompts = args.prompts.split(",")
    if unknown := [name for name in prompts if name not in PROMPTS]:
        p.error(f"unknown prompts {unknown}; choose from {', '.join(PROMPTS)}")
    if args.strategy == "speculative" and args.assistant is None:
        p.error("--strategy speculative needs an --assistant")
    if args.assistant is not None and "assistant_model" not in STRATEGIES[args.strategy]:
        p.error(f"--strategy {args.strategy} takes no --assistant")
    record = Record("bench_rounds", __file__, argv, args.results)

    import jaxspec

    model = jaxspec.load(args.model)
    kwargs = dict(STRATEGIES[args.strategy])
    if args.assistant is not None:
        kwargs["assistant_model"] = args.assistant
    if "assistant_model" in kwargs:
        kwargs["assistant_model"] = jaxspec.load(kwargs["assistant_model"])
    ids = {name: chat_ids(model.tokenizer, PROMPTS[name]) for name in prompts}

    def calls(name):
        plain = jaxspec.generate(model, [ids[name]], max_new_tokens=args.max_new_tokens)
        return plain, jaxspec.generate(model, [ids[name]], max_new_tokens=args.max_new_tokens, **kwargs)

    for name in prompts:
        calls(name)  # compiles (and prices the strategy's loop on its first call)
    title = (f"{args.strategy} against plain decoding: {args.model}, {args.max_new_tokens} new tokens, batch 1, "
             f"median of {args.passes} passes")
    print(f"# {title}\n")
    print("| prompt | speedup | modelled | prefill ms, plain | prefill ms, strategy | round in steps | priced "
          "| tokens/round | acceptance |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in prompts:
        passes = [calls(name) for _ in range(args.passes)]
        speedup = statistics.median(plain.decode_seconds / mine.decode_seconds for plain, mine in passes)
        round_steps = statistics.median(mine.seconds_per_round / plain.seconds_per_round for plain, mine in passes)
        plain, mine = passes[len(passes) // 2]
        priced = mine.priced_steps / mine.rounds if mine.priced_steps > 0 else float("nan")
        row = dict(table="rounds", prompt=name, speedup=speedup, modelled=mine.modelled_speedup,
                   plain_prefill_ms=plain.prefill_seconds * 1e3, prefill_ms=mine.prefill_seconds * 1e3,
                   round_steps=round_steps, priced_steps=priced, tokens_per_round=mine.mean_accepted_length,
                   acceptance=mine.acceptance_rate)
        rows.append(row)
        print(f"| {name} | {speedup:.2f}x | {row['modelled']:.2f}x | {row['plain_prefill_ms']:.0f} | "
              f"{row['prefill_ms']:.0f} | {round_steps:.2f} | {priced:.2f} | {row['tokens_per_round']:.2f} | "
              f"{row['acceptance']:.2f} |", flush=True)
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


if __name__ == "__main__":
    sys.exit(main())
