"""What attention over the live prefix of the cache saves (`jaxspec.models.layers.attend_live`) against attention
over the whole cache, side by side in one run.

    python benchmarks/bench_live_keys.py [--models smollm2-135m,qwen2.5-coder-0.5b] [--caches 2048,4096]
        [--batch-sizes 1] [--budget 2000] [--repeats 3] [--results benchmarks/results]

A cache is sized for the prompt plus the whole budget (`max_new_tokens`), and a chat answer that stops at its
end-of-sequence token leaves most of it unwritten. Two tables:

- Forwards: milliseconds per one-token forward of each of `--batch-sizes` rows from position 200
  (jaxspec/costs.py's timing loop) in caches of `--caches` entries, attention over the whole cache against over the
  live prefix (the prefixes `key_extents` gives that batch: for one row, none below 2048 entries; for 8 rows, none
  below 1024).
- Decoding: the chat prompt of benchmarks/bench.py in every row of each batch, plain greedy with a `--budget`-token
  budget until the model's end-of-sequence token, tokens per second (decode time after the prefill, median of
  `--repeats` calls, the two variants interleaved); both variants must write the same tokens. Also printed: each
  variant's first compile (a switch over prefixes compiles each prefix's attention).

"Whole cache" sets models/layers.py's PREFIX_FROM and BATCH_PREFIX_FROM_KEYS past every cache, which is what
attention did before `attend_live` (and still does in caches too short to choose); compiled loops are dropped between
variants so each runs its own. Both tables also go to a JSON record in `--results` (benchmarks/_record.py, a sibling
module, as is the prompt set: run it as a script).
"""

from __future__ import annotations

import argparse
import statistics
import sys

from _bench_prompts import PROMPTS
from _record import Record, add_results_argument

WHOLE = 1 << 40  # thresholds past any cache: attention reads the whole cache


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    p.add_argument("--caches", default="2048,4096")
    p.add_argument("--budget", type=int, default=2000)
    p.add_argument("--batch-sizes", default="1", help="comma-separated rows per call, e.g. 1,8,32")
    p.add_argument("--repeats", type=int, default=3)
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

    live = (layers.PREFIX_FROM, layers.BATCH_PREFIX_FROM_KEYS)
    variants = {"whole cache": (WHOLE, WHOLE), "live prefix": live}

    def use(thresholds: tuple[int, int]) -> None:
        layers.PREFIX_FROM, layers.BATCH_PREFIX_FROM_KEYS = thresholds
        loop._compiled.clear()  # jaxspec's executables, then jax's traces: the next call compiles this variant
        jax.clear_caches()

    caches = [int(c) for c in args.caches.split(",")]
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows, models = [], args.models.split(",")
    for name in models:
        model = jaxspec.load(name)
        forward = {}
        for _ in range(args.repeats):  # the variants take turns, so a machine that drifts moves both alike
            for batch in batches:
                for cache in caches:
                    for variant, thresholds in variants.items():
                        use(thresholds)
                        ms = costs.time_forwards(model, (1,), cache_size=cache, runs=4, steps=8, batch=batch)[1]
                        forward[batch, cache, variant] = min(ms, forward.get((batch, cache, variant), ms))

        tok = model.tokenizer
        text = tok.apply_chat_template([{"role": "user", "content": PROMPTS["chat"]}], tokenize=False,
                                       add_generation_prompt=True)
        ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"], np.int32)[None]
        rates, compiles, tokens, written = {}, {}, {}, {}
        for _ in range(args.repeats):
            for batch in batches:
                for variant, thresholds in variants.items():
                    use(thresholds)
                    out = jaxspec.generate(model, np.repeat(ids, batch, axis=0), max_new_tokens=args.budget)
                    new = int(np.sum(out.num_new_tokens))
                    rates.setdefault((batch, variant), []).append(new / (out.decode_seconds - out.prefill_seconds))
                    tokens.setdefault((batch, variant), out.sequences)
                    compiles.setdefault((batch, variant), out.compile_seconds)
                    written[batch] = int(out.num_new_tokens[0])
        for batch in batches:
            if not np.array_equal(tokens[batch, "whole cache"], tokens[batch, "live prefix"]):
                raise SystemExit(f"{name}: the two variants wrote different tokens at batch {batch}")
        use(live)

        title = (f"{name}: attention over the live prefix against the whole cache ({jax.default_backend()}, "
                 f"{model.dtype})")
        print(f"\n# {title}\n")
        print("| batch | cache entries | prefixes | whole cache: ms / forward | live prefix: ms / forward | speedup |")
        print("|---:|---:|---|---:|---:|---:|")
        for batch in batches:
            for cache in caches:
                whole, prefix = forward[batch, cache, "whole cache"], forward[batch, cache, "live prefix"]
                extents = layers.key_extents(cache, batch)
                print(f"| {batch} | {cache} | {', '.join(map(str, extents))} | {whole:.2f} | {prefix:.2f} | "
                      f"{whole / prefix:.2f} |")
                rows.append({"table": "forwards", "model": name, "batch": batch, "cache_entries": cache,
                             "prefixes": list(extents), "whole_cache_ms": whole, "live_prefix_ms": prefix,
                             "speedup": whole / prefix})
        size = buffer_size(ids.shape[1] + args.budget + 1, default_prefill_chunk())
        print(f"\nChat answer in every row, greedy, budget {args.budget} ({ids.shape[1]}-token prompt, cache of {size} "
              f"entries), tokens per second over the batch:\n")
        print("| batch | tokens written a row | whole cache | live prefix | speedup | compile s: whole, live |")
        print("|---:|---:|---:|---:|---:|---|")
        for batch in batches:
            whole, prefix = (statistics.median(rates[batch, v]) for v in variants)
            compile_whole, compile_live = compiles[batch, "whole cache"], compiles[batch, "live prefix"]
            print(f"| {batch} | {written[batch]} | {whole:.2f} | {prefix:.2f} | {prefix / whole:.2f} | "
                  f"{compile_whole:.1f}, {compile_live:.1f} |")
            rows.append({"table": "decoding", "model": name, "batch": batch, "budget": args.budget,
                         "prompt_tokens": ids.shape[1], "new_tokens": written[batch], "cache_entries": size,
                         "whole_cache_tokens_per_second": whole, "live_prefix_tokens_per_second": prefix,
                         "speedup": prefix / whole, "compile_seconds_whole": compile_whole,
                         "compile_seconds_live": compile_live})
    record.write(rows, models, title="attention over the live prefix against the whole cache",
                 settings={"caches": caches, "batch_sizes": batches, "budget": args.budget, "repeats": args.repeats,
                           "prefix_from": layers.PREFIX_FROM, "min_key_extent": layers.MIN_KEY_EXTENT,
                           "batch_rows": layers.BATCH_ROWS, "batch_prefix_from_keys": layers.BATCH_PREFIX_FROM_KEYS,
                           "batch_min_key_extent": layers.BATCH_MIN_KEY_EXTENT})

if __name__ == "__main__":
    sys.exit(main())
