"""Tree verification (jaxspec/tree.py): a branching-1 tree is a chain, greedy takes the sibling the target chooses,
and recursive rejection sampling is exact, by chi-square over the joint law of two committed tokens, with the two
negative controls the proof names (siblings drawn with replacement but verified as drawn without, and a residual not
updated after a rejected sibling) caught by the same check."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import tree as tree_lib
from jaxspec import verify as verify_lib
from tests.fixtures import oracles

V = 6  # vocabulary of the exactness test: 36 joint cells
ROWS = 200_000


def test_depths_and_ancestors_of_a_hand_built_tree():
    # root -> 0 -> 2 -> 4 ; root -> 1 ; 0 -> 3
    parents = jnp.array([[-1, -1, 0, 0, 2]])
    tree = tree_lib.DraftTree(tokens=jnp.arange(5)[None], parents=parents, ranks=jnp.array([[0, 1, 0, 1, 0]]),
                              count=jnp.array([5]))
    np.testing.assert_array_equal(tree.depths()[0], [1, 1, 2, 2, 3])
    seen = np.asarray(tree.ancestors()[0]).astype(int)
    np.testing.assert_array_equal(seen[4], [1, 0, 1, 0, 1])
    np.testing.assert_array_equal(seen[3], [1, 0, 0, 1, 0])
    np.testing.assert_array_equal(seen[1], [0, 1, 0, 0, 0])


@pytest.mark.parametrize("do_sample", [False, True])
def test_a_branching_one_tree_is_the_chain(do_sample):
    """Same key, same drafts: the tree walk accepts and commits exactly what the chain's verification does."""
    batch, k = 64, 4
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    logits = 2.0 * jax.random.normal(keys[0], (batch, k + 1, V))
    drafts = jax.random.randint(keys[1], (batch, k), 0, V)
    count = jax.random.randint(keys[2], (batch,), 0, k + 1)
    q = jax.nn.softmax(jax.random.normal(keys[3], (batch, k, V)), -1) if do_sample else None
    if not do_sample:  # make greedy chains long: most drafts are the target's argmax
        choice = jnp.argmax(logits[:, :-1], -1)
        drafts = jnp.where(jax.random.uniform(keys[1], (batch, k)) < 0.8, choice, drafts)
    rng = jax.random.PRNGKey(7)
    n, tokens = verify_lib.verify(rng, logits, drafts, count, q, do_sample)
    verdict = tree_lib.verify_tree(rng, logits, tree_lib.chain(drafts, count, q), depth=k, branching=1,
                                   do_sample=do_sample)
    np.testing.assert_array_equal(verdict.accepted, n)
    rows = np.arange(batch)
    np.testing.assert_array_equal(np.asarray(verdict.tokens)[rows, n], np.asarray(tokens)[rows, n])
    for b in range(batch):
        np.testing.assert_array_equal(verdict.tokens[b, : n[b]], tokens[b, : n[b]])
        np.testing.assert_array_equal(verdict.path[b, : n[b]], np.arange(n[b]))
    assert 0 < int(n.sum()) < int(count.sum())  # both outcomes occur


def test_greedy_commits_the_sibling_the_target_chooses():
    """root's children: node 0 (token 1) and node 1 (token 2), the target's argmax after the root being 2; node 1's
    child, node 2 (token 3), is its argmax there too: the path is nodes 1, 2, then the target's own token."""
    logits = jnp.full((1, 4, V), -5.0)
    logits = logits.at[0, 0, 2].set(5.0).at[0, 2, 3].set(5.0).at[0, 3, 4].set(5.0).at[0, 1, 0].set(5.0)
    tree = tree_lib.DraftTree(tokens=jnp.array([[1, 2, 3]]), parents=jnp.array([[-1, -1, 1]]),
                              ranks=jnp.array([[0, 1, 0]]), count=jnp.array([3]))
    verdict = tree_lib.verify_tree(jax.random.PRNGKey(0), logits, tree, depth=2, branching=2, do_sample=False)
    assert int(verdict.accepted[0]) == 2
    np.testing.assert_array_equal(verdict.path[0], [1, 2])
    np.testing.assert_array_equal(verdict.tokens[0], [2, 3, 4])


def _laws(seed):
    rng = np.random.default_rng(seed)
    def law(scale):
        x = rng.normal(size=V) * scale
        return np.exp(x) / np.exp(x).sum()
    return law(1.0), np.stack([law(1.0) for _ in range(V)]), law(0.7), np.stack([law(0.7) for _ in range(V)])


def _siblings(rng, law, rows, with_replacement):
    """Two siblings per row from `law` [rows, V] -> tokens [rows, 2] and the q each is verified with: the second
    sibling's q is `law` without the first, renormalised (its law when drawn without replacement)."""
    first = rng.random(rows)[:, None] > np.cumsum(law, axis=1)
    first = first.sum(axis=1).clip(max=V - 1)
    second_law = law.copy()
    second_law[np.arange(rows), first] = 0.0
    second_law /= second_law.sum(axis=1, keepdims=True)
    draw_from = law if with_replacement else second_law
    second = (rng.random(rows)[:, None] > np.cumsum(draw_from, axis=1)).sum(axis=1).clip(max=V - 1)
    return np.stack([first, second], 1), np.stack([law, second_law], 1)


def _joint_of_two_tokens(seed, *, with_replacement=False):
    """A depth-2 tree per row: two root children drawn from q_root, and two children of the first drawn from the
    drafter's law after its token. The target is a bigram law (p_root after the root, P[t] after token t). -> the
    flattened joint (t1 * V + t2) of the first two committed tokens (the second, when the round committed only one,
    drawn from P[t1] as the next round would), and the exact law."""
    p_root, p_next, q_root, q_next = _laws(seed)
    rng = np.random.default_rng(seed + 1)
    top, top_q = _siblings(rng, np.broadcast_to(q_root, (ROWS, V)), ROWS, with_replacement)
    below, below_q = _siblings(rng, q_next[top[:, 0]], ROWS, with_replacement)
    tokens = np.concatenate([top, below], 1)  # nodes 0, 1 (root's), 2, 3 (node 0's)
    probs = np.concatenate([top_q, below_q], 1)  # [ROWS, 4, V]
    tree = tree_lib.DraftTree(tokens=jnp.asarray(tokens, jnp.int32),
                              parents=jnp.broadcast_to(jnp.array([-1, -1, 0, 0]), (ROWS, 4)),
                              ranks=jnp.broadcast_to(jnp.array([0, 1, 0, 1]), (ROWS, 4)),
                              count=jnp.full((ROWS,), 4), probs=jnp.asarray(probs, jnp.float32))
    joint, verdict = _two_tokens_under_bigrams(tree, p_root, p_next, seed, rng)
    return joint, (p_root[:, None] * p_next).reshape(-1), np.asarray(verdict.accepted)


def _two_tokens_under_bigrams(tree, p_root, p_next, seed, rng):
    """Verify a depth-2 tree of ROWS rows against the bigram target (p_root after the root, P[t] after token t) ->
    (the flattened joint t1 * V + t2 of the first two committed tokens, the second drawn from P[t1] as the next round
    would when the round committed only one; the verdict)."""
    laws = np.concatenate([np.broadcast_to(p_root, (ROWS, 1, V)), p_next[np.asarray(tree.tokens)]], 1)
    verdict = tree_lib.verify_tree(jax.random.PRNGKey(seed), jnp.log(jnp.asarray(laws, jnp.float32)), tree, depth=2,
                                   branching=2, do_sample=True)
    committed = np.asarray(verdict.tokens)
    first = committed[:, 0]
    next_round = (rng.random(ROWS)[:, None] > np.cumsum(p_next[first], axis=1)).sum(axis=1).clip(max=V - 1)
    second = np.where(np.asarray(verdict.accepted) >= 1, committed[:, 1], next_round)
    return first * V + second, verdict


def test_recursive_rejection_sampling_is_exact_and_both_controls_are_caught(monkeypatch):
    joint, exact, accepted = _joint_of_two_tokens(3)
    assert np.mean(accepted >= 1) > 0.3 and np.mean(accepted == 2) > 0.1  # the tree's depth is exercised
    assert oracles.goodness_of_fit(joint, exact) > 1e-3

    lossy, exact, _ = _joint_of_two_tokens(3, with_replacement=True)  # drawn with replacement, verified as without
    assert oracles.goodness_of_fit(lossy, exact) < 1e-6

    monkeypatch.setattr(tree_lib, "_residual", lambda law, q: law)  # the residual not updated after a rejection
    stale, exact, _ = _joint_of_two_tokens(3)
    assert oracles.goodness_of_fit(stale, exact) < 1e-6


def test_tree_shapes_name_their_budget_depth_and_branching():
    assert tree_lib.TreeShape.parse("12,4") == tree_lib.TreeShape(12, 4, 3)
    shape = tree_lib.TreeShape.parse((8, 4, 3))
    assert shape.selects and shape.entries(1) == 4 and shape.entries(4) == 9  # min(F d, N) + 1
    assert not tree_lib.TreeShape(12, 4).selects
    with pytest.raises(ValueError, match="multiple of the depth"):
        tree_lib.TreeShape.parse("10,4")
    with pytest.raises(ValueError, match=r"4 <= N <= 12"):
        tree_lib.TreeShape.parse("13,4,3")
    with pytest.raises(ValueError, match="N,D,F"):
        tree_lib.TreeShape.parse("1,2,3,4")


def _cumulative_best(weights: np.ndarray, valid: np.ndarray, nodes: int) -> set[tuple[int, int]]:
    """EAGLE-2's rule by brute force: each candidate's path probability (the chain's draft probabilities above it,
    times its own rank's probability), the `nodes` best kept, ties to the earlier node."""
    depth, width = valid.shape
    scored = []
    for d in range(depth):
        for j in range(width):
            if valid[d, j]:
                scored.append((-np.prod(weights[:d, 0]) * weights[d, 1 + j], d * width + j, (d, j)))
    return {cell for _, _, cell in sorted(scored)[:nodes]}


def test_selection_keeps_the_most_probable_paths_as_a_tree():
    rng = np.random.default_rng(0)
    batch, depth, width, nodes = 64, 4, 3, 7
    ranked = -np.sort(-rng.dirichlet(np.full(10, 0.3), size=(batch, depth)), axis=-1)[..., :width]  # [B, D, F]
    greedy = np.concatenate([ranked[..., :1], ranked], axis=-1)  # the chain's token is the law's best
    sampled = np.concatenate([ranked[..., :1] * rng.uniform(0.2, 1.0, (batch, depth, 1)), ranked], axis=-1)
    valid = np.arange(depth)[None, :, None] < rng.integers(1, depth + 1, batch)[:, None, None]
    valid = np.broadcast_to(valid, (batch, depth, width))
    for weights in (greedy, sampled):
        keep = np.asarray(tree_lib.select_by_probability(jnp.asarray(weights, jnp.float32), jnp.asarray(valid),
                                                         nodes))
        for b in range(batch):
            assert {tuple(cell) for cell in np.argwhere(keep[b])} == _cumulative_best(weights[b], valid[b], nodes)
            chain = keep[b, :, 0]
            assert np.all(chain[:-1] >= chain[1:])  # the chain is kept from the top
            assert np.all(keep[b, 1:].any(axis=1) <= chain[:-1])  # every kept candidate's parent is kept
            assert np.all(keep[b, :, :-1] >= keep[b, :, 1:])  # a depth keeps its first siblings in draw order
    assert keep[:, :, 1:].any() and (~keep & valid).any()  # alternatives are kept, and some dropped


def _joint_of_a_selected_tree(seed, *, own_probability=False):
    """Depth 2, two candidates a depth, a budget of 3 nodes: the chain's two tokens and one alternative, at depth 1 or
    2 by `select_by_probability` (which of them depends on the chain's first token). -> as `_joint_of_two_tokens`.
    `own_probability`: rank each alternative by its own drawn token's probability, EAGLE-2's rule applied to sampled
    candidates, which keeps an alternative because of what was drawn."""
    p_root, p_next, _, q_next = _laws(seed)
    q_root = np.array([6.0, 1.0, 0.6, 0.5, 0.4, 0.3]) / 8.8  # peaked: after its best token depth 2 is worth more
    rng = np.random.default_rng(seed + 1)
    top, top_q = _siblings(rng, np.broadcast_to(q_root, (ROWS, V)), ROWS, False)
    below_law = q_next[top[:, 0]]
    below, below_q = _siblings(rng, below_law, ROWS, False)
    rows = np.arange(ROWS)

    def weights(law, drawn):  # [ROWS, F + 1]: the chain token's probability, then the ranked ones
        if own_probability:
            return np.stack([law[rows, drawn[:, 0]], law[rows, drawn[:, 0]], law[rows, drawn[:, 1]]], 1)
        return np.concatenate([law[rows, drawn[:, 0]][:, None], -np.sort(-law, axis=1)[:, :2]], 1)

    tree = tree_lib.sibling_tree(jnp.asarray(np.stack([top, below], 1), jnp.int32), jnp.full((ROWS,), 2),
                                 jnp.asarray(np.stack([top_q, below_q], 1), jnp.float32),
                                 weights=jnp.asarray(np.stack([weights(np.broadcast_to(q_root, (ROWS, V)), top),
                                                               weights(below_law, below)], 1), jnp.float32),
                                 nodes=3)
    joint, _ = _two_tokens_under_bigrams(tree, p_root, p_next, seed, rng)
    depth_one_alternative = np.asarray(tree.ranks)[:, 1] == 1  # node 1 is the root's second child
    return joint, (p_root[:, None] * p_next).reshape(-1), depth_one_alternative


def test_selected_trees_sample_exactly_and_ranking_by_the_drawn_token_is_caught():
    joint, exact, at_depth_one = _joint_of_a_selected_tree(5)
    assert 0.1 < np.mean(at_depth_one) < 0.9  # the budget goes to either depth, by the chain's first token
    assert oracles.goodness_of_fit(joint, exact) > 1e-3
    biased, exact, _ = _joint_of_a_selected_tree(5, own_probability=True)
    assert oracles.goodness_of_fit(biased, exact) < 1e-6
