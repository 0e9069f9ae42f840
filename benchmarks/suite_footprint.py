"""Wall time and peak resident memory of the default test suite, over all of its processes.

    python benchmarks/suite_footprint.py [PYTEST ARGS...]

Runs `python -m pytest -q` (plus any arguments) and samples the resident memory of the whole process tree every half
second: the suite runs in xdist workers, so the figure that matters is their sum (with the controller's), which
`/usr/bin/time -v` does not give (its "maximum resident set size" is the largest single process). Linux only: it reads
/proc. Prints one table; exits with pytest's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time


def children(pid: int) -> list[int]:
    """Direct child processes of `pid` (threads excluded)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as handle:
                found += [int(child) for child in handle.read().split()]
        except OSError:
            pass
    return found


def resident_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        current = todo.pop()
        pids.append(current)
        todo += children(current)
    return pids


def main(argv: list[str]) -> int:
    start = time.perf_counter()
    process = subprocess.Popen([sys.executable, "-m", "pytest", "-q", *argv])
    peak_total = peak_single = 0.0
    while process.poll() is None:
        sizes = [resident_mb(pid) for pid in tree(process.pid)]
        peak_total, peak_single = max(peak_total, sum(sizes)), max([peak_single, *sizes])
        time.sleep(0.5)
    wall = time.perf_counter() - start
    print(f"\n{'wall time':<36}{wall:8.0f} s\n{'peak resident memory, all processes':<36}{peak_total / 1024:8.2f} GB\n"
          f"{'peak resident memory, one process':<36}{peak_single / 1024:8.2f} GB")
    return process.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
