"""Draft trees in the compiled loop (`tree=(N, D)`; jaxspec/tree.py, loop.py `verify_tree_block`).

A branching-1 tree is the chain, round for round; greedy trees equal plain greedy, batched with ragged rows; a
hand-built tree whose second sibling is the target's token commits it every round, which also checks that the
accepted path's cache entries were moved where a chain run would have written them (a later round that read a
rejected sibling's entry would not reproduce plain greedy); every node is processed with its own path as history.
Sampled trees are checked for exactness in tests/decode/test_exactness.py."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec import settings as settings_lib
from jaxspec.schedule import make_schedule
from jaxspec.strategies.base import Context, DecodeState, Draft, Drafter, DraftStep, RoundResult, room_for_drafts
from jaxspec.strategies.prompt_lookup import continuation_trie, find_continuations
from jaxspec.tree import ROOT, DraftTree, TreeShape
from tests.fixtures import eagle3 as eagle3_fixtures
from tests.fixtures import hf_models

REPETITIVE = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4], [20, 21, 22, 23, 20, 21, 24, 20, 21]]
N = 24
CONSTANT = dict(num_assistant_tokens_schedule="constant", eos_token_id=[])


@pytest.fixture(scope="module")
def head(tiny_llama_dir, tmp_path_factory):
    """A random EAGLE-3 head for the tiny Llama, sharing its embedding (as in tests/strategies/test_eagle3.py)."""
    hf_target = hf_models.load_hf(tiny_llama_dir)
    reference = eagle3_fixtures.reference(seed=3)
    with torch.no_grad():
        reference.embed_tokens.weight.copy_(hf_target.model.embed_tokens.weight)
    return jaxspec.load(eagle3_fixtures.save(reference, tmp_path_factory.mktemp("eagle3")))


@pytest.fixture(scope="module")
def dflash_drafter(tmp_path_factory):
    """The random DFlash drafter of tests/strategies/test_dflash.py (transformers' layout) for the tiny Llama."""
    from tests.fixtures import dflash as dflash_fixtures
    from tests.strategies.test_dflash import DRAFTER

    folder = tmp_path_factory.mktemp("dflash")
    dflash_fixtures.muse(DRAFTER, seed=3).save_pretrained(folder)
    return jaxspec.load(str(folder))


def test_the_trie_of_several_matches_shares_prefixes_and_ranks_by_match():
    # Candidates: [1 2 3], [1 2 4], [5 6] and [1] (a prefix of the first: no node of its own).
    tree = continuation_trie(jnp.asarray([[[1, 2, 3], [1, 2, 4], [5, 6, 7], [1, 9, 9]]]), jnp.asarray([[3, 3, 2, 1]]))
    assert int(tree.count[0]) == 6
    np.testing.assert_array_equal(tree.tokens[0, :6], [1, 2, 3, 4, 5, 6])
    np.testing.assert_array_equal(tree.parents[0, :6], [ROOT, 0, 1, 1, ROOT, 4])
    np.testing.assert_array_equal(tree.ranks[0, :6], [0, 0, 0, 1, 1, 0])
    # [1 2 3 1 2 4 1 2]: the bigram (1, 2) continues at 2 and at 5; the unigram 2's continuations are the same.
    starts, found = find_continuations(jnp.asarray([1, 2, 3, 1, 2, 4, 1, 2, 0, 0]), jnp.int32(8), 2, 1, 3)
    np.testing.assert_array_equal(starts[:2], [2, 5])
    np.testing.assert_array_equal(found, [True, True, False])


BRANCHING_ONE = {  # (strategy, sampled): the slow suite runs the sampled head too, whose q and keys must match
    "eagle3-sampled": (True, True), "eagle3-greedy": (True, False), "lookup-sampled": (False, True),
    "lookup-greedy": (False, False)}


@pytest.mark.parametrize("case", [case if case == "lookup-greedy" else pytest.param(case, marks=pytest.mark.slow)
                                  for case in BRANCHING_ONE])
def test_a_branching_one_tree_is_the_chain_round_for_round(target, head, case):
    with_head, do_sample = BRANCHING_ONE[case]
    strategy = dict(assistant_model=head, num_assistant_tokens=4) if with_head else dict(prompt_lookup_num_tokens=4)
    sampling = dict(do_sample=True, temperature=3.0, seed=5) if do_sample else {}
    chain = jaxspec.generate(target, REPETITIVE, max_new_tokens=N, **strategy, **CONSTANT, **sampling)
    tree = jaxspec.generate(target, REPETITIVE, max_new_tokens=N, **strategy, tree=(4, 4), **CONSTANT, **sampling)
    np.testing.assert_array_equal(tree.sequences, chain.sequences)
    np.testing.assert_array_equal(tree.accepted_hist, chain.accepted_hist)
    np.testing.assert_array_equal(tree.drafted, chain.drafted)
    assert tree.tree_rounds == 0  # no alternatives: every round verified a chain
    assert chain.drafted.sum() > 0 and (chain.accepted.sum() > 0 or not with_head)  # the random target copies nothing


@pytest.mark.slow  # 20-25 s a case; the default suite runs the branching-1 and second-sibling tests through the loop
@pytest.mark.parametrize("case", ["lookup-constant", "assistant-constant", "lookup-adaptive", "assistant-adaptive",
                                  "eagle3-constant", "eagle3-adaptive", "dflash-constant", "dflash-adaptive",
                                  "lookup-budget", "assistant-budget", "eagle3-budget", "dflash-budget"])
def test_greedy_trees_equal_plain_greedy_and_rows_alone(target, head, dflash_drafter, tiny_llama_draft_dir, case):
    """An assistant's rounds often commit an alternative, after which its cache must keep only the chain's drafts
    before it (RoundResult.on_chain): a wrong entry kept would change its later drafts, not the output, so the test
    of that is the next one. "budget": 3 candidates a depth, the 5 most probable of 9 kept (constant schedule)."""
    drafter, schedule = case.split("-")
    strategy = {"lookup": dict(prompt_lookup_num_tokens=4), "eagle3": dict(assistant_model=head),
                "assistant": dict(assistant_model=jaxspec.load(tiny_llama_draft_dir),
                                  assistant_confidence_threshold=0.0),  # the weak assistant doubts every draft
                "dflash": dict(assistant_model=dflash_drafter)}[drafter]
    plain = jaxspec.generate(target, REPETITIVE, max_new_tokens=N, eos_token_id=[])
    tree, schedule = ((5, 3, 3), "constant") if schedule == "budget" else ((6, 3), schedule)
    kwargs = dict(max_new_tokens=N, tree=tree, num_assistant_tokens_schedule=schedule, eos_token_id=[], **strategy)
    out = jaxspec.generate(target, REPETITIVE, **kwargs)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.drafted.sum() > 0
    assert schedule == "adaptive" or out.tree_rounds > 0  # the constant schedule drafts the whole tree
    alone = jaxspec.generate(target, REPETITIVE[2:], **kwargs)
    np.testing.assert_array_equal(alone.new_tokens(0), out.new_tokens(2))


@pytest.mark.slow  # ~22 s
def test_an_assistant_drafting_for_itself_accepts_its_whole_chain(target):
    """The target as its own assistant: each chain token is the target's choice, so every round of a tree commits all
    D depths along the chain, as a chain does, which holds only if the assistant's cache follows the chain it fed."""
    kwargs = dict(max_new_tokens=N, assistant_model=target, assistant_confidence_threshold=0.0, **CONSTANT)
    chain = jaxspec.generate(target, REPETITIVE, num_assistant_tokens=4, **kwargs)
    tree = jaxspec.generate(target, REPETITIVE, tree=(8, 4), **kwargs)
    np.testing.assert_array_equal(tree.sequences, chain.sequences)
    np.testing.assert_array_equal(tree.accepted_hist, chain.accepted_hist)
    assert chain.accepted_hist[:, 4].sum() >= 2 * (N // 5)  # all but the budget's last round commit 4 drafts


def test_the_schedule_branches_where_alternatives_pay_and_learns_from_tree_rounds():
    """Chain acceptance 0.3 while a depth with two alternatives is won 0.9 of the time: with tree blocks nearly as cheap
    as chain blocks (an accelerator) the schedule drafts the tree; where each entry costs half a step, the chain. A
    tree round teaches the branch acceptance; the chain's comes from the chain tokens alone (`on_chain`)."""
    schedule = make_schedule("adaptive", 4, 4, draft_cost=0.0, entries_per_draft=3)
    first_depth = jnp.zeros((1, schedule.depths)).at[:, 0].set  # [1, D] counts at the first depth, none deeper
    state = dataclasses.replace(schedule.init(1, jnp.int32(4)), accepted=first_depth(3.0), judged=first_depth(10.0),
                                branch_accepted=jnp.array([9.0]), branch_judged=jnp.array([10.0]))
    active = jnp.array([True])

    def priced(per_entry):
        return dataclasses.replace(schedule, verify_costs=tuple(1 + per_entry * (e - 1) for e in schedule.entry_widths),
                                   chain_costs=tuple(1 + 0.02 * (w - 1) for w in schedule.widths))

    cheap, dear = priced(0.02), priced(0.5)
    constant = make_schedule("constant", 4, 4, draft_cost=0.0, entries_per_draft=3)
    assert int(constant.branching(state, active)) == 3  # other schedules draft the whole tree every round
    depth, branching = cheap.choice(state, active)
    assert int(branching) == 3 and int(depth) >= 1 and int(cheap.branching(state, active)) == 3
    depth, branching = dear.choice(state, active)
    assert int(branching) == 1 and int(depth) >= 1 and int(dear.branching(state, active)) == 1
    # A tree round of depth 2: the chain's first token rejected, an alternative accepted.
    result = RoundResult(drafted=jnp.array([2]), accepted=jnp.array([1]), committed=jnp.array([2]),
                         tokens=jnp.zeros((1, 5), jnp.int32), hidden=jnp.zeros((1, 5, 1)), lengths=jnp.array([9]),
                         on_chain=jnp.array([0]))
    after = cheap.update(state, result, 4)
    decay = cheap.DECAY
    np.testing.assert_allclose(after.accepted, decay * first_depth(3.0))  # no chain token accepted
    np.testing.assert_allclose(after.judged, decay * first_depth(10.0) + first_depth(1.0))  # one judged: the rejected
    np.testing.assert_allclose(after.branch_accepted, decay * 9.0 + 1)
    np.testing.assert_allclose(after.branch_judged, decay * 10.0 + 1)
    untaught = dear.update(state, result, 4)  # the dear schedule drafted a chain: the branch estimate stays
    np.testing.assert_allclose(untaught.branch_accepted, 9.0)


@dataclasses.dataclass(frozen=True)
class SecondSiblingDrafter(Drafter):
    """Knows the plain greedy continuation (`future`, each row's whole sequence) and proposes, at every depth, a
    wrong token first and the right one second, the right one being the parent of the next depth."""

    future: np.ndarray = dataclasses.field(default=None, compare=False)
    schedule: object = None

    def runtime_inputs(self):
        return {"future": self.future}

    def draft(self, ctx: Context, loop: DecodeState, state, rng) -> DraftStep:
        depth, batch = self.max_draft, loop.lengths.shape[0]
        future = ctx.draft_inputs["future"]
        index = jnp.minimum(loop.lengths[:, None] + jnp.arange(depth)[None, :], future.shape[1] - 1)
        right = jnp.take_along_axis(future, index, axis=1)  # [B, D]
        wrong = (right + 1) % ctx.target.cfg.vocab_size
        tokens = jnp.stack([wrong, right], axis=2).reshape(batch, 2 * depth)
        level = jnp.arange(2 * depth) // 2
        parents = jnp.where(level == 0, ROOT, 2 * (level - 1) + 1)
        depths = jnp.minimum(depth, room_for_drafts(loop))
        tree = DraftTree(tokens=tokens.astype(jnp.int32),
                         parents=jnp.broadcast_to(parents, tokens.shape).astype(jnp.int32),
                         ranks=jnp.broadcast_to(jnp.arange(2 * depth) % 2, tokens.shape).astype(jnp.int32),
                         count=(2 * depths).astype(jnp.int32))
        return DraftStep(draft=Draft.of_tree(tree), state=state, forwards=jnp.zeros((), jnp.int32),
                         target_cache=loop.cache)


@pytest.mark.parametrize("processors", [{}, dict(repetition_penalty=1.5, no_repeat_ngram_size=2)])
def test_the_second_sibling_is_committed_and_its_path_cached_like_a_chain(target, processors):
    """Every round accepts all D depths through second siblings, and the output is plain greedy's (with the
    history-dependent processors, each node judged with its own path)."""
    depth, prompts = 3, REPETITIVE
    plain, future = _plain_future(target, prompts, **processors)
    out = _second_siblings(target, prompts, future, depth, **processors)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    # (N - 1) / (D + 1) rounds commit D + 1 tokens each; the last round drafts only what the budget leaves
    assert out.accepted_hist[:, depth].min() == (N - 1) // (depth + 1)
    assert out.accepted_hist[:, 0].max() == 0
    assert out.tree_rounds == out.rounds  # each round verified alternatives


def _plain_future(target, prompts, **processors):
    """Plain greedy decoding of `prompts` and each row's whole sequence, as SecondSiblingDrafter's `future`."""
    plain = jaxspec.generate(target, prompts, max_new_tokens=N, eos_token_id=[], **processors)
    future = np.zeros((len(prompts), 64), np.int32)
    for row, prompt in enumerate(prompts):
        sequence = [*prompt, *plain.new_tokens(row).tolist()]
        future[row, :len(sequence)] = sequence
    return plain, future


def _second_siblings(target, prompts, future, depth, **processors):
    drafter = SecondSiblingDrafter(max_draft=depth, tree=TreeShape(2 * depth, depth), future=future,
                                   schedule=make_schedule("constant", depth, depth, draft_cost=0.0))
    settings = settings_lib.resolve(target, max_new_tokens=N, eos_token_id=[], **processors)
    return jaxspec.generate_with_drafter(target, prompts, None, drafter, settings)


@pytest.mark.slow  # 16-22 s a family
@pytest.mark.parametrize("family", ["gemma2", "gemma4_text"])
def test_gemma_trees_commit_second_siblings_and_cache_them_like_a_chain(family, tmp_path):
    """Gemma's tree attention: a sliding window of 4 keys (by rope position, shorter than a tree round's reach),
    Gemma 2's soft-capped scores, Gemma 4's layers that read another layer's keys and its per-layer inputs; each
    round commits its D depths through second siblings, and the output is plain greedy's."""
    gemma = jaxspec.load(hf_models.save_tiny_gemma(family, tmp_path, seed=0))
    depth = 3
    plain, future = _plain_future(gemma, REPETITIVE)
    out = _second_siblings(gemma, REPETITIVE, future, depth)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.accepted_hist[:, depth].min() == (N - 1) // (depth + 1)


@pytest.mark.slow  # ~60 s a family
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_moe_mtp_trees_equal_plain_greedy(family, tmp_path):
    """DeepSeek-V3's latent attention and GLM-4.5's verify trees, which their MTP layers draft; rows alone too."""
    from tests.fixtures.moe import FAMILIES, save_checkpoint

    model = jaxspec.load(save_checkpoint(family, tmp_path / family, 2, 2, FAMILIES[family]))
    plain = jaxspec.generate(model, REPETITIVE, max_new_tokens=N, eos_token_id=[])
    kwargs = dict(max_new_tokens=N, use_mtp=True, tree=(4, 2, 3), **CONSTANT)
    out = jaxspec.generate(model, REPETITIVE, **kwargs)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.tree_rounds > 0
    alone = jaxspec.generate(model, REPETITIVE[2:], **kwargs)
    np.testing.assert_array_equal(alone.new_tokens(0), out.new_tokens(2))


@pytest.mark.slow  # ~30 s: the MTP layers' loop compiles for the chain and for two trees
def test_mtp_trees_equal_the_chain_and_plain_greedy(tmp_path):
    """MTP layers keep N // D candidates per depth (and with a budget, the N most probable): a branching-1 tree
    drafts the chain round for round, and trees reproduce plain greedy, rows alone too."""
    from tests.train.test_train_mtp import save_llama_with_mtp

    folder, _ = save_llama_with_mtp(tmp_path / "mtp", layers=2, mtp_layers=2)
    model = jaxspec.load(folder)
    kwargs = dict(max_new_tokens=N, use_mtp=True, **CONSTANT)
    plain = jaxspec.generate(model, REPETITIVE, max_new_tokens=N, eos_token_id=[])
    chain = jaxspec.generate(model, REPETITIVE, num_assistant_tokens=3, **kwargs)
    single = jaxspec.generate(model, REPETITIVE, tree=(3, 3), **kwargs)
    np.testing.assert_array_equal(single.sequences, chain.sequences)
    np.testing.assert_array_equal(single.accepted_hist, chain.accepted_hist)
    for tree in [(6, 3), (5, 3, 3)]:
        out = jaxspec.generate(model, REPETITIVE, tree=tree, **kwargs)
        np.testing.assert_array_equal(out.sequences, plain.sequences)
        assert out.tree_rounds > 0
        alone = jaxspec.generate(model, REPETITIVE[1:2], tree=tree, **kwargs)
        np.testing.assert_array_equal(alone.new_tokens(0), out.new_tokens(1))


def test_tree_mistakes_are_named_before_compiling(target, monkeypatch):
    with pytest.raises(ValueError, match="multiple of the depth"):
        jaxspec.generate(target, REPETITIVE, max_new_tokens=4, prompt_lookup_num_tokens=4, tree=(10, 4))
    with pytest.raises(ValueError, match=r"4 <= N <= 8"):
        jaxspec.generate(target, REPETITIVE, max_new_tokens=4, prompt_lookup_num_tokens=4, tree=(9, 4, 2))
    with pytest.raises(ValueError, match="N,D"):
        jaxspec.generate(target, REPETITIVE, max_new_tokens=4, prompt_lookup_num_tokens=4, tree="12x4")
    with pytest.raises(ValueError, match="tree"):
        jaxspec.generate(target, REPETITIVE, max_new_tokens=4, assistant_early_exit=1, tree=(12, 4))
    # Every family has tree attention today; one that lacked it would be refused by name.
    monkeypatch.setattr(type(target.module), "tree_attention", False)
    with pytest.raises(NotImplementedError, match="tree attention"):
        jaxspec.generate(target, REPETITIVE, max_new_tokens=4, prompt_lookup_num_tokens=4, tree=(12, 4))
