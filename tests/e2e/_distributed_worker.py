"""One process of a multi-process run, started by tests/e2e/test_distributed.py (and benchmarks/bench_distributed.py).

    python tests/e2e/_distributed_worker.py CHECKPOINT OUT.npz --mesh 1,2,2 [--coordinator 127.0.0.1:PORT
        --num-processes 2 --process-id 0] [--save-restore FOLDER] [--rss]

Every process runs this same program: it loads CHECKPOINT sharded on a (data, model, expert) mesh over all devices
of all processes, generates with plain greedy, sampling and use_mtp, and writes the sequences it got back (every
process gets the full outputs) to OUT.npz. The devices per process come from XLA_FLAGS, set by the caller.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, os.pardir))

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [3, 4, 5], [20, 21, 22, 23, 24, 25], [9, 8, 7, 6]]
CALLS = {
    "greedy": dict(),
    "sample": dict(do_sample=True, temperature=0.8, top_k=20, seed=3),
    "mtp": dict(use_mtp=True),
    "lookup": dict(prompt_lookup_num_tokens=3),
    "early_exit": dict(assistant_early_exit=1, num_assistant_tokens=2),
    # The model drafts for itself, as a second sharded model, every round: the adaptive schedule would never draft
    # for an assistant as costly as the target (Schedule.drafting_can_pay)
    "assistant": dict(num_assistant_tokens=2, num_assistant_tokens_schedule="constant"),
}


def reset_peak_rss() -> bool:
    """Restart the kernel's peak-RSS count (Linux >= 4.0); False where that is not allowed."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    """The peak resident memory since `reset_peak_rss` (else since the process started)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("checkpoint")
    p.add_argument("out")
    p.add_argument("--mesh", default="1,2,2", help="data,model,expert sizes")
    p.add_argument("--coordinator", default=None)
    p.add_argument("--num-processes", type=int, default=1)
    p.add_argument("--process-id", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=10)
    p.add_argument("--calls", default="greedy,sample,mtp")
    p.add_argument("--save-restore", default=None, help="also save the loaded model there and restore it")
    p.add_argument("--rss", action="store_true", help="only load, and report the peak RSS of the load")
    p.add_argument("--repeats", type=int, default=1, help="decode timings: best of this many runs per call")
    p.add_argument("--one-device", action="store_true", help="also greedy on one device, unsharded (one process)")
    args = p.parse_args(argv)

    import jax

    from jaxspec import distributed

    if args.num_processes > 1:
        distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from jax.sharding import Mesh

    import jaxspec
    from jaxspec import checkpoint

    shape = tuple(int(n) for n in args.mesh.split(","))
    mesh = Mesh(np.array(jax.devices()).reshape(shape), ("data", "model", "expert"))
    jnp.zeros(()).block_until_ready()  # the runtime's own memory, before the load
    rss_before = current_rss_bytes()
    reset_peak_rss()
    model = jaxspec.load(args.checkpoint, dtype=jnp.float32, mesh=mesh)
    leaves = jax.tree.leaves(nnx.state(model.module))
    shards = [shard.data.nbytes for leaf in leaves for shard in leaf.addressable_shards]
    results = {"peak_rss": peak_rss_bytes(), "rss_before_load": rss_before, "local_param_bytes": sum(shards),
               "largest_box_bytes": max(shards)}
    if args.rss:
        _write(args.out, results)
        return 0

    arrays = {}
    if args.save_restore:
        checkpoint.save(model, args.save_restore)
        restored = checkpoint.restore(args.save_restore, mesh=mesh)
        saved, back = (distributed.fetch(nnx.to_pure_dict(nnx.state(m.module))) for m in (model, restored))
        results["restored_equal"] = all(np.array_equal(saved[k], back[k]) for k in saved)
        results["restored_sharding_equal"] = all(
            a.sharding == b.sharding for a, b in zip(jax.tree.leaves(nnx.state(model.module)),
                                                      jax.tree.leaves(nnx.state(restored.module))))
    for name in args.calls.split(","):
        seconds = []
        for _ in range(args.repeats):
            assistant = dict(assistant_model=model) if name == "assistant" else {}
            out = jaxspec.generate(model, PROMPTS, max_new_tokens=args.max_new_tokens, mesh=mesh, **CALLS[name],
                                   **assistant)
            seconds.append(out.decode_seconds)
        arrays[name] = out.sequences
        results[f"{name}_decode_seconds"] = min(seconds)
        results[f"{name}_compile_seconds"] = out.compile_seconds
        results[f"{name}_new_tokens"] = int(out.num_new_tokens.sum())
    if args.one_device:
        unsharded = jaxspec.load(args.checkpoint, dtype=jnp.float32)
        arrays["greedy_one_device"] = jaxspec.generate(unsharded, PROMPTS, max_new_tokens=args.max_new_tokens).sequences
    _write(args.out, results, arrays)
    return 0


def _write(out: str, results: dict, arrays: dict | None = None) -> None:
    import numpy as np

    np.savez(out, results=json.dumps(results), **(arrays or {}))


if __name__ == "__main__":
    sys.exit(main())
