"""What streaming costs: the same generate call without a streamer, with transformers' TextStreamer (printing into
a buffer) and with an `on_tokens` callback, side by side in one run, per strategy (CPU, float32, batch 1).

    python benchmarks/bench_streaming.py [--model smollm2-135m] [--max-new-tokens 128] [--repeats 5]
        [--rounds-per-dispatch N] [--results benchmarks/results]

A streamed call runs the compiled loop for `rounds_per_dispatch` rounds at a time (default: as many as fill
jaxspec's stream interval), hands the new tokens to the host, and dispatches again; the figures are the wall time of
the whole call (median of `--repeats`, after an untimed call that compiles), so they include every host round trip
and the detokenisation of TextStreamer. The table also goes to a JSON record in `--results`
(benchmarks/_record.py, a sibling module: run it as a script).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import statistics
import sys
import time

from _record import Record, add_results_argument

STRATEGIES = {"greedy": {}, "prompt lookup": {"prompt_lookup_num_tokens": 10}}
PROMPT = "Write a Python function that checks whether a number is prime, then explain how it works."


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rounds-per-dispatch", type=int, default=None)
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_streaming", __file__, argv, args.results)

    from transformers import TextStreamer

    import jaxspec

    model = jaxspec.load(args.model)
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                              tokenize=True, return_dict=False)
    sink = io.StringIO()
    modes = {
        "no streamer": lambda: {},
        "TextStreamer": lambda: {"streamer": TextStreamer(model.tokenizer, skip_prompt=True)},
        "on_tokens": lambda: {"on_tokens": lambda rows: None},
    }
    # No EOS: every call makes the same number of tokens. The chat template's end-of-turn token is SmolLM2's pad
    # token too, so the mask is passed (no EOS left to tell it from padding).
    common = dict(max_new_tokens=args.max_new_tokens, eos_token_id=[], rounds_per_dispatch=args.rounds_per_dispatch)

    def timed(kwargs: dict) -> float:
        start = time.perf_counter()
        with contextlib.redirect_stdout(sink):
            out = jaxspec.generate(model, [ids], [[1] * len(ids)], **common, **kwargs)
        return time.perf_counter() - start - out.compile_seconds

    dispatch = args.rounds_per_dispatch or "the rounds that fill jaxspec's stream interval (the default)"
    title = (f"streaming overhead: {args.model}, batch 1, {args.max_new_tokens} new tokens, per dispatch {dispatch}, "
             f"median of {args.repeats} (whole call, compile apart)")
    print(f"# {title}\n")
    print("| strategy | no streamer (s) | TextStreamer (s) | on_tokens (s) | TextStreamer / none | on_tokens / none |")
    print("|---|---:|---:|---:|---:|---:|")
    rows = []
    for name, strategy in STRATEGIES.items():
        for make in modes.values():  # compile every variant first
            timed(strategy | make())
        seconds = {mode: [] for mode in modes}
        for _ in range(args.repeats):  # interleaved, so that a change of load spreads over every mode
            for mode, make in modes.items():
                seconds[mode].append(timed(strategy | make()))
        median = {mode: statistics.median(values) for mode, values in seconds.items()}
        base = median["no streamer"]
        print(f"| {name} | {base:.3f} | {median['TextStreamer']:.3f} | {median['on_tokens']:.3f} | "
              f"{median['TextStreamer'] / base:.3f} | {median['on_tokens'] / base:.3f} |", flush=True)
        rows.append({"table": "streaming", "model": args.model, "strategy": name, "no_streamer_s": base,
                     "text_streamer_s": median["TextStreamer"], "on_tokens_s": median["on_tokens"],
                     "text_streamer_vs_none": median["TextStreamer"] / base,
                     "on_tokens_vs_none": median["on_tokens"] / base})
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


if __name__ == "__main__":
    sys.exit(main())
