"""What a verify block of W tokens costs against a plain decoding step (one token), for the target alone: the
figures behind the adaptive schedule's verify costs (`jaxspec.strategies.base.default_verify_costs`, and what
`generate` measures for itself: jaxspec/costs.py, whose timing loop this script runs).

    python benchmarks/bench_verify_width.py [--model smollm2-135m] [--widths 1,2,3,4,8] [--steps 20]
        [--quantization int8] [--scan-layers] [--unfused] [--results benchmarks/results]

Per width, one jitted loop of `--steps` target forwards at batch 1 that writes a 512-position cache in place (as
the decode loop does; the cache is donated), from position 200; best of 4 runs, printed as milliseconds per forward
and as the ratio to width 1, side by side in one run. Where `generate` verifies with a contiguous copy of a tied
head (on CPU: jaxspec/head.py), both heads are timed: the tied embedding read through a transpose, and the copy that
decoding uses for one-row forwards (the two columns differ at width 1 only). Timing single calls instead would add a
copy of the whole cache and a dispatch to every width, which hides most of the difference. On a CPU the ratio shows
what leaving the memory-bound matrix-vector path costs; on an accelerator it stays near 1.
`--scan-layers` (Llama-family models) adds two columns timed in alternating runs: the forward as it is, and the
same forward with its decoder layers run by a `lax.scan` over stacked copies of their weights, with each one's
compile seconds: what MaxText's `scan_layers` would cost a step and save a compile here (docs/design.md, 'The model
contract').
`--unfused` adds a column: the model as loaded but each of a layer's fused projections (q, k and v; gate and up:
`jaxspec.layout.FUSED_GROUPS`) in its own array and product, as before they were fused, timed in two runs
alternating with the head column generate uses, the best of each kept.
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
    p.add_argument("--scan-layers", action="store_true", help="add columns: decoder layers under lax.scan")
    p.add_argument("--unfused", action="store_true", help="add a column: each projection its own product")
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_verify_width", __file__, argv, args.results)

    import jax
    from flax import nnx

    import jaxspec
    from _bench_plans import unfused
    from jaxspec.costs import time_forwards
    from jaxspec.head import verify_head

    model = jaxspec.load(args.model)
    copy = verify_head(model, nnx.split(model.module)[1], None)  # None where generate verifies with the model's head
    generating = "model's head" if copy is None else "contiguous copy (generate)"  # the head generate verifies with
    heads = {generating: (model, None)} if copy is None else {"tied view": (model, None), generating: (model, copy)}
    if args.quantization:
        heads[args.quantization] = (jaxspec.quantize(model, args.quantization), None)
    widths = tuple(sorted({1} | {int(w) for w in args.widths.split(",")}))
    milliseconds = {name: time_forwards(timed, widths, head, steps=args.steps, runs=4)
                    for name, (timed, head) in heads.items()}
    if args.unfused:
        heads["unfused"] = (unfused(model), heads[generating][1])
        milliseconds["unfused"] = {w: float("inf") for w in widths}
        for _ in range(2):
            for name in (generating, "unfused"):
                timed, head = heads[name]
                again = time_forwards(timed, widths, head, steps=args.steps, runs=4)
                milliseconds[name] = {w: min(milliseconds[name][w], again[w]) for w in widths}
    compiles = {}
    if args.scan_layers:
        timed = _layer_loops_ms(model, widths, copy, args.steps)  # with the head generate verifies with
        for variant, compile_column, scan in (("unrolled, same runs", "unrolled: compile s", False),
                                              ("layers scanned", "layers scanned: compile s", True)):
            heads[variant] = (model, copy)
            milliseconds[variant] = {w: timed[w, scan][0] for w in widths}
            compiles[compile_column] = {w: timed[w, scan][1] for w in widths}
    title = f"verify width cost: {args.model}, {jax.default_backend()}, {model.dtype}, batch 1"
    print(f"# {title}\n")
    print("| width | " + " | ".join(f"{name}: ms | vs one token" for name in heads)
          + "".join(f" | {name}" for name in compiles) + " |")
    print("|---:|" + "---:|---:|" * len(heads) + "---:|" * len(compiles))
    for w in widths:
        cells = [f"{milliseconds[name][w]:.2f} | {milliseconds[name][w] / milliseconds[name][1]:.2f}" for name in heads]
        cells += [f"{compiles[name][w]:.2f}" for name in compiles]
        print(f"| {w} | " + " | ".join(cells) + " |")
    rows = [{"table": "widths", "model": args.model, "head": name, "width": w, "ms": milliseconds[name][w],
             "vs_one_token": milliseconds[name][w] / milliseconds[name][1]} for w in widths for name in heads]
    rows += [{"table": "compile", "model": args.model, "variant": name, "width": w, "seconds": compiles[name][w]}
             for name in compiles for w in widths]
    if args.quantization:
        floating = milliseconds[next(iter(heads))][1]
        ratio = milliseconds[args.quantization][1] / floating
        print(f"\n{args.quantization} one-token forward / float one: {ratio:.2f}")
        rows.append({"table": "quantization", "model": args.model, "quantization": args.quantization,
                     "one_token_vs_float": ratio})
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


def _layer_loops_ms(model, widths, head, steps: int, runs: int = 6) -> dict[tuple[int, bool], tuple[float, float]]:
    """{(width, scanned): (milliseconds per forward, compile seconds)}: loops of `steps` forwards at batch 1, as
    `jaxspec.costs.time_forwards` runs them, with the decoder layers unrolled (the model's own forward) or under a
    `lax.scan` over stacked copies of their weights (the layer function and the cache are the model's own; the
    layer index is the scan's counter). The loops take turns, run after run, and the fastest run of each counts:
    timed one after the other, this machine's drift between them was larger than the difference."""
    import importlib
    import time

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec import costs

    module = model.module
    if type(module).__name__ != "LlamaForCausalLM":
        raise NotImplementedError(f"--scan-layers runs Llama-family decoder layers only, not {type(module).__name__}.")
    llama = importlib.import_module(type(module).__module__)
    cfg, (graphdef, state) = module.cfg, nnx.split(module)
    stacked = jax.tree.map(lambda *layers: jnp.stack(layers), *[layer.params() for layer in module.layers])

    def forward(scan, state, stacked, head, tokens, positions, cache):
        net = nnx.merge(graphdef, state)
        x = net.embed_tokens(tokens)
        if not scan:
            x, cache = net.run_layers(x, positions, cache)
        else:
            def layer(carry, params_and_index):
                params, index = params_and_index
                x, cache = llama._decoder_layer(cfg, params, carry[0], positions, carry[1], index, cfg.inv_freq())
                return (x, cache), None

            (x, cache), _ = jax.lax.scan(layer, (x, cache), (stacked, jnp.arange(cfg.num_layers)))
        return net.logits(net.final_hidden(x), head), cache

    def loop(width, scan, state, stacked, head, cache):
        def step(i, carry):
            cache, checksum = carry
            tokens = jnp.ones((1, width), jnp.int32)
            positions = (costs.START_POSITION + i * width + jnp.arange(width))[None, :]  # [1, W]
            logits, cache = forward(scan, state, stacked, head, tokens, positions, cache)
            return cache, checksum + logits[0, 0, 0]

        return jax.lax.fori_loop(0, steps, step, (cache, jnp.zeros((), jnp.float32)))

    run = jax.jit(loop, static_argnums=(0, 1), donate_argnums=5)
    compiled, caches, result = {}, {}, {}
    for width in widths:
        for scan in (False, True):
            cache = module.init_cache(1, costs.CACHE_SIZE)
            started = time.perf_counter()
            compiled[width, scan] = run.lower(width, scan, state, stacked, head, cache).compile()
            result[width, scan] = (float("inf"), time.perf_counter() - started)
            caches[width, scan] = compiled[width, scan](state, stacked, head, cache)[0]  # warm
    return _take_turns(compiled, caches, result, steps, runs, state, stacked, head)


def _take_turns(compiled: dict, caches: dict, result: dict, steps: int, runs: int, *inputs) -> dict:
    """Runs each compiled loop `executable(*inputs, cache) -> (cache, checksum)` in turn, `runs` times over, and
    keeps each one's fastest run as milliseconds per forward in `result[key]` = (ms, compile seconds): timed one
    after the other, this machine's drift between loops was larger than the differences they measure."""
    import time

    import jax

    for _ in range(runs):
        for key, executable in compiled.items():
            started = time.perf_counter()
            caches[key], checksum = executable(*inputs, caches[key])
            jax.block_until_ready(checksum)
            ms = (time.perf_counter() - started) / steps * 1e3
            result[key] = (min(result[key][0], ms), result[key][1])
    return result


if __name__ == "__main__":
    sys.exit(main())
