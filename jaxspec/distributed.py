"""Several processes, one program: jaxspec on JAX's multi-controller runtime (`jax.distributed`).

A TPU pod slice, a GPU cluster, or a few local CPU processes in a test: every process runs the same Python program
with the same arguments and inputs (prompts, seed, sampling settings), and each drives only its own devices. A
mesh spans the devices of every process; an array on it ("global") is built by each process from the slices its own
devices hold, and the same jitted computation runs everywhere, XLA inserting the collectives.

- `initialize(...)` starts the runtime (before anything else touches JAX); with no arguments JAX detects a TPU VM
  slice, SLURM or similar, as `jax.distributed.initialize()` does. On CPU the collectives go through gloo.
- `global_array(host, sharding)` turns a host array that every process holds identically (token ids, lengths)
  into a global array: each process hands over only its devices' slices.
- `array_from_blocks(shape, dtype, sharding, read)` builds a global array from a reader of boxes, reading each
  distinct box of this process's devices once and moving it to its devices at once; this is how checkpoints load
  without any process holding more than its own shards.
- `fetch(tree)` brings every array back to the host of **every** process (a collective: all processes call it, in
  the same order). `jaxspec.generate` returns its outputs through it, so every process gets the full sequences
  and counters, exactly as a single process would.

With one process every function here is the plain single-process operation.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Sharding

Index = tuple[slice, ...]


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: list[int] | None = None,
) -> None:
    """Join the group of processes; call it first, in every process. Missing arguments are detected as
    `jax.distributed.initialize()` detects them (TPU VM slices, SLURM, Kubernetes, MPI); on one machine with CPU
    devices pass all three (e.g. "127.0.0.1:1234", 2, 0 and 1). A second call in the same process does nothing."""
    if jax.distributed.is_initialized():
        return
    # Must be set before the CPU client exists; it touches only CPU devices, so it is harmless on TPU and GPU.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=coordinator_address,
        num_processes=num_processes,
        process_id=process_id,
        local_device_ids=local_device_ids,
    )


def is_multiprocess() -> bool:
    return jax.process_count() > 1


def barrier(name: str) -> None:
    """Every process waits here until all have arrived (a no-op with one process). `name` must match across them."""
    if is_multiprocess():
        multihost_utils.sync_global_devices(name)


def broadcast(value: Any) -> Any:
    """Process 0's `value` (a pytree of arrays or scalars) in every process."""
    if not is_multiprocess():
        return value
    return jax.tree.map(np.asarray, multihost_utils.broadcast_one_to_all(value))


def global_array(host: Any, sharding: Sharding) -> jax.Array:
    """The global array whose value is `host`, laid out by `sharding`. Every process must pass the same value; each
    copies only the slices of its own devices."""
    host = np.asarray(host)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def array_from_blocks(
    shape: tuple[int, ...], dtype, sharding: Sharding, read: Callable[[Index], np.ndarray]
) -> jax.Array:
    """A global array of `shape` whose every box is `read(box)` (a host array of that box's shape and `dtype`).

    Each distinct box of this process's devices is read once (replicas share it) and placed on its devices right
    away, so the host holds at most one box beyond what the devices already hold; no process reads a box that only
    other processes' devices hold.
    """
    by_index: dict[tuple, list] = {}
    for device, index in sharding.addressable_devices_indices_map(shape).items():
        key = tuple((s.start, s.stop) for s in _explicit(index, shape))
        by_index.setdefault(key, []).append(device)
    shards = []
    for key, devices in by_index.items():
        block = np.asarray(read(tuple(slice(a, b) for a, b in key)), dtype)
        expected = tuple(b - a for a, b in key)
        if block.shape != expected:
            raise ValueError(f"read returned a block of shape {block.shape} for the box {key}, expected {expected}")
        shards += [jax.device_put(block, device) for device in devices]
        del block
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _explicit(index: Index, shape: tuple[int, ...]) -> Index:
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape))


def fetch(tree: Any) -> Any:
    """Every array leaf of `tree` as a host numpy array holding its full value, in every process.

    An array that spans processes is gathered with `process_allgather`, a collective: every process must call
    `fetch` on the same arrays in the same order. Arrays a process holds entirely are read directly.
    """

    def one(x):
        if isinstance(x, jax.Array) and not x.is_fully_addressable:
            return np.asarray(multihost_utils.process_allgather(x, tiled=True))
        return jax.device_get(x)

    return jax.tree.map(one, tree)
