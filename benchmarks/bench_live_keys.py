"""What attention over the live prefix of the cache saves (`jaxspec.models.layers.attend_live`) against attention
over the whole cache, side by side in one run.

    python benchmarks/bench_live_keys.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--caches 2048,4096]
        [--budget 2000] [--repeats 3] [--prefix-from 2048 --min-extent 512] [--results benchmarks/results]

A cache is sized for the prompt plus the whole budget (`max_new_tokens`), and a chat answer that stops at its
end-of-sequence token leaves most of it unwritten. Two tables:

- Forwards: milliseconds per one-token forward from position 200 (jaxspec/costs.py's timing loop) in caches of
  `--caches` entries, attention over the whole cache against over the live prefix.
- Decoding: the chat prompt of benchmarks/bench.py, plain greedy with a `--budget`-token budget until the model's
  end-of-sequence token, tokens per second (decode time after the prefill, median of `--repeats` calls, the two
  variants interleaved); both variants must write the same tokens. Also printed: each variant's first compile
  (a switch over prefixes compiles each prefix's attention).

`--prefix-from` and `--min-extent` try other thresholds for the live variant: `--caches 256,1024 --prefix-from 256
--min-extent 128` shows what a branch per layer costs where the cache is small. "Whole cache" sets
`jaxspec.models.layers.PREFIX_FROM` past every cache size, which is what attention did before
`attend_live` (and still does in caches shorter than PREFIX_FROM); compiled loops are dropped between variants so
each runs its own. Both tables also go to a JSON record in `--results` (benchmarks/_record.py, a sibling module, as
is the prompt set: run it as a script).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _bench_prompts import PROMPTS
from _record import Record, add_results_argument

WHOLE = 1 << 30  # PREFIX_FROM past any cache: attention reads the whole cache


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    p.add_argument("--caches", default="2048,4096")
    p.add_argument("--budget", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix-from", type=int, default=None, help="PREFIX_FROM of the live variant (default: jaxspec's)")
    p.add_argument("--min-extent", type=int, default=None, help="MIN_KEY_EXTENT of the live variant")
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_live_keys", __file__, argv, args.results)

    import jax
    import numpy as np

    import jaxspec
    from jaxspec import costs, loop
    from jaxspec.models import layers
    from jaxspec.prompts import buffer_size
    from jaxspec.strategies import default_prefill_chunk

    live = args.prefix_from or layers.PREFIX_FROM
    layers.MIN_KEY_EXTENT = args.min_extent or layers.MIN_KEY_EXTENT
    variants = {"whole cache": WHOLE, "live prefix": live}

    def use(prefix_from: int) -> None:
        layers.PREFIX_FROM = prefix_from
        loop._compiled.clear()  # jaxspec's executables, then jax's traces: the next call compiles this variant
        jax.clear_caches()

    caches = [int(c) for c in args.caches.split(",")]
    rows, models = [], args.models.split(",")
    for name in models:
        model = jaxspec.load(name)
        forward = {}
        for cache in caches:
            for variant, prefix_from in variants.items():
                use(prefix_from)
                forward[cache, variant] = costs.time_forwards(model, (1,), cache_size=cache, runs=4, steps=8)[1]

        tok = model.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS["chat"]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int32)[None]
        rates, compiles, tokens = {v: [] for v in variants}, {}, {}
        for _ in range(args.repeats):
            for variant, prefix_from in variants.items():
                use(prefix_from)
                out = jaxspec.generate(model, ids, max_new_tokens=args.budget)
                rates[variant].append(int(out.num_new_tokens[0]) / (out.decode_seconds - out.prefill_seconds))
                tokens.setdefault(variant, out.sequences)
                compiles.setdefault(variant, out.compile_seconds)
        if not np.array_equal(*tokens.values()):
            raise SystemExit(f"{name}: the two variants wrote different tokens")
        new = int(out.num_new_tokens[0])
        use(live)

        title = (f"{name}: attention over the live prefix against the whole cache ({jax.default_backend()}, "
                 f"{model.dtype}, batch 1)")
        print(f"\n# {title}\n")
        print("| cache entries | whole cache: ms / forward | live prefix: ms / forward | speedup |")
        print("|---:|---:|---:|---:|")
        for cache in caches:
            whole, prefix = forward[cache, "whole cache"], forward[cache, "live prefix"]
            print(f"| {cache} | {whole:.2f} | {prefix:.2f} | {whole / prefix:.2f} |")
            rows.append({"table": "forwards", "model": name, "cache_entries": cache, "whole_cache_ms": whole,
                         "live_prefix_ms": prefix, "speedup": whole / prefix})
        whole, prefix = (statistics.median(rates[v]) for v in variants)
        size = buffer_size(ids.shape[1] + args.budget + 1, default_prefill_chunk())
        print(f"\nChat answer, greedy, budget {args.budget} ({ids.shape[1]}-token prompt, {new} tokens written, "
              f"cache of {size} entries): "
              f"{whole:.2f} tok/s over the whole cache, {prefix:.2f} over the live prefix: {prefix / whole:.2f}x; "
              f"compiling took {compiles['whole cache']:.1f} s and {compiles['live prefix']:.1f} s")
        rows.append({"table": "decoding", "model": name, "budget": args.budget, "prompt_tokens": ids.shape[1],
                     "new_tokens": new, "cache_entries": size, "whole_cache_tokens_per_second": whole,
                     "live_prefix_tokens_per_second": prefix, "speedup": prefix / whole,
                     "compile_seconds_whole": compiles["whole cache"], "compile_seconds_live": compiles["live prefix"]})
    record.write(rows, models, title="attention over the live prefix against the whole cache, batch 1",
                 settings={"caches": caches, "budget": args.budget, "repeats": args.repeats, "prefix_from": live,
                           "min_key_extent": layers.MIN_KEY_EXTENT})


if __name__ == "__main__":
    sys.exit(main())
