"""What several processes cost: decode on a random DeepSeek-V3-shaped model (MLA, MoE with expert parallelism, one
MTP layer) on the same (data, model, expert) mesh of 4 CPU devices, held by one process or by two processes of 2
devices each (`jax.distributed` on 127.0.0.1, gloo collectives), side by side in one run; then what the planner
says for DeepSeek-V3 on real TPU slices.

    python benchmarks/bench_distributed.py [--layers 4] [--max-new-tokens 32] [--repeats 3] [--mesh 1,2,2]
        [--results benchmarks/results]

Every configuration runs in fresh processes started here (one process per configuration, or two that join as one
program), loads the checkpoint sharded on the mesh, compiles, then times `--repeats` generations of each strategy
(best of). Decode time is the compiled loop alone; the call time adds placing the prompts on the mesh and gathering
the outputs to every process. On CPU the processes share this machine's cores, so the ratio is an upper bound of
what the cross-process collectives cost; on a TPU slice each process has its own host and chips.

Both tables also go to a JSON record in `--results` (benchmarks/_record.py). Run it as a script, as above: it imports
bench_mtp.py, its sibling in benchmarks/, which Python finds because it puts the script's folder on sys.path.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

from _record import Record, add_results_argument

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25], [9, 8, 7, 6]]
CALLS = {"greedy": dict(), "sample": dict(do_sample=True, temperature=0.8, seed=3), "mtp": dict(use_mtp=True)}


def worker(args) -> int:
    """One process of a configuration: load on the mesh, compile, time each call; process 0 writes the results."""
    import jax

    from jaxspec import distributed

    if args.num_processes > 1:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import numpy as np
    from jax.sharding import Mesh

    import jaxspec

    mesh = Mesh(np.array(jax.devices()).reshape(tuple(int(n) for n in args.mesh.split(","))),
                ("data", "model", "expert"))
    start = time.perf_counter()
    model = jaxspec.load(args.checkpoint, mesh=mesh)
    results = {"load_seconds": time.perf_counter() - start}
    for name in args.calls.split(","):
        kwargs = dict(max_new_tokens=args.max_new_tokens, mesh=mesh, eos_token_id=[], **CALLS[name])
        first = jaxspec.generate(model, PROMPTS, **kwargs)
        decode, call = [], []
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = jaxspec.generate(model, PROMPTS, **kwargs)
            call.append(time.perf_counter() - start)
            decode.append(out.decode_seconds)
        results[name] = {"compile_seconds": first.compile_seconds, "decode_seconds": min(decode),
                         "call_seconds": min(call), "tokens": int(out.num_new_tokens.sum()),
                         "sequences": out.sequences.tolist()}
    if jax.process_index() == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    return 0


def run_configuration(args, processes: int, devices: int, out: str) -> dict:
    env = os.environ | {"XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for pid in range(processes):
        command = [sys.executable, __file__, "--worker", "--checkpoint", args.checkpoint, "--out", out,
                   "--mesh", args.mesh, "--max-new-tokens", str(args.max_new_tokens), "--repeats", str(args.repeats),
                   "--calls", args.calls, "--num-processes", str(processes), "--process-id", str(pid),
                   "--coordinator", f"127.0.0.1:{port}"]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit("a worker failed:\n" + "\n-----\n".join(log[-3000:] for log in logs))
    with open(out) as f:
        return json.load(f)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--mesh", default="1,2,2", help="data,model,expert over 4 devices")
    p.add_argument("--calls", default=",".join(CALLS))
    p.add_argument("--checkpoint", default=None, help="an existing DeepSeek-V3 folder instead of a random one")
    add_results_argument(p)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--coordinator", help=argparse.SUPPRESS)
    p.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    record = Record("bench_distributed", __file__, argv, args.results)

    with tempfile.TemporaryDirectory() as tmp:
        if args.checkpoint is None:
            from bench_mtp import CONFIG, build_checkpoint

            args.checkpoint = build_checkpoint(os.path.join(tmp, "deepseek"), args.layers, 1)
            model = "random-deepseek"
            shape = (f"random DeepSeek-V3 shape: {args.layers} layers (1 dense), hidden {CONFIG['hidden_size']}, "
                     f"{CONFIG['n_routed_experts']} experts (top {CONFIG['num_experts_per_tok']}), MLA latent "
                     f"{CONFIG['kv_lora_rank']}, 1 MTP layer, float32")
        else:
            model = shape = args.checkpoint
        single = run_configuration(args, 1, 4, os.path.join(tmp, "single.json"))
        multi = run_configuration(args, 2, 2, os.path.join(tmp, "multi.json"))

    print(f"# one process x 4 CPU devices vs two processes x 2 CPU devices, mesh (data, model, expert) = "
          f"({args.mesh}); {shape}; batch {len(PROMPTS)}, {args.max_new_tokens} new tokens, best of {args.repeats}\n")
    print("| strategy | 1 process: decode tok/s | 2 processes: decode tok/s | decode time ratio (2p / 1p) | "
          "call time ratio (2p / 1p) | same tokens | compile s (1p / 2p) |")
    print("|---|---:|---:|---:|---:|---|---:|")
    rows = []
    for name in args.calls.split(","):
        a, b = single[name], multi[name]
        row = {"table": "processes", "model": model, "strategy": name,
               "decode_tokens_per_second_1p": a["tokens"] / a["decode_seconds"],
               "decode_tokens_per_second_2p": b["tokens"] / b["decode_seconds"],
               "decode_time_ratio": b["decode_seconds"] / a["decode_seconds"],
               "call_time_ratio": b["call_seconds"] / a["call_seconds"],
               "same_tokens": a["sequences"] == b["sequences"],
               "compile_seconds_1p": a["compile_seconds"], "compile_seconds_2p": b["compile_seconds"]}
        rows.append(row)
        print(f"| {name} | {row['decode_tokens_per_second_1p']:.1f} | {row['decode_tokens_per_second_2p']:.1f} | "
              f"{row['decode_time_ratio']:.2f}x | {row['call_time_ratio']:.2f}x | {row['same_tokens']} | "
              f"{a['compile_seconds']:.1f} / {b['compile_seconds']:.1f} |")
    print(f"\nload (sharded, each process its own slices): {single['load_seconds']:.1f} s in one process, "
          f"{multi['load_seconds']:.1f} s in two\n")
    rows.append({"table": "load", "model": model, "load_seconds_1p": single["load_seconds"],
                 "load_seconds_2p": multi["load_seconds"]})

    from jaxspec.cli.plan import readme_rows, readme_table

    print("# planner: per-chip bytes, bf16 weights (jaxspec-plan --slices)\n")
    slices = readme_rows("bfloat16")
    print(readme_table("bfloat16", slices))
    # The planned models are a label of these rows; "model" stays the run's, as in every record.
    rows += [{"table": "planner", "model": model, "planned_model": r["model"]}
             | {k: v for k, v in r.items() if k != "model"} for r in slices]
    record.write(rows, [model], title=f"one process x 4 CPU devices vs two processes x 2, mesh ({args.mesh}); {shape}",
                 settings={"batch": len(PROMPTS), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                           "mesh": args.mesh})
    return 0


if __name__ == "__main__":
    sys.exit(main())
