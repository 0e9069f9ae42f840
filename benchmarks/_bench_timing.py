"""The timing half of benchmarks/bench.py: threads, read bandwidth, paired passes, medians and ranges.

A `Call` is one generate() call on one prompt; `measure_all` runs every (library, strategy) on a prompt back to back
in each timed pass, and a `Measurement` holds the passes of one (library, model, strategy): tokens/s is the median
over passes, the range beside it the min-max, and a speedup over greedy is the median of per-pass paired ratios.
Nothing here imports jax or torch at module level: the thread setting must come first.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics
import sys
import time
from typing import Callable

import numpy as np


@dataclasses.dataclass
class Call:
    """One generate() call on one prompt."""

    prompt: str
    tokens: list[int]  # the new tokens
    seconds: float  # timed seconds (jaxspec: decode only)
    compile_seconds: float
    target_forwards: int
    rounds: int  # verification rounds
    round_tokens: int  # tokens committed by those rounds
    drafted: int
    accepted: int


@dataclasses.dataclass
class Measurement:
    """One library x model x strategy over the prompt set: the untimed pass and every timed pass."""

    library: str
    model: str
    strategy: str
    warmup: list[Call]
    passes: list[list[Call]]

    @property
    def new_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.passes[0])

    @property
    def per_pass(self) -> list[float]:
        return [self.new_tokens / sum(c.seconds for c in calls) for calls in self.passes]

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(self.per_pass)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.per_pass), max(self.per_pass)

    @property
    def compile_seconds(self) -> float:
        return sum(c.compile_seconds for c in self.warmup + [c for p in self.passes for c in p])

    def total(self, field: str) -> int:
        """A counter summed over the prompts of the first timed pass (greedy: every pass counts the same)."""
        return sum(getattr(c, field) for c in self.passes[0])

    @property
    def acceptance_rate(self) -> float:
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else math.nan

    @property
    def mean_accepted_length(self) -> float:
        rounds = self.total("rounds")
        return self.total("round_tokens") / rounds if rounds else math.nan

    def speedups_over(self, base: "Measurement", prompt: str | None = None) -> list[float]:
        """This strategy's tokens/s over `base`'s (the same library's greedy), pass by pass: in pass r, the calls
        of both on a prompt ran back to back (see measure_all), so each ratio compares neighbours in time and a
        slow stretch of the machine cancels out of it. `prompt`: that prompt only; else the whole pass."""
        def rate(calls: list[Call]) -> float:
            chosen = [c for c in calls if prompt is None or c.prompt == prompt]
            return sum(len(c.tokens) for c in chosen) / sum(c.seconds for c in chosen)

        return [rate(mine) / rate(theirs) for mine, theirs in zip(self.passes, base.passes)]

    def acceptance_by_prompt(self) -> dict[str, float]:
        return {c.prompt: c.accepted / c.drafted if c.drafted else math.nan for c in self.passes[0]}

    def tokens_by_prompt(self) -> dict[str, list[int]]:
        return {c.prompt: c.tokens for c in self.passes[0]}


CallFn = Callable[[str, np.ndarray], Call]


def measure_all(model: str, calls: dict[tuple[str, str], CallFn], prompts: dict[str, np.ndarray],
                repeats: int) -> dict[tuple[str, str], Measurement]:
    """One untimed pass of every (library, strategy) over the prompts (jaxspec compiles there), then `repeats`
    timed passes. A pass takes the prompts in turn and runs every (library, strategy) on a prompt back to back, so
    a strategy's call and its greedy baseline's on the same prompt are seconds apart: a load change on a shared
    machine lands on both (the paired ratios of `Measurement.speedups_over` cancel it) instead of on whichever
    strategy ran during it."""
    print(f"  untimed pass (jaxspec compiles) over {len(calls)} library x strategy pairs", file=sys.stderr)
    warmups = {key: [call(name, ids) for name, ids in prompts.items()] for key, call in calls.items()}
    passes: dict[tuple[str, str], list[list[Call]]] = {key: [] for key in calls}
    for repeat in range(repeats):
        print(f"  timed pass {repeat + 1}/{repeats}", file=sys.stderr)
        for key in calls:
            passes[key].append([])
        for name, ids in prompts.items():
            for key, call in calls.items():
                passes[key][-1].append(call(name, ids))
    results = {key: Measurement(key[0], model, key[1], warmups[key], passes[key]) for key in calls}
    for (library, strategy), m in results.items():
        print(f"  {library:12s} {strategy:16s} {m.tokens_per_second:8.2f} tok/s", file=sys.stderr)
    return results


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan


def paired_speedup(m: Measurement | None, greedy: Measurement | None, prompt: str | None = None) -> float:
    """The median over passes of the paired speedup over greedy (nan without either)."""
    return statistics.median(m.speedups_over(greedy, prompt)) if m and greedy else math.nan


# ------------------------------------------------------------------------------------------------------------------
# Threads, bandwidth and the machine's load


def pin_threads(threads: int | None) -> list[int]:
    """Restrict this process to `threads` cores (XLA sizes its pool from the affinity mask) and tell OpenMP; torch
    gets the same count from `_bench_hf.set_torch_threads`."""
    available = sorted(os.sched_getaffinity(0))
    threads = threads or len(available)
    if threads > len(available):
        print(f"note: --threads {threads} > {len(available)} cores available; using {len(available)}", file=sys.stderr)
        threads = len(available)
    cores = available[:threads]
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # The default, stated so the run records it: Eigen (XLA's CPU matmuls) uses the whole pool.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=true").strip()
    return cores


def measure_read_bandwidth(megabytes: int, trials: int = 7) -> float:
    """GB/s at which XLA reads a float32 matrix in a matrix-vector product: what decoding does with every weight.

    Read-only (the vector and the result are tiny), on the same threads the decode loop uses. Best of `trials`.
    """
    import jax
    import jax.numpy as jnp

    columns = 4096
    matrix = jnp.ones((megabytes * 2**20 // 4 // columns, columns), jnp.float32)
    vector = jnp.ones((columns,), jnp.float32)
    matvec = jax.jit(lambda m, v: m @ v)
    jax.block_until_ready(matvec(matrix, vector))
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(matvec(matrix, vector))
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best / 1e9


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds busy on the whole machine, CPU seconds of this process); None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(x) for x in handle.readline().split()[1:9]]  # user .. steal, in clock ticks
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    own = os.times()
    return time.perf_counter(), (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def other_processes_cores(start, end) -> float | None:
    """Cores that other processes kept busy on average between two snapshots: the noise in every timing here."""
    if start is None or end is None:
        return None
    wall, busy, own = (b - a for a, b in zip(start, end))
    return max(0.0, (busy - own) / wall)


def contention_note(cores_used_by_others: float | None) -> str | None:
    if cores_used_by_others is None or cores_used_by_others < 0.2:
        return None
    return (f"other processes kept {cores_used_by_others:.1f} of the machine's {os.cpu_count()} cores busy on average "
            "during this run: the timings are noisy; rerun on an idle machine")

