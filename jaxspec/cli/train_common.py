"""What the training command lines (`jaxspec-train-mtp`, `jaxspec-train-dflash`, `jaxspec-train-eagle3`) share: the
data and run flags and their checks, loading a tapped drafter's target, the data cache's folder, building (or
reading back) a tapped corpus, timing the target's generation on this machine for the time estimate, and the summary
a finished run writes and prints."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

# Prompts take about this many of a generated row's positions; the rest are generated one token per step.
TYPICAL_PROMPT_LEN = 40


def run_workdir(args: argparse.Namespace, kind: str) -> str:
    """Where a training run of `kind` ("mtp", "dflash", "eagle3") keeps its data and checkpoints: --workdir, else
    the model's default (`workdir_path`); created if missing."""
    workdir = args.workdir or workdir_path(args.model, kind)
    os.makedirs(workdir, exist_ok=True)
    return workdir


def workdir_path(model: str, kind: str) -> str:
    """The default workdir of a training run of `kind` for `model` (a catalogue name or a folder), not created:
    `run_workdir` creates it; a trainer also looks here for another trainer's cached data."""
    from jaxspec import catalog

    return os.path.join(catalog.cache_root(), "train", f"{os.path.basename(os.path.normpath(model))}-{kind}")


def add_data_flags(p: argparse.ArgumentParser, *, stdlib_windows: int, heldout_prompts: int = 64) -> None:
    """The flags of the data recipe: prompts the target answers, held-out prompts, standard-library windows."""
    p = p.add_argument_group("data (built once, cached in the workdir by its recipe)")
    p.add_argument("--train-prompts", type=int, default=2560, help="training prompts the target answers")
    p.add_argument("--heldout-prompts", type=int, default=heldout_prompts, help="held-out prompts (never trained on)")
    p.add_argument("--stdlib-share", type=float, default=0.5,
                   help="share of the prompts made from standard-library code (the rest: instructions and free text)")
    p.add_argument("--stdlib-windows", type=int, default=stdlib_windows, help="windows of standard-library source")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--max-prompt-len", type=int, default=160)
    p.add_argument("--gen-batch-size", type=int, default=32)


def check_data_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`p.error` (exit 2) on a data flag no recipe can use."""
    check_at_least_one(p, args, ("train_prompts", "heldout_prompts", "gen_batch_size"))
    if args.stdlib_windows < 0:
        p.error("--stdlib-windows must be >= 0")
    if not 0.0 <= args.stdlib_share <= 1.0:
        p.error("--stdlib-share must be between 0 and 1")
    if not 0 < args.max_prompt_len < args.seq_len:
        p.error("--max-prompt-len must be between 1 and --seq-len - 1 (generations need room)")


def add_run_flags(p: argparse.ArgumentParser, kind: str, *, steps: int, batch_size: int, lr: float, eval_every: int,
                  batch_help: str = "rows per train step") -> None:
    """The flags of a training run that every trainer has: its length and optimiser, how often it evaluates and
    checkpoints, where it keeps its work (`kind`: "mtp", "dflash" or "eagle3", the default workdir's suffix), and
    stopping early or before any work. The defaults that differ between trainers are arguments."""
    p = p.add_argument_group("the run (rerunning the same command resumes from the last checkpoint)")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch-size", type=int, default=batch_size, help=batch_help)
    p.add_argument("--lr", type=float, default=lr, help="peak learning rate (AdamW, warmup then cosine decay)")
    p.add_argument("--warmup", type=int, default=50, help="warmup steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=eval_every, help="held-out acceptance every this many steps")
    p.add_argument("--checkpoint-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workdir", default=None, help=f"data cache, checkpoints and plot (default: "
                   f"$JAXSPEC_CACHE/train/<model>-{kind}, i.e. ~/.cache/jaxspec/train/...)")
    p.add_argument("--stop-after", type=int, default=None, help="stop at this step (rerun to resume)")
    p.add_argument("--estimate-only", action="store_true",
                   help="print the estimate (time; memory for a tapped corpus) and exit")


def check_run_flags(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """`p.error` (exit 2) on a run flag no training run can use."""
    check_at_least_one(p, args, ("steps", "batch_size", "eval_every", "checkpoint_every"))
    if not args.lr > 0:
        p.error("--lr must be positive")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.weight_decay < 0:
        p.error("--weight-decay must be >= 0")
    if args.stop_after is not None and args.stop_after < 1:
        p.error("--stop-after must be >= 1 (a step of the run)")


def check_at_least_one(p: argparse.ArgumentParser, args: argparse.Namespace, names) -> None:
    """`p.error` naming the first of the integer flags `names` (attribute names) that is below 1."""
    for name in names:
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")


def parse_target_layers(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--target-layers, comma-separated integers, as a tuple in place (None stays None)."""
    if args.target_layers is None:
        return
    try:
        args.target_layers = tuple(int(x) for x in args.target_layers.split(","))
    except ValueError:
        p.error(f"--target-layers must be comma-separated integers, got {args.target_layers!r}")


def load_tapped_target(name: str):
    """The target a tapped drafter (DFlash, EAGLE-3) trains for, without MTP layers (a catalogue model has them),
    or None after saying why on stderr: the prompts need a tokenizer."""
    import jaxspec
    from jaxspec.assets import strip_mtp

    model = strip_mtp(jaxspec.load(name, progress=True))
    if model.tokenizer is None:
        print(f"{name} has no tokenizer; the prompts need one.", file=sys.stderr)
        return None
    return model


def data_recipe(args: argparse.Namespace, model, **extra: Any) -> dict[str, Any]:
    """What a cached corpus was built from: the data flags, the target, this Python (its standard library is data)
    and the target's dtype, plus `extra`."""
    recipe = {key: getattr(args, key) for key in ("train_prompts", "heldout_prompts", "stdlib_share",
                                                  "stdlib_windows", "seq_len", "max_prompt_len", "seed")}
    return recipe | {"model": model.source, "python": sys.version.split()[0], "dtype": str(model.dtype)} | extra


def data_folder(workdir: str, recipe: dict[str, Any]) -> str:
    """WORKDIR/data-<hash of the recipe>: a changed recipe builds (and caches) its own data."""
    digest = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:12]
    return os.path.join(workdir, "data-" + digest)


def timed(run: Callable[[], Any]) -> float:
    """Seconds `run()` takes once compiled: it runs twice, the first time to compile."""
    import jax

    jax.block_until_ready(run())
    start = time.perf_counter()
    jax.block_until_ready(run())
    return time.perf_counter() - start


def generation_step_seconds(module, batch_size: int, seq_len: int) -> float:
    """Seconds per generated position of a batch of `batch_size` greedy generations (a short buffer: each step costs
    about the same as at full length)."""
    import numpy as np

    from jaxspec.train import data

    prompts = [list(np.random.default_rng(0).integers(0, module.cfg.vocab_size, 8)) for _ in range(batch_size)]
    short = min(seq_len, 40)
    return timed(lambda: data.greedy_generations(module, prompts, short, batch_size, eos_ids=()).tokens) / (short - 8)


def generation_seconds(args: argparse.Namespace, step_seconds: float) -> float:
    """Seconds to generate the training and held-out answers, at `step_seconds` per generated position of a batch."""
    batches = -(-(args.train_prompts + args.heldout_prompts) // args.gen_batch_size)
    prompt = min(TYPICAL_PROMPT_LEN, args.max_prompt_len // 2)
    return batches * (args.seq_len - prompt) * step_seconds


def tapped_corpus_gigabytes(args: argparse.Namespace, model, layer_ids) -> float:
    """The most a tapped corpus of this recipe can take (every row at --seq-len), for the plan a trainer prints."""
    from jaxspec.train import dflash_data

    rows = args.train_prompts + args.stdlib_windows + args.heldout_prompts
    return dflash_data.corpus_bytes(rows, args.seq_len, model.config.hidden_size, len(layer_ids)) / 1e9


def tapped_data_rates(model, args: argparse.Namespace, layer_ids, tokens) -> dict[str, float]:
    """Seconds of the data work a tapped-corpus trainer (DFlash, EAGLE-3) does, measured here: a generation step of
    a --gen-batch-size batch, and the taps at `layer_ids` of such a batch of rows like `tokens` [B, T]."""
    import numpy as np

    from jaxspec.train import dflash_data

    length = tokens.shape[1]
    many = np.resize(tokens, (args.gen_batch_size, length))
    return {
        "gen_step": generation_step_seconds(model.module, args.gen_batch_size, args.seq_len),
        "taps_batch": timed(lambda: dflash_data.block_corpus(
            model.module, many, np.full(len(many), length), np.zeros(len(many)), layer_ids,
            args.gen_batch_size).features),
    }


def estimate_tapped_run(args: argparse.Namespace, rates: dict[str, float], need_data: bool) -> dict[str, float]:
    """Seconds of each stage of a tapped-corpus trainer's run, from `rates` (`tapped_data_rates` when the corpus
    must be built, and `train_step`, `eval_row`)."""
    out = {}
    if need_data:
        out["generation"] = generation_seconds(args, rates["gen_step"])
        rows = args.train_prompts + args.heldout_prompts + args.stdlib_windows
        out["target taps"] = -(-rows // args.gen_batch_size) * rates["taps_batch"]
    out["training"] = args.steps * rates["train_step"]
    evaluations = args.steps // args.eval_every + 2  # before the first step, every --eval-every, after the last
    out["held-out evaluations"] = evaluations * args.heldout_prompts * rates["eval_row"]
    return out


def print_timing(rates: dict[str, float], estimate: dict[str, float]) -> None:
    """The rates measured here and the run's estimated time, as the training commands print them before starting."""
    print("measured here: " + ", ".join(f"{k} {v:.3g} s" for k, v in rates.items())
          + f"; peak memory so far (the target and one train step) {peak_memory_gb():.1f} GB")
    print("estimated time on this machine: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in estimate.items())
          + f"; total {sum(estimate.values()) / 60:.0f} min", flush=True)


def peak_memory_gb() -> float:
    """This process's peak resident memory so far, in GB (Linux reports kilobytes)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6


def build_tapped_corpora(model, args: argparse.Namespace, layer_ids, data, dflash_data):
    """(training corpus, held-out corpus) of `dflash_data.BlockCorpus`: the target's greedy answers to the training
    and held-out prompts of the data flags (and --stdlib-windows windows of text, training only) with its taps at
    `layer_ids`, as jaxspec-train-dflash and jaxspec-train-eagle3 train on them."""
    from tqdm.auto import tqdm

    tokenizer, module = model.tokenizer, model.module
    eos = model.eos_token_ids()
    train_ids = data.prompt_ids(tokenizer, False, args.train_prompts, args.stdlib_share, args.max_prompt_len,
                                args.seed)
    heldout_ids = data.prompt_ids(tokenizer, True, args.heldout_prompts, args.stdlib_share, args.max_prompt_len,
                                  args.seed)
    with tqdm(total=len(train_ids) + len(heldout_ids), desc="answering", unit="prompt") as bar:
        heldout = dflash_data.generated_block_corpus(module, heldout_ids, args.seq_len, args.gen_batch_size, eos,
                                                     layer_ids, progress=bar.update)
        train_corpus = dflash_data.generated_block_corpus(module, train_ids, args.seq_len, args.gen_batch_size, eos,
                                                          layer_ids, progress=bar.update)
    windows = data.stdlib_windows(tokenizer, args.seq_len, args.stdlib_windows, args.seed)
    if len(windows):
        with tqdm(total=len(windows), desc="stdlib windows", unit="row") as bar:
            text = dflash_data.block_corpus(module, windows, [args.seq_len] * len(windows), [0] * len(windows),
                                            layer_ids, args.batch_size, bar.update)
        train_corpus = dflash_data.concat([train_corpus, text])
    return train_corpus, heldout


def cached_tapped_corpora(workdir: str, sources: list[str], recipe: dict[str, Any], data, dflash_data):
    """(the data folder, (training, held-out) corpora) from the first of `workdir` and `sources` that caches a
    corpus of exactly `recipe`; (WORKDIR's data folder, None) when none does."""
    for folder in [workdir, *sources]:
        data_dir = data_folder(folder, recipe)
        cached = tuple(data.load(os.path.join(data_dir, split), recipe, kind=dflash_data.BlockCorpus)
                       for split in ("train", "heldout"))
        if None not in cached:
            return data_dir, cached
    return data_folder(workdir, recipe), None


def tapped_corpora(model, args: argparse.Namespace, layer_ids, data_dir: str, recipe: dict[str, Any], cached,
                   data, dflash_data):
    """(training corpus, held-out corpus): `cached` where the data folder had them, else built by the target
    (`build_tapped_corpora`) and saved in `data_dir` under `recipe`, so that the next run reads them."""
    if cached is not None:
        train_corpus, heldout = cached
        print(f"data: {len(train_corpus)} training rows ({train_corpus.num_tokens} tokens) and {len(heldout)} "
              f"held-out rows, cached in {data_dir}", flush=True)
        return train_corpus, heldout
    start = time.perf_counter()
    train_corpus, heldout = build_tapped_corpora(model, args, layer_ids, data, dflash_data)
    data.save(train_corpus, os.path.join(data_dir, "train"), recipe)
    data.save(heldout, os.path.join(data_dir, "heldout"), recipe)
    print(f"data: {len(train_corpus)} training rows ({train_corpus.num_tokens} tokens) and {len(heldout)} "
          f"held-out rows in {(time.perf_counter() - start) / 60:.1f} min (cached in {data_dir})", flush=True)
    return train_corpus, heldout


def report_training(result, args: argparse.Namespace, workdir: str, *, recipe: dict[str, Any], data_dir: str,
                    minutes: float, max_drafts: int, plot: str | None) -> tuple[dict[str, Any] | None, int]:
    """Write WORKDIR/summary.json (the recipe, the data folder, this session's minutes and what the run's history
    says: steps, tokens, the last held-out evaluation) and print the held-out acceptance at 1, 2, 4 and `max_drafts`
    drafts a round. Returns (that evaluation or None before the first, the steps trained)."""
    history = result.history
    final = history["evals"][-1] if history["evals"] else None
    steps = history["step"][-1] if history["step"] else 0
    summary = {"model": args.model, "steps": steps, "training_tokens": history["tokens"][-1] if history["tokens"] else 0,
               "train_minutes_this_session": round(minutes, 1), "heldout": final, "recipe": recipe, "data": data_dir,
               "train_config": history["settings"]}
    with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2)
    if final:
        for k in sorted({1, 2, 4, max_drafts} & set(range(1, max_drafts + 1))):
            acc = final["acceptance"][str(k)]
            print(f"held-out, {k} draft(s) per round: acceptance {acc['acceptance_rate']:.3f}, "
                  f"{acc['tokens_per_round']:.2f} tokens per round")
        per_draft = final["acceptance"][str(max_drafts)]["per_depth"]
        print("held-out acceptance of draft k given drafts 1..k-1 accepted: " + " ".join(f"{x:.2f}" for x in per_draft))
    print(f"plot: {plot or 'skipped (matplotlib is not installed)'}; summary: {workdir}/summary.json")
    return final, steps
