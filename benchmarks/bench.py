"""jaxspec against transformers on CPU, side by side in one run: a markdown table of tokens/s and their ratios.

    python benchmarks/bench.py [--models smollm2-135m,random-500m]
        [--strategies greedy,speculative,speculative-self,prompt_lookup,early_exit,universal,
                      speculative-int8,universal-int8,mtp,dflash,eagle3]
        [--universal-assistant smollm2-135m]
        [--max-new-tokens 64] [--repeats 3] [--threads T] [--out bench_out/] [--skip-hf]
        [--prompts code_completion,code_editing,chat,summary]
        [--num-assistant-tokens K] [--confidence-threshold C] [--schedule constant]
        [--prompt-lookup-num-tokens 10] [--early-exit E] [--bandwidth-mb 1024] [--results benchmarks/results]

Models: any catalogue name (`jaxspec.catalog`; transformers loads the same GGUF file, dequantized to float32), or
`random-500m` / `random-tiny`: random Llama configs built by transformers with a fixed seed, saved with
`save_pretrained` and loaded from that folder by both libraries. Random models draft with a half-depth random
assistant of the same vocabulary; `speculative-self` drafts with the target itself (every draft accepted: the
ceiling of speculative decoding). `universal` drafts with `--universal-assistant`, a catalogue model with another
tokenizer (SmolLM2-135M for a Qwen target): jaxspec maps the vocabularies in its loop, transformers runs its
universal assisted decoding with the same two tokenizers. `speculative-int8` and `universal-int8` run the same
assistants with int8 weights and activations (`jaxspec.quantize`), jaxspec only, and so is `mtp`: the target's own
MTP layers draft (`use_mtp=True`; for a catalogue model, the trained set jaxspec ships for it), and `dflash`: the DFlash
drafter jaxspec ships for a catalogue model (`--strategy dflash`), and `eagle3`: the EAGLE-3 head it ships (K=4). Batch 1 and float32
everywhere else; greedy decoding, so every strategy must give the plain greedy tokens. Besides the table over all
prompts, a second table gives each strategy's speedup over its own library's greedy per prompt.

Timing: each (library, model, strategy) runs the prompt set once untimed (jaxspec compiles there, reported in its
own column), then `--repeats` (at least 3) timed passes; tokens/s is new tokens over the summed per-call seconds of a
pass, and the table shows the median over passes with the range (min-max) beside it. Both libraries are timed the
same way: the wall time of the whole `generate` call, host work included (jaxspec's executables are compiled by then
and come from its cache). Both libraries hold the model at once, and a timed pass takes the prompts in turn and
runs every (library, strategy) on a prompt back to back. So a change of load on the machine lands on a strategy and
its greedy baseline alike, and a speedup over greedy is the median over passes of a paired ratio (the strategy's
calls over greedy's calls of the same pass), not a ratio of two medians taken minutes apart.
Peak memory is therefore both libraries' float32 weights (random-500m with its assistant: about 7 GB).

Roofline: decoding one token reads every weight once, so the best possible greedy rate is (read bandwidth) / (weight
bytes). The read bandwidth is measured read-only, the way decoding reads: a jitted float32 matrix-vector product over
a `--bandwidth-mb` matrix, best of several runs.

Draft schedules: jaxspec runs its default ("adaptive") unless `--schedule` says otherwise; transformers has no adaptive
schedule and runs "constant" then (its default).

Threads: both libraries get the same CPU cores. The process is pinned to the first T cores of its affinity mask
before jax or torch is imported: XLA's CPU client sizes its thread pool from that mask. The often-quoted
`XLA_FLAGS=... intra_op_parallelism_threads=T` is not an XLA flag: jax 0.10 ignores it without dashes and aborts
on `--intra_op_parallelism_threads` as unknown, so it is not set. torch gets `torch.set_num_threads(T)`.

Outputs: the table on stdout and in `{out}/bench.md`, every raw figure in `{out}/bench.json`, a bar chart
`{out}/bench.png` when matplotlib is installed, and the run's record in `{results}/` (benchmarks/_record.py: every
figure of the tables with the command, commit, machine and bandwidth), which benchmarks/render.py turns into
docs/benchmarks.md and the README's summary.

The harness: this file is the command (options, one model after another); _bench_plans.py the models, the
strategies' plans and jaxspec's calls; _bench_hf.py the transformers baseline (all that imports torch's models);
_bench_timing.py the paired passes, medians and ranges; _bench_report.py the tables, chart and record rows. Run it as
`python benchmarks/bench.py`: Python puts the script's folder first on sys.path, which is how these siblings import.
"""


from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import os
import sys
import tempfile
from typing import Any

import numpy as np

# Siblings in benchmarks/ (on sys.path as the script's own folder). `Call`, `measure_all` and `paired_speedup` are
# also this module's names for the harness's tests.
from _bench_hf import HFTally, hf_call, load_hf, quiet_transformers, set_torch_threads
from _bench_plans import (DFLASH, EAGLE3, INT8, MTP, RANDOM_COMMON, RANDOM_MODELS, STRATEGIES, UNIVERSAL_ASSISTANT,
                          DraftSettings, ModelSource, Plan, draft_settings, encode_prompts, jaxspec_call, jaxspec_only, plan_for,
                          prompt_tokenizer, resolve_source, weight_bytes_per_token)
from _bench_prompts import PROMPTS
from _bench_report import (PromptRow, Roofline, Row, build_rows, chart, environment, losslessness_notes, markdown,
                           measurement_record, per_prompt_rows, record_rows, roofline)
from _bench_timing import (Call, Measurement, contention_note, cpu_snapshot, measure_all, measure_read_bandwidth,
                           other_processes_cores, paired_speedup, pin_threads)
from _record import Record, add_results_argument, plain

# jax, torch, transformers and jaxspec are imported inside functions, never at module level: the thread setting
# (CPU affinity, environment) must be in place before either runtime starts its thread pools.

__all__ = ["Call", "Measurement", "bench_model", "main", "measure_all", "paired_speedup", "parse_args"]


@dataclasses.dataclass
class ModelRun:
    """Everything measured on one model."""

    plans: dict[str, Plan]
    jaxspec: dict[str, Measurement]
    hf: dict[str, Measurement]
    prompts: dict[str, np.ndarray]
    eos: list[int]
    pad: int
    parameters: int
    bytes_per_token: int


def bench_model(source: ModelSource, args, settings: DraftSettings, notes: list[str]) -> ModelRun:
    """Load the model (and assistant) in both libraries, then measure every applicable strategy."""
    import jaxspec

    plans = {}
    for strategy in args.strategies:
        plan = plan_for(strategy, source, settings)
        if isinstance(plan, str):
            notes.append(f"{source.name}: {strategy} skipped: {plan}")
        else:
            plans[strategy] = plan
    paths = {"assistant": source.assistant_path, "universal": source.universal_path, MTP: source.mtp_path,
             DFLASH: source.dflash_path, EAGLE3: source.eagle3_path}
    quantized = {p.drafter for p in plans.values() if p.drafter and p.drafter.endswith(INT8)}
    drafters = ({p.drafter for p in plans.values()} | {kind[: -len(INT8)] for kind in quantized}) & set(paths)

    target = jaxspec.load(source.path, dtype="float32")  # explicit: the default is bfloat16 on accelerators
    # "mtp": the target again, loaded by its catalogue name, which attaches the MTP layers jaxspec ships for it.
    assistants = {kind: jaxspec.load(paths[kind], dtype="float32") for kind in drafters}
    assistants |= {kind: jaxspec.quantize(assistants[kind[: -len(INT8)]], "int8") for kind in quantized}
    prompts = encode_prompts(prompt_tokenizer(source, target), target.config.vocab_size, args.prompts)
    eos = list(target.eos_token_ids())
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else (eos[0] if eos else 0)
    parameters, nbytes = weight_bytes_per_token(target.module)
    calls = {("jaxspec", s): jaxspec_call(p, target, assistants, eos, pad, args.max_new_tokens)
             for s, p in plans.items()}
    if not args.skip_hf:
        # Both libraries stay loaded so that the timed passes can alternate between them.
        hf_target = load_hf(source.path)
        hf_assistants = {kind: load_hf(paths[kind]) for kind in drafters if kind not in (MTP, DFLASH, EAGLE3)}
        tally = HFTally(hf_target)
        # transformers' universal run gets the same tokenizers jaxspec built from the GGUF files.
        tokenizers = (target.tokenizer, assistants["universal"].tokenizer) if "universal" in drafters else None
        calls |= {("transformers", s): hf_call(p, hf_target, hf_assistants, tally, eos, pad, args.max_new_tokens,
                                               tokenizers)
                  for s, p in plans.items() if not jaxspec_only(s)}
    results = measure_all(source.name, calls, prompts, args.repeats)
    return ModelRun(
        plans=plans,
        jaxspec={s: m for (lib, s), m in results.items() if lib == "jaxspec"},
        hf={s: m for (lib, s), m in results.items() if lib == "transformers"},
        prompts=prompts, eos=eos, pad=pad, parameters=parameters, bytes_per_token=nbytes,
    )


# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,random-500m",
                        help=f"catalogue names and/or {', '.join(RANDOM_MODELS)} "
                             "(add -prefix for an exact cheap assistant)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=", ".join(STRATEGIES))
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=", ".join(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (>= 3); median and range reported")
    parser.add_argument("--threads", type=int, default=None, help="CPU cores for both libraries (default: all)")
    parser.add_argument("--out", default="bench_out", help="folder of bench.md, bench.json (raw) and bench.png")
    parser.add_argument("--skip-hf", action="store_true", help="jaxspec only")
    parser.add_argument("--num-assistant-tokens", type=int, default=4)
    parser.add_argument("--schedule", default="adaptive",
                        choices=("adaptive", "constant", "heuristic", "heuristic_transient"),
                        help="jaxspec's draft schedule (transformers runs constant where this is adaptive)")
    parser.add_argument("--confidence-threshold", type=float, default=None,
                        help="assistant_confidence_threshold (default 0.4; 0 = off for random models)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--universal-assistant", default=UNIVERSAL_ASSISTANT,
                        help="catalogue model with another tokenizer, the drafter of `universal`")
    parser.add_argument("--early-exit", type=int, default=None, help="draft layers (default: num_layers // 2)")
    parser.add_argument("--bandwidth-mb", type=int, default=1024, help="matrix size of the bandwidth measurement")
    add_results_argument(parser)
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.prompts = [p for p in args.prompts.split(",") if p]
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: one pass says nothing about the noise")
    for s in args.strategies:
        if s not in STRATEGIES:
            parser.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    for p in args.prompts:
        if p not in PROMPTS:
            parser.error(f"unknown prompt {p!r}; choose from {', '.join(PROMPTS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    record = Record("bench", __file__, argv, args.results)
    cores = pin_threads(args.threads)
    set_torch_threads(len(cores))
    quiet_transformers()
    os.makedirs(args.out, exist_ok=True)
    bandwidth = measure_read_bandwidth(args.bandwidth_mb)
    env = environment(cores, bandwidth)
    notes: list[str] = []
    if args.schedule == "adaptive":
        notes.append("jaxspec's adaptive schedule drafts fewer tokens after misses and stops drafting while a row "
                     "keeps missing; transformers has no such schedule and drafts K every round (constant)")
    elif args.schedule != "constant":
        notes.append(f"{args.schedule} schedule: jaxspec grows the draft length up to its static buffer "
                     "(max_assistant_tokens, by default 16); transformers grows it without a cap")
    if "speculative" in args.strategies and not args.skip_hf and importlib.util.find_spec("sklearn") is not None:
        # transformers' AssistedCandidateGenerator re-fits the threshold from a ROC curve when sklearn imports.
        notes.append("scikit-learn is installed: transformers re-tunes assistant_confidence_threshold during "
                     "speculative decoding with a separate assistant; jaxspec keeps the given value")
    start = cpu_snapshot()
    header = [
        f"# jaxspec vs transformers, CPU, float32, batch 1, greedy, max_new_tokens={args.max_new_tokens}, "
        f"median of {args.repeats}",
        "",
        f"{len(cores)} thread{'s' if len(cores) > 1 else ''} (cores {cores}); jax {env['jax']}, "
        f"transformers {env['transformers']}, "
        f"torch {env['torch']}; prompts: {', '.join(args.prompts)}. Read bandwidth {bandwidth:.1f} GB/s.",
    ]
    rows: list[Row] = []
    per_prompt: list[PromptRow] = []
    rooflines: list[Roofline] = []
    models: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jaxspec-bench-") as workdir:
        for name in args.models:
            print(f"{name}:", file=sys.stderr)
            try:
                source = resolve_source(name, workdir, args.universal_assistant)
            except (FileNotFoundError, KeyError, ValueError) as error:
                notes.append(f"{name}: skipped: {error}")
                continue
            settings = draft_settings(args, source)
            run = bench_model(source, args, settings, notes)
            rows += build_rows(name, run.jaxspec, run.hf, run.plans)
            per_prompt += per_prompt_rows(name, run.jaxspec, run.hf)
            notes += losslessness_notes(name, run.jaxspec, run.hf)
            rooflines.append(roofline(name, run.parameters, run.bytes_per_token, run.jaxspec, run.hf, bandwidth))
            models.append({
                "model": name, "path": source.path, "assistant_path": source.assistant_path,
                "random_config": RANDOM_COMMON | RANDOM_MODELS[name] if name in RANDOM_MODELS else None,
                "settings": dataclasses.asdict(settings), "eos_token_id": run.eos, "pad_token_id": run.pad,
                "prompt_lengths": {p: len(ids) for p, ids in run.prompts.items()},
                "measurements": [measurement_record(m) for m in [*run.jaxspec.values(), *run.hf.values()]],
            })
            gc.collect()  # free this model's weights (module graphs hold reference cycles) before the next loads

    env["other_processes_cores"] = other_processes_cores(start, cpu_snapshot())
    notes += [n for n in [contention_note(env["other_processes_cores"])] if n]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if not has_matplotlib:
        notes.append("matplotlib is not installed: no chart written")
    report = markdown(rows, rooflines, header, notes, per_prompt, args.prompts)
    print(report)
    with open(os.path.join(args.out, "bench.md"), "w", encoding="utf-8") as handle:
        handle.write(report)
    with open(os.path.join(args.out, "bench.json"), "w", encoding="utf-8") as handle:
        json.dump(plain({"environment": env, "arguments": vars(args), "rows": [dataclasses.asdict(r) for r in rows],
                         "rooflines": [dataclasses.asdict(r) for r in rooflines], "models": models,
                         "notes": notes}), handle, indent=1)
    record.write(record_rows(rows, per_prompt, rooflines), [m["model"] for m in models], bandwidth_gb_s=bandwidth,
                 notes=notes, cores=cores, prompts=args.prompts,
                 settings={m["model"]: m["settings"] for m in models},
                 software={k: env[k] for k in ("jax", "flax", "transformers", "torch", "xla_flags")}
                 | {"torch_threads": env["torch_threads"], "other_processes_cores": env["other_processes_cores"]},
                 title=header[0].lstrip("# "))
    if has_matplotlib:  # last, so that a plotting failure cannot cost the figures
        chart(rows, os.path.join(args.out, "bench.png"))


if __name__ == "__main__":
    main()
