"""Self-distillation of MTP layers, and the greedy acceptance they would reach, both over teacher-forced rows.

The MTP chain during decoding (jaxspec/strategies/mtp.py): depth k's entry at position i embeds the token at i and
reads depth k-1's output at i-1 (depth 0 reads the target's hidden state at i-1); its logits propose the token at
i+1. Verification accepts that draft when it is what the target itself would produce after the tokens up to i,
which, once the drafts before it were accepted, are the target's own tokens. So on a row of the target's own
greedy generation, running every depth over the whole row at once (teacher forcing) computes, at each position,
exactly the logits a decoding round would draft from there.

The soft target of every depth at position i is the target's own next-token distribution p(. | tokens up to i):
the LM head over the cached hidden state at i. Training minimises KL(p || q_k) there. Soft targets carry the whole
distribution (what exact speculative sampling compares q against, accepting with probability sum min(p, q)) and
need no generated tokens, so plain text rows train as well as generations; on the target's greedy rows, argmax p is
the next token, so greedy acceptance gets the same signal a hard label would give.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def shift_right(x: jax.Array) -> jax.Array:
    """[B, T, D] -> [B, T, D] with x[:, i-1] at i (zeros at 0): entry i reads the state at i-1."""
    return jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)


def mtp_outputs(module, tokens: jax.Array, hidden: jax.Array, depths: int) -> list[jax.Array]:
    """Depth k's normed output at every position, teacher-forced over whole rows: `depths` arrays [B, T, D].

    tokens: [B, T]; hidden: [B, T, D] the target's final-normed hidden states. Depth k's output is defined from
    position k+1 on (its attention never sees the entries below, which read padding). Depths past the last MTP layer
    reuse it, as decoding does.
    """
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t))
    cache = module.init_mtp_cache(b, t, depths=depths)
    prev, outs = shift_right(hidden), []
    for depth in range(depths):
        out, _, cache = module.mtp_step(depth, tokens, prev, positions, cache,
                                        layer=min(depth, module.num_mtp_layers - 1))
        outs.append(out)
        prev = shift_right(out)
    return outs


def valid_positions(lengths: jax.Array, t: int, depth: int) -> jax.Array:
    """[B, T] where depth `depth` has an entry (i >= depth+1) whose next token is in the row (i <= length-2)."""
    i = jnp.arange(t)[None, :]
    return (i >= depth + 1) & (i <= lengths[:, None] - 2)


def distillation_loss(module, tokens: jax.Array, lengths: jax.Array, hidden: jax.Array, lse: jax.Array, depths: int,
                      draft_vocab: bool = False):
    """Mean over depths of the mean KL(p || q_k) over each depth's valid positions; metrics per depth.

    tokens: [B, T]; lengths: [B]; hidden: [B, T, D] the target's cached hidden states; lse: [B, T] the logsumexp of
    its logits. `draft_vocab=True` trains q over the model's draft vocabulary V' only (the head drafts use), and
    never computes the full head: log p on V' is the V' head's logits minus the cached lse. The target's mass
    outside V' is out of reach, so the best q is p renormalised on V' (p~), and the loss is the cross-entropy
    against p on V' minus its minimum: m * KL(p~ || q) with m = p(V'), the same gradient, and 0 at the optimum.
    """
    hidden = hidden.astype(jnp.float32)
    if draft_vocab:
        log_p = module.draft_vocab_logits(hidden) - lse[..., None]  # [B, T, V']
    else:
        log_p = jax.nn.log_softmax(module.logits(hidden), axis=-1)  # [B, T, V]
    p = jnp.exp(log_p)
    log_best = log_p - jax.nn.logsumexp(log_p, axis=-1, keepdims=True) if draft_vocab else log_p
    teacher_top = jnp.argmax(log_p, axis=-1)
    head = module.draft_vocab_logits if draft_vocab else module.logits
    losses, agreement = [], []
    for depth, out in enumerate(mtp_outputs(module, tokens, hidden.astype(module.dtype), depths)):
        mask = valid_positions(lengths, tokens.shape[1], depth)
        count = jnp.maximum(mask.sum(), 1)
        logits = head(out)
        kl = jnp.sum(p * (log_best - jax.nn.log_softmax(logits, axis=-1)), axis=-1)  # [B, T]
        losses.append(jnp.sum(jnp.where(mask, kl, 0.0)) / count)
        agreement.append(jnp.sum((jnp.argmax(logits, axis=-1) == teacher_top) & mask) / count)
    loss = jnp.mean(jnp.stack(losses))
    return loss, {"loss": loss, "depth_loss": jnp.stack(losses), "depth_top1": jnp.stack(agreement)}


def draft_tokens(module, tokens: jax.Array, hidden: jax.Array, depths: int) -> jax.Array:
    """Each depth's greedy draft at every position, teacher-forced: [B, depths, T] int32, from the head decoding
    uses (the draft vocabulary's where the model has one)."""
    outs = mtp_outputs(module, tokens, hidden.astype(module.dtype), depths)
    return jnp.stack([greedy_draft(module, out) for out in outs], axis=1).astype(jnp.int32)


def greedy_draft(module, out: jax.Array) -> jax.Array:
    """[..., D] -> [...]: the argmax of `draft_logits`, the token greedy decoding drafts. With a draft vocabulary it
    is taken over the V' logits and mapped to its id, without scattering them into a [..., V] array (at [B, T, V]
    that scatter costs more than the evaluation it serves; see docs/design.md, 'MTP layers and training').
    jaxspec.train's draft vocabularies are sorted ids, so a tie goes to the smaller id here as there."""
    if getattr(module.cfg, "draft_vocab_size", 0):
        return module.draft_vocab[...][jnp.argmax(module.draft_vocab_logits(out), axis=-1)]
    return jnp.argmax(module.logits(out), axis=-1)


def simulate_greedy_rounds(drafts: np.ndarray, tokens: np.ndarray, starts: np.ndarray, lengths: np.ndarray,
                           num_drafts: int) -> dict[str, np.ndarray]:
    """Replay greedy MTP decoding of each row with `num_drafts` drafts per round, as jaxspec.generate runs it.

    drafts: [N, K', T] from `draft_tokens` (K' >= num_drafts); tokens: [N, T] the target's greedy rows; starts: the
    prompt lengths. The prefill commits the token at `starts`; a round at committed length L proposes draft j from
    depth j at position L-1+j, accepts the longest prefix that equals the row's tokens L, L+1, ..., and commits one
    more token. Rounds draft at most length - L - 1 tokens, like the decode loop at the end of its budget.
    Returns drafted and accepted counts, and `reached` / `accepted_at` per draft index (for per-depth acceptance).
    """
    reached = np.zeros(num_drafts, np.int64)
    accepted_at = np.zeros(num_drafts, np.int64)
    drafted = accepted = rounds = 0
    for row in range(len(tokens)):
        length = int(lengths[row])
        committed = int(starts[row]) + 1
        while committed < length:
            count = min(num_drafts, length - committed - 1)
            taken = 0
            while taken < count and drafts[row, taken, committed - 1 + taken] == tokens[row, committed + taken]:
                taken += 1
            reached[: min(taken + 1, count)] += 1
            accepted_at[:taken] += 1
            drafted, accepted, rounds = drafted + count, accepted + taken, rounds + 1
            committed += taken + 1
    return {"drafted": drafted, "accepted": accepted, "rounds": rounds, "reached": reached,
            "accepted_at": accepted_at}


def acceptance_summary(stats: dict) -> dict[str, float | list[float]]:
    """Acceptance rate (accepted / drafted), tokens per round, and per-depth acceptance given the earlier drafts
    were accepted."""
    per_depth = (stats["accepted_at"] / np.maximum(stats["reached"], 1)).tolist()
    return {
        "acceptance_rate": stats["accepted"] / max(stats["drafted"], 1),
        "tokens_per_round": (stats["accepted"] + stats["rounds"]) / max(stats["rounds"], 1),
        "per_depth": per_depth,
    }
