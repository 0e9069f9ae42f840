"""What looping a CPU model's wide forwards over its stacked layers (jaxspec/layer_stack.py) costs a call that has
compiled already: decode speed with `JAXSPEC_LAYER_STACK=off` (every forward unrolled) beside `auto`, in one process.

    python benchmarks/bench_layer_stack.py [--model smollm2-135m] [--strategies plain,lookup,mtp] [--passes 7]
        [--max-new-tokens 96] [--setting auto] [--widths 2,4,8,11] [--results benchmarks/results]

The two settings compile two executables (the stack is an input of one of them) and measure their own step costs,
so each is decoded as a user would get it. Per strategy and prompt (a code edit, which prompt lookup can copy, and a
story, which it cannot), the calls alternate between the settings, pass after pass; the first pass compiles and
prices, and the table gives each setting's median tokens per second over the others (prefill included, as
`decode_seconds` counts it) and their ratio, with each setting's compile seconds from the first pass. Compile time
as a CLI user meets it: benchmarks/bench_compile.py. `--setting on` stacks a model above the size limit
(`STACK_MAX_BYTES`), or of a family `auto` leaves unrolled (Gemma), to see what they keep out.

First, per forward (`--widths`; none with `--widths ""`): the model's own forward of a [1, width] block at position
200 of a 512-entry cache, with the stack bound and unrolled, each the fastest of 5 alternating runs of 4 forwards.
"""

from __future__ import annotations

import argparse
import os
import statistics

from _record import REPO, Record, add_results_argument

FORWARDS = 4  # forwards per timed call (forward_ms)
RUNS = 5  # timed calls of each side per width; the fastest counts


def prompts() -> dict[str, str]:
    code = open(os.path.join(REPO, "jaxspec", "head.py")).read()[1500:3200]
    return {"code edit": code + "\n# The same code with every comment rewritten in French:\n",
            "story": "Write a short story about a lighthouse keeper who finds a message in a bottle."}


def strategy_options(name: str, model_name: str) -> dict:
    import jaxspec

    if name == "plain":
        return {}
    if name == "lookup":
        return {"prompt_lookup_num_tokens": 10}
    if name == "mtp":
        return {"use_mtp": True}
    if name in ("dflash", "eagle3"):
        return {"assistant_model": jaxspec.load(f"{model_name}-{name}")}
    raise SystemExit(f"--strategies: {name!r} is not one of plain, lookup, mtp, dflash, eagle3.")


def forward_ms(model, stack, widths: list[int]) -> dict[int, tuple[float, float]]:
    """{width: (unrolled ms, looped ms)} of one forward of a [1, width] block, the two sides' runs alternating."""
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model.module)

    @jax.jit
    def forwards(state, stack, tokens, positions):
        module = nnx.merge(graphdef, state)
        module.layer_stack = stack  # bound as the decode loop binds it; None: unrolled

        def step(i, carry):
            cache, total = carry
            logits, _, cache = module(tokens, positions + i * tokens.shape[1], cache)
            return cache, total + logits[:, -1, 0].sum()

        return jax.lax.fori_loop(0, FORWARDS, step, (module.init_cache(1, 512), 0.0))

    out = {}
    for width in widths:
        tokens, positions = jnp.ones((1, width), jnp.int32), 200 + jnp.arange(width)[None]
        sides = {"unrolled": None, "looped": stack}
        best = dict.fromkeys(sides, float("inf"))
        for _ in range(RUNS + 1):  # the first run of each side compiles
            for side, bound in sides.items():
                start = time.perf_counter()
                jax.block_until_ready(forwards(state, bound, tokens, positions))
                best[side] = min(best[side], (time.perf_counter() - start) / FORWARDS * 1e3)
        out[width] = (best["unrolled"], best["looped"])
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--strategies", default="plain,lookup,mtp")
    p.add_argument("--passes", type=int, default=7, help="the first compiles and prices; the others are timed")
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--setting", default="auto", choices=("auto", "on"), help="the setting timed beside off")
    p.add_argument("--widths", default="2,4,8,11", help="block widths timed per forward; empty: none")
    add_results_argument(p)
    args = p.parse_args(argv)
    if args.passes < 2:
        raise SystemExit("--passes must be at least 2: the first compiles and prices.")
    record = Record("bench_layer_stack", __file__, argv, args.results)
    settings = ("off", args.setting)

    import jaxspec

    from jaxspec.layer_stack import layer_stack

    model = jaxspec.load(args.model)
    rows = []
    widths = [int(width) for width in args.widths.split(",") if width]
    os.environ["JAXSPEC_LAYER_STACK"] = args.setting
    stack = layer_stack(model, None)
    if stack is None:
        raise SystemExit(f"JAXSPEC_LAYER_STACK={args.setting} stacks no layers of {args.model}: nothing to compare.")
    if widths:
        print(f"# one forward, unrolled and looped: {args.model}, fastest of {RUNS} runs of {FORWARDS}\n")
        print("| width | unrolled ms | looped ms | looped / unrolled |\n|---:|---:|---:|---:|")
        for width, (unrolled, looped) in forward_ms(model, stack, widths).items():
            print(f"| {width} | {unrolled:.1f} | {looped:.1f} | {looped / unrolled:.2f} |")
            rows.append({"table": "forward", "width": width, "unrolled_ms": unrolled, "looped_ms": looped,
                         "looped_vs_unrolled": looped / unrolled})
        print()
    strategies = args.strategies.split(",")
    options = {name: strategy_options(name, args.model) for name in strategies}
    texts = prompts()
    speeds: dict[tuple[str, str, str], list[float]] = {}
    compiles: dict[tuple[str, str, str], float] = {}
    for index in range(args.passes):
        for name in strategies:
            for prompt, text in texts.items():
                ids = model.tokenizer(text)["input_ids"]
                for setting in settings if index % 2 == 0 else settings[::-1]:
                    os.environ["JAXSPEC_LAYER_STACK"] = setting
                    out = jaxspec.generate(model, [ids], max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                           **options[name])
                    if index == 0:
                        compiles[name, prompt, setting] = out.compile_seconds
                    else:
                        speeds.setdefault((name, prompt, setting), []).append(args.max_new_tokens / out.decode_seconds)
    title = f"layer stack off / {args.setting}: {args.model}, median of {args.passes - 1} passes"
    print(f"# {title}\n")
    print(f"| strategy | prompt | off: tok/s | {args.setting}: tok/s | {args.setting} / off | off: compile s | "
          f"{args.setting}: compile s |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name in strategies:
        for prompt in texts:
            off, stacked = (statistics.median(speeds[name, prompt, setting]) for setting in settings)
            print(f"| {name} | {prompt} | {off:.2f} | {stacked:.2f} | {stacked / off:.3f} | "
                  f"{compiles[name, prompt, 'off']:.1f} | {compiles[name, prompt, args.setting]:.1f} |")
            rows.append({"table": "layer stack", "strategy": name, "prompt": prompt, "setting": args.setting,
                         "off_tok_s": off, "stacked_tok_s": stacked, "stacked_vs_off": stacked / off,
                         "off_compile_s": compiles[name, prompt, "off"],
                         "stacked_compile_s": compiles[name, prompt, args.setting]})
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


if __name__ == "__main__":
    main()
