"""The DFlash objective (arXiv 2602.06036) and the greedy acceptance a drafter would reach, over teacher-forced rows.

A decoding round whose newest committed token sits at position a (the bonus: the target produced it but has not
read it yet) runs the drafter once over the block [token at a, mask x (W-1)] at positions a .. a+W-1, with the
target's taps at positions 0 .. a-1 as context (`write_context` at committed positions, `draft_block` with
lengths = a; models/dflash.py); block entry k (1 <= k <= W-1) drafts the token at a+k. Verification accepts draft
k when drafts 1 .. k-1 were accepted and it is what the target itself produces there, which, after accepted
drafts, is the next token of the target's own greedy row. So on the target's greedy rows, a block anchored at any
position a computes exactly the drafts a round anchored there would propose: the context is the row's taps before
a, the bonus is the row's token at a.

Training (`block_loss`) anchors several blocks at random positions of each row's answer (`sample_anchors`: never in
the prompt, as decoding's first block is anchored at the first answer token) and runs each one as decoding does:
one `draft_block` call per anchor, vmapped over a row's anchors, all reading one context cache of the whole row;
a block reads only the entries before its anchor (its `lengths`), which is the paper's attention mask (context
strictly before the anchor, the block's own entries, never another block) with no mask to build.

The loss at block entry k is KL(p || q): p the target's distribution of the token at a+k (its LM head over its
final-normed state at a+k-1, the full vocabulary), q the drafter's (the drafter's state through the target's head,
frozen). Soft targets, not the paper's cross-entropy against generated tokens: on the target's greedy rows argmax p
is the row's next token, so greedy drafting gets the same signal, and p also carries what exact speculative
sampling compares q against (a draft is accepted with probability sum min(p, q)) and is defined on text windows,
whose tokens are not the target's. Its price is one more head product over the blocks, forward only.

With a draft vocabulary (the drafter's `vocab_ids`, V' of the target's V tokens: decoding heads its drafts with
those V' rows of the target's head only, models/dflash.py), q is that V'-way distribution, and p the target's
restricted to V' and renormalised, as SpecForge trains EAGLE-3 heads (`eagle3_losses`); an entry whose row token is
outside V' is left out (no draft can be accepted there, and the renormalised p says nothing about it). Training then
computes the [V', D] head product decoding computes, not the whole head's: on SmolLM2-135M (V = 49,152, V' = 8,192)
the head was more than half of a step.

Entries are weighted w_k = exp(-(k-1)/gamma) (the paper's Eq. 4): draft k counts only when every earlier one was
accepted, so early entries matter more. gamma defaults to the paper's values, 7 for W = 16, 5 for 10, 4 for 8
(`default_loss_decay`). The loss is the w-weighted mean of KL over every (anchor, entry) whose target token is in
the row.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from .dflash_data import anchor_bounds


def default_loss_decay(block_size: int) -> float:
    """gamma of the position weights: the DFlash paper's 4, 5 and 7 for blocks of 8, 10 and 16, linear between
    them and held beyond."""
    return float(np.interp(block_size, (8, 10, 16), (4.0, 5.0, 7.0)))


def position_weights(block_size: int, loss_decay: float) -> jax.Array:
    """[W-1] w_k = exp(-(k-1)/gamma) for block entries k = 1 .. W-1."""
    return jnp.exp(-jnp.arange(block_size - 1, dtype=jnp.float32) / loss_decay)


def sample_anchors(rng: np.random.Generator, starts: np.ndarray, lengths: np.ndarray, count: int,
                   seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """`count` distinct anchor positions per row, uniformly among the row's (`anchor_bounds`): anchors [B, A] int32
    and valid [B, A] bool. A row with fewer positions than `count` gets all of them; its other entries are padding
    blocks (valid False, weight 0) at a position of the row."""
    low, high = anchor_bounds(starts, lengths)
    positions = np.arange(seq_len)
    allowed = (positions >= low[:, None]) & (positions <= high[:, None])  # [B, T]
    keys = np.where(allowed, rng.random(allowed.shape), 2.0)  # the allowed positions first, in a random order
    chosen = np.argsort(keys, axis=1, kind="stable")[:, :count]  # [B, A]
    valid = np.take_along_axis(allowed, chosen, axis=1)
    return np.where(valid, chosen, low[:, None]).astype(np.int32), valid


def block_hidden(drafter, target, tokens: jax.Array, features: jax.Array, anchors: jax.Array) -> jax.Array:
    """The drafter's final-normed states of the blocks anchored at `anchors`, each computed as a decoding round
    anchored there computes it: [B, A, W, D].

    tokens: [B, T]; features: [B, T, n*D] the target's taps (`dflash_data.target_taps`); anchors: [B, A] in 0..T-1.
    The context cache holds every position of the row; the block at anchor a reads the entries before a only."""
    b, t = tokens.shape
    w, d = drafter.cfg.block_size, drafter.cfg.hidden_size
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = drafter.write_context(drafter.project_context(features), positions, drafter.init_cache(b, t))
    bonus = jnp.take_along_axis(tokens, anchors, axis=1)  # [B, A]
    blocks = drafter.block_tokens(bonus.reshape(-1)).reshape(*anchors.shape, w)  # [B, A, W]
    # As the strategy embeds a block: the target's table (its first D columns), times input_embedding_scale.
    embedded = target.embed_tokens(blocks)[..., :d] * drafter.cfg.input_embedding_scale  # [B, A, W, D]
    block_positions = anchors[..., None] + jnp.arange(w)  # [B, A, W]

    def one_round(embedded, positions, lengths):  # [B, W, D], [B, W], [B]: one block per row, as decoding runs it
        return drafter.draft_block(embedded, positions, cache, lengths)

    return jax.vmap(one_round, in_axes=1, out_axes=1)(embedded, block_positions, anchors)


def draft_columns(drafter, target) -> tuple[jax.Array, jax.Array | None]:
    """The target head's columns a draft is headed with, [D, V'], and their token ids [V'] (the drafter's draft
    vocabulary); the whole head [D, V] and None for a drafter without one."""
    head = target.head_matrix()
    if not drafter.cfg.draft_vocab_size:
        return head, None
    ids = drafter.vocab_ids[...]
    return head[:, ids], ids


def block_loss(drafter, target, tokens: jax.Array, lengths: jax.Array, features: jax.Array, hidden: jax.Array,
               anchors: jax.Array, valid: jax.Array, loss_decay: float):
    """The w-weighted mean KL(p || q) over the blocks' entries (module docstring) -> (loss, metrics).

    tokens: [B, T]; lengths: [B]; features: [B, T, n*D]; hidden: [B, T, D] the target's final-normed states;
    anchors, valid: [B, A] (`sample_anchors`). metrics: loss, the sum of the weights (`weight`, to pool batches),
    and per block entry k the mean KL (`position_loss`, [W-1]) and how often q's argmax is p's (`position_top1`,
    [W-1]), each over the entries that count. With a draft vocabulary, p and q are over it (module docstring)."""
    w = drafter.cfg.block_size
    columns, ids = draft_columns(drafter, target)  # [D, V'], [V'] (V' = V and None without a draft vocabulary)
    states = block_hidden(drafter, target, tokens, features, anchors)  # [B, A, W, D]
    log_q = jax.nn.log_softmax(drafter.logits(states[:, :, 1:], columns), axis=-1)  # [B, A, W-1, V']
    predicted = anchors[..., None] + jnp.arange(1, w)  # [B, A, W-1]: the position each entry drafts
    source = jnp.minimum(predicted - 1, tokens.shape[1] - 1)  # p of the token at i comes from the state at i-1
    rows = jnp.arange(tokens.shape[0])[:, None, None]
    log_p = jax.nn.log_softmax(target.logits(hidden[rows, source].astype(jnp.float32), columns), axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)  # [B, A, W-1]
    counts = valid[..., None] & (predicted < lengths[:, None, None])  # the target is in the row
    if ids is not None:  # ... and in the draft vocabulary
        in_vocab = jnp.zeros(target.cfg.vocab_size, bool).at[ids].set(True)
        counts &= in_vocab[tokens[rows, jnp.minimum(predicted, tokens.shape[1] - 1)]]
    mask = counts.astype(jnp.float32)
    weights = mask * position_weights(w, loss_decay)
    loss = jnp.sum(weights * kl) / jnp.maximum(jnp.sum(weights), 1e-9)
    count = jnp.maximum(jnp.sum(mask, axis=(0, 1)), 1.0)  # [W-1]
    agree = (jnp.argmax(log_q, axis=-1) == jnp.argmax(log_p, axis=-1)).astype(jnp.float32)
    return loss, {"loss": loss, "weight": jnp.sum(weights), "position_loss": jnp.sum(mask * kl, axis=(0, 1)) / count,
                  "position_top1": jnp.sum(mask * agree, axis=(0, 1)) / count}


def block_drafts(drafter, target, tokens: jax.Array, features: jax.Array, anchors: jax.Array) -> jax.Array:
    """The greedy drafts of the blocks anchored at `anchors` [B, A]: [B, A, W-1] int32, entry k-1 drafting the
    token at anchor + k (the argmax of the drafter's logits through the target's head, over its draft vocabulary
    where it has one, as greedy decoding takes it; the ids are ascending, so a tie goes to the smaller id in both)."""
    columns, ids = draft_columns(drafter, target)
    states = block_hidden(drafter, target, tokens, features, anchors)
    best = jnp.argmax(drafter.logits(states[:, :, 1:], columns), axis=-1)
    return (best if ids is None else ids[best]).astype(jnp.int32)


def replay_layout(drafts: np.ndarray) -> np.ndarray:
    """Block drafts by anchor [N, T, W-1] -> by draft index and position [N, W-1, T], the layout
    `losses.simulate_greedy_rounds` replays: its round at committed length L takes draft j (0-based) from
    [j, L-1+j], which here is the block anchored at L-1 (the bonus), entry j+1."""
    n, t, k = drafts.shape
    out = np.zeros((n, k, t), drafts.dtype)
    for j in range(k):
        out[:, j, j:] = drafts[:, : t - j, j]
    return out
