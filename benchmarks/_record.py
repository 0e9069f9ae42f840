"""The JSON record every benchmark writes beside its printed table: results are data, the docs render them.

A record is one run of one benchmark:

    {"benchmark": "bench", "command": ["python", "benchmarks/bench.py", "--models", "smollm2-135m", ...],
     "commit": "<git rev-parse HEAD>[+dirty]", "date": "<UTC ISO 8601>", "models": ["smollm2-135m"],
     "machine": {"platform", "python", "cpu_count", "cores" (this process's affinity), "load_average" ({"start",
                 "end"}: os.getloadavg() when the run began and ended), "jax", "jax_backend", "jax_devices"},
     "bandwidth_gb_s": <measured read bandwidth, or null where the benchmark does not measure it>,
     "rows": [{"table": ..., "model": ..., <every figure of the printed tables, with its labels>}, ...],
     "notes": [...], "title": <the printed heading>, ...<the benchmark's own fields, e.g. "settings", "mode">}

`benchmarks/render.py` turns the newest record per (benchmark, model) into docs/benchmarks.md and the README's
summary. Records go to `benchmarks/results/` by default (`--results DIR` elsewhere), one file per run, named
`{benchmark}-{models}-{UTC time}.json`, so runs never overwrite each other and the folder's history is the results'.

Benchmarks import this module as a sibling (`from _record import Record`): run them as `python benchmarks/NAME.py`,
which puts benchmarks/ first on sys.path.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import subprocess
import sys
from typing import Any, Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")


def add_results_argument(parser) -> None:
    """`--results DIR`: where the JSON record goes (every benchmark takes it)."""
    parser.add_argument("--results", default=RESULTS,
                        help="folder of the JSON record of this run (default: benchmarks/results)")


def commit() -> str | None:
    """`git rev-parse HEAD` of the checkout, with "+dirty" when the tree has uncommitted changes; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return head.stdout.strip() + ("+dirty" if status.stdout.strip() else "")


def command(script: str, argv: Sequence[str] | None) -> list[str]:
    """The command that reproduces this run from the repository root: `python benchmarks/NAME.py ARGS`.

    `argv` is what main() was given (None: the process's own arguments, as a command line gives them)."""
    args = list(sys.argv[1:] if argv is None else argv)
    return ["python", os.path.relpath(os.path.abspath(script), REPO), *args]


def machine(cores: Sequence[int] | None = None) -> dict[str, Any]:
    """Where the figures were taken. jax is imported here, so call this after a benchmark has set its threads."""
    import jax

    return {
        "platform": platform.platform(), "processor": _cpu_model(), "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cores": list(cores) if cores is not None else sorted(os.sched_getaffinity(0)),
        "jax": jax.__version__, "jax_backend": jax.default_backend(),
        "jax_devices": [str(d) for d in jax.devices()],
    }


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def plain(value):
    """Strict JSON: NaN and inf (a figure that does not apply) become null; numpy scalars and tuples plain."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist") and not isinstance(value, (str, bytes)):  # numpy scalars and arrays
        return plain(value.tolist())
    if isinstance(value, float):
        return None if math.isnan(value) or math.isinf(value) else value
    return value


class Record:
    """Start one at the beginning of a run (it notes the load average then), `write` it at the end."""

    def __init__(self, benchmark: str, script: str, argv: Sequence[str] | None, results: str):
        self.benchmark = benchmark
        self.command = command(script, argv)
        self.results = results
        self.load_start = list(os.getloadavg())
        self.started = datetime.datetime.now(datetime.timezone.utc)

    def write(self, rows: list[dict[str, Any]], models: Sequence[str], *, bandwidth_gb_s: float | None = None,
              notes: Sequence[str] = (), cores: Sequence[int] | None = None, **extra: Any) -> str:
        """Write the record; returns its path. `extra`: more top-level fields (e.g. a benchmark's settings)."""
        info = machine(cores) | {"load_average": {"start": self.load_start, "end": list(os.getloadavg())}}
        record = {
            "benchmark": self.benchmark, "command": self.command, "commit": commit(),
            "date": self.started.isoformat(timespec="seconds"), "models": list(models), "machine": info,
            "bandwidth_gb_s": bandwidth_gb_s, "rows": rows, "notes": list(notes),
        } | extra
        os.makedirs(self.results, exist_ok=True)
        stamp = self.started.strftime("%Y%m%dT%H%M%SZ")
        name = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{self.benchmark}-{'+'.join(models) or 'none'}")[:120]
        path = os.path.join(self.results, f"{name}-{stamp}.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(plain(record), handle, indent=1, allow_nan=False)
            handle.write("\n")
        shown = os.path.relpath(path)
        print(f"record: {path if shown.startswith(os.pardir) else shown}", file=sys.stderr)
        return path
