"""What a Gemma 4 MTP drafter step costs against a target forward, and the acceptance that makes drafting pay off.

    python benchmarks/bench_gemma4_drafter.py [--scale 0.5] [--context 512] [--batch 1] [--repeats 30]
        [--results benchmarks/results]

There are no real Gemma 4 weights here, so both models are random, with Gemma 4 E2B's proportions (35 layers, the
last 20 KV-shared, 4 sliding layers to 1 full, 8 query heads, 1 kv head, head widths 256 / 512, per-layer inputs
256 wide, double-wide MLPs in shared layers, a 262144-token vocabulary) and a 4-layer drafter 256 wide with a 2048-
centroid head (top 32), every width and the vocabulary multiplied by `--scale` (depths kept) so that it fits a CPU.
The drafter's shape is an assumption: no published config was available offline.

Measured side by side in one run (float32, medians of interleaved calls, compile apart), all over a target cache
holding `--context` positions: one target forward of W tokens (W = 1 is a plain decoding step, W = K + 1 verifies K
drafts) and one drafter step (the target's embedding, the drafter over the target's shared keys and values, the
head, argmax), with the centroid head and with a dense head. A round with K drafts then costs K drafter steps and a
forward of K + 1 tokens, and commits (accepted drafts + 1) tokens; plain decoding commits one per forward. The table
gives, per K, the tokens per round at which the two break even, and the per-draft acceptance that reaches it if
every draft is accepted independently with the same probability (tokens per round = (1 - a^(K+1)) / (1 - a)).
Both tables also go to a JSON record in `--results` (benchmarks/_record.py, a sibling module: run it as a script).
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

from _record import Record, add_results_argument

E2B = dict(hidden_size=1536, intermediate_size=6144, num_hidden_layers=35, num_attention_heads=8,
           num_key_value_heads=1, head_dim=256, global_head_dim=512, hidden_size_per_layer_input=256,
           vocab_size=262_144, num_kv_shared_layers=20, sliding_window=512)
DRAFTER = dict(hidden_size=256, intermediate_size=2048, num_hidden_layers=4, num_attention_heads=4,
               num_centroids=2048, centroid_intermediate_top_k=32)
DRAFTS = (1, 2, 3, 4, 6, 8)


def configs(scale: float, ordered: bool) -> tuple[dict, dict]:
    """(target config.json, drafter config.json) at `scale` times E2B's widths."""
    def width(n: int, multiple: int = 8) -> int:
        return max(multiple, int(round(n * scale / multiple)) * multiple)

    layer_types = ["full_attention" if i % 5 == 4 else "sliding_attention" for i in range(E2B["num_hidden_layers"])]
    vocab = width(E2B["vocab_size"], DRAFTER["num_centroids"])
    shared = dict(vocab_size=vocab, num_key_value_heads=1, head_dim=width(E2B["head_dim"]),
                  global_head_dim=width(E2B["global_head_dim"]), sliding_window=E2B["sliding_window"],
                  max_position_embeddings=131_072, bos_token_id=2, eos_token_id=1, pad_token_id=0)
    target = shared | dict(model_type="gemma4_text", hidden_size=width(E2B["hidden_size"]),
                           intermediate_size=width(E2B["intermediate_size"]),
                           num_hidden_layers=E2B["num_hidden_layers"], num_attention_heads=8,
                           hidden_size_per_layer_input=width(E2B["hidden_size_per_layer_input"]),
                           vocab_size_per_layer_input=vocab, num_kv_shared_layers=E2B["num_kv_shared_layers"],
                           use_double_wide_mlp=True, final_logit_softcapping=30.0, layer_types=layer_types)
    text = shared | dict(model_type="gemma4_text", hidden_size=width(DRAFTER["hidden_size"]),
                         intermediate_size=width(DRAFTER["intermediate_size"]), num_hidden_layers=4,
                         num_attention_heads=4, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
                         layer_types=["sliding_attention"] * 3 + ["full_attention"])
    drafter = dict(model_type="gemma4_assistant", backbone_hidden_size=target["hidden_size"], text_config=text,
                   use_ordered_embeddings=ordered, num_centroids=DRAFTER["num_centroids"],
                   centroid_intermediate_top_k=max(1, int(round(DRAFTER["centroid_intermediate_top_k"] * scale))))
    return target, drafter


def break_even_acceptance(tokens_per_round: float, k: int) -> float:
    """The per-draft acceptance a with (1 - a^(K+1)) / (1 - a) = tokens_per_round (nan if out of reach)."""
    if tokens_per_round <= 1.0:
        return 0.0
    if tokens_per_round > k + 1:
        return float("nan")
    low, high = 0.0, 1.0
    for _ in range(60):
        a = (low + high) / 2
        if sum(a**i for i in range(k + 1)) < tokens_per_round:
            low = a
        else:
            high = a
    return (low + high) / 2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", type=float, default=0.5, help="width multiplier on Gemma 4 E2B (depth kept)")
    p.add_argument("--context", type=int, default=512, help="positions in the target cache while measuring")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--repeats", type=int, default=30)
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_gemma4_drafter", __file__, argv, args.results)

    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxspec.models.gemma import GemmaConfig, GemmaForCausalLM
    from jaxspec.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM

    target_hf, _ = configs(args.scale, ordered=True)
    target_cfg = GemmaConfig.from_hf_config(target_hf)
    start = time.perf_counter()
    target = GemmaForCausalLM(target_cfg, rngs=nnx.Rngs(0))
    drafters = {}
    for ordered, label in ((True, "centroid head"), (False, "dense head")):
        cfg = Gemma4AssistantConfig.from_hf_config(configs(args.scale, ordered)[1])
        drafters[label] = Gemma4AssistantForCausalLM(cfg, rngs=nnx.Rngs(1))
    build_seconds = time.perf_counter() - start

    def count(module) -> int:
        return sum(x.size for x in jax.tree.leaves(nnx.state(module, nnx.Param)))

    # Modules cross jit as (graphdef, state), split once, as the decode loop does (nnx.jit re-walks the graph per call).
    target_graph, target_state = nnx.split(target)
    b, size = args.batch, args.context + max(DRAFTS) + 8
    positions = jnp.broadcast_to(jnp.arange(args.context), (b, args.context))
    tokens = jax.random.randint(jax.random.key(0), (b, args.context), 3, target_cfg.vocab_size)

    @jax.jit
    def prefill(state, tokens, cache):
        return nnx.merge(target_graph, state)(tokens, positions, cache)

    _, hidden, cache = prefill(target_state, tokens, target.init_cache(b, size))
    last, hidden = tokens[:, -1], hidden[:, -1]
    query = jnp.full((b, 1), args.context)  # the drafter queries from L-1 = context over positions < L-1

    @jax.jit
    def target_forward(state, block, cache):
        width = block.shape[1]
        block_positions = args.context + jnp.broadcast_to(jnp.arange(width), (b, width))
        return nnx.merge(target_graph, state)(block, block_positions, cache)[0]

    @functools.partial(jax.jit, static_argnums=1)
    def draft_step(state, drafter_graph, drafter_state, token, hidden, cache):
        target, drafter = nnx.merge(target_graph, state), nnx.merge(drafter_graph, drafter_state)
        shared = {t: target.shared_kv(cache, t) for t in set(drafter.cfg.layer_types)}
        inputs = jnp.concatenate([target.input_embeddings(token[:, None]), hidden[:, None]], axis=-1)
        logits, projected = drafter(inputs, query, shared)
        return jnp.argmax(logits[:, 0], axis=-1), projected[:, 0]

    calls = {f"target forward, W={w}": functools.partial(target_forward, target_state, jnp.zeros((b, w), jnp.int32),
                                                         cache)
             for w in sorted({1} | {k + 1 for k in DRAFTS})}
    calls |= {f"drafter step, {label}": functools.partial(draft_step, target_state, *nnx.split(d), last, hidden, cache)
              for label, d in drafters.items()}
    compile_start = time.perf_counter()
    for call in calls.values():
        jax.block_until_ready(call())
    compile_seconds = time.perf_counter() - compile_start
    times = {name: [] for name in calls}
    for _ in range(args.repeats):  # interleaved, so a slow moment of the machine hits every call alike
        for name, call in calls.items():
            begin = time.perf_counter()
            jax.block_until_ready(call())
            times[name].append(time.perf_counter() - begin)
    median = {name: statistics.median(t) for name, t in times.items()}

    plain = median["target forward, W=1"]
    model = f"random gemma4-e2b x{args.scale:g}"
    title = (f"Gemma 4 E2B proportions x {args.scale}: target {count(target) / 1e6:.0f}M params "
             f"(hidden {target_cfg.hidden_size}, vocab {target_cfg.vocab_size}), drafter "
             f"{count(drafters['dense head']) / 1e6:.1f}M (hidden {drafters['dense head'].cfg.hidden_size}); "
             f"batch {b}, {args.context} cached positions, float32 on {jax.default_backend()}")
    print(f"{title} (build {build_seconds:.0f}s, compile {compile_seconds:.0f}s apart)\n")
    print(f"{'call':<32} {'ms':>8} {'/ target W=1':>13}")
    rows = []
    for name, seconds in median.items():
        print(f"{name:<32} {1e3 * seconds:>8.2f} {seconds / plain:>13.3f}")
        rows.append({"table": "calls", "model": model, "call": name, "ms": 1e3 * seconds,
                     "vs_target_w1": seconds / plain})
    for label in drafters:
        step = median[f"drafter step, {label}"]
        print(f"\nBreak-even with the {label} (a round of K drafts: K drafter steps + one target forward of K+1):")
        print(f"{'K':>3} {'round cost (plain steps) = break-even tokens/round':>51} {'per-draft acceptance':>21} "
              f"{'speedup at a=0.6':>17} {'a=0.8':>6}")
        for k in DRAFTS:
            round_cost = (k * step + median[f"target forward, W={k + 1}"]) / plain
            speedups = [sum(a**i for i in range(k + 1)) / round_cost for a in (0.6, 0.8)]
            print(f"{k:>3} {round_cost:>51.2f} {break_even_acceptance(round_cost, k):>21.2f} "
                  f"{speedups[0]:>17.2f} {speedups[1]:>6.2f}")
            rows.append({"table": "break-even", "model": model, "head": label, "K": k,
                         "round_cost_plain_steps": round_cost,
                         "break_even_acceptance": break_even_acceptance(round_cost, k),
                         "speedup_at_a_0.6": speedups[0], "speedup_at_a_0.8": speedups[1]})
    record.write(rows, [model], title=title, build_seconds=build_seconds, compile_seconds=compile_seconds,
                 settings={"scale": args.scale, "context": args.context, "batch": b, "repeats": args.repeats})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
