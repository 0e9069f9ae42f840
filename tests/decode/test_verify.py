"""The shared verify step: exactness of speculative sampling, the ensemble formulas, HF's test vectors.

Distributions differ by row and by position, and rows carry different draft counts, so a verifier that mixes up
rows, positions or counts fails; deliberately broken verifiers are kept as negative controls of the same checks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import torch
from transformers.generation.utils import _speculative_sampling

from jaxspec.sampling import sample
from jaxspec.verify import verify

DRAWS = 100_000
V = 5
# p[b, i] and q[b, i]: row b's target and draft distributions at block position i (4 positions, 3 drafts).
P = np.array([
    [[0.45, 0.25, 0.15, 0.10, 0.05], [0.05, 0.10, 0.15, 0.25, 0.45], [0.30, 0.05, 0.30, 0.05, 0.30],
     [0.20, 0.20, 0.20, 0.20, 0.20]],
    [[0.10, 0.60, 0.10, 0.10, 0.10], [0.25, 0.25, 0.40, 0.05, 0.05], [0.02, 0.08, 0.10, 0.30, 0.50],
     [0.70, 0.10, 0.10, 0.05, 0.05]],
], np.float32)
Q = np.array([
    [[0.10, 0.20, 0.10, 0.50, 0.10], [0.30, 0.30, 0.20, 0.10, 0.10], [0.20, 0.20, 0.20, 0.20, 0.20]],
    [[0.40, 0.20, 0.20, 0.10, 0.10], [0.05, 0.05, 0.80, 0.05, 0.05], [0.50, 0.20, 0.10, 0.10, 0.10]],
], np.float32)
COUNT = jnp.array([3, 1])  # row 1 drafts once: its second token is the bonus token from p[1, 1]


def tv(a, b) -> float:
    return 0.5 * float(np.abs(np.asarray(a) - np.asarray(b)).sum())


def committed_tokens(verifier, p=P, q=Q, count=COUNT, ensemble_weight=None):
    """Draw drafts from q, verify against p, DRAWS times: -> (n [DRAWS, B], tokens [DRAWS, B, 4])."""
    logits, q = jnp.log(jnp.asarray(p)), jnp.asarray(q)

    def one(key):
        draft_key, verify_key = jax.random.split(key)
        drafts = sample(draft_key, jnp.log(q))  # [B, 3]
        return verifier(verify_key, logits, drafts, count, q, True, ensemble_weight)

    n, tokens = jax.vmap(one)(jax.random.split(jax.random.key(0), DRAWS))
    return np.asarray(n), np.asarray(tokens)


def position_errors(n, tokens, expected):
    """TV between what each row committed at positions 0 and 1 and `expected[b, i]`: position 1 counts the rounds
    that got there (the first draft accepted), whose token must follow the next position's distribution."""
    errors = []
    for b in range(tokens.shape[1]):
        errors.append(tv(np.bincount(tokens[:, b, 0], minlength=V) / len(tokens), expected[b, 0]))
        reached = n[:, b] >= 1
        second = np.bincount(tokens[reached, b, 1], minlength=V) / reached.sum()
        errors.append(tv(second, expected[b, 1]))
    return np.array(errors)


def always_accept(rng, target_logits, drafts, count, probs, do_sample, ensemble_weight=None):
    """Broken: keeps every draft. Its output follows q, not p."""
    bonus = sample(rng, target_logits[:, -1])
    return count, jnp.concatenate([drafts, bonus[:, None]], axis=1)


def first_position_only(rng, target_logits, drafts, count, probs, do_sample, ensemble_weight=None):
    """Broken: judges every draft by the block's first distribution (an indexing bug)."""
    first = jnp.broadcast_to(target_logits[:, :1], target_logits.shape)
    return verify(rng, first, drafts, count, probs, do_sample, ensemble_weight)


def test_speculative_sampling_outputs_each_positions_target_distribution():
    n, tokens = committed_tokens(verify)
    assert (position_errors(n, tokens, P) < 0.01).all(), position_errors(n, tokens, P)
    assert (n[:, 1] <= 1).all() and (n[:, 0] == 3).any()  # counts are per row


def test_negative_controls_fail_the_same_check():
    for broken in (always_accept, first_position_only):
        n, tokens = committed_tokens(broken)
        assert position_errors(n, tokens, P).max() > 0.1, broken.__name__


def test_draft_equal_to_target_is_always_accepted():
    n, _ = committed_tokens(verify, q=P[:, :3])
    assert (n == np.asarray(COUNT)).all()


def test_ensemble_acceptance_rate_and_output_distribution():
    for w in (0.3, 0.7):
        n, tokens = committed_tokens(verify, ensemble_weight=w)
        mixture = w * P[:, :3] + (1 - w) * Q
        # Position 0 commits the draft with probability 1 - w * TV(p, q) and follows the mixture.
        for b in range(2):
            assert abs((n[:, b] >= 1).mean() - (1 - w * tv(P[b, 0], Q[b, 0]))) < 0.01
            assert tv(np.bincount(tokens[:, b, 0], minlength=V) / DRAWS, mixture[b, 0]) < 0.01


def test_greedy_ensemble_compares_with_the_mixture_argmax():
    # HF's example: p = [.5, .49, .01], q = [.1, .89, .01], w = .5 -> the mixture's argmax is token 1, not p's 0.
    p, q = jnp.log(jnp.asarray([[0.5, 0.49, 0.01]])), jnp.asarray([[[0.1, 0.89, 0.01]]])
    logits = jnp.concatenate([p, p])[None]  # [1, 2, 3]
    n, tokens = verify(jax.random.key(0), logits, jnp.array([[1]]), jnp.array([1]), q, False, 0.5)
    assert int(n[0]) == 1 and int(tokens[0, 0]) == 1
    n, _ = verify(jax.random.key(0), logits, jnp.array([[1]]), jnp.array([1]), q, False, None)
    assert int(n[0]) == 0  # plain greedy rejects it


def test_greedy_accepts_the_matching_prefix_per_row():
    logits = jnp.log(jnp.asarray(P))  # argmax per position: row 0: 0, 4, 0, 0; row 1: 1, 2, 4, 0
    drafts = jnp.array([[0, 4, 1], [1, 3, 4]])
    n, tokens = verify(jax.random.key(0), logits, drafts, jnp.array([3, 2]), None, False)
    assert n.tolist() == [2, 1]
    assert tokens[0, :3].tolist() == [0, 4, 0] and tokens[1, :2].tolist() == [1, 2]


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
    n, tokens = verify(jax.random.key(3), jnp.asarray(NEW_LOGITS), DRAFTS, jnp.array([3]), q, True)
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
        return verify(key, jnp.asarray(new_logits), DRAFTS, jnp.array([3]), q, True)

    n, tokens = jax.vmap(one)(jax.random.split(jax.random.key(4), 10_000))
    assert (np.asarray(n) == 2).all()
    assert (np.asarray(tokens)[:, 0, :2] == [1, 4]).all()
    counts = np.bincount(np.asarray(tokens)[:, 0, 2], minlength=10)
    assert set(np.flatnonzero(counts)) <= {1, 3, 7, 8}
    assert counts[1] > counts[3] > counts[7] > 0 and counts[8] > counts[3]
