"""Train an EAGLE-3 head for a Llama, Qwen2, Qwen3 or Gemma target, offline, and write it in the
`LlamaForCausalLMEagle3` layout that vLLM, SGLang and SpecForge load, and `jaxspec.load` too (`assistant_model=`,
`--strategy eagle3 --assistant FOLDER`).

    jaxspec-train-eagle3 --out drafters/smollm2-135m-eagle3
    jaxspec-train-eagle3 --model path/to/qwen3 --draft-vocab 32000 --steps 4000 --out drafters/qwen3-eagle3

`python scripts/train_eagle3.py ...` runs the same. Steps:
1. The data, once: the target's greedy answers to the training prompts (jaxspec/train/prompts.py, as for
   jaxspec-train-mtp and jaxspec-train-dflash) and to a held-out prompt set that training never sees, with the
   target's outputs at the head's three layers (--target-layers; default: 1, the middle and n-3, the layers of
   jaxspec-train-dflash's default drafter) and its final-normed states, in bfloat16. It is the corpus
   jaxspec-train-dflash builds for the same model, prompts and layers, so a cached one is reused: this command looks
   in WORKDIR, then in --data-from (default: jaxspec-train-dflash's default workdir for the model), and builds (into
   WORKDIR/data-*) only when neither holds a corpus of exactly this recipe. The script prints the corpus's size
   before building it.
2. A draft vocabulary (--draft-vocab): the V' tokens the training answers use most, ascending, as SpecForge's
   vocabulary mapping picks them; and a fresh head: fc passing the deepest tapped state through, a midlayer whose
   output projections start at zero, and the target's final norm and head rows of the draft tokens
   (jaxspec/train/eagle3_export.py says why).
3. AdamW with warmup and cosine decay on EAGLE-3's training-time test: every index of each row is a decoding round
   drafted --ttt-steps deep (SpecForge's default, 7), step i weighted --step-decay**i (0.8), KL to the target's
   next-token distribution over the draft vocabulary. Orbax checkpoints in WORKDIR/checkpoints; rerunning the same
   command resumes. Held-out greedy acceptance of the chained drafts is replayed every --eval-every steps, for 1 ..
   --eval-drafts drafts a round.
4. WORKDIR/loss.png, WORKDIR/summary.json, and with --out the head folder (config.json, model.safetensors in
   bfloat16 unless --export-dtype float32, training.json with the held-out acceptance and the recipe).

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
                           tapped_data_rates, timed, workdir_path)

DEFAULT_MODEL = "smollm2-135m"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file, conversion folder or catalogue name")
    p.add_argument("--target-layers", default=None,
                   help="three comma-separated target layers whose outputs the head reads, in order (default: 1, the "
                        "middle and n-3, e.g. 1,14,27 for a 30-layer target; SpecForge's default is 1,n/2-1,n-4)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="V': the head drafts over the V' tokens the training answers use most (at least the whole "
                        "vocabulary: all of it)")
    p.add_argument("--ttt-steps", type=int, default=7, help="chained drafts trained per round (SpecForge's ttt_length)")
    p.add_argument("--step-decay", type=float, default=0.8,
                   help="TTT step i's loss weight is step-decay**i (SpecForge's ploss_decay)")
    p.add_argument("--eval-drafts", type=int, default=7, help="held-out acceptance for 1 .. this many drafts a round")
    add_data_flags(p, stdlib_windows=0, heldout_prompts=32)
    add_run_flags(p, "eagle3", steps=2000, batch_size=4, lr=1e-3, eval_every=250,
                  batch_help="rows per train step (every index of a row is a round)")
    p.add_argument("--data-from", default=None,
                   help="another workdir whose cached corpus to reuse when its recipe is this run's (default: "
                        "jaxspec-train-dflash's default workdir for the model)")
    p.add_argument("--out", default=None, help="write the trained head to this folder (LlamaForCausalLMEagle3)")
    p.add_argument("--export-dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="the exported weights' dtype")
    args = p.parse_args(argv)
    check_data_flags(p, args)
    check_run_flags(p, args)
    parse_target_layers(p, args)
    if args.target_layers is not None and (len(args.target_layers) != 3 or len(set(args.target_layers)) != 3):
        p.error(f"--target-layers must name three distinct layers, got {list(args.target_layers)}")
    check_at_least_one(p, args, ("draft_vocab", "ttt_steps", "eval_drafts"))
    if not args.step_decay > 0:
        p.error("--step-decay must be positive")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    import ml_dtypes
    import numpy as np

    from jaxspec.train import Eagle3TrainConfig, OptimConfig, data, dflash_data, new_eagle3_head, train_eagle3
    from jaxspec.train.eagle3_export import draft_vocabulary_for, vocabulary_coverage
    from jaxspec.train.eagle3_loop import plot_eagle3_history

    workdir = run_workdir(args, "eagle3")
    model = load_tapped_target(args.model)
    if model is None:
        return 2
    vocab_size = model.config.vocab_size
    draft_size = min(args.draft_vocab, vocab_size)
    # Every setting is checked on a head built now (the draft vocabulary is settled once the data exists).
    try:
        probe = new_eagle3_head(model, np.arange(draft_size), layer_ids=args.target_layers, seed=args.seed)
    except (ValueError, NotImplementedError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    layer_ids = probe.config.layer_ids(model.config.num_layers)

    # -- the plan, timed on this machine ----------------------------------------------------------------------
    # The recipe is jaxspec-train-dflash's for the same layers, so a corpus it cached is this run's corpus.
    recipe = data_recipe(args, model, target_layer_ids=list(layer_ids))
    data_dir, cached = cached_tapped_corpora(workdir, _data_sources(args), recipe, data, dflash_data)
    need_data = cached is None
    rates = _calibrate(model, probe, args, need_data)
    estimate = estimate_tapped_run(args, rates, need_data)
    corpus_gb = tapped_corpus_gigabytes(args, model, layer_ids)
    print(f"plan: an EAGLE-3 head reading target layers {list(layer_ids)}, a draft vocabulary of {draft_size} of "
          f"{vocab_size} tokens; {args.train_prompts} training + {args.heldout_prompts} held-out answers and "
          f"{args.stdlib_windows} stdlib windows of {args.seq_len} tokens ({corpus_gb:.2f} GB of data, at most"
          + (f", cached in {data_dir}" if cached else "") + f"); {args.steps} steps of {args.batch_size} rows x "
          f"{args.ttt_steps} TTT steps")
    print_timing(rates, estimate)
    if args.estimate_only:
        return 0

    # -- data: the target runs once -----------------------------------------------------------------------------
    train_corpus, heldout = tapped_corpora(model, args, layer_ids, data_dir, recipe, cached, data, dflash_data)

    # -- the head, training, outputs ---------------------------------------------------------------------------
    vocab = draft_vocabulary_for(train_corpus, draft_size, vocab_size)
    print(f"draft vocabulary: {len(vocab)} tokens cover {vocabulary_coverage(heldout, vocab, vocab_size):.3f} of "
          "the held-out answer tokens")
    head = new_eagle3_head(model, vocab, layer_ids=layer_ids, seed=args.seed)
    cfg = Eagle3TrainConfig(steps=args.steps, batch_size=args.batch_size, ttt_steps=args.ttt_steps,
                            step_decay=args.step_decay, eval_drafts=args.eval_drafts, eval_every=args.eval_every,
                            checkpoint_every=args.checkpoint_every, seed=args.seed,
                            optim=OptimConfig(learning_rate=args.lr, warmup_steps=args.warmup,
                                              weight_decay=args.weight_decay))
    start = time.perf_counter()
    result = train_eagle3(head, model, train_corpus, heldout, cfg, workdir, stop_at=args.stop_after)
    minutes = (time.perf_counter() - start) / 60
    plot = plot_eagle3_history(result.history, os.path.join(workdir, "loss.png"),
                               title=f"EAGLE-3 head, {os.path.basename(os.path.normpath(args.model))}")
    final, steps = report_training(result, args, workdir, recipe=recipe, data_dir=data_dir, minutes=minutes,
                                   max_drafts=args.eval_drafts, plot=plot)
    if steps < args.steps:
        print(f"stopped at step {steps} of {args.steps}; rerun the same command to resume.")
        return 0
    if args.out:
        from jaxspec.train import save_eagle3_head

        dtype = ml_dtypes.bfloat16 if args.export_dtype == "bfloat16" else np.float32
        training = {"base": args.model, "heldout": final, "recipe": recipe | {"model": args.model},
                    "train_config": result.history["settings"]}
        print(f"wrote {save_eagle3_head(result.model, args.out, dtype=dtype, training=training)}")
    return 0


def _data_sources(args) -> list[str]:
    """Workdirs besides this run's whose cached corpus may be reused: --data-from, else jaxspec-train-dflash's
    default workdir for the model (not created when absent)."""
    return [args.data_from] if args.data_from else [workdir_path(args.model, "dflash")]



def _calibrate(model, probe, args, need_data: bool) -> dict[str, float]:
    """Seconds per unit of work, measured here (each after its compile): a generation step of a batch, the taps of
    a batch of rows, one train step, and the two calls a held-out evaluation repeats."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    from jaxspec.train.eagle3_loop import EVAL_ROWS
    from jaxspec.train.loop import committed
    from jaxspec.train.step import (OptimConfig, make_optimizer, make_ttt_drafts, make_ttt_eval_loss,
                                    make_ttt_train_step, split_head)

    rng = np.random.default_rng(0)
    layer_ids = probe.config.layer_ids(model.config.num_layers)
    b, t, d, vocab = args.batch_size, args.seq_len, model.config.hidden_size, model.config.vocab_size
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    rates = tapped_data_rates(model, args, layer_ids, tokens) if need_data else {}
    graphdef, trainable, head_frozen = split_head(probe.module)
    target_graphdef, target_state = nnx.split(model.module)
    optim = OptimConfig()
    trainable, opt_state, frozen = committed(trainable, make_optimizer(optim).init(trainable),
                                             (head_frozen, target_state))
    step = make_ttt_train_step(graphdef, target_graphdef, optim, args.ttt_steps, args.step_decay)
    batch = (jnp.asarray(tokens), jnp.full((b,), t, jnp.int32), jnp.full((b,), t // 4, jnp.int32),
             jnp.asarray(rng.standard_normal((b, t, 3 * d)), jnp.bfloat16),
             jnp.asarray(rng.standard_normal((b, t, d)), jnp.bfloat16))
    state = [trainable, opt_state]

    def train_step():
        state[0], state[1], metrics = step(state[0], state[1], frozen, *batch)
        return metrics

    rates["train_step"] = timed(train_step)
    rows = np.resize(np.arange(b), EVAL_ROWS)
    eval_batch = tuple(jnp.asarray(np.asarray(x)[rows]) for x in batch)
    drafts = make_ttt_drafts(graphdef, target_graphdef, args.eval_drafts)
    loss = make_ttt_eval_loss(graphdef, target_graphdef, args.ttt_steps, args.step_decay)
    seconds = timed(lambda: loss(state[0], frozen, *eval_batch))
    seconds += timed(lambda: drafts(state[0], frozen, eval_batch[0], eval_batch[3]))
    rates["eval_row"] = seconds / EVAL_ROWS
    jax.block_until_ready(state)
    return rates


if __name__ == "__main__":
    sys.exit(main())
