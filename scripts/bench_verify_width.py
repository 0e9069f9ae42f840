"""What a verify block of W tokens costs against a plain decoding step (one token), for the target alone: the
figures behind the adaptive schedule's verify costs (`jaxspec.strategies.base.default_verify_costs`).

    python scripts/bench_verify_width.py [--model smollm2-135m] [--widths 1,2,3,4,8] [--steps 20]

Per width, one jitted loop of `--steps` target forwards at batch 1 that writes a 512-position cache in place (as
the decode loop does; the cache is donated), from position 200; best of 4 runs, printed as milliseconds per forward
and as the ratio to width 1, side by side in one run. Where `generate` verifies with a contiguous copy of a tied
head (on CPU: jaxspec/head.py), both heads are timed: the tied embedding read through a transpose, and the copy that
decoding uses. Timing single calls instead would add a copy of the whole cache and a dispatch to every width, which
hides most of the difference. On a CPU the ratio shows what leaving the memory-bound matrix-vector path costs (the
LM head's matrix multiply at 2 rows costs about twice its 1-row product); on an accelerator it stays near 1.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--widths", default="1,2,3,4,8")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args(argv)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    import jaxspec
    from jaxspec.head import verify_head

    model = jaxspec.load(args.model)
    graphdef, state = nnx.split(model.module)
    copy = verify_head(model, state, None)  # None where generate verifies with the model's own head
    heads = {"model's head": None} if copy is None else {"tied view": None, "contiguous copy (generate)": copy}

    def timed_loop(width: int):
        def loop(state, head, cache):
            module = nnx.merge(graphdef, state)

            def step(i, carry):
                cache, checksum = carry
                tokens = jnp.ones((1, width), jnp.int32)
                positions = 200 + i * width + jnp.arange(width)[None]
                logits, _, cache = module(tokens, positions, cache, head=head)
                return cache, checksum + logits[0, 0, 0]

            return jax.lax.fori_loop(0, args.steps, step, (cache, jnp.zeros((), jnp.float32)))

        return jax.jit(loop, donate_argnums=2)

    def seconds(width: int, head) -> float:
        run = timed_loop(width)
        cache, _ = run(state, head, model.module.init_cache(1, 512))  # compile
        best = float("inf")
        for _ in range(4):
            start = time.perf_counter()
            cache, checksum = run(state, head, cache)
            jax.block_until_ready(checksum)
            best = min(best, (time.perf_counter() - start) / args.steps)
        return best

    widths = sorted({1} | {int(w) for w in args.widths.split(",")})
    times = {(name, w): seconds(w, head) for w in widths for name, head in heads.items()}
    print(f"# verify width cost: {args.model}, {jax.default_backend()}, {model.dtype}, batch 1\n")
    print("| width | " + " | ".join(f"{name}: ms | vs one token" for name in heads) + " |")
    print("|---:|" + "---:|---:|" * len(heads))
    for w in widths:
        cells = [f"{times[name, w] * 1e3:.2f} | {times[name, w] / times[name, 1]:.2f}" for name in heads]
        print(f"| {w} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
