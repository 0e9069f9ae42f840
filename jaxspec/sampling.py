"""Logits processing and sampling, in the order and with the semantics of HF's warpers.

HF applies, when sampling: temperature, then top-k, then top-p (`TemperatureLogitsWarper`, `TopKLogitsWarper`,
`TopPLogitsWarper`). Greedy decoding uses the raw logits. Sampling uses the Gumbel-max trick on the processed
logits: argmax(logits + Gumbel noise) is an exact draw from softmax(logits), needs no normalisation, and treats
masked (-inf) tokens correctly.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Static sampling settings; each distinct value compiles its own loop."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int | None = None
    top_p: float | None = None

    def __post_init__(self):
        if self.do_sample:
            if not self.temperature > 0:
                raise ValueError(f"temperature must be > 0 when sampling, got {self.temperature}.")
            if self.top_k is not None and self.top_k < 1:
                raise ValueError(f"top_k must be >= 1 (or None to disable it), got {self.top_k}.")
            if self.top_p is not None and not 0 < self.top_p <= 1:
                raise ValueError(f"top_p must be in (0, 1] (or None to disable it), got {self.top_p}.")


def process_logits(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Apply the warpers to float32 logits [..., V]; removed tokens become -inf. Greedy: unchanged."""
    logits = logits.astype(jnp.float32)
    if not params.do_sample:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    if params.top_k is not None and params.top_k < logits.shape[-1]:
        kth_best = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_best, NEG_INF, logits)  # ties with the k-th best are kept, as in HF
    if params.top_p is not None and params.top_p < 1.0:
        logits = _top_p(logits, params.top_p)
    return logits


def _top_p(logits: jax.Array, top_p: float) -> jax.Array:
    """Keep the smallest set of most likely tokens whose mass exceeds top_p (at least one token), as HF does:
    in ascending order, drop tokens whose cumulative probability is <= 1 - top_p."""
    order = jnp.argsort(logits, axis=-1)  # ascending
    sorted_logits = jnp.take_along_axis(logits, order, axis=-1)
    cumulative = jnp.cumsum(jax.nn.softmax(sorted_logits, axis=-1), axis=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted = remove_sorted.at[..., -1].set(False)
    remove = jnp.take_along_axis(remove_sorted, jnp.argsort(order, axis=-1), axis=-1)  # back to vocab order
    return jnp.where(remove, NEG_INF, logits)


def sample(rng: jax.Array, processed_logits: jax.Array) -> jax.Array:
    """One exact draw per row from softmax(processed_logits): [..., V] -> [...] int32."""
    gumbel = jax.random.gumbel(rng, processed_logits.shape, jnp.float32)
    return jnp.argmax(processed_logits + gumbel, axis=-1).astype(jnp.int32)


def sample_from_probs(rng: jax.Array, probs: jax.Array) -> jax.Array:
    """One exact draw per row from an (unnormalised, non-negative) distribution [..., V]."""
    return sample(rng, jnp.log(probs))


def select(rng: jax.Array, logits: jax.Array, params: SamplingParams) -> jax.Array:
    """The next token: argmax when greedy, a draw from the processed distribution when sampling."""
    if not params.do_sample:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return sample(rng, process_logits(logits, params))
