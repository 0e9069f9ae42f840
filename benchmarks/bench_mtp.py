"""MTP decoding (`use_mtp=True`), measured side by side in one run (CPU, float32, batch 1).

    python benchmarks/bench_mtp.py [--model smollm2-135m] [--max-new-tokens 128] [--repeats 2] [--prompts 12]
    python benchmarks/bench_mtp.py --acceptance-only [--prompts 70]
    python benchmarks/bench_mtp.py --model random-deepseek [--layers 8] [--mtp-layers 1]

Default: a model with trained MTP layers (the catalogue's SmolLM2-135M with its shipped set, or any folder with
MTP layers) on prompts that training never saw (jaxspec.train.prompts' held-out set, the prompts of
benchmarks/bench.py, and the CLI's default prompt). For K = 1, 2 and 3 drafts per round (constant schedule), with the
reduced draft vocabulary and with the full head, and for the default (`--strategy mtp`: the adaptive schedule, up to the
draft length the layers recommend, else one draft per layer), it prints
tokens/s against plain greedy (all in one run, decode time only, compile reported apart), the acceptance rate, the
acceptance per depth (draft j accepted, given drafts < j were; meaningful under the constant schedule), tokens per
round and whether the output equals plain greedy; then what one draft step costs against one target step, with
each head.

`--acceptance-only`: acceptance alone, over many more prompts in the same time: one greedy decode per prompt and K
(constant schedule, the model's draft head), no timing. `--prompts 70` reads every held-out prompt that fits.

`--model random-deepseek`: a random DeepSeek-V3-shaped model against transformers' `generate(use_mtp=True)`. Its
MTP layers are random, so they accept almost nothing: the figures show what an MTP round costs over a plain step.

Every mode also writes its tables as a JSON record in `--results` (default benchmarks/results; benchmarks/_record.py).
Run it as a script, as above: it imports its siblings in benchmarks/ (the prompt set, the record), which Python finds
because it puts the script's folder on sys.path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from _bench_prompts import PROMPTS
from _record import Record, add_results_argument

CONFIG = dict(
    vocab_size=32000, hidden_size=1024, intermediate_size=2816, moe_intermediate_size=512, num_attention_heads=16,
    num_key_value_heads=16, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32,
    v_head_dim=64, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2,
    first_k_dense_replace=1, max_position_embeddings=2048, rope_parameters={"rope_theta": 10000.0},
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def build_checkpoint(folder: str, layers: int, mtp_layers: int) -> str:
    """Random DeepSeek-V3 with `mtp_layers` MTP layers written in HF's layout (`model.layers.{layers + k}`).

    transformers drops MTP tensors when saving, so a model with layers + mtp_layers decoder layers supplies the MTP
    decoder blocks and the MTP-only tensors are added by hand.
    """
    import json

    import torch
    import transformers
    from safetensors.torch import load_file, save_file

    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(**CONFIG, num_hidden_layers=layers + mtp_layers, num_nextn_predict_layers=0)
    transformers.DeepseekV3ForCausalLM(config).save_pretrained(folder + "-scratch")
    tensors = load_file(os.path.join(folder + "-scratch", "model.safetensors"))
    d = CONFIG["hidden_size"]
    for k in range(mtp_layers):
        prefix = f"model.layers.{layers + k}."
        tensors[prefix + "enorm.weight"] = torch.ones(d)
        tensors[prefix + "hnorm.weight"] = torch.ones(d)
        tensors[prefix + "eh_proj.weight"] = 0.02 * torch.randn(d, 2 * d)
        tensors[prefix + "shared_head.norm.weight"] = torch.ones(d)
    os.makedirs(folder, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder + "-scratch", "config.json")) as f:
        hf_config = json.load(f)
    hf_config |= {"num_hidden_layers": layers, "num_nextn_predict_layers": mtp_layers}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(hf_config, f)
    return folder


def time_jaxspec(model, ids, args, **kwargs):
    import jaxspec

    jaxspec.generate(model, [ids], max_new_tokens=args.max_new_tokens, eos_token_id=[], **kwargs)  # compile
    runs = [jaxspec.generate(model, [ids], max_new_tokens=args.max_new_tokens, eos_token_id=[], **kwargs)
            for _ in range(args.repeats)]
    return statistics.median(r.tokens_per_second for r in runs), runs[-1]


def time_transformers(model, ids, args, **kwargs):
    import torch

    x = torch.tensor([ids])
    model.generate(x, max_new_tokens=4, do_sample=False, **kwargs)  # warm up
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        out = model.generate(x, max_new_tokens=args.max_new_tokens, min_new_tokens=args.max_new_tokens,
                             do_sample=False, **kwargs)
        seconds.append(time.perf_counter() - start)
    return args.max_new_tokens / statistics.median(seconds), out[0, len(ids):].numpy()


def bench_random_deepseek(args) -> tuple[list[dict], str]:
    import jax
    import torch
    import transformers
    from flax import nnx

    import jaxspec

    folder = build_checkpoint(os.path.join(tempfile.mkdtemp(), "deepseek"), args.layers, args.mtp_layers)
    model = jaxspec.load(folder)
    params = sum(int(np.prod(v.shape)) for v in jax.tree.leaves(nnx.state(model.module)))
    ids = list(np.random.RandomState(0).randint(3, CONFIG["vocab_size"], 24))

    greedy_tps, greedy = time_jaxspec(model, ids, args)
    mtp_tps, mtp = time_jaxspec(model, ids, args, use_mtp=True)

    hf_class = transformers.DeepseekV3ForCausalLM
    hf_class._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{args.layers + k}\..*"
                                                   for k in range(args.mtp_layers)]
    torch.set_num_threads(os.cpu_count())
    hf = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
    hf_greedy_tps, hf_tokens = time_transformers(hf, ids, args)
    hf_mtp_tps, _ = time_transformers(hf, ids, args, use_mtp=True)

    n = args.max_new_tokens
    same = bool((greedy.sequences[0, len(ids):len(ids) + n] == hf_tokens[:n]).all())
    title = (f"MTP on a random DeepSeek-V3-shaped model ({params / 1e6:.0f}M params incl. MTP, {args.layers} layers, "
             f"{args.mtp_layers} MTP layer(s)); CPU float32, batch 1, {n} new tokens, median of {args.repeats}")
    nan = float("nan")
    rows = [dict(library="jaxspec", strategy="greedy", tokens_per_second=greedy_tps, vs_own_greedy=1.0,
                 target_forwards=greedy.target_forwards, acceptance=nan, mean_accepted_length=1.0),
            dict(library="jaxspec", strategy="use_mtp", tokens_per_second=mtp_tps, vs_own_greedy=mtp_tps / greedy_tps,
                 target_forwards=mtp.target_forwards, acceptance=mtp.acceptance_rate,
                 mean_accepted_length=mtp.mean_accepted_length),
            dict(library="transformers", strategy="greedy", tokens_per_second=hf_greedy_tps, vs_own_greedy=1.0,
                 target_forwards=n, acceptance=nan, mean_accepted_length=1.0),
            dict(library="transformers", strategy="use_mtp", tokens_per_second=hf_mtp_tps,
                 vs_own_greedy=hf_mtp_tps / hf_greedy_tps, target_forwards=None, acceptance=nan,
                 mean_accepted_length=nan)]
    print(f"# {title}\n")
    print("| library | strategy | tok/s | vs own greedy | target forwards | acceptance | mean accepted length |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['library']} | {r['strategy']} | {r['tokens_per_second']:.2f} | {r['vs_own_greedy']:.2f}x | "
              f"{_cell(r['target_forwards'], 'd')} | {_cell(r['acceptance'])} | {_cell(r['mean_accepted_length'])} |")
    same_mtp = bool((mtp.sequences == greedy.sequences).all())
    print(f"\njaxspec greedy tokens equal transformers' greedy tokens: {same}; jaxspec use_mtp tokens equal jaxspec "
          f"greedy: {same_mtp}. Random MTP layers accept little; a trained checkpoint's acceptance decides the real "
          "speedup.")
    rows = [{"table": "libraries", "model": args.model} | r for r in rows]
    rows.append({"table": "checks", "model": args.model, "jaxspec_greedy_equals_transformers": same,
                 "use_mtp_equals_greedy": same_mtp})
    return rows, title


def _cell(value, spec: str = ".2f") -> str:
    """A table cell: '–' where the figure does not apply (None or NaN)."""
    return "–" if value is None or (isinstance(value, float) and np.isnan(value)) else format(value, spec)


# ----------------------------------------------------------------------------------------------------------------
# A model with trained MTP layers


CLI_DEFAULT_PROMPT = "Write a Python function that checks whether a number is prime."  # jaxspec-generate's


def heldout_prompts(tokenizer, count: int) -> list[tuple[str, list[int]]]:
    """(label, ids): held-out training prompts (chat template or raw, as drawn), benchmarks/bench.py's prompts in the
    chat template, and the CLI's default prompt as raw text; none of them was trained on."""
    from jaxspec.train.data import encode_prompts
    from jaxspec.train.prompts import Prompt, prompt_set

    def encode(text: str, chat: bool) -> list[int]:
        return encode_prompts(tokenizer, [Prompt(text, chat)], max_len=10**6)[0]

    out = [(name, encode(text, chat=True)) for name, text in PROMPTS.items()]
    out.append(("cli default", encode(CLI_DEFAULT_PROMPT, chat=False)))
    for index, prompt in enumerate(prompt_set(heldout=True, count=64)):
        if len(out) >= count:
            break
        ids = encode(prompt.text, prompt.chat)
        if len(ids) <= 160:
            out.append((f"held-out {index}", ids))
    return out[:count]


def per_depth_acceptance(hist: np.ndarray) -> list[float]:
    """P(draft j accepted | drafts < j accepted) from the histogram of accepted counts per round [K+1]."""
    reached = hist[::-1].cumsum()[::-1]  # rounds that accepted at least j drafts, j = 0..K
    return [float(reached[j + 1] / reached[j]) if reached[j] else float("nan") for j in range(len(hist) - 1)]


def time_draft_step(model, depths: int, iterations: int = 200) -> float:
    """Seconds of one MTP draft step at batch 1 (one depth over a window of depths+1 entries, then the head on the
    newest), as the drafter runs it: the draft vocabulary's head rows are gathered once per call, outside."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model.module)
    size, window = 256, depths + 1

    @jax.jit
    def step(state, tokens, prev, positions, cache, head):
        module = nnx.merge(graphdef, state)
        out, _, cache = module.mtp_step(0, tokens, prev, positions, cache)
        logits = module.logits(out[:, -1]) if head is None else module.draft_logits(out[:, -1], head)
        return logits.argmax(-1), cache

    has_vocab = bool(getattr(model.config, "draft_vocab_size", 0))
    head = jax.jit(lambda state: nnx.merge(graphdef, state).draft_head())(state) if has_vocab else None  # per call

    tokens = jnp.ones((1, window), jnp.int32)
    prev = jnp.ones((1, window, model.config.hidden_size), model.module.dtype)
    positions = jnp.arange(100, 100 + window)[None]
    cache = model.module.init_mtp_cache(1, size)
    return _time(lambda: step(state, tokens, prev, positions, cache, head), iterations)


def time_target_step(model, iterations: int = 100) -> float:
    """Seconds of one plain decoding forward at batch 1 (the target reads one token against a 256-entry cache)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model.module)

    @jax.jit
    def step(state, tokens, positions, cache):
        logits, _, cache = nnx.merge(graphdef, state)(tokens, positions, cache)
        return logits.argmax(-1), cache

    tokens, positions = jnp.ones((1, 1), jnp.int32), jnp.full((1, 1), 100)
    cache = model.module.init_cache(1, 256)
    return _time(lambda: step(state, tokens, positions, cache), iterations)


def _time(fn, iterations: int) -> float:
    import jax

    jax.block_until_ready(fn())
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(iterations):
            out = fn()
        jax.block_until_ready(out)
        best = min(best, (time.perf_counter() - start) / iterations)
    return best


def bench_trained(args) -> tuple[list[dict], str]:
    import jaxspec
    from jaxspec.assets import strip_draft_vocab

    model = jaxspec.load(args.model)
    layers = getattr(model.module, "num_mtp_layers", 0)
    if not layers:
        raise SystemExit(f"{args.model} has no MTP layers (num_nextn_predict_layers is 0 or absent).")
    has_vocab = bool(getattr(model.config, "draft_vocab_size", 0))
    heads = {"draft vocab": model, "full head": strip_draft_vocab(model)} if has_vocab else {"full head": model}
    prompts = heldout_prompts(model.tokenizer, args.prompts)
    depths = [k for k in (1, 2, 3) if k <= max(layers, 1)] if not args.extra_drafts else [1, 2, 3]
    configs = [("greedy", model, {})]
    for k in depths:
        for head, variant in heads.items():
            # The constant schedule drafts K every round, so the histogram gives the acceptance per depth.
            configs.append((f"mtp K={k}, {head}", variant, dict(use_mtp=True, num_assistant_tokens=k,
                                                                num_assistant_tokens_schedule="constant")))
    # What `--strategy mtp` runs: the adaptive schedule (it drafts only where drafting pays), up to the draft length
    # the layers recommend (mtp_num_assistant_tokens), else one draft per layer.
    default_k = model.hf_config.get("mtp_num_assistant_tokens") or layers
    configs.append((f"mtp K={default_k}, adaptive schedule (the default)", model, dict(use_mtp=True)))

    common = dict(max_new_tokens=args.max_new_tokens)
    results = {name: {"seconds": 0.0, "tokens": 0, "hist": None, "compile": 0.0, "same": True, "drafted": 0,
                      "accepted": 0} for name, _, _ in configs}
    by_prompt: dict[str, dict[str, float]] = {}  # prompt -> config -> acceptance
    for label, ids in prompts:
        plain = None
        for name, variant, kwargs in configs:
            runs = [jaxspec.generate(variant, [ids], **common, **kwargs) for _ in range(args.repeats + 1)]
            timed = sorted(runs[1:], key=lambda r: r.decode_seconds)[len(runs[1:]) // 2]  # the median run
            entry = results[name]
            entry["compile"] += runs[0].compile_seconds
            entry["seconds"] += timed.decode_seconds
            entry["tokens"] += int(timed.num_new_tokens.sum())
            if kwargs:
                hist = timed.accepted_hist.sum(0)
                entry["hist"] = hist if entry["hist"] is None else entry["hist"] + hist
                entry["same"] &= bool((timed.sequences == plain.sequences).all())
                entry["drafted"] += int(timed.drafted.sum())
                entry["accepted"] += int(timed.accepted.sum())
                by_prompt.setdefault(label, {})[name] = int(timed.accepted.sum()) / max(int(timed.drafted.sum()), 1)
            else:
                plain = timed
        print(f"  {label}: {len(ids)} prompt tokens, {int(plain.num_new_tokens[0])} generated", flush=True)

    greedy = results["greedy"]["tokens"] / results["greedy"]["seconds"]
    title = (f"{args.model}: {layers} MTP layer(s)"
             + (f", draft vocabulary of {model.config.draft_vocab_size}" if has_vocab else "")
             + f"; {len(prompts)} held-out prompts, batch 1, up to {args.max_new_tokens} new tokens, CPU float32, "
             f"median of {args.repeats}")
    print(f"\n# {title}\n")
    print("| strategy | tok/s | vs greedy | acceptance | per depth (1, 2, 3) | tokens per round | same as greedy |")
    print("|---|---:|---:|---:|---|---:|---|")
    rows = []
    for name, _, kwargs in configs:
        entry = results[name]
        rate = entry["tokens"] / entry["seconds"]
        row = {"table": "strategies", "model": args.model, "strategy": name, "tokens_per_second": rate,
               "vs_greedy": rate / greedy, "compile_seconds": entry["compile"]}
        rows.append(row)
        if not kwargs:
            row |= {"tokens_per_round": 1.0}
            print(f"| {name} | {rate:.1f} | 1.00x | – | – | 1.00 | – |")
            continue
        hist = entry["hist"]
        rounds = hist.sum()
        row |= {"acceptance": entry["accepted"] / entry["drafted"], "per_depth": per_depth_acceptance(hist),
                "tokens_per_round": (entry["accepted"] + rounds) / rounds, "same_as_greedy": entry["same"]}
        depth = ", ".join(f"{x:.2f}" for x in row["per_depth"])
        print(f"| {name} | {rate:.1f} | {rate / greedy:.2f}x | {row['acceptance']:.3f} | "
              f"{depth} | {row['tokens_per_round']:.2f} | {entry['same']} |")
    drafting = [name for name, _, kwargs in configs if kwargs]
    print("\nAcceptance per prompt:\n")
    print("| prompt | " + " | ".join(drafting) + " |")
    print("|---|" + "---:|" * len(drafting))
    for label, rates in by_prompt.items():
        print(f"| {label} | " + " | ".join(f"{rates[name]:.2f}" for name in drafting) + " |")
        rows += [{"table": "acceptance per prompt", "model": args.model, "prompt": label, "strategy": name,
                  "acceptance": rates[name]} for name in drafting]
    compile_total = sum(entry["compile"] for entry in results.values())
    print(f"\nCompile time (apart from the figures): {compile_total:.0f}s over all runs. Acceptance: accepted / "
          "drafted tokens; per depth: rounds that accepted at least j drafts / rounds that accepted at least j-1.")

    target = time_target_step(model)
    print("\n| one step at batch 1 | ms | vs a target step |")
    print("|---|---:|---:|")
    print(f"| target forward (plain decoding) | {target * 1e3:.2f} | 1.00 |")
    rows.append({"table": "steps", "model": args.model, "step": "target forward (plain decoding)",
                 "ms": target * 1e3, "vs_target_step": 1.0})
    for head, variant in heads.items():
        draft = time_draft_step(variant, 1)
        print(f"| MTP draft step (window 2), {head} | {draft * 1e3:.2f} | {draft / target:.3f} |")
        rows.append({"table": "steps", "model": args.model, "step": f"MTP draft step (window 2), {head}",
                     "ms": draft * 1e3, "vs_target_step": draft / target})
    return rows, title


def bench_acceptance(args) -> tuple[list[dict], str]:
    """Acceptance per depth for K = 1, 2, 3 over `--prompts` unseen prompts: for the fixed prompts, for the held-out
    set, and for both. Greedy acceptance needs no timing, so each prompt and K decodes once."""
    import jaxspec

    model = jaxspec.load(args.model)
    layers = getattr(model.module, "num_mtp_layers", 0)
    if not layers:
        raise SystemExit(f"{args.model} has no MTP layers (num_nextn_predict_layers is 0 or absent).")
    prompts = heldout_prompts(model.tokenizer, args.prompts)
    depths = [k for k in (1, 2, 3) if k <= layers] if not args.extra_drafts else [1, 2, 3]
    groups = {"bench.py's prompts and the CLI's default": lambda label: not label.startswith("held-out"),
              "held-out training-set prompts": lambda label: label.startswith("held-out"), "all": lambda label: True}
    totals = {(group, k): np.zeros(k + 1, np.int64) for group in groups for k in depths}
    accepted_drafted = {(group, k): [0, 0] for group in groups for k in depths}
    for label, ids in prompts:
        for k in depths:
            out = jaxspec.generate(model, [ids], max_new_tokens=args.max_new_tokens, use_mtp=True,
                                   num_assistant_tokens=k, num_assistant_tokens_schedule="constant")
            for group, member in groups.items():
                if member(label):
                    totals[group, k] += out.accepted_hist.sum(0)
                    accepted_drafted[group, k][0] += int(out.accepted.sum())
                    accepted_drafted[group, k][1] += int(out.drafted.sum())
    counts = {group: sum(member(label) for label, _ in prompts) for group, member in groups.items()}
    title = (f"{args.model}: acceptance on {len(prompts)} unseen prompts, greedy, batch 1, up to "
             f"{args.max_new_tokens} new tokens, constant schedule")
    print(f"\n# {title}\n")
    print("| prompts | K | acceptance | per depth | tokens per round |")
    print("|---|---:|---:|---|---:|")
    rows = []
    for group in groups:
        for k in depths:
            hist, (accepted, total) = totals[group, k], accepted_drafted[group, k]
            if not total:
                continue
            rounds = hist.sum()
            depth = ", ".join(f"{x:.3f}" for x in per_depth_acceptance(hist))
            print(f"| {group} ({counts[group]}) | {k} | {accepted / total:.3f} | {depth} | "
                  f"{(accepted + rounds) / rounds:.2f} |")
            rows.append({"table": "acceptance", "model": args.model, "prompts": f"{group} ({counts[group]})", "K": k,
                         "acceptance": accepted / total, "per_depth": per_depth_acceptance(hist),
                         "tokens_per_round": (accepted + rounds) / rounds})
    return rows, title


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m",
                   help="catalogue name or folder with MTP layers, or random-deepseek")
    p.add_argument("--max-new-tokens", type=int, default=None, help="default 128 (random-deepseek: 32)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts (trained model)")
    p.add_argument("--extra-drafts", action="store_true",
                   help="also K beyond the number of MTP layers (the last layer drafts the extra tokens)")
    p.add_argument("--acceptance-only", action="store_true",
                   help="acceptance per depth over --prompts unseen prompts, without timing (trained model)")
    p.add_argument("--layers", type=int, default=8, help="random-deepseek: main layers")
    p.add_argument("--mtp-layers", type=int, default=1, help="random-deepseek: MTP layers")
    add_results_argument(p)
    args = p.parse_args(argv)
    record = Record("bench_mtp", __file__, argv, args.results)
    if args.model == "random-deepseek":
        args.max_new_tokens = args.max_new_tokens or 32
        rows, title = bench_random_deepseek(args)
    else:
        args.max_new_tokens = args.max_new_tokens or 128
        rows, title = (bench_acceptance if args.acceptance_only else bench_trained)(args)
    mode = "random-deepseek" if args.model == "random-deepseek" else "acceptance" if args.acceptance_only else "timed"
    record.write(rows, [args.model], title=title, mode=mode,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


if __name__ == "__main__":
    sys.exit(main())
