"""Training an EAGLE-3 head against a frozen target: `train_eagle3` runs the shared loop (`loop.run`: seeded batches,
orbax checkpoints with exact resume, a progress bar) with the training-time test (`eagle3_losses.ttt_loss`).

The data is a DFlash corpus (`dflash_data.BlockCorpus`) tapped at the head's three layers: the target's greedy
answers, its outputs at those layers in the head's order, and its final-normed states (whose head gives the target's
distributions). A step's batch is a function of (seed, step) alone (`loop.batch_rows`), so a resumed run draws the
same rows; every index of every row is a round (no sampling of positions), `ttt_steps` drafts deep.

The held-out evaluation replays greedy decoding of each held-out answer (`losses.simulate_greedy_rounds`) with the
head's chained drafts at every index (`eagle3_losses.ttt_drafts`, the chain teacher-forced on the row, which is the
chain a round runs whenever its draft is verified): a round at committed length L accepts the longest prefix of its
drafts that equals the target's row and commits one more token; tokens per round is accepted + 1 per round, for
every draft count K of 1 .. `eval_drafts` a round may verify.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.models.eagle3 import Eagle3Head

from .dflash_data import BlockCorpus
from .dflash_export import with_drafter_state
from .eagle3_export import check_head_layers, vocabulary_digest
from .eagle3_losses import DEFAULT_STEP_DECAY, DEFAULT_TTT_STEPS, replay_layout
from .loop import Objective, Schedule, TrainResult, batch_rows, plot_history, rounds_postfix, run
from .losses import acceptance_summary, simulate_greedy_rounds
from .step import OptimConfig, make_optimizer, make_ttt_drafts, make_ttt_eval_loss, make_ttt_train_step, split_head

EVAL_ROWS = 8  # held-out rows per evaluation call


@dataclasses.dataclass(frozen=True)
class Eagle3TrainConfig:
    steps: int = 1000
    batch_size: int = 4  # rows per step, every index of each a round
    ttt_steps: int = DEFAULT_TTT_STEPS  # chained drafts trained per round (SpecForge's ttt_length)
    step_decay: float = DEFAULT_STEP_DECAY  # TTT step i's loss weight is step_decay**i (SpecForge's ploss_decay)
    eval_drafts: int = 7  # held-out acceptance is replayed for 1 .. eval_drafts drafts per round
    optim: OptimConfig = OptimConfig(learning_rate=1e-3)
    eval_every: int = 100  # held-out acceptance every this many steps (and before the first and after the last)
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0

    def resolved(self) -> Eagle3TrainConfig:
        return dataclasses.replace(self, optim=dataclasses.replace(self.optim, total_steps=self.steps))


def train_eagle3(head, target, corpus: BlockCorpus, heldout: BlockCorpus | None, cfg: Eagle3TrainConfig,
                 workdir: str, progress: bool = True, stop_at: int | None = None) -> TrainResult:
    """Train the EAGLE-3 `head` (a `jaxspec.Model`: `new_eagle3_head(target, ...)`, or a loaded head to fine-tune)
    to draft for the frozen `target` on `corpus`, checkpointing into `workdir/checkpoints` and resuming from its
    latest checkpoint; held-out acceptance is replayed on `heldout` (None: no evaluation). `stop_at` ends the run
    early at that step (resume later with the same settings). Every argument is checked before anything compiles."""
    check_training(head, target, corpus, heldout, cfg)
    cfg = cfg.resolved()
    graphdef, trainable, head_frozen = split_head(head.module)
    target_graphdef, target_state = nnx.split(target.module)
    step_fn = make_ttt_train_step(graphdef, target_graphdef, cfg.optim, cfg.ttt_steps, cfg.step_decay)

    def batch(step: int) -> tuple[tuple, int]:
        rows = corpus.take(np.sort(batch_rows(step, cfg.batch_size, len(corpus), cfg.seed)))
        return _arrays(rows), rows.num_tokens

    objective = Objective(step=step_fn, batch=batch, recorded=("step_loss", "step_top1"),
                          evaluate=_evaluator(graphdef, target_graphdef, cfg, heldout), postfix=rounds_postfix)
    schedule = Schedule(cfg.steps, cfg.eval_every, cfg.checkpoint_every, cfg.keep_checkpoints)
    trainable, history = run(objective, trainable, (head_frozen, target_state), make_optimizer(cfg.optim), schedule,
                             _settings(cfg, head, corpus), workdir, progress, stop_at)
    return TrainResult(model=with_drafter_state(head, trainable), history=history)


def check_training(head, target, corpus: BlockCorpus, heldout: BlockCorpus | None, cfg: Eagle3TrainConfig) -> None:
    """Raise a ValueError naming the first mistake in the arguments of `train_eagle3`."""
    if not isinstance(getattr(head, "module", None), Eagle3Head):
        raise ValueError(f"train_eagle3 trains an EAGLE-3 head; got a {type(getattr(head, 'module', head)).__name__} "
                         "(build one with jaxspec.train.new_eagle3_head or jaxspec.load an EAGLE-3 checkpoint).")
    head.config.check_target(target.config)
    for name in ("steps", "batch_size", "ttt_steps", "eval_drafts", "eval_every", "checkpoint_every",
                 "keep_checkpoints"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if not cfg.step_decay > 0:
        raise ValueError(f"step_decay must be positive, got {cfg.step_decay!r}.")
    if len(corpus) < cfg.batch_size:
        raise ValueError(f"the corpus has {len(corpus)} rows, fewer than batch_size={cfg.batch_size}.")
    if heldout is not None and not len(heldout):
        raise ValueError("the held-out corpus has no rows; pass heldout=None to train without evaluations.")
    layer_ids = head.config.layer_ids(target.config.num_layers)
    check_head_layers(target.config, layer_ids)
    for name, rows in (("training", corpus), ("held-out", heldout)):
        if rows is not None:
            _check_corpus(name, rows, layer_ids, target.config.hidden_size)


def _check_corpus(name: str, corpus: BlockCorpus, layer_ids: tuple[int, ...], width: int) -> None:
    tapped = tuple(int(x) for x in corpus.layer_ids)
    if tapped != tuple(layer_ids):
        raise ValueError(f"the {name} corpus holds taps of target layers {list(tapped)}, the head reads "
                         f"{list(layer_ids)}; build the corpus for the head's layers, in its order.")
    if corpus.hidden.shape[-1] != width or corpus.features.shape[-1] != 3 * width:
        raise ValueError(f"the {name} corpus's states have width {corpus.hidden.shape[-1]}, the target's is {width}.")
    nothing = np.flatnonzero(corpus.lengths < corpus.starts + 2)
    if len(nothing):
        raise ValueError(f"{len(nothing)} {name} row(s) (e.g. row {nothing[0]}) have no token to draft: an answer "
                         "needs two tokens, the one the prefill produces and one after it "
                         "(dflash_data.generated_block_corpus leaves such rows out).")


def _settings(cfg: Eagle3TrainConfig, head, corpus: BlockCorpus) -> dict[str, Any]:
    """What a resumed run must share with the run it continues (JSON-comparable)."""
    fields = dataclasses.asdict(cfg)
    for name in ("eval_every", "checkpoint_every", "keep_checkpoints"):  # free to change between sessions
        fields.pop(name)
    ids = np.asarray(head.module.vocab_ids[...], np.int32)
    described = {"layer_ids": [int(x) for x in corpus.layer_ids], "hidden_size": head.config.hidden_size,
                 "draft_vocab_size": len(ids), "draft_vocab_sha256": vocabulary_digest(ids)}
    return json.loads(json.dumps(fields | {"head": described, "corpus_rows": len(corpus),
                                           "corpus_tokens": corpus.num_tokens}))


def _arrays(rows: BlockCorpus) -> tuple:
    """(tokens, lengths, starts, features, hidden) on the device, as the step and the held-out loss take them."""
    return tuple(jnp.asarray(x) for x in (rows.tokens, rows.lengths, rows.starts, rows.features, rows.hidden))


def _evaluator(graphdef, target_graphdef, cfg: Eagle3TrainConfig, heldout: BlockCorpus | None):
    """Held-out greedy acceptance for 1 .. eval_drafts drafts per round (decoding replayed on the target's own
    answers) and the held-out loss over every index, so every evaluation scores the same rounds."""
    if heldout is None:
        return None
    drafts_fn = make_ttt_drafts(graphdef, target_graphdef, cfg.eval_drafts)
    loss_fn = make_ttt_eval_loss(graphdef, target_graphdef, cfg.ttt_steps, cfg.step_decay)
    n, seq_len = heldout.tokens.shape

    def evaluate(trainable, frozen, step: int, tokens: int) -> dict[str, Any]:
        drafts = np.zeros((n, cfg.eval_drafts, seq_len), np.int32)  # [N, K, T]: step j's draft at index t
        loss_sum = weight_sum = 0.0
        for begin in range(0, n, EVAL_ROWS):
            rows = np.arange(begin, min(begin + EVAL_ROWS, n))
            part = heldout.take(np.concatenate([rows, np.full(EVAL_ROWS - len(rows), rows[0])]))  # one shape
            part.lengths[len(rows):] = 0  # padding rows count nowhere
            arrays = _arrays(part)
            metrics = loss_fn(trainable, frozen, *arrays)
            loss_sum += float(metrics["loss"]) * float(metrics["weight"])
            weight_sum += float(metrics["weight"])
            drafts[rows] = np.asarray(drafts_fn(trainable, frozen, arrays[0], arrays[3]))[: len(rows)]
        replayed = replay_layout(drafts)
        acceptance = {str(k): acceptance_summary(simulate_greedy_rounds(replayed, heldout.tokens, heldout.starts,
                                                                        heldout.lengths, k))
                      for k in range(1, cfg.eval_drafts + 1)}
        return {"step": step, "tokens": tokens, "loss": loss_sum / max(weight_sum, 1e-9), "acceptance": acceptance}

    return evaluate


def plot_eagle3_history(history: dict, path: str, title: str = "") -> str | None:
    """`loop.plot_history` for an EAGLE-3 run: loss per TTT step, held-out acceptance per draft."""
    return plot_history(history, path, title, series="step", series_label="TTT step",
                        heldout_label="held-out (weighted mean of steps)")
