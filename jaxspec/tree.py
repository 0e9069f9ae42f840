"""Draft trees and their verification: several candidates per position, judged after one target forward.

A tree of N nodes hangs below the root, the row's newest committed token. Nodes are numbered so that a parent comes
before its children and earlier siblings before later ones (the order a drafter proposes them in); node i holds a
token, its parent (-1: the root) and its rank among its siblings. The target scores [root, node 0 .. node N-1] in one
forward, so `logits[:, 0]` is its law after the root and `logits[:, i + 1]` its law after node i's path.

Verification walks down from the root, one depth at a time, trying the current node's children in sibling order:

- Greedy: the child whose token is the target's argmax at the current node (at most one: siblings differ), until
  none is; then the target's argmax there is the bonus token. The committed tokens are exactly plain greedy decoding's.
- Sampling (recursive rejection sampling; Chen et al. 2023, Jeon et al. 2024 "Recursive Speculative Decoding"):
  with r the target's law at the current node, child j (drawn from q_j given the siblings before it) is accepted with
  probability min(1, r(c_j) / q_j(c_j)); on rejection r becomes normalize(max(r - q_j, 0)) and the next sibling is
  tried; when every child is rejected, the committed token is drawn from r.

Why sampling is exact. The one-candidate lemma of speculative sampling: if c ~ q, accepting it with probability
min(1, r(c)/q(c)) and otherwise drawing from normalize(max(r - q, 0)) outputs a draw from r, for any laws r and q.
Trying child j is that lemma with r = the current residual and q = q_j, where the "otherwise" branch is the rest of
the walk over siblings j+1.. with the new residual, which outputs a draw from that residual by induction on the
number of siblings left (the last "otherwise" draws it directly). The lemma needs c_j ~ q_j given everything the
walk has seen, which holds when q_j is the law c_j was actually drawn from given the earlier siblings: for siblings
drawn without replacement, q with the earlier siblings removed and renormalised; for deterministic candidates (top-k
children, prompt-lookup matches) the one-hot q_j = delta(c_j), which accepts with probability r(c_j) and removes
c_j from r. An accepted child continues the walk at its own node with the target's law there, so each committed
token is a draw from the target's law after the tokens before it. Using a q_j that is not c_j's law (siblings drawn
with replacement but verified as without, or a residual not updated after a rejection) biases the output, and the
tests catch both.

Shapes: B rows, N nodes, V vocabulary, D the tree's depth bound, F its branching bound (both static).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from .sampling import sample_from_probs, select

ROOT = -1


@dataclasses.dataclass(frozen=True)
class TreeShape:
    """A drafter's static tree budget: `nodes` N below the root, at most `depth` D deep, so a verify block holds at
    most N + 1 entries and a round commits at most D + 1 tokens, and `branching` F, the most children a node may have
    (drafters that keep alternatives at every depth draw F candidates per depth).

    Without F, F = N // D and every candidate is verified. With N < D F, the drafter draws D F candidates and keeps
    the N with the highest cumulative draft probability (EAGLE-2's rule, `select_by_probability`), so the tree's
    shape follows the drafter's confidence from round to round inside the same static shapes."""

    nodes: int
    depth: int
    branching: int = 0  # 0: N // D

    def __post_init__(self):
        for name in ("nodes", "depth", "branching"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "branching" else 1):
                raise ValueError(f"tree {name} must be an integer >= 1, got {value!r}.")
        if not self.branching:
            if self.nodes % self.depth:
                raise ValueError(f"tree=({self.nodes}, {self.depth}): the node budget must be a multiple of the depth "
                                 f"(N = depth x branching), e.g. ({self.depth * max(1, self.nodes // self.depth)}, "
                                 f"{self.depth}), or name the branching: ({self.nodes}, {self.depth}, F).")
            object.__setattr__(self, "branching", self.nodes // self.depth)
        if not self.depth <= self.nodes <= self.depth * self.branching:
            raise ValueError(f"tree=({self.nodes}, {self.depth}, {self.branching}): the node budget must hold the "
                             f"chain and at most every candidate: {self.depth} <= N <= "
                             f"{self.depth * self.branching} (depth x branching).")

    @property
    def selects(self) -> bool:
        """Whether the drafter draws more candidates than the budget holds and keeps the most probable."""
        return self.nodes < self.depth * self.branching

    def entries(self, depth: int) -> int:
        """The verify block's entries for a tree `depth` deep: the root and F per depth, within the budget."""
        return min(self.branching * depth, self.nodes) + 1

    @staticmethod
    def parse(value) -> "TreeShape":
        """`tree=` as generate() and the CLI take it: "N,D" or "N,D,F", a pair or triple, or a TreeShape."""
        if isinstance(value, TreeShape):
            return value
        if isinstance(value, str):
            try:
                parts = tuple(int(part) for part in value.split(","))
            except ValueError:
                parts = ()
            if len(parts) not in (2, 3):
                raise ValueError(f"tree must be 'N,D' or 'N,D,F' (node budget, depth, branching), e.g. '12,4'; "
                                 f"got {value!r}.")
            return TreeShape(*parts)
        if isinstance(value, (tuple, list)) and len(value) in (2, 3):
            return TreeShape(*value)
        raise ValueError(f"tree must be (N, D) or (N, D, F): a node budget, a depth and optionally a branching, "
                         f"e.g. (12, 4); got {value!r}.")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DraftTree:
    tokens: jax.Array  # [B, N] int32 node tokens; nodes at or past `count` are padding
    parents: jax.Array  # [B, N] int32 parent node, ROOT for the root's children; parents[b, i] < i
    ranks: jax.Array  # [B, N] int32 rank among siblings (0 first), the order they were proposed in
    count: jax.Array  # [B] int32 valid nodes
    # [B, N, V] the law node i was drawn from given its parent and its earlier siblings (processed, over the
    # target's vocabulary), or None for deterministic candidates (one-hot q)
    probs: jax.Array | None = None

    @property
    def valid(self) -> jax.Array:  # [B, N] bool
        return jnp.arange(self.tokens.shape[1])[None, :] < self.count[:, None]

    def truncated(self, nodes: int) -> "DraftTree":
        """The first `nodes` nodes (a parent comes before its children, so they are a tree of their own)."""
        cut = lambda x: None if x is None else x[:, :nodes]  # noqa: E731
        return DraftTree(tokens=cut(self.tokens), parents=cut(self.parents), ranks=cut(self.ranks),
                         count=jnp.minimum(self.count, nodes), probs=cut(self.probs))

    def paths(self, depth: int) -> jax.Array:
        """[B, N, depth] int32: the tokens on each node's path below the root, in depth order (node i's own token
        last, at index depths[i] - 1; 0 past it): the history node i's logits are processed with."""
        seen = self.ancestors()  # [B, N(i), N(j)]
        depths = jnp.sum(seen, axis=2, dtype=jnp.int32)  # [B, N]
        at_depth = depths[:, :, None] == jnp.arange(1, depth + 1)[None, None, :]  # [B, N(j), D]
        on_path = seen[:, :, :, None] & at_depth[:, None, :, :]  # [B, N(i), N(j), D]
        return jnp.sum(jnp.where(on_path, self.tokens[:, None, :, None], 0), axis=2).astype(jnp.int32)

    def depths(self) -> jax.Array:
        """[B, N] int32: 1 for the root's children, 2 for theirs, ... (a node's position is the root's + depth)."""
        return jnp.sum(self.ancestors(), axis=2, dtype=jnp.int32)  # a node and its ancestors, one per depth

    def ancestors(self) -> jax.Array:
        """[B, N, N] bool: ancestors[b, i, j] when node j is node i or one of its ancestors (what node i's query may
        see of the tree in the verifying forward). The closure of "is the parent of" by repeated squaring: after s
        squarings it holds the ancestors up to 2^s generations up."""
        n = self.tokens.shape[1]
        nodes = jnp.arange(n)
        seen = (self.parents[:, :, None] == nodes[None, None, :]) | (nodes[:, None] == nodes[None, :])[None]
        for _ in range(max(n - 1, 1).bit_length()):
            seen = jnp.einsum("bij,bjk->bik", seen.astype(jnp.int32), seen.astype(jnp.int32)) > 0
        return seen


def chain(tokens: jax.Array, count: jax.Array, probs: jax.Array | None = None) -> DraftTree:
    """A chain of drafts [B, K] as a tree of branching 1: node i's parent is node i - 1."""
    k = tokens.shape[1]
    parents = jnp.broadcast_to(jnp.arange(k) - 1, tokens.shape).astype(jnp.int32)
    return DraftTree(tokens=tokens, parents=parents, ranks=jnp.zeros_like(tokens), count=count, probs=probs)


def sibling_tree(tokens: jax.Array, depth: jax.Array, probs: jax.Array | None = None,
                 branching: jax.Array | None = None, weights: jax.Array | None = None,
                 nodes: int | None = None) -> DraftTree:
    """A chain with alternatives at every depth, from a drafter that drafts one chain and keeps F candidates per
    step: tokens [B, D, F] (candidate 0 is the chain's token, the parent of every candidate one depth down), depth
    [B] the depths the row drafts, probs [B, D, F, V] each candidate's law or None. Node d * F + j is candidate j at
    depth d + 1, so the row's nodes come first and a branching-1 tree is the chain. `branching` ([], at most F;
    None: F): the candidates kept per depth this round (the adaptive schedule's choice; 1 drafts the chain alone).

    `nodes` (a budget below D F) with `weights` [B, D, F + 1] (`candidate_weights` of each depth): the `nodes`
    candidates with the highest cumulative probability (`select_by_probability`), as N nodes."""
    batch, max_depth, width = tokens.shape
    index = jnp.arange(max_depth * width)
    level, rank = index // width, index % width
    parents = jnp.where(level == 0, ROOT, (level - 1) * width)
    flat = lambda x: x.reshape((batch, max_depth * width) + x.shape[3:])  # noqa: E731
    tree = DraftTree(tokens=flat(tokens), parents=jnp.broadcast_to(parents, (batch, index.size)).astype(jnp.int32),
                     ranks=jnp.broadcast_to(rank, (batch, index.size)).astype(jnp.int32),
                     count=(depth * width).astype(jnp.int32), probs=None if probs is None else flat(probs))
    selecting = nodes is not None and nodes < max_depth * width
    if (branching is None or width == 1) and not selecting:
        return tree
    keep = level[None, :] < depth[:, None]
    if branching is not None:
        keep &= rank[None, :] < branching
    if selecting:
        keep &= select_by_probability(weights, keep.reshape(batch, max_depth, width), nodes).reshape(batch, -1)
        return packed(tree, keep).truncated(nodes)
    return packed(tree, keep)


def candidate_weights(law: jax.Array, chain_token: jax.Array, width: int) -> jax.Array:
    """What `select_by_probability` ranks a depth's candidates by, from the law [B, V] the chain's token [B] was drawn
    from -> [B, F + 1]: the chain token's probability, then the law's F largest probabilities in order."""
    chain_p = law[jnp.arange(law.shape[0]), chain_token]
    return jnp.concatenate([chain_p[:, None], jax.lax.top_k(law, width)[0]], axis=1)


def select_by_probability(weights: jax.Array, valid: jax.Array, nodes: int) -> jax.Array:
    """EAGLE-2's rule inside static shapes: of the valid candidates [B, D, F] of a chain with alternatives, keep the
    `nodes` whose paths are most probable under the drafter -> [B, D, F] bool.

    Candidate j at depth d scores P_(d-1) p_j(d): P_(d-1) the product of the chain's draft probabilities above it
    (its path is the chain's to depth d - 1), p_j(d) the j-th largest probability of depth d's law (`weights`).
    Greedy drafts the law's best tokens, so p_j(d) is candidate j's own probability and this is EAGLE-2's cumulative
    draft probability. Sampling keeps the same function of the laws, never of the alternatives drawn: whether the
    alternatives at depth d are kept depends on the chain's tokens (at any depth) and the laws only, and they are
    drawn afresh given the chain's token at d, so each kept one is still a draw from the law it is verified with,
    and the kept ones are the first siblings in draw order (p_j(d) falls with j). Whether the chain's own token at
    d is kept depends on the chain above it only (no deeper node or sibling outscores it). So recursive rejection
    sampling stays exact: in the module's proof, the walk at a node tries its first child, then "otherwise" yields a
    draw from the residual whatever number of siblings follow, so that number may depend on the first child. A
    score never exceeds its parent's (every factor is at most 1), and ties go to the earlier node, so the kept nodes
    are a tree."""
    batch, depth, width = valid.shape
    chain_p, ranked = weights[..., 0], weights[..., 1:]  # [B, D], [B, D, F]
    above = jnp.cumprod(jnp.concatenate([jnp.ones((batch, 1), chain_p.dtype), chain_p[:, :-1]], axis=1), axis=1)
    score = jnp.where(valid, above[:, :, None] * ranked, -1.0).reshape(batch, depth * width)  # [B, N']
    order = jnp.arange(depth * width)
    # Node i loses to node j when j scores higher, or the same and comes first; the best `nodes` lose to fewer.
    beats = (score[:, None, :] > score[:, :, None]) | ((score[:, None, :] == score[:, :, None])
                                                        & (order[None, :] < order[:, None])[None])  # [B, i, j]
    keep = (jnp.sum(beats, axis=2) < nodes).reshape(batch, depth, width) & valid
    # A candidate's parent is the chain's node one depth up: keep none below a dropped one (round-off guard).
    chain_kept = jnp.cumprod(keep[:, :, 0], axis=1).astype(bool)  # [B, D]
    parent_kept = jnp.concatenate([jnp.ones((batch, 1), bool), chain_kept[:, :-1]], axis=1)
    return keep & parent_kept[:, :, None]


def packed(tree: DraftTree, keep: jax.Array) -> DraftTree:
    """The nodes of `tree` where keep [B, N] (a node kept with each of its ancestors), moved to the front in their
    order, so that parents still come first and `count` says which are valid."""
    batch, n = tree.tokens.shape
    index = jnp.cumsum(keep, axis=1) - 1  # [B, N] each kept node's new index
    target = jnp.where(keep, index, n)  # dropped nodes are written past the end
    parents = jnp.where(tree.parents == ROOT, ROOT, jnp.take_along_axis(index, jnp.maximum(tree.parents, 0), axis=1))
    rows = jnp.arange(batch)[:, None]

    def move(x, fill):
        return jnp.full_like(x, fill).at[rows, target].set(x, mode="drop")

    return DraftTree(tokens=move(tree.tokens, 0), parents=move(parents.astype(jnp.int32), ROOT),
                     ranks=move(tree.ranks, 0), count=jnp.sum(keep, axis=1).astype(jnp.int32),
                     probs=None if tree.probs is None else move(tree.probs, 0.0))


def draw_candidates(rng: jax.Array, processed: jax.Array, width: int, do_sample: bool, keep_probs: bool,
                    law=jax.nn.softmax) -> tuple[jax.Array, jax.Array | None]:
    """`width` distinct candidates from processed logits [B, V] -> (tokens [B, F], their laws [B, F, V] or None).

    Greedy: the F best tokens. Sampling: F draws without replacement (Gumbel top-k: the top F of logits + Gumbel
    noise are distributed as sequential draws, each from the law with the earlier ones removed and renormalised), and
    candidate j's law is exactly that: q with candidates 0 .. j-1 removed. Where the earlier ones took all of q's
    mass (a top-k of one), candidate j is a fixed token given them, and its law the one-hot of it. With F = 1 this
    is `sampling.select` with the same key: a branching-1 tree drafts the chain's tokens. `law`: processed logits ->
    the law they are drawn from (the drafter's own function, which tests replace to break exactness on purpose)."""
    if width == 1:
        token = select(rng, processed, do_sample)[:, None]
        probs = law(processed)[:, None] if keep_probs else None
        return token, probs
    if do_sample:
        noise = jax.random.gumbel(rng, processed.shape, jnp.float32)
        _, tokens = jax.lax.top_k(processed + noise, width)
    else:
        _, tokens = jax.lax.top_k(processed, width)
    tokens = tokens.astype(jnp.int32)
    return tokens, candidate_laws(law(processed), tokens) if keep_probs else None


def candidate_laws(q: jax.Array, candidates: jax.Array) -> jax.Array:
    """A step's law q [B, V] and its candidates [B, F], drawn one after another without replacement -> [B, F, V]:
    candidate j's law, q with candidates 0 .. j-1 removed and renormalised (the one-hot of candidate j where they
    took all of q's mass: it was then a fixed token given them)."""
    if candidates.shape[1] == 1:
        return q[:, None]
    laws, removed = [], jnp.zeros(q.shape, bool)
    for j in range(candidates.shape[1]):
        one_hot = jax.nn.one_hot(candidates[:, j], q.shape[-1], dtype=q.dtype)
        remaining = jnp.where(removed, 0.0, q)
        total = jnp.sum(remaining, axis=-1, keepdims=True)
        laws.append(jnp.where(total > jnp.finfo(q.dtype).tiny, remaining / jnp.maximum(total, 1e-30), one_hot))
        removed = removed | one_hot.astype(bool)
    return jnp.stack(laws, axis=1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeBlock:
    """How the target's verifying forward lays out a tree: block entry 0 is the root, entry i + 1 is node i. Entry j
    is written to cache slot start + j (so siblings, which share a position, never share a slot), at rope position
    start + its depth, and sees the committed entries (slots below start) and its ancestors in the block
    (models/layers.py `tree_attention`). `jaxspec.cache.move_entries` then moves the accepted path to consecutive
    slots."""

    start: jax.Array  # [B] int32, the root's slot: the row's committed length - 1
    ancestors: jax.Array  # [B, W, W] bool: ancestors[b, i, j] when entry j is entry i or one of its ancestors

    def slots(self) -> jax.Array:  # [B, W]
        return self.start[:, None] + jnp.arange(self.ancestors.shape[1])[None, :]


def tree_block(tree: DraftTree, start: jax.Array) -> tuple[TreeBlock, jax.Array]:
    """The verify block of `tree` below a root in slot `start` [B] -> (its TreeBlock, rope positions [B, N + 1])."""
    batch, n = tree.tokens.shape
    nodes = tree.ancestors()  # [B, N, N]
    ancestors = jnp.zeros((batch, n + 1, n + 1), bool).at[:, :, 0].set(True).at[:, 1:, 1:].set(nodes)
    depths = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.depths()], axis=1)
    return TreeBlock(start=start, ancestors=ancestors), start[:, None] + depths


def path_sources(verdict: "TreeVerdict", width: int) -> jax.Array:
    """[B, W]: for `jaxspec.cache.move_entries`, the block entry each slot start + j takes after verification: the
    root stays, slot d (1 <= d <= accepted) takes the path's node at depth d, the rest keep their own entry."""
    batch, depth = verdict.path.shape
    sources = jnp.broadcast_to(jnp.arange(width), (batch, width))
    on_path = jnp.arange(depth)[None, :] < verdict.accepted[:, None]
    moved = jnp.where(on_path, verdict.path + 1, jnp.arange(1, depth + 1)[None, :])
    return sources.at[:, 1:depth + 1].set(moved)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TreeVerdict:
    accepted: jax.Array  # [B] int32 nodes accepted along the path
    path: jax.Array  # [B, D] int32 the accepted nodes in depth order (entries at or past `accepted`: -1)
    tokens: jax.Array  # [B, D + 1] the committed tokens: the path's, then the target's own token


def verify_tree(rng: jax.Array, target_logits: jax.Array, tree: DraftTree, depth: int, branching: int,
                do_sample: bool) -> TreeVerdict:
    """target_logits [B, N + 1, V] processed (entry 0: after the root; entry i + 1: after node i) -> the verdict.

    Each node's logits must be processed with its own path as the history (its ancestors' tokens), as a chain's
    are with the drafts before it."""
    batch = tree.tokens.shape[0]
    rows = jnp.arange(batch)
    accept_rng, residual_rng = jax.random.split(rng)
    # One uniform per (depth, sibling): with branching 1 these are a chain's per-draft uniforms, so a chain verified
    # as a tree accepts exactly what `verify.speculative_sampling` does with the same key.
    uniforms = jax.random.uniform(accept_rng, (batch, depth * branching)).reshape(batch, depth, branching)
    current = jnp.full((batch,), ROOT, jnp.int32)  # the node the walk stands on
    walking = jnp.ones((batch,), bool)  # the walk has not stopped
    path = jnp.full((batch, depth), -1, jnp.int32)
    tokens = jnp.zeros((batch, depth + 1), jnp.int32)
    accepted = jnp.zeros((batch,), jnp.int32)
    final = jnp.zeros((batch, target_logits.shape[-1]), jnp.float32)  # the law the own token is drawn from
    for d in range(depth):
        logits = target_logits[rows, current + 1]  # [B, V]
        law = jax.nn.softmax(logits, axis=-1)
        chosen = jnp.full((batch,), -1, jnp.int32)
        for j in range(branching):
            child, exists = _child(tree, current, j)  # [B], [B]
            exists = exists & walking & (chosen < 0)
            token = tree.tokens[rows, jnp.maximum(child, 0)]
            if do_sample:
                q = (jax.nn.one_hot(token, law.shape[-1], dtype=law.dtype) if tree.probs is None
                     else tree.probs[rows, jnp.maximum(child, 0)])
                ratio = law[rows, token] / jnp.maximum(q[rows, token], jnp.finfo(jnp.float32).tiny)
                take = exists & (uniforms[:, d, j] <= ratio)
                residual = _residual(law, q)
                law = jnp.where((exists & ~take)[:, None], residual, law)
            else:
                take = exists & (token == jnp.argmax(logits, axis=-1))
            chosen = jnp.where(take, child, chosen)
        stops = walking & (chosen < 0)
        final = jnp.where(stops[:, None], law if do_sample else jax.nn.one_hot(jnp.argmax(logits, -1), law.shape[-1]),
                          final)
        moved = walking & (chosen >= 0)
        path = path.at[:, d].set(jnp.where(moved, chosen, -1))
        tokens = tokens.at[:, d].set(jnp.where(moved, tree.tokens[rows, jnp.maximum(chosen, 0)], tokens[:, d]))
        accepted = accepted + moved
        current = jnp.where(moved, chosen, current)
        walking = moved
    # A walk that reached the depth bound takes its own token from the target's law at its last node.
    leaf_logits = target_logits[rows, current + 1]
    leaf_law = jax.nn.softmax(leaf_logits, -1) if do_sample else jax.nn.one_hot(jnp.argmax(leaf_logits, -1),
                                                                                 leaf_logits.shape[-1])
    final = jnp.where(walking[:, None], leaf_law, final)
    own = sample_from_probs(residual_rng, final) if do_sample else jnp.argmax(final, axis=-1).astype(jnp.int32)
    tokens = tokens.at[rows, accepted].set(own)
    return TreeVerdict(accepted=accepted, path=path, tokens=tokens)


def _child(tree: DraftTree, node: jax.Array, rank: int) -> tuple[jax.Array, jax.Array]:
    """The child of `node` [B] with sibling rank `rank` -> (its index [B], whether it exists [B])."""
    match = (tree.parents == node[:, None]) & (tree.ranks == rank) & tree.valid  # [B, N]
    return jnp.argmax(match, axis=1).astype(jnp.int32), jnp.any(match, axis=1)


def _residual(law: jax.Array, q: jax.Array) -> jax.Array:
    """normalize(max(law - q, 0)); where that has no mass (law == q, so rejection had probability zero), the law
    itself, so that float round-off never yields NaN."""
    residual = jnp.maximum(law - q, 0.0)
    total = jnp.sum(residual, axis=-1, keepdims=True)
    return jnp.where(total > jnp.finfo(jnp.float32).tiny, residual / jnp.maximum(total, 1e-30), law)
