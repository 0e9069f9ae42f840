"""Train MTP (multi-token prediction) layers for a target by self-distillation, offline, and write them where
`jaxspec.load` finds them (`use_mtp=True`, `--strategy mtp`).

    jaxspec-train-mtp --layers 3 --default-drafts 2 --asset jaxspec/assets/smollm2-135m-mtp
    jaxspec-train-mtp --model path/to/deepseek-or-glm --out converted/finetuned --steps 300

`python scripts/train_mtp.py ...` runs the same. The recipe of the shipped SmolLM2-135M set is the default (see
jaxspec/assets/smollm2-135m-mtp/README.md). Steps:
1. The target's hidden states, once, cached in WORKDIR/data-*: its greedy generations from the training prompts
   (jaxspec/train/prompts.py: hand-written instructions and free-text requests, and, for --stdlib-share of them,
   prompts made from the Python standard library's functions and docs; chat template or raw text), windows of the
   standard library's own sources, and generations from a held-out prompt set that training never sees (other
   instructions, other free-text words, other stdlib modules).
2. `--layers K` attaches K fresh DeepSeek-style MTP layers to a Llama/Qwen2 target (replacing any it has); without
   it, the model's own MTP layers are fine-tuned (DeepSeek-V3, GLM-4.5, or a set attached before).
3. AdamW with warmup and cosine decay; depth k learns the target's own next-token distribution k+1 tokens past its
   input (KL to the target's soft targets). Orbax checkpoints in WORKDIR/checkpoints; rerunning the same command
   resumes. Held-out greedy acceptance is replayed on the held-out generations every --eval-every steps.
4. WORKDIR/loss.png, WORKDIR/summary.json, and the outputs: --asset (only the MTP tensors, bfloat16) and/or --out
   (a whole-model conversion folder).

Before the long work starts, the script times the target and one train step on this machine and prints how long
the run will take.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .train_common import (add_data_flags, add_run_flags, check_data_flags, check_run_flags, data_folder, data_recipe,
                           generation_seconds, generation_step_seconds, report_training, run_workdir)

DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, conversion folder or catalogue name")
    p.add_argument("--layers", type=int, default=None,
                   help="attach this many fresh MTP layers (Llama/Qwen2); default: fine-tune the model's own")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="V': drafts use a head over the V' most frequent training tokens (0: the full head)")
    p.add_argument("--default-drafts", type=int, default=None,
                   help="record this as the asset's draft length for use_mtp when generate gets none (default: one "
                        "per layer); benchmarks/bench_mtp.py measures which K pays")
    add_data_flags(p, stdlib_windows=192)
    add_run_flags(p, "mtp", steps=1400, batch_size=8, lr=2e-3, eval_every=50)
    p.add_argument("--asset", default=None, help="write the MTP layers as an asset folder (MTP tensors only)")
    p.add_argument("--out", default=None, help="write the whole model as a conversion folder")
    args = p.parse_args(argv)
    check_data_flags(p, args)
    check_run_flags(p, args)
    if args.layers is not None and args.layers < 1:
        p.error("--layers must be >= 1")
    if args.default_drafts is not None and args.default_drafts < 1:
        p.error("--default-drafts must be >= 1")
    if args.draft_vocab < 0:
        p.error("--draft-vocab must be >= 0")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import jaxspec
    from jaxspec.assets import strip_mtp
    from jaxspec.train import OptimConfig, TrainConfig, attach_mtp_layers, data, plot_history, save_mtp_asset, train

    workdir = run_workdir(args, "mtp")
    model = jaxspec.load(args.model, progress=True)
    if args.layers is not None:
        model = strip_mtp(model)
    elif not getattr(model.module, "num_mtp_layers", 0):
        print(f"{args.model} has no MTP layers: pass --layers K to attach K fresh ones.", file=sys.stderr)
        return 2
    if model.tokenizer is None:
        print(f"{args.model} has no tokenizer; the prompts and the standard-library text need one.", file=sys.stderr)
        return 2
    eos = model.eos_token_ids()

    # -- the plan, timed on this machine ----------------------------------------------------------------------
    recipe = data_recipe(args, model)
    data_dir = data_folder(workdir, recipe)
    cached = data.load(os.path.join(data_dir, "train"), recipe), data.load(os.path.join(data_dir, "heldout"), recipe)
    depths = args.layers or model.module.num_mtp_layers
    rates = _calibrate(model, args, depths, need_data=None in cached)
    estimate = _estimate(args, rates, need_data=None in cached)
    print(f"plan: {args.train_prompts} training + {args.heldout_prompts} held-out generations, "
          f"{args.stdlib_windows} stdlib windows of {args.seq_len} tokens, {args.steps} steps of {args.batch_size} "
          f"rows, {depths} MTP depth(s)")
    print("estimated time on this machine: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in estimate.items())
          + f"; total {sum(estimate.values()) / 60:.0f} min", flush=True)
    if args.estimate_only:
        return 0

    # -- data: the target runs once -----------------------------------------------------------------------------
    train_corpus, heldout = cached
    if train_corpus is None or heldout is None:
        start = time.perf_counter()
        train_corpus, heldout = _build_data(model, args, eos, data)
        data.save(train_corpus, os.path.join(data_dir, "train"), recipe)
        data.save(heldout, os.path.join(data_dir, "heldout"), recipe)
        print(f"data: {train_corpus.num_tokens} training and {heldout.num_tokens} held-out tokens in "
              f"{(time.perf_counter() - start) / 60:.1f} min (cached in {data_dir})", flush=True)

    # -- layers, training, outputs -----------------------------------------------------------------------------
    if args.layers is not None:
        vocab = None
        if args.draft_vocab:
            counts = data.token_frequencies(train_corpus, model.config.vocab_size)
            vocab = data.draft_vocabulary(counts, min(args.draft_vocab, model.config.vocab_size))
            coverage = _coverage(heldout, vocab)
            print(f"draft vocabulary: {len(vocab)} tokens cover {coverage:.3f} of the held-out generated tokens")
        model = attach_mtp_layers(model, args.layers, draft_vocab=vocab, seed=args.seed)
    cfg = TrainConfig(
        steps=args.steps, batch_size=args.batch_size, depths=depths,
        draft_vocab=bool(getattr(model.config, "draft_vocab_size", 0)), eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, seed=args.seed,
        optim=OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup, weight_decay=args.weight_decay),
    )
    start = time.perf_counter()
    result = train(model, train_corpus, heldout, cfg, workdir, stop_at=args.stop_after)
    minutes = (time.perf_counter() - start) / 60
    plot = plot_history(result.history, os.path.join(workdir, "loss.png"),
                        title=f"MTP self-distillation, {os.path.basename(os.path.normpath(args.model))}")
    final, steps = report_training(result, args, workdir, recipe=recipe, data_dir=data_dir, minutes=minutes,
                                   max_drafts=depths, plot=plot)
    if steps < args.steps:
        print(f"stopped at step {steps} of {args.steps}; rerun the same command to resume.")
        return 0
    if args.asset:
        extra = {"base": args.model, "heldout": final, "recipe": recipe | {"model": args.model},
                 "train_config": result.history["settings"]}
        if args.default_drafts is not None:
            extra["mtp_num_assistant_tokens"] = args.default_drafts
        print(f"wrote {save_mtp_asset(result.model, args.asset, extra_config=extra)}")
    if args.out:
        from jaxspec import checkpoint

        print(f"wrote {checkpoint.save(result.model, args.out, force=checkpoint.is_converted(args.out))}")
    return 0


def _build_data(model, args, eos, data):
    from tqdm.auto import tqdm

    tokenizer, module = model.tokenizer, model.module
    train_ids = data.prompt_ids(tokenizer, False, args.train_prompts, args.stdlib_share, args.max_prompt_len,
                                args.seed)
    heldout_ids = data.prompt_ids(tokenizer, True, args.heldout_prompts, args.stdlib_share, args.max_prompt_len,
                                  args.seed)
    windows = data.stdlib_windows(tokenizer, args.seq_len, args.stdlib_windows, args.seed)
    parts = []
    with tqdm(total=len(train_ids) + len(heldout_ids), desc="generating", unit="prompt") as bar:
        heldout = data.greedy_generations(module, heldout_ids, args.seq_len, args.gen_batch_size, eos, bar.update)
        parts.append(data.greedy_generations(module, train_ids, args.seq_len, args.gen_batch_size, eos, bar.update))
    with tqdm(total=windows.size, desc="stdlib windows", unit="tok") as bar:
        parts.append(data.text_corpus(module, windows, args.batch_size, bar.update))
    return data.Corpus.concat(parts), heldout


def _coverage(heldout, vocab) -> float:
    import numpy as np

    generated = np.arange(heldout.tokens.shape[1])[None] >= heldout.starts[:, None]
    generated &= np.arange(heldout.tokens.shape[1])[None] < heldout.lengths[:, None]
    return float(np.isin(heldout.tokens[generated], vocab).mean())


def _calibrate(model, args, depths: int, need_data: bool) -> dict[str, float]:
    """Seconds per unit of work, measured here: a generation step of a batch, a forward of one batch of windows,
    and one train step (each after its compile)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxspec.train import data as data_module
    from jaxspec.train.export import attach_mtp_layers
    from jaxspec.train.loop import committed
    from jaxspec.train.step import (OptimConfig, make_draft_tokens, make_eval_loss, make_optimizer, make_train_step,
                                    split_trainable)

    rng = np.random.default_rng(0)
    rates = {}
    vocab = model.config.vocab_size
    if need_data:
        rates["gen_step"] = generation_step_seconds(model.module, args.gen_batch_size, args.seq_len)
        windows = rng.integers(0, vocab, (args.batch_size, args.seq_len)).astype(np.int32)
        for timed in (False, True):
            start = time.perf_counter()
            data_module.text_corpus(model.module, windows, args.batch_size)
            if timed:
                rates["forward_batch"] = time.perf_counter() - start
    probe = model
    if args.layers is not None:
        probe = attach_mtp_layers(model, args.layers,
                                  draft_vocab=np.arange(min(args.draft_vocab, vocab)) if args.draft_vocab else None)
    graphdef, trainable, frozen = split_trainable(probe.module)
    trainable, opt_state, frozen = committed(trainable, make_optimizer(OptimConfig()).init(trainable), frozen)
    step = make_train_step(graphdef, OptimConfig(), depths, bool(getattr(probe.config, "draft_vocab_size", 0)))
    b, t, d = args.batch_size, args.seq_len, model.config.hidden_size
    batch = (jnp.asarray(rng.integers(0, vocab, (b, t)), jnp.int32), jnp.full((b,), t, jnp.int32),
             jnp.asarray(rng.standard_normal((b, t, d)), jnp.float32), jnp.zeros((b, t), jnp.float32))
    for timed in (False, True):
        start = time.perf_counter()
        trainable, opt_state, metrics = step(trainable, opt_state, frozen, *batch)
        jax.block_until_ready(metrics)
        if timed:
            rates["train_step"] = time.perf_counter() - start
    # A held-out evaluation: every depth's drafts and the loss over each batch of held-out rows.
    drafts = make_draft_tokens(graphdef, depths)
    loss = make_eval_loss(graphdef, depths, bool(getattr(probe.config, "draft_vocab_size", 0)))
    for timed in (False, True):
        start = time.perf_counter()
        jax.block_until_ready((drafts(trainable, frozen, batch[0], batch[2]), loss(trainable, frozen, *batch)))
        if timed:
            rates["eval_row"] = (time.perf_counter() - start) / args.batch_size
    return rates


def _estimate(args, rates: dict[str, float], need_data: bool) -> dict[str, float]:
    out = {}
    if need_data:
        out["generation"] = generation_seconds(args, rates["gen_step"])
        out["stdlib windows"] = -(-args.stdlib_windows // args.batch_size) * rates["forward_batch"]
    out["training"] = args.steps * rates["train_step"]
    evaluations = args.steps // args.eval_every + 2  # before the first step, every --eval-every, after the last
    out["held-out evaluations"] = evaluations * -(-args.heldout_prompts // 8) * 8 * rates["eval_row"]  # batches of 8
    return out


if __name__ == "__main__":
    sys.exit(main())
