"""The training loop: batches in a seeded order, orbax checkpoints with resume, held-out evaluation, a loss plot.

`run` is the loop itself, for any objective (`Objective`: a jitted step, how a step's batch is drawn, which metrics
are kept, the held-out evaluation); `train` runs it for MTP layers, `dflash_loop.train_dflash` for a DFlash
drafter.

Resuming continues the same run: the batch of step s is a function of (seed, s) alone, the optimizer state and the
history are checkpointed with the params, and the learning-rate schedule is a function of the step; so a run stopped
at step s and resumed computes the same steps as one that never stopped (tests/train/ check the loss curves). A
checkpoint records the run's settings, and resuming with different ones is an error.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from .data import Corpus
from .export import with_trained
from .losses import acceptance_summary, simulate_greedy_rounds
from .step import OptimConfig, make_draft_tokens, make_eval_loss, make_optimizer, make_train_step, split_trainable


@dataclasses.dataclass(frozen=True)
class Objective:
    """What `run` trains, apart from the parameters themselves.

    step: `(trainable, opt_state, frozen, *arrays) -> (trainable, opt_state, metrics)`, jitted, donating the first
        two; metrics hold "loss" and every name in `recorded`.
    batch: `step -> (arrays, tokens)`: the step's batch on the device, a function of the step alone (so resuming
        redraws it), and how many corpus tokens it holds (the history's x axis).
    recorded: per-step metrics kept in the history besides the loss (vectors, e.g. one entry per depth).
    evaluate: `(trainable, frozen, step, tokens) -> dict` held-out results, or None.
    postfix: the progress bar's text from the history.
    """

    step: Callable
    batch: Callable[[int], tuple[tuple, int]]
    recorded: tuple[str, ...]
    evaluate: Callable | None
    postfix: Callable[[dict], dict[str, str]]


@dataclasses.dataclass(frozen=True)
class Schedule:
    """When `run` steps, evaluates and checkpoints."""

    steps: int
    eval_every: int
    checkpoint_every: int
    keep_checkpoints: int


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000
    batch_size: int = 8
    depths: int | None = None  # drafts per round trained (default: the model's MTP layers); extra ones reuse the last
    draft_vocab: bool = False  # train q over the model's draft vocabulary only (the head drafts use)
    optim: OptimConfig = OptimConfig()
    eval_every: int = 100  # held-out acceptance every this many steps (and before the first and after the last)
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    seed: int = 0

    def resolved(self, module) -> "TrainConfig":
        depths = self.depths or module.num_mtp_layers
        optim = dataclasses.replace(self.optim, total_steps=self.steps)
        return dataclasses.replace(self, depths=depths, optim=optim)


@dataclasses.dataclass
class TrainResult:
    model: Any  # the trained jaxspec.Model: the target with its MTP layers, or the DFlash drafter
    history: dict[str, Any]  # per step: step, tokens, loss and the objective's recorded metrics; evals


def committed(trainable, opt_state, frozen):
    """The step's state committed to one device, as its outputs are: jit keys its cache on whether arguments are
    committed, so uncommitted inputs to the first step would compile the step a second time. The trainable params
    and optimizer state are copied, since the step donates (invalidates) them and the module still shares them."""
    device = jax.devices()[0]
    trainable, opt_state = jax.device_put((trainable, opt_state), device, may_alias=False)
    return trainable, opt_state, jax.device_put(frozen, device)


def batch_rows(step: int, batch_size: int, num_rows: int, seed: int) -> np.ndarray:
    """Row indices of step `step`'s batch: consecutive slices of one seeded permutation per epoch."""
    flat = step * batch_size + np.arange(batch_size)
    epochs, offsets = flat // num_rows, flat % num_rows
    return np.array([np.random.default_rng([seed, int(e)]).permutation(num_rows)[o] for e, o in zip(epochs, offsets)])


def train(model, corpus: Corpus, heldout: Corpus | None, cfg: TrainConfig, workdir: str,
          progress: bool = True, stop_at: int | None = None) -> TrainResult:
    """Train the MTP layers of `model` on `corpus`, checkpointing into `workdir/checkpoints` and resuming from its
    latest checkpoint. `stop_at` ends the run early at that step (resume later with the same settings)."""
    if len(corpus) < cfg.batch_size:
        raise ValueError(f"the corpus has {len(corpus)} rows, fewer than batch_size={cfg.batch_size}.")
    cfg = cfg.resolved(model.module)
    graphdef, trainable, frozen = split_trainable(model.module)
    step_fn = make_train_step(graphdef, cfg.optim, cfg.depths, cfg.draft_vocab)

    def batch(step: int) -> tuple[tuple, int]:
        rows = corpus.take(np.sort(batch_rows(step, cfg.batch_size, len(corpus), cfg.seed)))
        return _arrays(rows), rows.num_tokens

    objective = Objective(step=step_fn, batch=batch, recorded=("depth_loss", "depth_top1"),
                          evaluate=_evaluator(graphdef, cfg, heldout), postfix=_postfix)
    schedule = Schedule(cfg.steps, cfg.eval_every, cfg.checkpoint_every, cfg.keep_checkpoints)
    trainable, history = run(objective, trainable, frozen, make_optimizer(cfg.optim), schedule,
                             _settings(cfg, corpus), workdir, progress, stop_at)
    return TrainResult(model=with_trained(model, trainable), history=history)


def run(objective: Objective, trainable, frozen, optimizer, schedule: Schedule, settings: dict[str, Any],
        workdir: str, progress: bool = True, stop_at: int | None = None) -> tuple[Any, dict[str, Any]]:
    """Run `objective` from its latest checkpoint in `workdir/checkpoints` (or from `trainable` and a fresh optimizer
    state) to `schedule.steps`, or to `stop_at`; return the trained state and the history. A checkpoint whose
    `settings` differ is an error, raised before any step."""
    import orbax.checkpoint as ocp

    opt_state = optimizer.init(trainable)
    history: dict[str, Any] = {"settings": settings, "step": [], "tokens": [], "loss": [],
                               **{name: [] for name in objective.recorded}, "evals": []}
    os.makedirs(workdir, exist_ok=True)
    manager = ocp.CheckpointManager(os.path.join(os.path.abspath(workdir), "checkpoints"),
                                    options=ocp.CheckpointManagerOptions(max_to_keep=schedule.keep_checkpoints))
    start = 0
    if manager.latest_step() is not None:
        start, trainable, opt_state, history = _restore(manager, trainable, opt_state)
        if history["settings"] != settings:
            manager.close()
            raise ValueError(f"{workdir} holds a run with other settings ({_diff(history['settings'], settings)}); "
                             "use another folder, or delete it to start over.")
    trainable, opt_state, frozen = committed(trainable, opt_state, frozen)

    evaluate = objective.evaluate
    if evaluate is not None and not history["evals"]:
        history["evals"].append(evaluate(trainable, frozen, 0, 0))
    end = schedule.steps if stop_at is None else min(stop_at, schedule.steps)
    bar = _progress_bar(progress, start, schedule.steps)
    tokens_seen = history["tokens"][-1] if history["tokens"] else 0
    for step in range(start, end):
        arrays, tokens = objective.batch(step)
        trainable, opt_state, metrics = objective.step(trainable, opt_state, frozen, *arrays)
        tokens_seen += tokens
        _record(history, step, tokens_seen, metrics, objective.recorded)
        done = step + 1
        if evaluate is not None and (done % schedule.eval_every == 0 or done == schedule.steps):
            history["evals"].append(evaluate(trainable, frozen, done, tokens_seen))
        if done % schedule.checkpoint_every == 0 or done == end:
            _save(manager, done, trainable, opt_state, history)
        bar.update(1)
        bar.set_postfix(objective.postfix(history))
    bar.close()
    manager.wait_until_finished()
    manager.close()
    return trainable, history


def _settings(cfg: TrainConfig, corpus: Corpus) -> dict[str, Any]:
    """What a resumed run must share with the run it continues (JSON-comparable)."""
    fields = dataclasses.asdict(cfg)
    for name in ("eval_every", "checkpoint_every", "keep_checkpoints"):  # free to change between sessions
        fields.pop(name)
    return json.loads(json.dumps(fields | {"corpus_rows": len(corpus), "corpus_tokens": corpus.num_tokens}))


def _diff(old: dict, new: dict) -> str:
    return ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                     if old.get(k) != new.get(k))


def _record(history: dict, step: int, tokens: int, metrics: dict, recorded: tuple[str, ...]) -> None:
    metrics = jax.device_get(metrics)
    history["step"].append(step + 1)
    history["tokens"].append(int(tokens))
    history["loss"].append(float(metrics["loss"]))
    for name in recorded:
        history[name].append([float(x) for x in metrics[name]])


def rounds_postfix(history: dict) -> dict[str, str]:
    """The progress bar's figures for a drafter evaluated by tokens per round (DFlash, EAGLE-3): the recent loss and
    the last held-out evaluation's tokens per round at its longest draft length."""
    out = {"loss": f"{np.mean(history['loss'][-20:]):.3f}"}
    if history["evals"]:
        acceptance = history["evals"][-1]["acceptance"]
        out["heldout_tokens_per_round"] = f"{acceptance[str(len(acceptance))]['tokens_per_round']:.2f}"
    return out


def _postfix(history: dict) -> dict[str, str]:
    recent = history["loss"][-20:]
    out = {"loss": f"{np.mean(recent):.3f}"}
    if history["evals"]:
        out["heldout_acc"] = f"{history['evals'][-1]['acceptance']['1']['acceptance_rate']:.3f}"
    return out


def _evaluator(graphdef, cfg: TrainConfig, heldout: Corpus | None, batch_size: int = 8):
    """Held-out greedy acceptance for 1..depths drafts per round (decoding replayed on the target's own rows, with
    the head drafts use), and the held-out loss."""
    if heldout is None:
        return None
    drafts_fn = make_draft_tokens(graphdef, cfg.depths)
    loss_fn = make_eval_loss(graphdef, cfg.depths, cfg.draft_vocab)

    def evaluate(trainable, frozen, step: int, tokens: int) -> dict[str, Any]:
        drafts, loss_sum = [], 0.0
        for begin in range(0, len(heldout), batch_size):
            rows = np.arange(begin, min(begin + batch_size, len(heldout)))
            part = heldout.take(np.concatenate([rows, np.zeros(batch_size - len(rows), int)]))  # one shape
            part.lengths[len(rows):] = 0  # padding rows count nowhere
            tokens_, lengths, hidden, lse = _arrays(part)
            drafts.append(np.asarray(drafts_fn(trainable, frozen, tokens_, hidden))[: len(rows)])
            loss_sum += float(loss_fn(trainable, frozen, tokens_, lengths, hidden, lse)["loss"]) * part.num_tokens
        drafts = np.concatenate(drafts)
        acceptance = {
            str(k): acceptance_summary(simulate_greedy_rounds(drafts, heldout.tokens, heldout.starts,
                                                              heldout.lengths, k))
            for k in range(1, cfg.depths + 1)
        }
        return {"step": step, "tokens": tokens, "loss": loss_sum / heldout.num_tokens, "acceptance": acceptance}

    return evaluate


def _arrays(batch: Corpus) -> tuple[jax.Array, ...]:
    """(tokens, lengths, hidden, lse) on the device, as the step and the held-out loss take them."""
    return tuple(jnp.asarray(x) for x in (batch.tokens, batch.lengths, batch.hidden, batch.lse))


def _save(manager, step: int, trainable, opt_state, history: dict) -> None:
    import orbax.checkpoint as ocp

    state = {"trainable": jax.tree.leaves(trainable), "opt_state": jax.tree.leaves(opt_state)}
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                               history=ocp.args.JsonSave(history)))


def _restore(manager, trainable, opt_state):
    """The latest checkpoint's (step, trainable, opt_state, history), rebuilt on the given trees' structure."""
    import orbax.checkpoint as ocp

    step = manager.latest_step()
    abstract = {"trainable": jax.tree.leaves(trainable), "opt_state": jax.tree.leaves(opt_state)}
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, abstract)
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                             history=ocp.args.JsonRestore()))
    state = restored["state"]
    trainable = jax.tree.unflatten(jax.tree.structure(trainable), state["trainable"])
    opt_state = jax.tree.unflatten(jax.tree.structure(opt_state), state["opt_state"])
    return step, trainable, opt_state, restored["history"]


def _progress_bar(enabled: bool, start: int, total: int):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=start, disable=not enabled, unit="step", dynamic_ncols=True)


# ----------------------------------------------------------------------------------------------------------------
# The loss and acceptance plot


def plot_history(history: dict, path: str, title: str = "", *, series: str = "depth", series_label: str = "depth",
                 heldout_label: str = "held-out (mean of depths)") -> str | None:
    """A PNG of the training loss and the held-out acceptance against training tokens; None without matplotlib.

    `history[series + "_loss"]` holds one loss per draft index and step (MTP depths, DFlash block positions), and
    each evaluation's `acceptance` maps a draft count K to `acceptance_summary` of the replayed rounds; the largest K
    gives the per-draft acceptance curves. With more than four draft indices, four spread ones are drawn."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = np.asarray(history["tokens"]) / 1e3
    per_draft = np.asarray(history[f"{series}_loss"])
    for index in _shown(per_draft.shape[1] if per_draft.size else 0):
        left.plot(tokens, _smooth(per_draft[:, index]), label=f"{series_label} {index + 1}")
    if history["evals"]:
        left.plot([e["tokens"] / 1e3 for e in history["evals"]], [e["loss"] for e in history["evals"]], "k.--",
                  label=heldout_label)
    left.set(xlabel="training tokens (thousands)", ylabel="KL(target || draft), nats", title="distillation loss")
    left.legend()
    evals = history["evals"]
    if evals:
        x = [e["tokens"] / 1e3 for e in evals]
        drafts = max(int(k) for k in evals[-1]["acceptance"])
        per_index = [evals_i["acceptance"][str(drafts)]["per_depth"] for evals_i in evals]
        for index in _shown(drafts):
            right.plot(x, [p[index] for p in per_index], "o-", label=f"draft {index + 1} (given earlier accepted)")
        right.plot(x, [e["acceptance"]["1"]["acceptance_rate"] for e in evals], "k--", label="acceptance, K=1")
    right.set(xlabel="training tokens (thousands)", ylabel="greedy acceptance", ylim=(0, 1),
              title="held-out acceptance (prompts never trained on)")
    right.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _shown(count: int, most: int = 4) -> list[int]:
    """Which of `count` draft indices a plot draws: all of up to `most`, else `most` spread from first to last."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})


def _smooth(values: np.ndarray, window: int = 20) -> np.ndarray:
    if len(values) < window:
        return values
    kernel = np.ones(window) / window
    head = np.cumsum(values[: window - 1]) / np.arange(1, window)
    return np.concatenate([head, np.convolve(values, kernel, mode="valid")])
