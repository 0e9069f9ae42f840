"""Per-device memory of a model on a mesh, from its config.json alone: no weights, no devices.

    jaxspec-plan deepseek-v3 --mesh data=1,model=8,expert=4 --batch 8 --max-len 8192
    jaxspec-plan path/to/config.json --mesh model=8 --dtype bf16 --hbm 32
    jaxspec-plan --slices        # DeepSeek-V3, GLM-4.5-Air and Qwen3-30B-A3B on real TPU slices

`python scripts/plan.py ...` runs the same. CONFIG is a folder or config.json, or a name in
jaxspec/cli/plan_configs.json (the public config.json of deepseek-v3, glm-4.5-air, glm-4.5 and qwen3-30b-a3b). Every
param, cache and MTP buffer is laid out exactly as jaxspec lays it out: the module is built abstractly
(`abstract_module`), each array's logical axes go through the same `ShardingRules`, and a dimension that its mesh axis
does not divide is replicated. Printed per device: weights by dtype (of which MTP layers), the target's KV or latent
cache at `--batch` rows of `--max-len` positions (the cache also holds the draft window, and generate rounds its length
up as `jaxspec.prompts.buffer_size` does), and the MTP drafter's state (one cache per depth and the main hidden states).
Sizes are in GB (10^9 bytes), as TPU HBM is quoted. FP8 checkpoints are dequantized when loaded, so weights take
`--dtype` (default bf16), not the checkpoint's fp8 bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import defaultdict
from importlib import resources

# Package data beside this module: the public config.json of the models the README's table plans.
CONFIGS = resources.files("jaxspec.cli") / "plan_configs.json"
GB = 1e9

# (slice name, chips, HBM per chip in GB). v5p-N counts TensorCores (2 per chip); v5e-N and v6e-N count chips.
SLICES = {"v5p-16": (8, 95), "v5p-64": (32, 95), "v5p-128": (64, 95), "v5e-32": (32, 16), "v5e-256": (256, 16),
          "v6e-8": (8, 32), "v6e-16": (16, 32), "v6e-256": (256, 32)}
# The rows --slices plans: model, slice, mesh, batch, max length.
README_ROWS = [
    ("deepseek-v3", "v5p-64", "data=1,model=8,expert=4", 8, 8192),
    ("deepseek-v3", "v5p-128", "data=2,model=8,expert=4", 16, 8192),
    ("deepseek-v3", "v5e-256", "data=1,model=32,expert=8", 4, 4096),
    ("deepseek-v3", "v6e-256", "data=1,model=16,expert=16", 16, 8192),
    ("deepseek-v3", "v6e-256", "data=2,model=16,expert=8", 32, 8192),
    ("glm-4.5-air", "v5p-16", "data=1,model=8,expert=1", 8, 8192),
    ("glm-4.5-air", "v6e-8", "data=1,model=8,expert=1", 8, 8192),
    ("glm-4.5-air", "v6e-16", "data=1,model=8,expert=2", 16, 8192),
    ("glm-4.5-air", "v5e-32", "data=1,model=8,expert=4", 8, 8192),
    ("qwen3-30b-a3b", "v6e-8", "data=1,model=4,expert=2", 8, 8192),
]
DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "f32": "float32", "fp32": "float32", "float32": "float32",
          "f16": "float16", "float16": "float16"}


def read_config(spec: str) -> tuple[str, dict]:
    """(label, config.json dict) from a catalogue name of plan_configs.json, a config.json or a folder holding one."""
    known = json.loads(CONFIGS.read_text(encoding="utf-8"))
    if spec in known:
        return spec, {k: v for k, v in known[spec].items() if not k.startswith("_")}
    path = os.path.join(spec, "config.json") if os.path.isdir(spec) else spec
    if not os.path.isfile(path):
        raise SystemExit(f"{spec!r} is neither a config.json, a folder with one, nor one of {sorted(known)}.")
    with open(path) as f:
        return os.path.basename(os.path.dirname(os.path.abspath(path))), json.load(f)


def parse_mesh(text: str) -> dict[str, int]:
    """"data=1,model=8,expert=4" -> {"data": 1, "model": 8, "expert": 4}."""
    mesh = {}
    for part in text.split(","):
        name, _, size = part.partition("=")
        if not name or not size.isdigit() or int(size) < 1:
            raise SystemExit(f"--mesh takes name=size pairs like data=1,model=8,expert=4; got {text!r}.")
        mesh[name.strip()] = int(size)
    return mesh


@dataclasses.dataclass
class Plan:
    label: str
    params: int  # main-model parameters
    mtp_params: int
    devices: int
    weights: dict[str, float]  # dtype -> bytes per device
    mtp_weights: float
    cache: float
    cache_shape: str
    mtp_state: float
    positions: int

    @property
    def total(self) -> float:
        return sum(self.weights.values()) + self.cache + self.mtp_state


def plan(hf: dict, label: str, mesh: dict[str, int], dtype: str, batch: int, max_len: int, mtp: bool) -> Plan:
    """Bytes per device of everything `jaxspec.generate` holds for this model on this mesh."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxspec.models.layers import abstract_module
    from jaxspec.prompts import buffer_size
    from jaxspec.registry import family_for
    from jaxspec.strategies import default_prefill_chunk
    from jaxspec.sharding import ShardingRules, shard_shape

    rules = ShardingRules()
    family = family_for(hf, label)
    cfg = family.config_from_hf(hf)
    module = abstract_module(lambda: family.model_cls()(cfg, dtype=jnp.dtype(dtype)))

    def per_device(shape, dtype, axes) -> float:
        return math.prod(shard_shape(axes, shape, mesh, rules)) * np.dtype(dtype).itemsize

    weights, mtp_weights, params, mtp_params = defaultdict(float), 0.0, 0, 0
    variables = jax.tree_util.tree_leaves_with_path(nnx.state(module), is_leaf=lambda x: isinstance(x, nnx.Variable))
    for path, variable in variables:
        value = variable.get_value()
        size = per_device(value.shape, value.dtype, variable.get_metadata().get("logical_axes"))
        weights[np.dtype(value.dtype).name] += size
        is_mtp = str(getattr(path[0], "key", path[0])).startswith("mtp_")
        mtp_weights += size if is_mtp else 0.0
        mtp_params += math.prod(value.shape) if is_mtp else 0
        params += 0 if is_mtp else math.prod(value.shape)

    depths = getattr(cfg, "num_mtp_layers", 0) if mtp else 0
    size = buffer_size(max_len + depths + 1, default_prefill_chunk())  # the cache length generate allocates
    cache = jax.eval_shape(lambda: module.init_cache(batch, size))
    axes = type(cache).logical_axes()
    cache_bytes = sum(per_device(c.shape, c.dtype, a) for c, a in zip(jax.tree.leaves(cache), _axes_leaves(axes)))
    cache_shape = " + ".join(f"{list(c.shape)}" for c in jax.tree.leaves(cache))
    mtp_state = 0.0
    if depths:
        mtp_cache = jax.eval_shape(lambda: module.init_mtp_cache(batch, size, depths=depths))
        mtp_state = sum(per_device(c.shape, c.dtype, a) for c, a in zip(jax.tree.leaves(mtp_cache), _axes_leaves(axes)))
        mtp_state += per_device((batch, size, cfg.hidden_size), dtype, ("batch", "seq", "embed"))  # main hidden
    return Plan(label, params, mtp_params, math.prod(mesh.values()), dict(weights), mtp_weights, cache_bytes,
                cache_shape, mtp_state, size)


def _axes_leaves(axes_tree) -> list[tuple[str, ...]]:
    """The logical-axes tuples of a cache's `logical_axes()` in leaf order (each tuple is one leaf's axes)."""
    import jax

    return jax.tree.leaves(axes_tree, is_leaf=lambda x: isinstance(x, tuple))


def report(p: Plan, mesh: dict[str, int], batch: int, max_len: int, hbm: float | None) -> str:
    mesh_text = " ".join(f"{k}={v}" for k, v in mesh.items())
    lines = [f"{p.label}: {p.params / 1e9:.1f}B params + {p.mtp_params / 1e9:.1f}B in MTP layers; mesh {mesh_text} "
             f"({p.devices} devices); batch {batch}, {max_len} positions (cache {p.positions})",
             "per device:"]
    for dtype, size in sorted(p.weights.items()):
        lines.append(f"  weights {dtype:<10} {size / GB:9.2f} GB")
    lines.append(f"    of which MTP layers {p.mtp_weights / GB:6.2f} GB")
    lines.append(f"  KV/latent cache    {p.cache / GB:9.2f} GB   {p.cache_shape}")
    lines.append(f"  MTP drafter state  {p.mtp_state / GB:9.2f} GB")
    lines.append(f"  total              {p.total / GB:9.2f} GB" + (f"   ({p.total / GB / hbm:.0%} of {hbm:g} GB HBM)"
                                                                     if hbm else ""))
    return "\n".join(lines)


def readme_rows(dtype: str) -> list[dict]:
    """The README's slices, planned: one dict of labels and per-chip GB per row."""
    rows = []
    for name, slice_name, mesh_text, batch, max_len in README_ROWS:
        chips, hbm = SLICES[slice_name]
        mesh = parse_mesh(mesh_text)
        assert math.prod(mesh.values()) == chips, (slice_name, mesh_text)
        label, hf = read_config(name)
        p = plan(hf, label, mesh, dtype, batch, max_len, mtp=True)
        rows.append({"model": name, "slice": slice_name, "chips": chips, "hbm_gb": hbm, "mesh": mesh_text,
                     "batch": batch, "positions": max_len, "weights_gb": sum(p.weights.values()) / GB,
                     "cache_gb": p.cache / GB, "mtp_state_gb": p.mtp_state / GB, "total_gb": p.total / GB,
                     "of_hbm": p.total / GB / hbm})
    return rows


def readme_table(dtype: str, rows: list[dict] | None = None) -> str:
    """`readme_rows` as the README's markdown table."""
    lines = ["| model | slice (chips, HBM/chip) | mesh | batch x positions | weights/chip | cache/chip "
             "| MTP state/chip | total/chip | of HBM |", "|---|---|---|---|---:|---:|---:|---:|---:|"]
    for r in readme_rows(dtype) if rows is None else rows:
        lines.append(f"| {r['model']} | {r['slice']} ({r['chips']}, {r['hbm_gb']} GB) | {r['mesh']} | "
                     f"{r['batch']} x {r['positions']} | {r['weights_gb']:.1f} GB | {r['cache_gb']:.2f} GB | "
                     f"{r['mtp_state_gb']:.2f} GB | {r['total_gb']:.1f} GB | {r['of_hbm']:.0%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", help="config.json, a folder with one, or a name in plan_configs.json")
    parser.add_argument("--mesh", default="data=1,model=8,expert=4")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max-len", type=int, default=8192, help="prompt + new tokens per row")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    parser.add_argument("--no-mtp", action="store_true", help="leave out the MTP drafter's state")
    parser.add_argument("--hbm", type=float, default=None, help="GB of memory per device, to print the fraction")
    parser.add_argument("--slices", action="store_true", help="print the README's table of TPU slices")
    args = parser.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")  # shapes only: no accelerator is touched
    dtype = DTYPES[args.dtype]
    if args.slices:
        print(readme_table(dtype))
        return 0
    if args.config is None:
        parser.error("give a CONFIG, or --slices")
    label, hf = read_config(args.config)
    mesh = parse_mesh(args.mesh)
    p = plan(hf, label, mesh, dtype, args.batch, args.max_len, mtp=not args.no_mtp)
    print(report(p, mesh, args.batch, args.max_len, args.hbm))
    return 0


if __name__ == "__main__":
    sys.exit(main())
