"""The one verification rule every strategy shares.

The target has scored `[last, d_1 .. d_K]` in one forward: `logits[:, i]` is its distribution for the token after
position i, so it judges draft d_{i+1} and, past the last accepted draft, supplies the next token itself. The
logits arrive processed (jaxspec.processors), each position with its own prefix, so every rule below judges drafts
by exactly the distribution plain decoding would have used at that position. Each row carries its own number of
valid drafts (`count`); drafts at or past it are padding and never accepted, and the positions after them are never
read (the round may have computed them at a wider block than the row needed).

Returned `tokens[:, :n+1]` are what the row commits: the n accepted drafts, then the target's token at position n
(the correction after a rejection, or the bonus token when every valid draft was accepted).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from .sampling import sample_from_probs, select


def leading_true(mask: jax.Array) -> jax.Array:
    """Length of the all-True prefix of each row: [B, K] bool -> [B] int32."""
    return jnp.sum(jnp.cumprod(mask.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def verify(
    rng: jax.Array,
    target_logits: jax.Array,  # [B, W, V] processed float32
    drafts: jax.Array,  # [B, W-1]
    count: jax.Array,  # [B] valid drafts per row, <= W-1
    draft_probs: jax.Array | None,  # [B, W-1, V] processed q, or None for deterministic drafts
    do_sample: bool,
    ensemble_weight: float | None = None,
) -> tuple[jax.Array, jax.Array]:
    """-> (n_accepted [B], tokens [B, W])."""
    width = target_logits.shape[1]
    if width == 1:  # no drafts: a plain decoding step
        return jnp.zeros(count.shape, jnp.int32), select(rng, target_logits, do_sample)
    is_draft = jnp.arange(width - 1)[None, :] < count[:, None]  # [B, W-1]
    if not do_sample:
        return _verify_greedy(target_logits, drafts, is_draft, draft_probs, ensemble_weight)
    return speculative_sampling(rng, target_logits, drafts, count, draft_probs, ensemble_weight)


def _verify_greedy(target_logits, drafts, is_draft, draft_probs, ensemble_weight):
    choice = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, W]
    if ensemble_weight is not None and draft_probs is not None:
        # Greedy ensemble: a draft position is judged by the argmax of the mixture w*p + (1-w)*q (HF semantics);
        # the position after the last valid draft is the target's own argmax.
        p = jax.nn.softmax(target_logits[:, :-1], axis=-1)
        mixture = ensemble_weight * p + (1 - ensemble_weight) * draft_probs
        mixed_choice = jnp.argmax(mixture, axis=-1).astype(jnp.int32)  # [B, W-1]
        choice = choice.at[:, :-1].set(jnp.where(is_draft, mixed_choice, choice[:, :-1]))
    n = leading_true((drafts == choice[:, :-1]) & is_draft)
    return n, choice


def speculative_sampling(rng, target_logits, drafts, count, q, ensemble_weight=None):
    """Exact speculative sampling (Leviathan et al.; Chen et al.), optionally against the static ensemble.

    target_logits: [B, W, V] processed; q: [B, W-1, V] processed draft distributions from which the drafts were
    drawn, or None for deterministic drafts (a one-hot q: accept d with probability p(d), and after a rejection
    draw from p without d). Accept d_i with probability min(1, p/q) (ensemble: min(1, (1-w) +
    w p/q)); at the first rejection draw from normalize(max(p - q, 0)); if every valid draft is accepted, draw the
    bonus token from p. Only the accepted drafts' probabilities and one full distribution per row are needed.
    """
    accept_rng, residual_rng = jax.random.split(rng)
    width = target_logits.shape[1]
    rows = jnp.arange(target_logits.shape[0])
    drafted_logit = jnp.take_along_axis(target_logits[:, :-1], drafts[..., None], axis=-1)[..., 0]  # [B, W-1]
    p_d = jnp.exp(drafted_logit - jax.nn.logsumexp(target_logits[:, :-1], axis=-1))
    q_d = 1.0 if q is None else jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    ratio = p_d / q_d
    if ensemble_weight is not None:
        ratio = (1 - ensemble_weight) + ensemble_weight * ratio
    u = jax.random.uniform(accept_rng, ratio.shape)
    is_draft = jnp.arange(width - 1)[None, :] < count[:, None]
    n = leading_true((u <= ratio) & is_draft)  # [B]

    p_n = jax.nn.softmax(target_logits[rows, n], axis=-1)  # [B, V]
    if q is None:
        q_n = jax.nn.one_hot(jnp.take_along_axis(drafts, jnp.minimum(n, width - 2)[:, None], axis=1)[:, 0],
                             p_n.shape[-1], dtype=p_n.dtype)
    else:
        q_n = jnp.concatenate([q, jnp.zeros_like(q[:, :1])], axis=1)[rows, n]  # no q after the last draft
    rejected = n < count
    residual = jnp.where(rejected[:, None], jnp.maximum(p_n - q_n, 0.0), p_n)
    # [p - q]+ has zero mass only if p == q there, where rejection has probability zero; fall back to p (HF's
    # ensemble fallback) so float round-off can never produce a NaN draw.
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > jnp.finfo(jnp.float32).tiny, residual, p_n)
    next_token = sample_from_probs(residual_rng, residual)  # [B]
    tokens = jnp.concatenate([drafts, jnp.zeros_like(drafts[:, :1])], axis=1)
    return n, tokens.at[rows, n].set(next_token)
