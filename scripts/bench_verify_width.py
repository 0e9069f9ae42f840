"""What a verify block of W tokens costs against a plain decoding step (one token), for the target alone: the
figures behind the adaptive schedule's verify costs (`jaxspec.strategies.base.default_verify_costs`).

    python scripts/bench_verify_width.py [--model smollm2-135m] [--widths 1,2,3,4,8] [--iterations 60]

One jitted target forward at batch 1 against a 512-position cache at position 200, per width, best of 3 runs of
`--iterations` calls; printed as milliseconds and as the ratio to width 1, side by side in one run. On a CPU the
ratio shows what leaving the memory-bound matrix-vector path costs; on an accelerator it stays near 1.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--widths", default="1,2,3,4,8")
    p.add_argument("--iterations", type=int, default=60)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxspec

    model = jaxspec.load(args.model)
    graphdef, state = nnx.split(model.module)

    @jax.jit
    def forward(state, tokens, positions, cache):
        logits, _, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
        return logits.argmax(-1), cache

    cache = model.module.init_cache(1, 512)

    def seconds(width: int) -> float:
        tokens, positions = jnp.ones((1, width), jnp.int32), jnp.arange(200, 200 + width)[None]
        jax.block_until_ready(forward(state, tokens, positions, cache))  # compile
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            for _ in range(args.iterations):
                out = forward(state, tokens, positions, cache)
            jax.block_until_ready(out)
            best = min(best, (time.perf_counter() - start) / args.iterations)
        return best

    widths = [int(w) for w in args.widths.split(",")]
    times = {w: seconds(w) for w in widths}
    base = times.get(1) or seconds(1)
    print(f"# verify width cost: {args.model}, {jax.default_backend()}, {model.dtype}, batch 1\n")
    print("| width | ms | vs one token |")
    print("|---:|---:|---:|")
    for w in widths:
        print(f"| {w} | {times[w] * 1e3:.2f} | {times[w] / base:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
