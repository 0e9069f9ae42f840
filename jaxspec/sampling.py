"""Logits processing and sampling, in the order and with the semantics of HF's processors and warpers.

Every value here is a run-time input (`Processing`, a pytree of arrays): a new temperature, top-k or penalty reuses
the compiled loop. HF's order is kept: the history-dependent processors (repetition penalty, no-repeat n-grams, bad
words, min_new_tokens, suppressed tokens; see `jaxspec.processors`) apply to greedy decoding and sampling alike; the
warpers (temperature, then top-k, then top-p, then min-p) only when sampling. Sampling uses the Gumbel-max trick on
the processed logits: argmax(logits + Gumbel noise) is an exact draw from softmax(logits), needs no normalisation,
and treats removed (-inf) tokens correctly.

Shapes: logits are [..., V] float32; every scalar setting is a 0-d array.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


# Top-k up to this many tokens is applied to `lax.top_k` candidates instead of a sort of the whole vocabulary (a
# sort of 150k logits per position would cost more than a small model's forward on a CPU). HF's default, 50, fits.
TOP_K_CANDIDATES = 128


def warp(logits: jax.Array, temperature, top_k, top_p, min_p) -> jax.Array:
    """Temperature, then top-k (0: off), then top-p (1: off), then min-p (0: off), as HF's warpers do.

    The filters need the logits ranked; they run only when one of them is on (a run-time branch), so plain
    temperature sampling pays nothing for them.
    """
    logits = logits.astype(jnp.float32) / temperature
    filtering = (top_k > 0) | (top_p < 1.0) | (min_p > 0.0)
    return jax.lax.cond(filtering, lambda x: _filter(x, top_k, top_p, min_p), lambda x: x, logits)


def _filter(logits: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """HF's TopK, TopP and MinP warpers in sequence (min_tokens_to_keep = 1): every token whose logit is below a
    per-row threshold is removed. With a small top-k the threshold comes from the best TOP_K_CANDIDATES logits (the
    others are removed by top-k anyway); otherwise from a full sort."""
    candidates = min(TOP_K_CANDIDATES, logits.shape[-1])
    few = (top_k > 0) & (top_k <= candidates)
    threshold = jax.lax.cond(
        few,
        lambda x: _threshold(jax.lax.top_k(x, candidates)[0], top_k, top_p, min_p),
        lambda x: _threshold(-jnp.sort(-x, axis=-1), top_k, top_p, min_p),
        logits,
    )
    return jnp.where(logits >= threshold, logits, NEG_INF)


def _threshold(ranked: jax.Array, top_k, top_p, min_p) -> jax.Array:
    """The smallest logit that survives the three filters, from logits ranked best first: [..., N] -> [..., 1]."""
    size = ranked.shape[-1]
    first = jnp.arange(size) == 0  # the best token always survives
    # Top-k: drop tokens below the k-th best (ties with it are kept, as in HF).
    kth_index = jnp.broadcast_to(jnp.clip(top_k - 1, 0, size - 1), ranked.shape[:-1] + (1,))
    kth_best = jnp.take_along_axis(ranked, kth_index, axis=-1)
    ranked = jnp.where((top_k <= 0) | (ranked >= kth_best), ranked, NEG_INF)
    # Top-p: HF sorts ascending and drops tokens whose cumulative probability is <= 1 - top_p. In descending order
    # that cumulative probability is 1 - (the mass strictly before the token).
    probs = jax.nn.softmax(ranked, axis=-1)
    ascending_cumulative = 1.0 - (jnp.cumsum(probs, axis=-1) - probs)
    ranked = jnp.where((top_p >= 1.0) | (ascending_cumulative > 1.0 - top_p) | first, ranked, NEG_INF)
    # Min-p: drop tokens whose probability is below min_p times the best one's (after the filters above).
    probs = jax.nn.softmax(ranked, axis=-1)
    ranked = jnp.where((probs >= min_p * probs[..., :1]) | first, ranked, NEG_INF)
    return jnp.min(jnp.where(jnp.isfinite(ranked), ranked, jnp.inf), axis=-1, keepdims=True)


def sample(rng: jax.Array, processed_logits: jax.Array) -> jax.Array:
    """One exact draw per row from softmax(processed_logits): [..., V] -> [...] int32."""
    gumbel = jax.random.gumbel(rng, processed_logits.shape, jnp.float32)
    return jnp.argmax(processed_logits + gumbel, axis=-1).astype(jnp.int32)


def sample_from_probs(rng: jax.Array, probs: jax.Array) -> jax.Array:
    """One exact draw per row from an (unnormalised, non-negative) distribution [..., V]."""
    return sample(rng, jnp.log(probs))


def select(rng: jax.Array, processed_logits: jax.Array, do_sample: bool) -> jax.Array:
    """The next token: argmax when greedy, a draw when sampling. [..., V] -> [...] int32."""
    if not do_sample:
        return jnp.argmax(processed_logits, axis=-1).astype(jnp.int32)
    return sample(rng, processed_logits)
