"""The shared verify step: exactness of speculative sampling, the ensemble formulas, HF's test vectors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.generation.utils import _speculative_sampling

from jaxspec.sampling import SamplingParams, sample
from jaxspec.verify import verify

SAMPLING = SamplingParams(do_sample=True)
DRAWS = 100_000
P_LOGITS = jnp.log(jnp.asarray([0.45, 0.25, 0.15, 0.1, 0.05]))
Q_LOGITS = jnp.log(jnp.asarray([0.1, 0.2, 0.1, 0.5, 0.1]))


def tv(a, b) -> float:
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def first_token_distribution(verifier, p_logits, q_logits, k=1, ensemble_weight=None):
    """Draw d_1..d_k ~ q, verify against p (the same p at every position), histogram the first committed token."""
    vocab = p_logits.shape[-1]
    target_logits = jnp.broadcast_to(p_logits, (1, k + 1, vocab))
    q = jnp.broadcast_to(jax.nn.softmax(q_logits), (1, k, vocab))

    def one(key):
        draft_key, verify_key = jax.random.split(key)
        drafts = sample(draft_key, jnp.broadcast_to(q_logits, (1, k, vocab)))
        n, tokens = verifier(verify_key, target_logits, drafts, jnp.array([k]), q, SAMPLING, ensemble_weight)
        return tokens[0, 0], n[0]

    first, accepted = jax.vmap(one)(jax.random.split(jax.random.key(0), DRAWS))
    return np.bincount(np.asarray(first), minlength=vocab) / DRAWS, np.asarray(accepted)


def always_accept(rng, target_logits, drafts, count, probs, params, ensemble_weight=None):
    """A deliberately broken verifier: it keeps every draft. Its output follows q, not p."""
    bonus = sample(rng, target_logits[:, -1])
    return count, jnp.concatenate([drafts, bonus[:, None]], axis=1)


def test_speculative_sampling_outputs_the_target_distribution():
    p = np.asarray(jax.nn.softmax(P_LOGITS))
    for k in (1, 3):
        dist, _ = first_token_distribution(verify, P_LOGITS, Q_LOGITS, k=k)
        assert tv(dist, p) < 0.01, (k, dist, p)


def test_negative_control_broken_verifier_fails_the_same_check():
    dist, _ = first_token_distribution(always_accept, P_LOGITS, Q_LOGITS)
    assert tv(dist, jax.nn.softmax(P_LOGITS)) > 0.1  # the check above would catch this verifier


def test_draft_equal_to_target_is_always_accepted():
    _, accepted = first_token_distribution(verify, P_LOGITS, P_LOGITS, k=3)
    assert (accepted == 3).all()


def test_ensemble_acceptance_rate_and_output_distribution():
    p, q = np.asarray(jax.nn.softmax(P_LOGITS)), np.asarray(jax.nn.softmax(Q_LOGITS))
    for w in (0.3, 0.7):
        dist, accepted = first_token_distribution(verify, P_LOGITS, Q_LOGITS, ensemble_weight=w)
        assert abs(accepted.mean() - (1 - w * tv(p, q))) < 0.01
        assert tv(dist, w * p + (1 - w) * q) < 0.01


def test_greedy_ensemble_compares_with_the_mixture_argmax():
    # HF's example: p = [.5, .49, .01], q = [.1, .89, .01], w = .5 -> the mixture's argmax is token 1, not p's 0.
    p, q = jnp.log(jnp.asarray([[0.5, 0.49, 0.01]])), jnp.asarray([[[0.1, 0.89, 0.01]]])
    logits = jnp.concatenate([p, p])[None]  # [1, 2, 3]
    n, tokens = verify(jax.random.key(0), logits, jnp.array([[1]]), jnp.array([1]), q, SamplingParams(), 0.5)
    assert int(n[0]) == 1 and int(tokens[0, 0]) == 1
    n, _ = verify(jax.random.key(0), logits, jnp.array([[1]]), jnp.array([1]), q, SamplingParams(), None)
    assert int(n[0]) == 0  # plain greedy rejects it


# -- transformers' own `test_speculative_sampling` vectors, ported ----------------------------------------------

CANDIDATE_LOGITS = np.full((1, 3, 10), -10.0, np.float32)
CANDIDATE_LOGITS[0, 0, 1] = CANDIDATE_LOGITS[0, 1, 4] = CANDIDATE_LOGITS[0, 2, 5] = 10.0  # drafts 1, 4, 5
NEW_LOGITS = np.full((1, 4, 10), -10.0, np.float32)
NEW_LOGITS[0, 0, 1] = NEW_LOGITS[0, 1, 4] = 10.0  # accepts 1 and 4
NEW_LOGITS[0, 2] = -np.inf
NEW_LOGITS[0, 2, 8] = 10.0  # rejects 5, resamples 8
DRAFTS = jnp.array([[1, 4, 5]])


def test_hf_speculative_sampling_vector():
    q = jax.nn.softmax(jnp.asarray(CANDIDATE_LOGITS), -1)
    n, tokens = verify(jax.random.key(3), jnp.asarray(NEW_LOGITS), DRAFTS, jnp.array([3]), q, SAMPLING)
    assert int(n[0]) == 2
    assert tokens[0, :3].tolist() == [1, 4, 8]
    # The oracle agrees.
    candidate_ids = torch.tensor([[8, 0, 3, 9, 8, 1, 4, 5]])
    valid, matches = _speculative_sampling(candidate_ids, torch.tensor(CANDIDATE_LOGITS), 3, torch.tensor(NEW_LOGITS))
    assert valid.tolist() == [[1, 4, 8]] and int(matches) == 2


def test_hf_speculative_sampling_target_distribution_vector():
    new_logits = NEW_LOGITS.copy()
    new_logits[0, 2] = -np.inf
    new_logits[0, 2, [1, 3, 7, 8]] = [2.0, 1.0, -0.01, 2.0]
    q = jax.nn.softmax(jnp.asarray(CANDIDATE_LOGITS), -1)

    def one(key):
        return verify(key, jnp.asarray(new_logits), DRAFTS, jnp.array([3]), q, SAMPLING)

    n, tokens = jax.vmap(one)(jax.random.split(jax.random.key(4), 10_000))
    assert (np.asarray(n) == 2).all()
    assert (np.asarray(tokens)[:, 0, :2] == [1, 4]).all()
    counts = np.bincount(np.asarray(tokens)[:, 0, 2], minlength=10)
    assert set(np.flatnonzero(counts)) <= {1, 3, 7, 8}
    assert counts[1] > counts[3] > counts[7] > 0 and counts[8] > counts[3]
