"""DFlash block drafting in the compiled loop: greedy output equals plain greedy and transformers'
`speculation_type="dflash"` run, and sampling is exact (with a lossy-q negative control through the same check)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.strategies import dflash as dflash_strategy
from tests.fixtures import dflash as dflash_fixtures
from tests.fixtures import hf_models, oracles
from tests.fixtures.patching import patched

BLOCK = 5  # block_size: the bonus token and 4 mask tokens, 4 drafts a block
DRAFTER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               head_dim=8, sliding_window=6, layer_types=["sliding_attention", "full_attention"],
               target_layer_ids=[1, 3], block_size=BLOCK, mask_token_id=127)  # layer 3: the target's last
PROMPTS = [[5, 6, 7, 8, 9, 5, 6, 7, 10, 11, 5, 6], [3, 4, 5, 3, 4], [20, 21, 22]]
# Sampling tests: a high temperature flattens both the target's and the random drafter's distributions, so that
# drafts are often accepted (acceptance is 1 - TV(p, q)) and multi-draft rounds are common.
TEMPERATURE = 3.0


@pytest.fixture(scope="module")
def pair(tiny_llama_dir, tmp_path_factory):
    folder = tmp_path_factory.mktemp("dflash")
    reference = dflash_fixtures.muse(DRAFTER, seed=3)
    reference.save_pretrained(folder)
    return jaxspec.load(tiny_llama_dir), jaxspec.load(str(folder)), hf_models.load_hf(tiny_llama_dir), reference


def test_the_drafter_selects_the_dflash_row(pair):
    target, drafter, *_ = pair
    out = jaxspec.generate(target, PROMPTS[:1], max_new_tokens=6, assistant_model=drafter)
    assert out.strategy == "dflash"
    named = jaxspec.generate(target, PROMPTS[:1], max_new_tokens=6, assistant_model=drafter,
                             speculation_type="dflash")
    np.testing.assert_array_equal(named.sequences, out.sequences)


@pytest.mark.parametrize("schedule", [pytest.param("constant", marks=pytest.mark.slow), "adaptive"])
def test_greedy_equals_plain_greedy(pair, schedule):
    target, drafter, *_ = pair
    plain = jaxspec.generate(target, PROMPTS, max_new_tokens=24, eos_token_id=[])
    out = jaxspec.generate(target, PROMPTS, max_new_tokens=24, eos_token_id=[], assistant_model=drafter,
                           num_assistant_tokens_schedule=schedule)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    if schedule == "constant":  # one drafter forward a round, but where no row has room left for a draft
        assert (out.drafted > 0).all() and out.rounds - 1 <= out.draft_forwards <= out.rounds


def test_greedy_equals_transformers_dflash(pair):
    target, drafter, hf_target, hf_drafter = pair
    ids = torch.tensor(PROMPTS[:1])
    with torch.no_grad():
        expected = hf_target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=hf_drafter,
                                      speculation_type="dflash", max_new_tokens=16, do_sample=False,
                                      eos_token_id=None, pad_token_id=0)
    out = jaxspec.generate(target, PROMPTS[:1], max_new_tokens=16, eos_token_id=[], assistant_model=drafter,
                           num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(out.sequences, expected.numpy())


@pytest.fixture(scope="module")
def agreeing_pair(pair, tmp_path_factory):
    """The random drafter with its layers' output projections scaled by 0.2, so that its drafts lean on the embedding
    of its mask token, 40, whose drafts the target often emits after PROMPTS[2] (token 78, 7 times in 24): rounds
    then accept 0, 1 or more drafts, and the accepted counts say something."""
    target, _, hf_target, _ = pair
    reference = dflash_fixtures.muse(DRAFTER | {"mask_token_id": 40}, seed=3)
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                param.mul_(0.2)
    folder = tmp_path_factory.mktemp("dflash_agreeing")
    reference.save_pretrained(folder)
    return target, jaxspec.load(str(folder)), hf_target, reference


def test_drafted_blocks_and_accepted_counts_equal_transformers(agreeing_pair, monkeypatch):
    """Round by round, greedy: the block jaxspec drafts and the drafts verification accepts equal what transformers'
    `DFlashTokenCandidateGenerator` proposes and `_assisted_decoding` accepts (its first iteration is the prefill's
    plain step, as jaxspec's prefill is)."""
    from transformers.generation import candidate_generator

    target, drafter, hf_target, hf_drafter = agreeing_pair
    hf_generator = candidate_generator.DFlashTokenCandidateGenerator
    hf_events = []
    real_candidates = hf_generator.get_candidates
    real_update = hf_generator.update_candidate_strategy

    def get_candidates(self, input_ids, *args, **kwargs):
        ids, logits = real_candidates(self, input_ids, *args, **kwargs)
        if logits is not None:
            hf_events.append(("drafts", ids[0, input_ids.shape[1]:].tolist()))
        return ids, logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        hf_events.append(("accepted", int(num_matches)))
        return real_update(self, input_ids, scores, num_matches)

    monkeypatch.setattr(hf_generator, "get_candidates", get_candidates)
    monkeypatch.setattr(hf_generator, "update_candidate_strategy", update_candidate_strategy)
    ids = torch.tensor(PROMPTS[2:])
    with torch.no_grad():
        hf_target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=hf_drafter,
                           speculation_type="dflash", max_new_tokens=24, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    # A round is a drafted block and the count accepted from it; the first iteration drafts nothing.
    hf_rounds = [(drafts, accepted) for (kind, drafts), (_, accepted) in zip(hf_events, hf_events[1:])
                 if kind == "drafts"]

    jax_events = []
    real_draft, real_update_state = dflash_strategy.BlockDrafter.draft, dflash_strategy.BlockDrafter.update

    def record_drafts(tokens, count):
        if count[0] > 0:  # a round that drafts nothing runs no block
            jax_events.append(("drafts", tokens[0, : count[0]].tolist()))

    def record_accepted(accepted):
        jax_events.append(("accepted", int(accepted[0])))

    def draft(self, ctx, loop_state, state, rng):
        step = real_draft(self, ctx, loop_state, state, rng)
        jax.debug.callback(record_drafts, step.draft.tokens, step.draft.count, ordered=True)
        return step

    def update(self, ctx, state, result):
        jax.debug.callback(record_accepted, result.accepted, ordered=True)
        return real_update_state(self, ctx, state, result)

    with patched(dflash_strategy.BlockDrafter, jax_caches=False, draft=draft, update=update):
        jaxspec.generate(target, PROMPTS[2:], max_new_tokens=24, eos_token_id=[], assistant_model=drafter,
                         num_assistant_tokens_schedule="constant")
    jax.effects_barrier()
    jax_rounds = [(drafts, accepted) for (kind, drafts), (_, accepted) in zip(jax_events, jax_events[1:])
                  if kind == "drafts"]
    accepted_counts = {accepted for _, accepted in hf_rounds}
    assert len(hf_rounds) >= 10 and 0 in accepted_counts and len(accepted_counts) >= 3, hf_rounds
    assert len(jax_rounds) == len(hf_rounds)
    generated = 1  # the prefill's token
    for index, ((drafts, accepted), (hf_drafts, hf_accepted)) in enumerate(zip(jax_rounds, hf_rounds)):
        assert (drafts, accepted) == (hf_drafts[: len(drafts)], hf_accepted), index
        # jaxspec drafts no further than the budget's end (the drafts and the target's token must fit in it);
        # transformers drafts its whole block there too, and drops what lies past the budget after verifying it
        assert len(drafts) == min(len(hf_drafts), 24 - generated - 1), index
        generated += accepted + 1


def _sampled_first_tokens(target, drafter, rows: int):
    prompt = PROMPTS[2]
    out = jaxspec.generate(target, [prompt] * rows, max_new_tokens=4, do_sample=True, temperature=TEMPERATURE, top_k=0,
                           seed=11, eos_token_id=[], assistant_model=drafter, num_assistant_tokens=3,
                           num_assistant_tokens_schedule="constant")
    return out, out.sequences[:, len(prompt):]


def test_sampling_is_exact_and_a_lossy_q_is_caught(pair):
    """4000 rows: the first three tokens follow the target's processed law (here, at TEMPERATURE). The control takes
    q from the drafter's logits before processing (the lossy slip transformers makes in its Gemma 4 path) and must be
    rejected by the same check."""
    target, drafter, hf_target, _ = pair
    exact = oracles.exact_marginals(hf_target, PROMPTS[2], positions=3, temperature=TEMPERATURE)
    out, new = _sampled_first_tokens(target, drafter, 4000)
    multi = int(out.accepted_hist[:, 2:].sum())
    assert multi > 1000, f"only {multi} rounds accepted two or more drafts"
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i

    def raw_q(processed):  # q at temperature 1 (processed logits are the raw ones over TEMPERATURE)
        return jax.nn.softmax(processed * TEMPERATURE, axis=-1)

    with patched(dflash_strategy, draft_distribution=raw_q):
        _, lossy = _sampled_first_tokens(target, drafter, 4000)
    p_values = [oracles.goodness_of_fit(lossy[:, i], exact[i]) for i in range(3)]
    assert min(p_values) < 1e-6, p_values


@pytest.mark.slow  # ~60 s: 8,000 batch-1 calls of the two references
def test_the_references_sample_exactly(pair):
    """transformers' `speculation_type="dflash"` and z-lab's `dflash_generate` (PyPI `dflash` 0.1.0) each draw a block
    position from its processed law and verify the draft with that law, by their code; checked here rather than
    assumed (docs/design.md, 'Feature taps and block drafters'): 4000 rows of each follow the target's law at
    TEMPERATURE, and the same rows fail against the law at a 20% lower temperature, which shows the check's power. At
    TEMPERATURE both the target's and a random drafter's laws are flat, so drafts are often accepted: in many rows the
    target runs twice, the prompt and one block that commits the other two tokens."""
    import transformers
    from dflash import model as dflash_model

    _, _, hf_target, muse = pair
    prompt, rows = PROMPTS[2], 4000
    ids = torch.tensor([prompt])
    zlab_config = transformers.Qwen3Config(
        hidden_size=hf_target.config.hidden_size, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=hf_target.config.vocab_size,
        num_target_layers=hf_target.config.num_hidden_layers, block_size=BLOCK,
        layer_types=["full_attention", "full_attention"],
        dflash_config={"mask_token_id": DRAFTER["mask_token_id"], "target_layer_ids": DRAFTER["target_layer_ids"]})
    zlab = dflash_fixtures.randomize(dflash_model.DFlashDraftModel(zlab_config), seed=4)
    torch.manual_seed(0)
    eos = hf_target.generation_config.eos_token_id
    hf_target.generation_config.eos_token_id = None  # decode the full budget, as exact_marginals counts
    forwards = []  # the target's forwards in each row: 2 (the prompt, one block) where the block committed a draft
    counting = hf_target.register_forward_hook(lambda *_: forwards.append(1))

    def counted(sample):
        start = len(forwards)
        tokens = sample()[0, len(prompt):].numpy()
        return tokens, len(forwards) - start

    try:
        with torch.no_grad():
            transformers_rows = [counted(lambda: hf_target.generate(
                ids, assistant_model=muse, speculation_type="dflash", do_sample=True, temperature=TEMPERATURE, top_k=0,
                max_new_tokens=3)) for _ in range(rows)]
            zlab_rows = [counted(lambda: dflash_model.dflash_generate(zlab, hf_target, ids, 3, None,
                                                                      temperature=TEMPERATURE)) for _ in range(rows)]
    finally:
        hf_target.generation_config.eos_token_id = eos
        counting.remove()
    exact = oracles.exact_marginals(hf_target, prompt, positions=3, temperature=TEMPERATURE)
    colder = oracles.exact_marginals(hf_target, prompt, positions=3, temperature=0.8 * TEMPERATURE)
    for name, drawn in (("transformers", transformers_rows), ("z-lab", zlab_rows)):
        samples = np.stack([tokens for tokens, _ in drawn])  # [rows, 3]
        assert samples.shape == (rows, 3), name
        accepting = sum(count == 2 for _, count in drawn)
        assert accepting > rows // 4, f"{name}: a draft was accepted in only {accepting} rows"
        assert min(oracles.goodness_of_fit(samples[:, i], exact[i]) for i in range(3)) > 1e-3, name
        assert min(oracles.goodness_of_fit(samples[:, i], colder[i]) for i in range(3)) < 1e-6, name


def _drafted_rounds(target, drafter, draw_all: bool, row: int = 0, **kwargs):
    """Every round's (count, drafts of `row` up to K) as the loop proposed them; `draw_all`: every drafting round
    draws all K positions of its block, as DFlash rounds did before 7d5bb0a."""
    rounds = []

    def draft(self, ctx, loop_state, state, rng):
        step = real_draft(self, ctx, loop_state, state, rng)
        jax.debug.callback(lambda tokens, count: rounds.append((count.tolist(), tokens[row].tolist())),
                           step.draft.tokens, step.draft.count, ordered=True)
        return step

    real_draft = dflash_strategy.BlockDrafter.draft
    every_draft_drawn = {"drafts_drawn": property(lambda self: (self.max_draft,))} if draw_all else {}
    with patched(dflash_strategy.BlockDrafter, jax_caches=False, draft=draft, **every_draft_drawn):
        out = jaxspec.generate(target, PROMPTS, max_new_tokens=20, eos_token_id=[], assistant_model=drafter,
                               **kwargs)
    jax.effects_barrier()
    return out, rounds


@pytest.mark.parametrize("do_sample", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_round_draws_only_the_drafts_its_rows_may_propose(agreeing_pair, do_sample):
    """A round puts only as many block positions through the target's head as its rows may draft (1 or K here,
    `BlockDrafter.drafts_drawn`); what it proposes equals the first drafts of the whole block, round by round, and
    the output is the same, greedy and sampled with one seed."""
    target, drafter, *_ = agreeing_pair
    sampling = dict(do_sample=True, temperature=TEMPERATURE, seed=5) if do_sample else {}
    bucketed, rounds = _drafted_rounds(target, drafter, draw_all=False, **sampling)
    whole, whole_rounds = _drafted_rounds(target, drafter, draw_all=True, **sampling)
    np.testing.assert_array_equal(bucketed.sequences, whole.sequences)
    assert [count for count, _ in rounds] == [count for count, _ in whole_rounds]
    single = 0
    for (count, drafts), (_, all_drafts) in zip(rounds, whole_rounds):
        assert drafts[: count[0]] == all_drafts[: count[0]]
        if 0 < max(count) <= 1:  # one position drawn: the rest of the buffer is padding
            single += 1
            assert drafts[1:] == [0] * (len(drafts) - 1)
    assert single >= 2, rounds  # the schedule's one-draft probes took the narrow branch


# ---------------------------------------------------------------------------------------------------------------
# A draft vocabulary (models/dflash.py): drafts over V' of the target's tokens, q zero elsewhere

VOCAB = 128  # the tiny target's
FAVOURITE = 78  # the agreeing drafter's favourite draft after PROMPTS[2] (agreeing_pair's docstring)


def test_a_draft_vocabulary_restricts_the_drafts_not_the_output(agreeing_pair, tmp_path):
    """Without its favourite token in the draft vocabulary, the agreeing drafter never proposes it, and the output is
    still plain greedy's; with every token in it, rounds draft and accept exactly what the drafter without one does
    (the restricted head computes the same logits)."""
    target, drafter, _, hf_drafter = agreeing_pair
    hf_drafter.save_pretrained(tmp_path / "saved")
    without_favourite = np.setdiff1d(np.arange(VOCAB), [FAVOURITE])
    restricted = jaxspec.load(dflash_fixtures.with_draft_vocab(tmp_path / "saved", tmp_path / "restricted",
                                                               without_favourite, VOCAB))
    every = jaxspec.load(dflash_fixtures.with_draft_vocab(tmp_path / "saved", tmp_path / "every", np.arange(VOCAB),
                                                          VOCAB))
    plain = jaxspec.generate(target, PROMPTS, max_new_tokens=20, eos_token_id=[])
    constant = dict(num_assistant_tokens_schedule="constant")
    runs = {name: _drafted_rounds(target, model, draw_all=False, row=2, **constant)
            for name, model in (("drafter", drafter), ("restricted", restricted), ("every", every))}
    for out, _ in runs.values():
        np.testing.assert_array_equal(out.sequences, plain.sequences)

    def proposed(rounds):
        return [token for count, drafts in rounds for token in drafts[: count[2]]]

    assert FAVOURITE in proposed(runs["drafter"][1])
    assert proposed(runs["restricted"][1]) and FAVOURITE not in proposed(runs["restricted"][1])
    assert runs["every"][1] == runs["drafter"][1]
    np.testing.assert_array_equal(runs["every"][0].accepted, runs["drafter"][0].accepted)
    assert runs["restricted"][0].accepted.sum() < runs["drafter"][0].accepted.sum()


def test_sampling_with_a_draft_vocabulary_is_exact(pair, tmp_path):
    """4000 rows with drafts over the even tokens only: q is zero at half the tokens the target samples, whose mass
    the residual must return. The first three tokens follow the target's processed law; the lossy-q control of
    `test_sampling_is_exact_and_a_lossy_q_is_caught` is caught by the same check here too."""
    target, _, hf_target, hf_drafter = pair
    hf_drafter.save_pretrained(tmp_path / "saved")
    drafter = jaxspec.load(dflash_fixtures.with_draft_vocab(tmp_path / "saved", tmp_path / "even",
                                                            np.arange(0, VOCAB, 2), VOCAB))
    exact = oracles.exact_marginals(hf_target, PROMPTS[2], positions=3, temperature=TEMPERATURE)
    out, new = _sampled_first_tokens(target, drafter, 4000)
    assert int(out.accepted_hist[:, 2:].sum()) > 500, "too few rounds accepted two or more drafts"
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i
    with patched(dflash_strategy, draft_distribution=lambda processed: jax.nn.softmax(processed * TEMPERATURE, -1)):
        _, lossy = _sampled_first_tokens(target, drafter, 4000)
    assert min(oracles.goodness_of_fit(lossy[:, i], exact[i]) for i in range(3)) < 1e-6


def test_a_draft_vocabulary_outside_the_target_vocabulary_is_refused(pair, tmp_path):
    """transformers' layout does not say its vocabulary's size, so the pair is checked when the strategy is built."""
    target, _, _, hf_drafter = pair
    hf_drafter.save_pretrained(tmp_path / "saved")
    drafter = jaxspec.load(dflash_fixtures.with_draft_vocab(tmp_path / "saved", tmp_path / "wide",
                                                            [3, VOCAB + 5], VOCAB + 6))
    with pytest.raises(ValueError, match=r"draft vocabulary \(d2t\) names token 133"):
        jaxspec.generate(target, PROMPTS[:1], max_new_tokens=4, assistant_model=drafter)
