"""The run-time control flow of each strategy's compiled rounds loop: how many while loops and conditionals it holds,
in each way `jaxspec.inplace` can run a branch (JAXSPEC_BRANCHES: `inplace`, a while loop of zero or one trip per
branch; `lax`, one XLA conditional).

    python benchmarks/count_branches.py [--model smollm2-135m] [--strategies greedy,prompt_lookup,mtp]

On a GPU, XLA records conditionals into CUDA graphs that branch on the device, while a data-dependent while loop it
cannot record reads its predicate back to the host on every trip; an H200 nevertheless timed the two ways alike
(docs/design.md, 'On a GPU'), and on a CPU both cost little. The counts are static: a round runs the loops and
conditionals of the branches it takes, not all of them. Fusions are XLA's kernels, counted the same way. Each loop
is compiled once per mode here (on whatever backend jax has), with the schedule's prices left unmeasured
(JAXSPEC_STEP_COSTS=default), so the counts need no timing.
"""

from __future__ import annotations

import argparse
import os
import re

CASES = {"greedy": {}, "prompt_lookup": {"prompt_lookup_num_tokens": 10}, "early_exit": {"assistant_early_exit": None},
         "mtp": {"use_mtp": True}, "dflash": {"assistant_model": "smollm2-135m-dflash"},
         "eagle3": {"assistant_model": "smollm2-135m-eagle3"}}


def counts(hlo: str) -> dict[str, int]:
    """Static counts of control flow and kernels in optimized HLO text."""
    return {name: len(re.findall(rf" {name}\(", hlo)) for name in ("while", "conditional", "fusion")}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--strategies", default=",".join(CASES),
                   help=f"comma-separated, of {', '.join(CASES)} (drafters: the ones shipped for SmolLM2)")
    args = p.parse_args(argv)
    strategies = [s for s in args.strategies.split(",") if s]
    if unknown := set(strategies) - set(CASES):
        p.error(f"unknown strategies {sorted(unknown)}; choose from {', '.join(CASES)}")
    os.environ.setdefault("JAXSPEC_STEP_COSTS", "default")

    import jaxspec
    from jaxspec import inplace, loop

    target = jaxspec.load(args.model)
    print("| strategy | mode | while loops | conditionals | fusions |\n|---|---|---:|---:|---:|")
    for strategy in strategies:
        kwargs = {key: jaxspec.load(value) if key == "assistant_model" else value
                  for key, value in CASES[strategy].items()}
        if "assistant_early_exit" in kwargs:  # the first half of the layers drafts, as device_check's case does
            kwargs["assistant_early_exit"] = max(1, target.config.num_layers // 2)
        for mode in inplace.MODES:
            inplace.MODE = mode  # read when a loop is traced; the loops of the other mode are dropped first
            loop._compiled.clear()
            jaxspec.generate(target, [[5, 6, 7, 8]], max_new_tokens=4, eos_token_id=[], **kwargs)
            (hlo,) = [compiled.as_text() for compiled in loop.compiled("rounds")]
            found = counts(hlo)
            print(f"| {strategy} | {mode} | {found['while']} | {found['conditional']} | {found['fusion']} |",
                  flush=True)


if __name__ == "__main__":
    main()
