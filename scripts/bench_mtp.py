"""MTP decoding on a random DeepSeek-V3-shaped model: jaxspec `use_mtp=True` against jaxspec plain greedy and
transformers' `generate(use_mtp=True)`, side by side in one run (CPU, float32, batch 1).

    python scripts/bench_mtp.py [--max-new-tokens 32] [--repeats 2] [--layers 8] [--mtp-layers 1]

The MTP layers are random, so they rarely predict what the target will say: expect an acceptance rate near zero.
The figures show what the MTP round costs over a plain step, not the speedup of a trained checkpoint.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import numpy as np

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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--mtp-layers", type=int, default=1)
    args = p.parse_args(argv)

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
    print(f"# MTP on a random DeepSeek-V3-shaped model ({params / 1e6:.0f}M params incl. MTP, {args.layers} layers, "
          f"{args.mtp_layers} MTP layer(s)); CPU float32, batch 1, {n} new tokens, median of {args.repeats}\n")
    print("| library | strategy | tok/s | vs own greedy | target forwards | acceptance | mean accepted length |")
    print("|---|---|---:|---:|---:|---:|---:|")
    print(f"| jaxspec | greedy | {greedy_tps:.2f} | 1.00x | {greedy.target_forwards} | – | 1.00 |")
    print(f"| jaxspec | use_mtp | {mtp_tps:.2f} | {mtp_tps / greedy_tps:.2f}x | {mtp.target_forwards} | "
          f"{mtp.acceptance_rate:.2f} | {mtp.mean_accepted_length:.2f} |")
    print(f"| transformers | greedy | {hf_greedy_tps:.2f} | 1.00x | {n} | – | 1.00 |")
    print(f"| transformers | use_mtp | {hf_mtp_tps:.2f} | {hf_mtp_tps / hf_greedy_tps:.2f}x | – | – | – |")
    print(f"\njaxspec greedy tokens equal transformers' greedy tokens: {same}; jaxspec use_mtp tokens equal jaxspec "
          f"greedy: {bool((mtp.sequences == greedy.sequences).all())}. Random MTP layers accept little; a trained "
          "checkpoint's acceptance decides the real speedup.")


if __name__ == "__main__":
    sys.exit(main())
