"""Train a DFlash block drafter for a Llama, Qwen2 or Qwen3 target, offline, and write it in z-lab's
`DFlashDraftModel` layout, where `jaxspec.load` (`assistant_model=`, `--strategy dflash --assistant FOLDER`) and
z-lab's `dflash` package read it.

    jaxspec-train-dflash --out drafters/smollm2-135m-dflash
    jaxspec-train-dflash --model path/to/qwen3 --layers 5 --block-size 16 --steps 3000 --out drafters/qwen3-dflash

`python scripts/train_dflash.py ...` runs the same. The defaults are the recipe for the default model on a CPU: a
3-layer drafter with blocks of 8 (7 drafts a round) and 32 blocks per row per step. Blocks of 16, as DFlash's
drafters for large targets use, spend half of each step's head products on entries 8 .. 15, which a drafter trained
for a few CPU hours rarely reaches; a 150-step probe on SmolLM2-135M (96 answers) reached 0.111 held-out first-draft
acceptance with blocks of 8 and 32 anchors against 0.084 with 16 and 16 (about as many head products a step).
Steps:
1. The data, once, cached in WORKDIR/data-*: the target's greedy answers to the training prompts
   (jaxspec/train/prompts.py, as for jaxspec-train-mtp) and to a held-out prompt set that training never sees, with
   the target's outputs at the drafter's tapped layers (--target-layers; default: one per drafter layer, z-lab's
   rule) and its final-normed states, in bfloat16. The script prints the corpus's size before building it.
2. A fresh drafter of --layers layers of the target's width, its layers copied from the target's last ones, a
   mask token (--mask-token-id, else the tokenizer's, else the id the training answers use least) and a draft
   vocabulary (--draft-vocab): the V' tokens the training answers use most, as for jaxspec-train-eagle3. Decoding
   heads its drafts with those V' rows of the target's head only (models/dflash.py), and training does the same.
3. AdamW with warmup and cosine decay on the DFlash objective: --anchors blocks per row per step, each anchored at a
   random position of the answer, its entries weighted exp(-(k-1)/gamma) (--loss-decay; default: the paper's for the
   block size), KL to the target's next-token distribution over the draft vocabulary. Orbax checkpoints in
   WORKDIR/checkpoints; rerunning the same command resumes. Held-out greedy block acceptance is replayed every
   --eval-every steps.
4. WORKDIR/loss.png, WORKDIR/summary.json, and with --out the drafter folder (config.json, model.safetensors in
   bfloat16, training.json with the held-out acceptance and the recipe).

Before the long work starts, the script times the target and one train step on this machine and prints how long
the run will take and how much memory the corpus needs.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from .train_common import (add_data_flags, add_run_flags, cached_tapped_corpora, check_at_least_one, check_data_flags,
                           check_run_flags, data_recipe, estimate_tapped_run, load_tapped_target, parse_target_layers,
                           print_timing, report_training, run_workdir, tapped_corpora, tapped_corpus_gigabytes,
                           tapped_data_rates, timed)

DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, conversion folder or catalogue name")
    p.add_argument("--layers", type=int, default=3, help="drafter layers")
    p.add_argument("--target-layers", default=None,
                   help="comma-separated target layers whose outputs form the drafter's context, in order (default: "
                        "one per drafter layer, spread over the target as z-lab's drafters are)")
    p.add_argument("--block-size", type=int, default=8,
                   help="W: the bonus token and W-1 mask tokens (W-1 drafts); DFlash's large drafters use 16")
    p.add_argument("--mask-token-id", type=int, default=None,
                   help="the block's mask token (default: the tokenizer's mask token, else the id the training "
                        "answers use least)")
    p.add_argument("--anchors", type=int, default=32, help="blocks per row per train step")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="V': the drafter trains and drafts over the V' tokens the training answers use most (0, or "
                        "at least the vocabulary's size: over every token)")
    p.add_argument("--loss-decay", type=float, default=None,
                   help="gamma of the block-entry weights exp(-(k-1)/gamma) (default: 7 for W=16, 5 for 10, 4 for 8)")
    # No stdlib windows by default: past its first entry, a block's targets are conditioned on tokens the target
    # would not have produced there, which its own answers never are. The held-out replay drafts at every position
    # of every answer (W-1 head rows each), so its set is smaller than jaxspec-train-mtp's.
    add_data_flags(p, stdlib_windows=0, heldout_prompts=32)
    add_run_flags(p, "dflash", steps=3000, batch_size=4, lr=1e-3, eval_every=500)
    p.add_argument("--out", default=None, help="write the trained drafter to this folder (z-lab's layout)")
    args = p.parse_args(argv)
    check_data_flags(p, args)
    check_run_flags(p, args)
    check_at_least_one(p, args, ("layers", "anchors"))
    if args.draft_vocab < 0:
        p.error("--draft-vocab must be >= 0 (0: every token)")
    if args.block_size < 2:
        p.error("--block-size must be >= 2 (the bonus token and at least one mask token)")
    parse_target_layers(p, args)
    if args.anchors > args.seq_len - 2:
        p.error(f"--anchors {args.anchors} exceeds the {args.seq_len - 2} positions a row of --seq-len tokens can "
                "anchor a block at")
    if args.loss_decay is not None and not args.loss_decay > 0:
        p.error("--loss-decay must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    from jaxspec.train import DFlashTrainConfig, OptimConfig, data, dflash_data, new_dflash_drafter, train_dflash
    from jaxspec.train.dflash_loop import plot_dflash_history

    workdir = run_workdir(args, "dflash")
    model = load_tapped_target(args.model)
    if model is None:
        return 2
    # Every setting is checked on a drafter built now (the mask token is settled once the data exists).
    try:
        probe = new_dflash_drafter(model, args.layers, args.block_size, target_layer_ids=args.target_layers,
                                   mask_token_id=args.mask_token_id)
    except (ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    layer_ids = probe.config.target_layer_ids

    # -- the plan, timed on this machine ----------------------------------------------------------------------
    recipe = data_recipe(args, model, target_layer_ids=list(layer_ids))
    data_dir, cached = cached_tapped_corpora(workdir, [], recipe, data, dflash_data)
    need_data = cached is None
    rates = _calibrate(model, probe, args, need_data)
    estimate = estimate_tapped_run(args, rates, need_data)
    corpus_gb = tapped_corpus_gigabytes(args, model, layer_ids)
    print(f"plan: a {args.layers}-layer drafter, blocks of {args.block_size}, context from target layers "
          f"{list(layer_ids)}; {args.train_prompts} training + {args.heldout_prompts} held-out answers and "
          f"{args.stdlib_windows} stdlib windows of {args.seq_len} tokens ({corpus_gb:.2f} GB of data, at most); "
          f"{args.steps} steps of {args.batch_size} rows x {args.anchors} blocks")
    print_timing(rates, estimate)
    if args.estimate_only:
        return 0

    # -- data: the target runs once -----------------------------------------------------------------------------
    train_corpus, heldout = tapped_corpora(model, args, layer_ids, data_dir, recipe, cached, data, dflash_data)

    # -- the drafter, training, outputs ------------------------------------------------------------------------
    mask = args.mask_token_id
    if mask is None and getattr(model.tokenizer, "mask_token_id", None) is None:
        mask = dflash_data.rarest_token(train_corpus, model.config.vocab_size)
    drafter = new_dflash_drafter(model, args.layers, args.block_size, target_layer_ids=layer_ids, mask_token_id=mask)
    mask = drafter.config.mask_token_id
    print(f"mask token: {mask} ({model.tokenizer.convert_ids_to_tokens(mask)!r})")
    drafter, vocabulary = _with_vocabulary(drafter, train_corpus, heldout, args.draft_vocab)
    cfg = DFlashTrainConfig(steps=args.steps, batch_size=args.batch_size, anchors_per_row=args.anchors,
                            loss_decay=args.loss_decay, eval_every=args.eval_every,
                            checkpoint_every=args.checkpoint_every, seed=args.seed,
                            optim=OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup,
                                              weight_decay=args.weight_decay))
    start = time.perf_counter()
    result = train_dflash(drafter, model, train_corpus, heldout, cfg, workdir, stop_at=args.stop_after)
    minutes = (time.perf_counter() - start) / 60
    plot = plot_dflash_history(result.history, os.path.join(workdir, "loss.png"),
                               title=f"DFlash drafter, {os.path.basename(os.path.normpath(args.model))}")
    final, steps = report_training(result, args, workdir, recipe=recipe, data_dir=data_dir, minutes=minutes,
                                   max_drafts=args.block_size - 1, plot=plot)
    if steps < args.steps:
        print(f"stopped at step {steps} of {args.steps}; rerun the same command to resume.")
        return 0
    if args.out:
        from jaxspec.train import save_dflash_drafter

        training = {"base": args.model, "heldout": final, "recipe": recipe | {"model": args.model},
                    "train_config": result.history["settings"] | {"draft_vocab": vocabulary}}
        print(f"wrote {save_dflash_drafter(result.model, args.out, training=training)}")
    return 0


def _with_vocabulary(drafter, train_corpus, heldout, size: int):
    """The drafter with the draft vocabulary of `size` tokens the training answers use most (none where `size` is 0
    or covers the vocabulary), which it trains and drafts over, and what to record of it: its size, the sha256 of its
    ids (int32) and the share of held-out answer tokens it covers."""
    from jaxspec.train import draft_vocabulary_for, with_draft_vocab
    from jaxspec.train.eagle3_export import vocabulary_coverage, vocabulary_digest

    vocab_size = drafter.config.vocab_size
    if not size or size >= vocab_size:
        return drafter, None
    ids = draft_vocabulary_for(train_corpus, size, vocab_size)
    coverage = vocabulary_coverage(heldout, ids, vocab_size)
    print(f"draft vocabulary: {len(ids)} tokens cover {coverage:.3f} of the held-out answer tokens")
    return with_draft_vocab(drafter, ids), {"size": len(ids), "sha256": vocabulary_digest(ids),
                                            "heldout_coverage": round(coverage, 4)}


def _calibrate(model, probe, args, need_data: bool) -> dict[str, float]:
    """Seconds per unit of work, measured here (each after its compile): a generation step of a batch, the taps of
    a batch of rows, one train step, and the two calls a held-out evaluation repeats."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxspec.train import with_draft_vocab
    from jaxspec.train.dflash_loop import EVAL_BLOCKS, EVAL_ROWS
    from jaxspec.train.dflash_losses import default_loss_decay, sample_anchors
    from jaxspec.train.loop import committed
    from jaxspec.train.step import (OptimConfig, make_block_drafts, make_block_eval_loss, make_block_train_step,
                                    make_optimizer, split_drafter)

    rng = np.random.default_rng(0)
    layer_ids = probe.config.target_layer_ids
    b, t, d, vocab = args.batch_size, args.seq_len, model.config.hidden_size, model.config.vocab_size
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    rates = tapped_data_rates(model, args, layer_ids, tokens) if need_data else {}
    if 0 < args.draft_vocab < vocab:  # a step heads its blocks with V' of the head's rows, as the run's will
        probe = with_draft_vocab(probe, np.arange(args.draft_vocab))
    graphdef, trainable, drafter_frozen = split_drafter(probe.module)
    target_graphdef, target_state = nnx.split(model.module)
    frozen = (drafter_frozen, target_state)
    decay = args.loss_decay or default_loss_decay(args.block_size)
    optim = OptimConfig()
    trainable, opt_state, frozen = committed(trainable, make_optimizer(optim).init(trainable), frozen)
    step = make_block_train_step(graphdef, target_graphdef, optim, decay)
    anchors, valid = sample_anchors(rng, np.full(b, t // 4), np.full(b, t), args.anchors, t)
    batch = (jnp.asarray(tokens), jnp.full((b,), t, jnp.int32),
             jnp.asarray(rng.standard_normal((b, t, len(layer_ids) * d)), jnp.bfloat16),
             jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16), jnp.asarray(anchors), jnp.asarray(valid))
    state = [trainable, opt_state]

    def train_step():
        state[0], state[1], metrics = step(state[0], state[1], frozen, *batch)
        return metrics

    rates["train_step"] = timed(train_step)
    # A held-out evaluation repeats, per EVAL_ROWS rows: one loss call and a draft call per chunk of anchors.
    chunk = max(EVAL_BLOCKS // (EVAL_ROWS * (args.block_size - 1)), 1)
    rows = np.resize(np.arange(b), EVAL_ROWS)
    eval_batch = tuple(jnp.asarray(np.asarray(x)[rows]) for x in batch)
    drafts, loss = make_block_drafts(graphdef, target_graphdef), make_block_eval_loss(graphdef, target_graphdef, decay)
    at = jnp.asarray(np.broadcast_to(np.arange(chunk), (EVAL_ROWS, chunk)), jnp.int32)
    seconds = timed(lambda: loss(state[0], frozen, *eval_batch))
    seconds += -(-args.seq_len // chunk) * timed(lambda: drafts(state[0], frozen, eval_batch[0], eval_batch[2], at))
    rates["eval_row"] = seconds / EVAL_ROWS  # anchors span at most the whole row
    jax.block_until_ready(state)
    return rates


if __name__ == "__main__":
    sys.exit(main())
