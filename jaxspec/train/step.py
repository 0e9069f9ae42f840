"""The optimizer and the jit-compiled train steps: only the drafter's parameters train; the target stays frozen.

MTP layers: the module splits into (graphdef, trainable, frozen): trainable are the `nnx.Param`s whose top-level
attribute starts with "mtp" (`mtp_layers` in Llama models, the stacked `mtp_*` arrays of DeepSeek-V3 / GLM-4.5),
frozen is everything else (the target, the draft vocabulary). A DFlash drafter is a module of its own: its
`nnx.Param`s train, and its draft vocabulary and the target (whose embedding and head the drafter reads) are frozen.
An EAGLE-3 head trains its `nnx.Param`s but an embedding table of its own (SpecForge freezes that too); its draft
vocabulary and the target are frozen. A step takes the frozen state as an argument that is never donated, and
donates the trainable params and the optimizer state, which it replaces.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from .dflash_losses import block_drafts, block_loss
from .eagle3_losses import ttt_drafts, ttt_loss
from .losses import distillation_loss


def is_trainable(path, value) -> bool:
    """nnx filter: the MTP layers' parameters."""
    return isinstance(value, nnx.Param) and str(path[0]).startswith("mtp")


def split_trainable(module: nnx.Module):
    """-> (graphdef, trainable state, frozen state)."""
    graphdef, trainable, frozen = nnx.split(module, is_trainable, ...)
    if not jax.tree.leaves(trainable):
        raise ValueError(f"{type(module).__name__} has no MTP layers to train; attach some first "
                         "(jaxspec.train.attach_mtp_layers).")
    return graphdef, trainable, frozen


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    learning_rate: float = 1e-3
    warmup_steps: int = 50
    total_steps: int = 1000
    final_lr_ratio: float = 0.05  # the cosine decay ends at learning_rate * final_lr_ratio
    weight_decay: float = 0.01
    clip_norm: float = 1.0


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    """AdamW under linear warmup then cosine decay, with global-norm clipping. Weight decay applies to matrices
    only: norms (and DeepSeek's router bias, which gets no gradient) keep their values."""
    schedule = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.learning_rate, warmup_steps=cfg.warmup_steps,
        decay_steps=max(cfg.total_steps, cfg.warmup_steps + 1), end_value=cfg.learning_rate * cfg.final_lr_ratio,
    )
    decay_mask = lambda params: jax.tree.map(lambda x: x.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(cfg.clip_norm),
        optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask),
    )


def descend(optimizer: optax.GradientTransformation, loss_fn, trainable, opt_state):
    """One optimizer step on `loss_fn(trainable) -> (loss, metrics)`: (trainable, opt_state, metrics + grad_norm)."""
    (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
    updates, opt_state = optimizer.update(grads, opt_state, trainable)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return optax.apply_updates(trainable, updates), opt_state, metrics


@functools.lru_cache(maxsize=8)
def make_train_step(graphdef, optim: OptimConfig, depths: int, draft_vocab: bool):
    """`step(trainable, opt_state, frozen, tokens, lengths, hidden, lse) -> (trainable, opt_state, metrics)`,
    jitted; one per setting, so a resumed run in the same process reuses the compiled step."""
    optimizer = make_optimizer(optim)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, opt_state, frozen, tokens, lengths, hidden, lse):
        def loss_fn(trainable):
            module = nnx.merge(graphdef, trainable, frozen)
            return distillation_loss(module, tokens, lengths, hidden, lse, depths, draft_vocab)

        return descend(optimizer, loss_fn, trainable, opt_state)

    return step


@functools.lru_cache(maxsize=8)
def make_eval_loss(graphdef, depths: int, draft_vocab: bool):
    """`loss(trainable, frozen, tokens, lengths, hidden, lse) -> metrics`, jitted (no update)."""

    @jax.jit
    def evaluate(trainable, frozen, tokens, lengths, hidden, lse):
        module = nnx.merge(graphdef, trainable, frozen)
        return distillation_loss(module, tokens, lengths, hidden, lse, depths, draft_vocab)[1]

    return evaluate


@functools.lru_cache(maxsize=8)
def make_draft_tokens(graphdef, depths: int):
    """`drafts(trainable, frozen, tokens, hidden) -> [B, depths, T]` greedy drafts with the head decoding uses,
    jitted."""
    from .losses import draft_tokens

    @jax.jit
    def drafts(trainable, frozen, tokens, hidden):
        module = nnx.merge(graphdef, trainable, frozen)
        return draft_tokens(module, tokens, hidden.astype(jnp.float32), depths)

    return drafts


# ----------------------------------------------------------------------------------------------------------------
# DFlash drafters: the drafter's parameters train; its draft vocabulary and the target (its embedding and head) are
# the frozen state, as the pair (drafter's frozen state, target's state).


def split_drafter(module: nnx.Module):
    """-> (graphdef, trainable state: every `nnx.Param`, the drafter's frozen state: its draft vocabulary, if any)."""
    return nnx.split(module, nnx.Param, ...)


@functools.lru_cache(maxsize=8)
def make_block_train_step(graphdef, target_graphdef, optim: OptimConfig, loss_decay: float):
    """`step(trainable, opt_state, frozen, tokens, lengths, features, hidden, anchors, valid) -> (trainable,
    opt_state, metrics)`, jitted: `trainable` is the drafter's parameters, `frozen` the pair (the drafter's frozen
    state, the target's state) (see `dflash_losses.block_loss` for the rest)."""
    optimizer = make_optimizer(optim)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, opt_state, frozen, tokens, lengths, features, hidden, anchors, valid):
        drafter_frozen, target_state = frozen
        target = nnx.merge(target_graphdef, target_state)

        def loss_fn(trainable):
            drafter = nnx.merge(graphdef, trainable, drafter_frozen)
            return block_loss(drafter, target, tokens, lengths, features, hidden, anchors, valid, loss_decay)

        return descend(optimizer, loss_fn, trainable, opt_state)

    return step


@functools.lru_cache(maxsize=8)
def make_block_eval_loss(graphdef, target_graphdef, loss_decay: float):
    """`loss(trainable, frozen, tokens, lengths, features, hidden, anchors, valid) -> metrics`, jitted."""
    @jax.jit
    def evaluate(trainable, frozen, tokens, lengths, features, hidden, anchors, valid):
        drafter, target = nnx.merge(graphdef, trainable, frozen[0]), nnx.merge(target_graphdef, frozen[1])
        return block_loss(drafter, target, tokens, lengths, features, hidden, anchors, valid, loss_decay)[1]

    return evaluate


@functools.lru_cache(maxsize=8)
def make_block_drafts(graphdef, target_graphdef):
    """`drafts(trainable, frozen, tokens, features, anchors) -> [B, A, W-1]` greedy block drafts, jitted."""
    @jax.jit
    def drafts(trainable, frozen, tokens, features, anchors):
        drafter, target = nnx.merge(graphdef, trainable, frozen[0]), nnx.merge(target_graphdef, frozen[1])
        return block_drafts(drafter, target, tokens, features, anchors)

    return drafts


# ----------------------------------------------------------------------------------------------------------------
# EAGLE-3 heads: the head's parameters train (not an embedding of its own); its draft vocabulary and the target are
# the frozen state, as the pair (head's frozen state, target's state).


def is_head_trainable(path, value) -> bool:
    """nnx filter: an EAGLE-3 head's parameters but its own embedding table."""
    return isinstance(value, nnx.Param) and str(path[0]) != "embed"


def split_head(module: nnx.Module):
    """-> (graphdef, trainable state, the head's frozen state)."""
    return nnx.split(module, is_head_trainable, ...)


@functools.lru_cache(maxsize=8)
def make_ttt_train_step(graphdef, target_graphdef, optim: OptimConfig, steps: int, decay: float):
    """`step(trainable, opt_state, frozen, tokens, lengths, starts, features, hidden) -> (trainable, opt_state,
    metrics)`, jitted: `frozen` is (the head's frozen state, the target's state); see `eagle3_losses.ttt_loss`."""
    optimizer = make_optimizer(optim)

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(trainable, opt_state, frozen, tokens, lengths, starts, features, hidden):
        head_frozen, target_state = frozen
        target = nnx.merge(target_graphdef, target_state)

        def loss_fn(trainable):
            head = nnx.merge(graphdef, trainable, head_frozen)
            return ttt_loss(head, target, tokens, lengths, starts, features, hidden, steps, decay)

        return descend(optimizer, loss_fn, trainable, opt_state)

    return step


@functools.lru_cache(maxsize=8)
def make_ttt_eval_loss(graphdef, target_graphdef, steps: int, decay: float):
    """`loss(trainable, frozen, tokens, lengths, starts, features, hidden) -> metrics`, jitted."""
    @jax.jit
    def evaluate(trainable, frozen, tokens, lengths, starts, features, hidden):
        head = nnx.merge(graphdef, trainable, frozen[0])
        target = nnx.merge(target_graphdef, frozen[1])
        return ttt_loss(head, target, tokens, lengths, starts, features, hidden, steps, decay)[1]

    return evaluate


@functools.lru_cache(maxsize=8)
def make_ttt_drafts(graphdef, target_graphdef, steps: int):
    """`drafts(trainable, frozen, tokens, features) -> [B, steps, T]` the chained greedy drafts, jitted."""
    @jax.jit
    def drafts(trainable, frozen, tokens, features):
        head = nnx.merge(graphdef, trainable, frozen[0])
        target = nnx.merge(target_graphdef, frozen[1])
        return ttt_drafts(head, target, tokens, features, steps)

    return drafts
