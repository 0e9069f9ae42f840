"""A tree-shaped verify block through a family's forward (jaxspec/tree.py `TreeBlock`): each node's logits equal a
chain forward over its own path, and after the accepted path's entries are moved to consecutive slots, the cache
holds what a chain run over that path writes. Llama; the Gemma family with sliding windows of 4 keys (shorter than
the prompt and block), Gemma 2's soft-capped scores and Gemma 4's shared keys and per-layer inputs; DeepSeek-V3's
latent cache and GLM-4.5's."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxspec
from jaxspec import tree as tree_lib
from jaxspec.cache import move_cache_entries
from tests.fixtures import hf_models

PROMPT = [5, 6, 7, 8, 9, 10, 11]
# root (the prompt's last token) -> node 0 (21) -> node 2 (23) ; root -> node 1 (22) -> node 3 (24) -> node 4 (25)
TOKENS = [21, 22, 23, 24, 25]
PARENTS = [-1, -1, 0, 1, 3]
RANKS = [0, 1, 0, 0, 0]
PATHS = {0: [], 1: [0], 2: [1], 3: [0, 2], 4: [1, 3], 5: [1, 3, 4]}  # block entry -> its nodes below the root


# The default suite runs Llama and Gemma 2 (10-12 s each); the rest, 18-25 s each, run in the slow suite.
FAMILIES = ["llama", "gemma2", *(pytest.param(f, marks=pytest.mark.slow) for f in ("gemma4_text", "deepseek_v3",
                                                                                   "glm4_moe"))]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request, tiny_llama_dir, tmp_path_factory):
    if request.param == "llama":
        return jaxspec.load(tiny_llama_dir).module
    folder = tmp_path_factory.mktemp(request.param)
    if request.param in ("deepseek_v3", "glm4_moe"):
        from tests.fixtures.moe import FAMILIES as MOE, save_checkpoint

        return jaxspec.load(save_checkpoint(request.param, folder, 2, 0, MOE[request.param])).module
    return jaxspec.load(hf_models.save_tiny_gemma(request.param, folder, seed=0)).module


def _prefilled(model, size=32):
    """The cache after the prompt's first P - 1 tokens (the root, the last one, is fed with the block)."""
    cache = model.init_cache(1, size)
    ids = jnp.asarray([PROMPT[:-1]])
    _, _, cache = model(ids, jnp.arange(ids.shape[1])[None], cache)
    return cache


def _chain(model, cache, nodes):
    """A plain causal forward over [root, nodes' tokens] at consecutive positions -> (logits, cache)."""
    ids = jnp.asarray([[PROMPT[-1]] + [TOKENS[i] for i in nodes]])
    start = len(PROMPT) - 1
    logits, _, cache = model(ids, start + jnp.arange(ids.shape[1])[None], cache)
    return logits, cache


def test_each_node_sees_its_path_and_the_accepted_path_compacts_to_a_chain(model):
    tree = tree_lib.DraftTree(tokens=jnp.asarray([TOKENS]), parents=jnp.asarray([PARENTS]),
                              ranks=jnp.asarray([RANKS]), count=jnp.asarray([5]))
    start = jnp.asarray([len(PROMPT) - 1])
    block, positions = tree_lib.tree_block(tree, start)
    np.testing.assert_array_equal(positions[0], start[0] + np.array([0, 1, 1, 2, 2, 3]))
    ids = jnp.asarray([[PROMPT[-1]] + TOKENS])
    logits, _, cache = model(ids, positions, _prefilled(model), tree=block)
    for entry, nodes in PATHS.items():
        expected, _ = _chain(model, _prefilled(model), nodes)
        # The chain and the 6-entry block multiply in different kernels on CPU (a chain's first entry is one row,
        # a matrix-vector product; the block's six rows a matrix multiply), which sum in other orders: Gemma 2's logits then differ by up to 7e-5 on some CPUs. A node that saw another
        # node's path would be off by the logits' own scale (1-5).
        np.testing.assert_allclose(logits[0, entry], expected[0, -1], rtol=1e-5, atol=1e-4)

    # Accept nodes 1 and 3 (depths 1 and 2): slots start+1, start+2 take block entries 2 and 4.
    verdict = tree_lib.TreeVerdict(accepted=jnp.asarray([2]), path=jnp.asarray([[1, 3, -1]]),
                                   tokens=jnp.zeros((1, 4), jnp.int32))
    sources = tree_lib.path_sources(verdict, width=6)
    np.testing.assert_array_equal(sources[0], [0, 2, 4, 3, 4, 5])
    moved = move_cache_entries(cache, start, sources)
    _, chain_cache = _chain(model, _prefilled(model), [1, 3])
    end = len(PROMPT) + 2  # the committed prompt, the root and the two accepted nodes
    for got, want in zip(jax.tree.leaves(moved), jax.tree.leaves(chain_cache), strict=True):  # [.., S, F] each
        np.testing.assert_allclose(got[..., :end, :], want[..., :end, :], atol=5e-5)  # kernels differ, as above
