"""Training a DFlash drafter against a frozen target: `train_dflash` runs the shared loop (`loop.run`: seeded
batches, orbax checkpoints with exact resume, a progress bar) with the DFlash objective (`dflash_losses`).

A step's batch is a function of (seed, step): its rows (`loop.batch_rows`) and its anchors (`sample_anchors` with a
generator seeded by both), so a resumed run draws the same blocks. The held-out evaluation replays greedy decoding
of each held-out answer with blocks of W (`losses.simulate_greedy_rounds` over every anchor's drafts): a round at
committed length L proposes the block anchored at L-1, accepts the longest prefix of its drafts that equals the
target's row, and commits one more token; tokens per round is accepted + 1 per round, for every draft count K of
1 .. W-1 a round may verify.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx

from .dflash_data import BlockCorpus, anchor_bounds
from .dflash_export import with_drafter_state
from .dflash_losses import default_loss_decay, replay_layout, sample_anchors
from .eagle3_export import vocabulary_digest
from .loop import Objective, Schedule, TrainResult, batch_rows, plot_history, rounds_postfix, run
from .losses import acceptance_summary, simulate_greedy_rounds
from .step import (OptimConfig, make_block_drafts, make_block_eval_loss, make_block_train_step, make_optimizer,
                   split_drafter)

ANCHOR_STREAM, HELDOUT_STREAM = 1, 2  # seeds of the training anchors and the held-out loss's fixed anchors
EVAL_ROWS = 8  # held-out rows per evaluation call
EVAL_BLOCKS = 2048  # block entries per draft call of the evaluation: rows x anchors x (W-1), to bound its logits


@dataclasses.dataclass(frozen=True)
class DFlashTrainConfig:
    steps: int = 1000
    batch_size: int = 4  # rows per step
    anchors_per_row: int = 16  # blocks per row per step, at distinct random positions of its answer
    loss_decay: float | None = None  # gamma of the block-entry weights exp(-(k-1)/gamma); None: the paper's for W
    optim: OptimConfig = OptimConfig(learning_rate=6e-4)
    eval_every: int = 100  # held-out acceptance every this many steps (and before the first and after the last)
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0

    def resolved(self, block_size: int) -> DFlashTrainConfig:
        decay = default_loss_decay(block_size) if self.loss_decay is None else self.loss_decay
        return dataclasses.replace(self, loss_decay=float(decay),
                                   optim=dataclasses.replace(self.optim, total_steps=self.steps))


def train_dflash(drafter, target, corpus: BlockCorpus, heldout: BlockCorpus | None, cfg: DFlashTrainConfig,
                 workdir: str, progress: bool = True, stop_at: int | None = None) -> TrainResult:
    """Train the DFlash `drafter` (a `jaxspec.Model`, e.g. `new_dflash_drafter(target, ...)`) to draft for the frozen
    `target` on `corpus`, over its draft vocabulary where it has one (`with_draft_vocab`: p and q renormalised over
    it, as decoding drafts; dflash_losses), checkpointing into `workdir/checkpoints` and resuming from its latest
    checkpoint; held-out acceptance is replayed on `heldout` (None: no evaluation). `stop_at` ends the run early at
    that step (resume later with the same settings). Every argument is checked before anything compiles."""
    check_training(drafter, target, corpus, heldout, cfg)
    cfg = cfg.resolved(drafter.config.block_size)
    graphdef, trainable, drafter_frozen = split_drafter(drafter.module)
    target_graphdef, target_state = nnx.split(target.module)
    frozen = (drafter_frozen, target_state)
    step_fn = make_block_train_step(graphdef, target_graphdef, cfg.optim, cfg.loss_decay)
    seq_len = corpus.tokens.shape[1]

    def batch(step: int) -> tuple[tuple, int]:
        rows = corpus.take(np.sort(batch_rows(step, cfg.batch_size, len(corpus), cfg.seed)))
        rng = np.random.default_rng([cfg.seed, ANCHOR_STREAM, step])
        anchors, valid = sample_anchors(rng, rows.starts, rows.lengths, cfg.anchors_per_row, seq_len)
        return _arrays(rows, anchors, valid), rows.num_tokens

    objective = Objective(step=step_fn, batch=batch, recorded=("position_loss", "position_top1"),
                          evaluate=_evaluator(graphdef, target_graphdef, drafter.config.block_size, cfg, heldout),
                          postfix=rounds_postfix)
    schedule = Schedule(cfg.steps, cfg.eval_every, cfg.checkpoint_every, cfg.keep_checkpoints)
    trainable, history = run(objective, trainable, frozen, make_optimizer(cfg.optim), schedule,
                             _settings(cfg, drafter, corpus), workdir, progress, stop_at)
    return TrainResult(model=with_drafter_state(drafter, trainable), history=history)


def check_training(drafter, target, corpus: BlockCorpus, heldout: BlockCorpus | None, cfg: DFlashTrainConfig) -> None:
    """Raise a ValueError naming the first mistake in the arguments of `train_dflash`."""
    if not hasattr(drafter.module, "draft_block"):
        raise ValueError(f"train_dflash trains a DFlash drafter; got a {type(drafter.module).__name__} "
                         "(build one with jaxspec.train.new_dflash_drafter or jaxspec.load a DFlash checkpoint).")
    drafter.config.check_target(target.config)
    for name in ("steps", "batch_size", "anchors_per_row", "eval_every", "checkpoint_every", "keep_checkpoints"):
        value = getattr(cfg, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}.")
    if cfg.loss_decay is not None and not cfg.loss_decay > 0:
        raise ValueError(f"loss_decay (gamma) must be positive, got {cfg.loss_decay!r}.")
    if len(corpus) < cfg.batch_size:
        raise ValueError(f"the corpus has {len(corpus)} rows, fewer than batch_size={cfg.batch_size}.")
    if heldout is not None and not len(heldout):
        raise ValueError("the held-out corpus has no rows; pass heldout=None to train without evaluations.")
    for name, rows in (("training", corpus), ("held-out", heldout)):
        if rows is not None:
            _check_corpus(name, rows, drafter.config, cfg.anchors_per_row)


def _check_corpus(name: str, corpus: BlockCorpus, drafter_cfg, anchors_per_row: int) -> None:
    layer_ids = tuple(int(x) for x in corpus.layer_ids)
    if layer_ids != tuple(drafter_cfg.target_layer_ids):
        raise ValueError(f"the {name} corpus holds taps of target layers {list(layer_ids)}, the drafter reads "
                         f"{list(drafter_cfg.target_layer_ids)}; build the corpus for the drafter's layers.")
    if corpus.hidden.shape[-1] != drafter_cfg.hidden_size:
        raise ValueError(f"the {name} corpus's hidden states have width {corpus.hidden.shape[-1]}, the drafter's "
                         f"is {drafter_cfg.hidden_size}.")
    no_room = np.flatnonzero(corpus.anchor_counts() < 1)
    if len(no_room):
        raise ValueError(f"{len(no_room)} {name} row(s) (e.g. row {no_room[0]}) have no position to anchor a block "
                         "at: an answer needs at least two tokens, the bonus and one to draft "
                         "(dflash_data.generated_block_corpus leaves such rows out).")
    seq_len = corpus.tokens.shape[1]
    if anchors_per_row > seq_len - 2:
        raise ValueError(f"anchors_per_row={anchors_per_row} exceeds the {seq_len - 2} positions a row of {seq_len} "
                         "tokens can anchor a block at.")


def _settings(cfg: DFlashTrainConfig, drafter_model, corpus: BlockCorpus) -> dict[str, Any]:
    """What a resumed run must share with the run it continues (JSON-comparable)."""
    fields = dataclasses.asdict(cfg)
    for name in ("eval_every", "checkpoint_every", "keep_checkpoints"):  # free to change between sessions
        fields.pop(name)
    drafter_cfg = drafter_model.config
    drafter = {"num_layers": drafter_cfg.num_layers, "block_size": drafter_cfg.block_size,
               "mask_token_id": drafter_cfg.mask_token_id, "target_layer_ids": list(drafter_cfg.target_layer_ids),
               "draft_vocab_size": drafter_cfg.draft_vocab_size}
    if drafter_cfg.draft_vocab_size:  # another vocabulary is another objective
        drafter["draft_vocab_sha256"] = vocabulary_digest(np.asarray(drafter_model.module.vocab_ids[...]))
    return json.loads(json.dumps(fields | {"drafter": drafter, "corpus_rows": len(corpus),
                                           "corpus_tokens": corpus.num_tokens}))


def _arrays(rows: BlockCorpus, anchors: np.ndarray, valid: np.ndarray) -> tuple:
    """(tokens, lengths, features, hidden, anchors, valid) on the device, as the step and the held-out loss take
    them."""
    return tuple(jnp.asarray(x) for x in (rows.tokens, rows.lengths, rows.features, rows.hidden, anchors, valid))


def _evaluator(graphdef, target_graphdef, block_size: int, cfg: DFlashTrainConfig, heldout: BlockCorpus | None):
    """Held-out greedy acceptance for 1 .. W-1 drafts per round (decoding replayed on the target's own answers) and
    the held-out loss at anchors drawn once, so every evaluation scores the same blocks."""
    if heldout is None:
        return None
    drafts_fn = make_block_drafts(graphdef, target_graphdef)
    loss_fn = make_block_eval_loss(graphdef, target_graphdef, cfg.loss_decay)
    n, seq_len = heldout.tokens.shape
    anchors, valid = sample_anchors(np.random.default_rng([cfg.seed, HELDOUT_STREAM]), heldout.starts,
                                    heldout.lengths, cfg.anchors_per_row, seq_len)
    low, high = anchor_bounds(heldout.starts, heldout.lengths)
    chunk = max(EVAL_BLOCKS // (EVAL_ROWS * (block_size - 1)), 1)  # anchors per draft call

    def evaluate(trainable, frozen, step: int, tokens: int) -> dict[str, Any]:
        drafts = np.zeros((n, seq_len, block_size - 1), np.int32)  # [N, T, W-1]: the block anchored at each position
        loss_sum = weight_sum = 0.0
        for begin in range(0, n, EVAL_ROWS):
            rows = np.arange(begin, min(begin + EVAL_ROWS, n))
            padded = np.concatenate([rows, np.full(EVAL_ROWS - len(rows), rows[0])])  # one compiled shape
            part = heldout.take(padded)
            real = (np.arange(EVAL_ROWS) < len(rows))[:, None]  # padding rows count nowhere
            arrays = _arrays(part, anchors[padded], valid[padded] & real)
            metrics = loss_fn(trainable, frozen, *arrays)
            loss_sum += float(metrics["loss"]) * float(metrics["weight"])
            weight_sum += float(metrics["weight"])
            for first in range(int(low[rows].min()), int(high[rows].max()) + 1, chunk):
                at = np.minimum(np.arange(first, first + chunk), seq_len - 1)
                block = drafts_fn(trainable, frozen, arrays[0], arrays[2],
                                  jnp.asarray(np.broadcast_to(at, (EVAL_ROWS, chunk)), jnp.int32))
                width = min(chunk, seq_len - first)
                drafts[rows, first:first + width] = np.asarray(block)[: len(rows), :width]
        replayed = replay_layout(drafts)
        acceptance = {str(k): acceptance_summary(simulate_greedy_rounds(replayed, heldout.tokens, heldout.starts,
                                                                        heldout.lengths, k))
                      for k in range(1, block_size)}
        return {"step": step, "tokens": tokens, "loss": loss_sum / max(weight_sum, 1e-9), "acceptance": acceptance}

    return evaluate


def plot_dflash_history(history: dict, path: str, title: str = "") -> str | None:
    """`loop.plot_history` for a DFlash run: loss per block entry, held-out acceptance per draft."""
    return plot_history(history, path, title, series="position", series_label="block entry",
                        heldout_label="held-out (weighted mean of entries)")
