"""Speculative decoding with an assistant model: greedy invariance, what the strategy did against transformers,
extremes, the schedules, exact sampling, errors."""

from __future__ import annotations

import dataclasses
import math
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation import logits_process as hf

import jaxspec
from jaxspec import loop
from jaxspec import settings as settings_lib
from jaxspec.schedule import Schedule, default_verify_costs
from jaxspec.strategies.base import Draft, DraftStep, RoundResult, deciding_rows, room_for_drafts
from jaxspec.strategies.prompt_lookup import PromptLookupDrafter
from tests.fixtures import hf_models, oracles
from tests.fixtures.patching import patched
from tests.fixtures.prompts import PROMPTS, left_padded

N = 40


@pytest.fixture(scope="module")
def plain(target):
    ids, mask = left_padded(PROMPTS)
    return jaxspec.generate(target, ids, mask, max_new_tokens=N).sequences


@pytest.mark.parametrize("k, schedule, threshold", [
    (1, "constant", 0.0), pytest.param(4, "constant", 0.4, marks=pytest.mark.slow),
    pytest.param(8, "heuristic", 0.0, marks=pytest.mark.slow), (4, "heuristic_transient", 0.4),
    pytest.param(4, "adaptive", 0.0, marks=pytest.mark.slow), (8, "adaptive", 0.4),
])
def test_greedy_equals_plain_greedy(target, draft, plain, k, schedule, threshold):
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=draft, num_assistant_tokens=k,
                           num_assistant_tokens_schedule=schedule, assistant_confidence_threshold=threshold)
    np.testing.assert_array_equal(out.sequences, plain)
    # Every schedule runs the assistant. The adaptive one probes this weak assistant in the shadow (docs/design.md,
    # 'Probes judged in the shadow'): its drafts miss there, and none reaches a verify block.
    assert out.draft_forwards > 0 and (schedule == "adaptive" or out.drafted.sum() > 0)


@pytest.mark.parametrize("k", [2, pytest.param(5, marks=pytest.mark.slow)])
def test_rounds_equal_a_replay_with_transformers_models(tiny_llama_dir, tiny_llama_draft_dir, target, draft, k):
    """Each round's accepted count equals what HF's assistant drafts and HF's target accepts from the same
    committed sequence: the assistant really drafts, and its drafts are the right ones."""
    hf_target, hf_draft = hf_models.load_hf(tiny_llama_dir), hf_models.load_hf(tiny_llama_draft_dir)
    for prompt in PROMPTS:
        accepted = oracles.replay_rounds(hf_target, oracles.assistant_drafts(hf_draft, k), prompt, N, eos=2)
        out = jaxspec.generate(target, [prompt], max_new_tokens=N, assistant_model=draft, num_assistant_tokens=k,
                               num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
        assert out.rounds == len(accepted) and out.target_forwards == 1 + len(accepted)
        assert out.accepted_hist.sum(0).tolist() == oracles.histogram(accepted, k)


@pytest.mark.parametrize("k, schedule, threshold", [pytest.param(3, "constant", 0.0, marks=pytest.mark.slow),
                                                    (5, "constant", 0.4),
                                                    pytest.param(2, "heuristic_transient", 0.0, marks=pytest.mark.slow)])
def test_greedy_equals_transformers_assisted_generate(tiny_llama_dir, tiny_llama_draft_dir, target, draft, k,
                                                      schedule, threshold):
    hf_target, hf_draft = hf_models.load_hf(tiny_llama_dir), hf_models.load_hf(tiny_llama_draft_dir)
    hf_draft.generation_config.num_assistant_tokens = k
    hf_draft.generation_config.num_assistant_tokens_schedule = schedule
    hf_draft.generation_config.assistant_confidence_threshold = threshold
    for prompt in PROMPTS:
        expected = hf_target.generate(torch.tensor([prompt]), assistant_model=hf_draft, max_new_tokens=N,
                                      do_sample=False).numpy()
        out = jaxspec.generate(target, [prompt], max_new_tokens=N, assistant_model=draft, num_assistant_tokens=k,
                               num_assistant_tokens_schedule=schedule, assistant_confidence_threshold=threshold)
        np.testing.assert_array_equal(out.sequences[:, : expected.shape[1]], expected)


@pytest.mark.slow  # ~15 s
def test_settings_come_from_the_assistant_generation_config(tiny_llama_draft_dir, target, plain):
    draft = jaxspec.load(tiny_llama_draft_dir)
    draft.generation_config.update(num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                                   num_assistant_tokens_schedule="constant")
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=draft)
    assert out.accepted_hist.shape[1] == 4  # K = 3 from the assistant's generation_config
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=draft, num_assistant_tokens=5)
    assert out.accepted_hist.shape[1] == 6  # an argument passed to generate wins
    np.testing.assert_array_equal(out.sequences, plain)


@pytest.mark.parametrize("k", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_identical_assistant_accepts_every_draft(target, k):
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(target, ids, mask, max_new_tokens=N, assistant_model=target, num_assistant_tokens=k,
                           num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0,
                           eos_token_id=[])
    plain = jaxspec.generate(target, ids, mask, max_new_tokens=N, eos_token_id=[])
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert (out.accepted == out.drafted).all()
    # One prefill makes the first token; each round then commits K drafts + 1 bonus token.
    assert out.target_forwards == 1 + math.ceil((N - 1) / (k + 1))


def test_always_wrong_assistant_accepts_nothing_and_backs_off(tiny_llama_dir, target):
    wrong = jaxspec.load(tiny_llama_dir)
    wrong.module.lm_head[...] = -wrong.module.lm_head[...]  # drafts the target's least likely token
    ids, mask = left_padded(PROMPTS)
    common = dict(max_new_tokens=N, assistant_model=wrong, num_assistant_tokens=4, assistant_confidence_threshold=0.0,
                  eos_token_id=[])
    plain = jaxspec.generate(target, ids, mask, max_new_tokens=N, eos_token_id=[]).sequences
    constant = jaxspec.generate(target, ids, mask, num_assistant_tokens_schedule="constant", **common)
    np.testing.assert_array_equal(constant.sequences, plain)
    # Every round commits one token and drafts K, or what the budget leaves room for.
    assert constant.accepted.sum() == 0 and (constant.drafted == sum(min(4, N - 1 - c) for c in range(1, N))).all()
    adaptive = jaxspec.generate(target, ids, mask, **common)
    np.testing.assert_array_equal(adaptive.sequences, plain)
    # The adaptive schedule drafts 4, then 1, then backs off: 1, 2, 4, ... rounds without drafting.
    assert adaptive.accepted.sum() == 0 and (adaptive.drafted <= 4 + 6).all()
    assert adaptive.draft_forwards < constant.draft_forwards / 5


@pytest.mark.parametrize("behind, blocks", [((1, 1), [1]), pytest.param((2, 1), [2], marks=pytest.mark.slow),
                                            ((12, 2), [16]), pytest.param((5, 1), [8], marks=pytest.mark.slow),
                                            pytest.param((40, 3), [64], marks=pytest.mark.slow), ((70, 9), [64, 8])])
def test_catch_up_reads_a_gap_in_the_narrowest_block_that_covers_it(target, behind, blocks):
    """A row that sat out rounds catches up in the narrowest block that covers its gap (12 tokens: one block of 16,
    not a chunk-wide block of 64, nor several of 8), and after a round that ended in a rejection (one token behind)
    in a one-token block; the logits and cache entries equal a forward over the whole sequence."""
    import jax
    import jax.numpy as jnp

    from flax import nnx

    from jaxspec.strategies.draft_model import catch_up, catch_up_widths

    model, size, synced = target.module, 96, np.array([5, 20], np.int32)
    lengths = synced + np.array(behind, np.int32)
    tokens = jnp.asarray(np.random.default_rng(0).integers(3, target.config.vocab_size, (2, size)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(size), (2, size))
    full_logits, _, full_cache = model(tokens, positions, model.init_cache(2, size))
    # The cache holds [0, synced) of each row; past it, garbage that the catch-up must overwrite before reading.
    held = (np.arange(size)[None, :] < synced[:, None])[None, :, None, :, None]  # [1, B, 1, S, 1] ([L, B, K, S, Dh])
    stale = type(full_cache)(k=jnp.where(held, full_cache.k, 7.0), v=jnp.where(held, full_cache.v, -7.0))

    widths_run = []

    class Recording:  # the model, noting the width of each block it runs
        def __getattr__(self, name):
            return getattr(model, name)

        def __call__(self, block, block_positions, cache):
            jax.debug.callback(lambda: widths_run.append(block.shape[1]), ordered=True)
            return model(block, block_positions, cache)

    logits, cache, count = catch_up(Recording(), tokens, jnp.asarray(synced), jnp.asarray(lengths), stale,
                                    catch_up_widths(64))
    jax.effects_barrier()
    assert widths_run == blocks and int(count) == len(blocks)
    # The LM head runs on each row's last hidden state only: no block computes logits for all its positions. Checked
    # on the model code's layout: there no other product's output has the vocabulary's size (the tiny model's fused
    # gate and up, 2 x 64, have it).
    graphdef, state = nnx.split(model)
    standard = nnx.merge(graphdef, jaxspec.layout.standard_layout(state))
    compiled = jax.jit(lambda *a: catch_up(standard, *a, catch_up_widths(64))).lower(
        tokens, jnp.asarray(synced), jnp.asarray(lengths), stale).compile().as_text()
    vocab = target.config.vocab_size
    assert f"f32[2,{vocab}]" in compiled and not re.search(rf"f32\[2,\d+,{vocab}\]", compiled)
    np.testing.assert_allclose(logits, full_logits[np.arange(2), lengths - 1], rtol=1e-4, atol=1e-4)
    for row in range(2):
        for mine, full in ((cache.k, full_cache.k), (cache.v, full_cache.v)):
            np.testing.assert_allclose(mine[:, row, :, : lengths[row]], full[:, row, :, : lengths[row]], rtol=1e-4,
                                       atol=1e-5)


def run_schedule(schedule, copies, cap=7):
    """One row through rounds in which every draft is accepted (copies[i] True) or none is; -> drafts allowed per
    round."""
    state, allowed = schedule.init(1, initial=cap), []
    for copying in copies:
        drafted = int(schedule.allowed(state)[0])
        allowed.append(drafted)
        result = RoundResult(drafted=np.array([drafted]), accepted=np.array([drafted if copying else 0]),
                             committed=np.array([1]), tokens=None, hidden=None, lengths=None)
        state = schedule.update(state, result, cap=cap)
    return allowed


CPU_COSTS = dict(widths=(1, 2, 4, 8), verify_costs=(1.0, 1.2, 1.3, 1.5))  # default_verify_costs on a CPU


def first_depth(counts, depths=7):
    """[B, D] schedule counts (`DraftLength.accepted`, `judged`) with `counts` at the first depth and none deeper."""
    return np.pad(np.asarray(counts, np.float32)[:, None], ((0, 0), (0, depths - 1)))


def test_cpu_verify_costs_are_the_defaults():
    assert default_verify_costs(CPU_COSTS["widths"]) == pytest.approx(CPU_COSTS["verify_costs"])


def test_adaptive_schedule_drafts_what_pays():
    """Copying text: blocks grow to K. Text that does not copy: drafting stops, and one-draft probes come after 1, 2,
    4, ... idle rounds. When copying resumes, a probe that hits brings drafting back. An expensive drafter needs
    more evidence than a free one."""
    free = Schedule("adaptive", draft_cost=0.0, **CPU_COSTS)
    allowed = run_schedule(free, [True] * 4 + [False] * 60 + [True] * 40)
    assert allowed[:4] == [3, 7, 7, 7]  # the prior (0.6) pays for 3 drafts; full acceptance makes K pay
    idle = np.array(allowed[4:64])
    probes = np.flatnonzero(idle[20:])  # once the estimate has decayed (cheap blocks keep one draft paying a while)
    assert (idle[20:][probes] == 1).all() and len(probes) <= 5 and (idle[30:] > 0).sum() <= 3  # probes only ...
    assert np.diff(probes).tolist() == sorted(np.diff(probes).tolist()) and max(np.diff(probes)) >= 16  # backing off
    assert allowed[-1] == 7  # a probe hit once the text copied again, and blocks grew back
    costly = Schedule("adaptive", draft_cost=0.5, **CPU_COSTS)
    assert run_schedule(costly, [False])[0] == 1 and run_schedule(free, [False])[0] == 3
    assert run_schedule(costly, [True] * 6)[-1] > 1  # hits make even an expensive drafter pay
    # A probe of the costly drafter costs 0.7 plain steps (0.2 for the free one): the free one's back-off is twice
    # the unit's (PROBE_UNIT = 0.1), the costly one's 7 times.
    assert (free.probe_spacing, costly.probe_spacing) == (2, 7)
    idle_free, idle_costly = (np.array(run_schedule(s, [False] * 200)[20:]) for s in (free, costly))
    assert 0 < (idle_costly > 0).sum() < (idle_free > 0).sum()
    assert (idle_costly > 0).sum() * 0.7 / len(idle_costly) < 0.02  # idle probing costs it under 2%
    assert (idle_free > 0).sum() * 0.2 / len(idle_free) < 0.02


def test_each_draft_depth_is_priced_at_its_own_acceptance(monkeypatch):
    """A block drafter whose first draft always lands and whose second never does: one rate pooled over depths (0.5)
    keeps buying a block of 4, where each depth's own rate learns to buy the block of 2 that holds every token it
    commits. A drafter whose first draft lands every other round, and whose later drafts then always follow it (rates
    that rise with depth, as an EAGLE-3 head's): its depths past the first are estimated above the first. The prices:
    an accelerator's, where a block of 4 costs 1.19 plain steps and a drafting round 0.15."""
    schedule = Schedule("adaptive", draft_cost=0.01, round_cost=0.15, widths=(1, 2, 4, 8),
                        verify_costs=(1.0, 1.06, 1.19, 1.45))

    def rounds(rule, accepted_of, count=16):  # accepted_of(drafts, round) -> leading drafts accepted
        monkeypatch.setattr(Schedule, "DEPTH_RATES", rule)
        state, chosen = schedule.init(1, np.int32(1)), []
        for step in range(count):
            drafted = int(schedule.allowed(state)[0])
            accepted = accepted_of(drafted, step)
            chosen.append(drafted)
            state = schedule.update(state, RoundResult(drafted=np.array([drafted]), accepted=np.array([accepted]),
                                                       committed=np.array([accepted + 1]), tokens=None, hidden=None,
                                                       lengths=None), cap=7)
        return chosen, np.asarray(schedule.acceptance(state))[0]

    def first_only(drafted, step):
        return min(drafted, 1)

    chosen, rates = rounds("per-depth", first_only)
    assert chosen[-6:] == [1] * 6 and rates[0] > 0.95 and rates[1] < 0.3
    chosen, rates = rounds("pooled", first_only)
    assert chosen[-6:] == [3] * 6 and np.allclose(rates, 0.5, atol=0.02)

    def every_other_round(drafted, step):
        return drafted if step % 2 else 0

    chosen, rates = rounds("per-depth", every_other_round)
    assert chosen[-4:] == [7] * 4 and rates[0] < 0.7 and (rates[1:] > 0.85).all()


@dataclasses.dataclass(frozen=True)
class FirstDraftOnlyDrafter(PromptLookupDrafter):
    """Knows plain greedy's continuation (`future`, each row's whole sequence): its first draft is the next token,
    every later one is wrong. Its schedule decides how many it proposes."""

    future: np.ndarray = dataclasses.field(default=None, compare=False)

    def runtime_inputs(self):
        return super().runtime_inputs() | {"future": self.future}

    def draft(self, ctx, loop, state, rng):
        k, future = self.max_draft, ctx.draft_inputs["future"]
        index = jnp.minimum(loop.lengths[:, None] + jnp.arange(k)[None, :], future.shape[1] - 1)
        right = jnp.take_along_axis(future, index, axis=1)  # [B, K]
        tokens = jnp.where(jnp.arange(k)[None, :] == 0, right, (right + 1) % ctx.target.cfg.vocab_size)
        count = jnp.minimum(self.schedule.allowed(state, deciding_rows(loop)), room_for_drafts(loop))
        return DraftStep(draft=Draft(tokens=tokens.astype(jnp.int32), count=count.astype(jnp.int32)), state=state,
                         forwards=jnp.zeros((), jnp.int32), target_cache=loop.cache)


def test_the_loop_learns_which_depths_land(target, default_verify_widths):
    """In the compiled loop, with an accelerator's prices (a block of 2 at 1.06 plain steps, of 4 at 1.19), a drafter
    whose first draft always lands and whose later drafts never do: the prior (0.6 at every depth) buys blocks of 4
    at first; once the second depth has missed about six times (its estimate leans on the first depth's, near 1, and
    a block of 4 costs little more than one of 2), rounds verify one draft, each committing two tokens. One rate
    pooled over depths (0.5) would keep drafting 3 (test_each_draft_depth_is_priced_at_its_own_acceptance). The
    output is plain greedy's."""
    prompts = [[5, 6, 7, 8, 9], [3, 4, 5]]
    plain = jaxspec.generate(target, prompts, max_new_tokens=N, eos_token_id=[])
    future = np.zeros((len(prompts), 64), np.int32)
    for row, prompt in enumerate(prompts):
        sequence = [*prompt, *plain.new_tokens(row).tolist()]
        future[row, :len(sequence)] = sequence
    schedule = Schedule("adaptive", widths=(1, 2, 4), verify_costs=(1.0, 1.06, 1.19))
    drafter = FirstDraftOnlyDrafter(max_draft=3, schedule=schedule, future=future)
    out = jaxspec.generate_with_drafter(target, prompts, None, drafter,
                                        settings_lib.resolve(target, max_new_tokens=N, eos_token_id=[]))
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert (out.accepted_hist[:, 2:].sum(axis=1) == 0).all()  # no round accepted a second draft
    assert (out.accepted_hist[:, 0] <= 1).all() and out.rounds <= N // 2 + 1  # every round but the last accepted one
    # Rounds of 3 drafts on the prior, then rounds of 1: under two drafts a round, where pooling drafts 3.
    assert (out.drafted < 2 * out.rounds).all() and (out.drafter_summary["num_assistant_tokens"] == 1).all(), (
        out.drafted, out.rounds)


def test_a_doubted_first_draft_counts_as_a_rejected_one():
    """Under the adaptive schedule a drafter proposes nothing when it doubts its first token, yet it ran: that round
    counts as one rejected draft, for idle rows' probe (a missed probe: cooldown, for every row of the batch, which
    probes together) and for rows whose drafting pays (their estimate falls), or a drafter that keeps doubting would
    run every round and learn nothing. HF's schedules keep their rule and are left alone."""
    from jaxspec.strategies.draft_model import AutoregressiveDrafter

    costs = default_verify_costs((1, 2, 4, 8))
    drafter = AutoregressiveDrafter(max_draft=7, schedule=Schedule("adaptive", draft_cost=0.3, widths=(1, 2, 4, 8),
                                                                    verify_costs=costs))
    nothing = RoundResult(drafted=np.array([0, 0]), accepted=np.array([0, 0]), committed=np.array([1, 1]),
                          tokens=None, hidden=None, lengths=None)
    # Idle rows: row 0 due to probe, row 1 cooling down. The batch probes, both rows with one draft.
    idle = dataclasses.replace(drafter.schedule.init(2, np.int32(1)), accepted=first_depth([0.0, 0.0]),
                               judged=first_depth([5.0, 5.0]), cooldown=np.array([0, 3], np.int32),
                               judged_any=np.ones(2, bool))
    assert bool(drafter.schedule.probing(idle)) and drafter.schedule.allowed(idle).tolist() == [1, 1]
    after = drafter.update_length(idle, nothing)
    assert after.misses.tolist() == [1, 1] and after.cooldown.tolist()[0] == after.cooldown.tolist()[1] > 0
    # Rows whose drafting pays: each judged one more draft and accepted none, 0.8 * 5 / (0.8 * 5 + 1).
    paying = dataclasses.replace(idle, accepted=first_depth([5.0, 5.0]))
    assert drafter.schedule.allowed(paying).tolist() == [7, 7] and not bool(drafter.schedule.probing(paying))
    after = drafter.update_length(paying, nothing)
    assert np.allclose(drafter.schedule.acceptance(after)[:, 0], 0.8) and after.misses.tolist() == [0, 0]
    # A finished row (nothing committed) is left alone.
    finished = dataclasses.replace(nothing, committed=np.array([1, 0]))
    after = drafter.update_length(idle, finished)
    assert after.misses.tolist() == [1, 0] and after.cooldown.tolist()[1] == 3 and np.allclose(after.judged[1, 0], 5.0)
    hf = dataclasses.replace(drafter, schedule=Schedule("constant", initial=3))
    assert drafter.drops_doubted_first and not hf.drops_doubted_first


def test_a_batch_backs_off_together_when_its_probe_does_not_pay():
    """A probe is judged by what the whole batch got from it. At batch 8 a probe of one draft costs its two-wide block
    and a draft for every row: two rows' hits do not pay for it, so every row that drafted counts a miss and the
    batch backs off together (were each hit to make its row due at once, a batch of rows that hit now and then would
    probe nearly every round). Hits that pay keep their rows due; a lone row's hit always pays. A row that had
    nothing to propose in the probe (prompt lookup without a match) backs off with the rest, or it would be due
    whenever it next matched, and a batch whose rows match at different times would probe more often than one row."""
    schedule = Schedule("adaptive", draft_cost=0.3, **CPU_COSTS)  # a probe: 1.2 + 0.3 plain steps a row

    def probe(rows: int, hits: list[int], available=None):
        idle = dataclasses.replace(schedule.init(rows, np.int32(1)), accepted=first_depth(np.zeros(rows)),
                                   judged=first_depth(np.full(rows, 5.0)), judged_any=np.ones(rows, bool))
        if available is not None:
            idle = Schedule.with_available(idle, np.array(available))
        assert bool(schedule.probing(idle)) and schedule.allowed(idle).tolist() == [1] * rows
        hit = np.array(hits)
        drafted = np.ones(rows, np.int32) if available is None else np.minimum(np.array(available), 1)
        result = RoundResult(drafted=drafted, accepted=hit, committed=hit + 1, tokens=None, hidden=None, lengths=None)
        return schedule.update(idle, result, cap=7)

    unpaid = probe(8, [1, 1, 0, 0, 0, 0, 0, 0])  # 10 tokens for 8 x 1.5 plain steps
    assert unpaid.misses.tolist() == [1] * 8 and len(set(unpaid.cooldown.tolist())) == 1 and unpaid.cooldown[0] > 0
    assert np.allclose(schedule.acceptance(unpaid)[:2, 0], 1 / 5)  # the hits still count as evidence
    paid = probe(8, [1, 1, 1, 1, 1, 1, 1, 0])  # 15 tokens for 12 plain steps
    assert paid.misses.tolist() == [0] * 7 + [1] and paid.cooldown.tolist()[:7] == [0] * 7 and paid.cooldown[7] > 0
    alone = probe(1, [1])  # 2 tokens for 1.5 plain steps
    assert alone.misses.tolist() == [0] and alone.cooldown.tolist() == [0]
    # Rows 4-7 had nothing to copy: they neither drafted nor were judged, yet they wait with the rows that missed.
    partial = probe(8, [0] * 8, available=[3] * 4 + [0] * 4)
    assert partial.misses.tolist() == [1] * 8 and len(set(partial.cooldown.tolist())) == 1 and partial.cooldown[0] > 0
    assert np.allclose(partial.judged[4:], first_depth(np.full(4, 5.0)))


def test_a_first_probe_and_one_after_a_miss_are_judged_in_the_shadow(monkeypatch):
    """A row's first probe, before any of its drafts was judged, and one that follows a missed probe are judged in
    the shadow (the loop runs the plain step and the schedule learns whether each row's first draft was the token it
    committed: docs/design.md, 'Probes judged in the shadow'), with one draft; a probe after a hit is verified. A hit
    in the shadow makes its row due again at once, for a verified probe, and keeps its misses, so that a verified
    miss then backs off further; a miss backs off as a verified one does. In a batch every due row must have no hit
    to verify, and a hit brings back only the rows that hit."""
    schedule = Schedule("adaptive", draft_cost=0.3, **CPU_COSTS)

    def idle(rows: int, misses: list[int]):  # rows whose drafts were judged, none accepted
        return dataclasses.replace(schedule.init(rows, np.int32(1)), accepted=first_depth(np.zeros(rows)),
                                   judged=first_depth(np.full(rows, 5.0)), misses=np.array(misses, np.int32),
                                   judged_any=np.ones(rows, bool))

    def shadow(hits: list[bool]):  # the round as the loop hands it over: drafted, first draft rejected, 1 committed
        rows = len(hits)
        return RoundResult(drafted=np.ones(rows, np.int32), accepted=np.zeros(rows, np.int32),
                           committed=np.ones(rows, np.int32), tokens=None, hidden=None, lengths=None,
                           in_shadow=np.bool_(True), shadow_hits=np.array(hits))

    def verified_miss(state):
        return schedule.update(state, RoundResult(drafted=np.array([1]), accepted=np.array([0]), committed=np.array([1]),
                                                  tokens=None, hidden=None, lengths=None), cap=7)

    # A fresh row whose prior does not pay: its first probe is in the shadow. A hit brings a verified probe at once;
    # a miss backs off as a verified miss does.
    fresh = dataclasses.replace(schedule.init(1, np.int32(1)), accepted=first_depth(np.full(1, 0.2)))
    assert int(schedule.paying_length(fresh)) == 0 and bool(schedule.probing(fresh))
    assert bool(schedule.in_shadow(fresh)) and schedule.allowed(fresh).tolist() == [1]
    fresh_hit, fresh_miss = (schedule.update(fresh, shadow([hit]), cap=7) for hit in (True, False))
    assert fresh_hit.judged_any.tolist() == [True] and fresh_hit.verify_next.tolist() == [True]
    assert bool(schedule.probing(fresh_hit)) and not bool(schedule.in_shadow(fresh_hit))
    assert fresh_miss.misses.tolist() == [1] and fresh_miss.cooldown[0] == verified_miss(fresh).cooldown[0] > 0
    monkeypatch.setattr(Schedule, "SHADOW_PROBES", "after-miss")  # the rule before 2026-12-07: verified
    assert bool(schedule.probing(fresh)) and not bool(schedule.in_shadow(fresh))
    monkeypatch.undo()

    first = idle(1, [0])  # judged drafts, and no missed probe yet: verified
    assert bool(schedule.probing(first)) and not bool(schedule.in_shadow(first))
    missed_once = verified_miss(first)
    assert missed_once.misses.tolist() == [1] and missed_once.cooldown[0] > 0
    after_miss = idle(1, [1])
    assert bool(schedule.in_shadow(after_miss)) and schedule.allowed(after_miss).tolist() == [1]
    hit, miss = schedule.update(after_miss, shadow([True]), cap=7), schedule.update(after_miss, shadow([False]), cap=7)
    assert hit.misses.tolist() == [1] and hit.cooldown.tolist() == [0] and hit.verify_next.tolist() == [True]
    assert bool(schedule.probing(hit)) and not bool(schedule.in_shadow(hit))  # due at once, verified
    assert np.allclose(hit.judged[:, 0], 0.8 * 5 + 1) and np.allclose(hit.accepted[:, 0], 1)  # judged, accepted
    missed_twice = verified_miss(hit)
    assert missed_twice.misses.tolist() == [2] and not missed_twice.verify_next[0]
    assert missed_twice.cooldown[0] > missed_once.cooldown[0]
    assert miss.misses.tolist() == [2] and miss.cooldown[0] > missed_once.cooldown[0]
    assert np.allclose(miss.judged[:, 0], 0.8 * 5 + 1) and np.allclose(miss.accepted, 0)
    assert not bool(schedule.in_shadow(idle(2, [1, 0])))  # a row that has not missed: verified
    batch = schedule.update(idle(3, [1, 1, 1]), shadow([False, True, False]), cap=7)
    assert batch.verify_next.tolist() == [False, True, False] and batch.misses.tolist() == [2, 1, 2]
    assert batch.cooldown[1] == 0 and min(batch.cooldown[0], batch.cooldown[2]) > 0
    assert float(schedule.shadow_price(np.int32(1))) == pytest.approx(1.0 + 0.3)  # no verify block
    # Trees and universal decoding (`Schedule.shadow` off) verify every probe, of the probe's own length.
    verified_only = dataclasses.replace(schedule, shadow=False)
    assert not bool(verified_only.in_shadow(after_miss))
    assert verified_only.allowed(after_miss).tolist() == [int(verified_only.probe_length())]


def test_probes_in_the_shadow_keep_greedy_output_and_verify_less(target):
    """End to end, prompt lookup on text whose matches the target does not continue: probes after the first miss
    run the plain step, so fewer drafts reach a verify block, the schedule's own accounting expects more of the
    call, and the tokens are plain greedy's."""
    prompts = [[5, 6, 7, 8, 9, 10, 11]]
    plain = jaxspec.generate(target, prompts, max_new_tokens=64, eos_token_id=[]).sequences
    shadowed = jaxspec.generate(target, prompts, max_new_tokens=64, eos_token_id=[], prompt_lookup_num_tokens=3)
    with patched(Schedule, in_shadow=lambda self, state, active=None: np.bool_(False)):
        verified = jaxspec.generate(target, prompts, max_new_tokens=64, eos_token_id=[], prompt_lookup_num_tokens=3)
    np.testing.assert_array_equal(shadowed.sequences, plain)
    np.testing.assert_array_equal(verified.sequences, plain)
    assert verified.accepted.sum() == shadowed.accepted.sum() == 0
    assert 0 < shadowed.drafted.sum() < verified.drafted.sum()
    assert int(shadowed.tree_rounds) == 0  # a shadow round verified no block, let alone a tree
    assert float(shadowed.modelled_speedup) > float(verified.modelled_speedup)


@pytest.mark.slow  # ~40 s: 6,000 sampled rows, and 2,000 through a broken shadow round
@pytest.mark.usefixtures("default_verify_widths")
def test_sampling_with_probes_in_the_shadow_is_exact(tiny_llama_dir, tmp_path):
    """Under sampling, a probe judged in the shadow commits the plain step's draw from the target's law, never its
    draft. Prompt lookup on a bigram model (`oracles.without_attention`) whose prompt follows each token with its
    third likeliest successor: the adaptive schedule drafts those copies, they mostly miss, and later probes are
    judged in the shadow (counted by a callback on the loop's choice). Every new token follows the target's exact
    law (`oracles.bigram_marginals`, checked against `oracles.exact_marginals` for the first three; 6,000 rows catch
    a bias of 3.4-5.7% TV at each position with power 0.9 at alpha 1e-3). Measured: a shadow round in each call of
    2,000 rows (round 5, about 1,250 rows drafting), and the control, a shadow round that commits its draft instead,
    failed with p-values of 0 and 1e-202 at the two positions after it."""
    hf_target = oracles.without_attention(hf_models.load_hf(tiny_llama_dir))
    hf_target.save_pretrained(tmp_path)
    target = jaxspec.load(str(tmp_path))
    last, positions, rows = 9, 8, 6000
    prompt = oracles.copyable_prompt(hf_target, last=last, top=20, successor=2)
    warpers = hf.LogitsProcessorList([hf.TemperatureLogitsWarper(0.5), hf.TopKLogitsWarper(5)])
    exact = oracles.bigram_marginals(hf_target, last, positions, warpers)
    np.testing.assert_allclose(exact[:3], oracles.exact_marginals(hf_target, prompt, 3, processors=warpers), atol=1e-9)
    settings = dict(max_new_tokens=positions, do_sample=True, temperature=0.5, top_k=5, eos_token_id=[],
                    prompt_lookup_num_tokens=3, max_matching_ngram_size=1, num_assistant_tokens_schedule="adaptive")

    def sampled(count: int, seed: int):
        return oracles.sample_rows(lambda ids, seed: jaxspec.generate(target, ids, seed=seed, **settings), prompt,
                                   count, seed)

    shadow_rounds = []  # (round, rows that drafted in it) of every round judged in the shadow

    def counting(drafter, drafter_state, state, count):
        in_shadow = choose(drafter, drafter_state, state, count)
        jax.debug.callback(lambda flag, rnd, n: shadow_rounds.append((int(rnd), int(n))) if flag else None,
                           in_shadow, state.counters.rounds, jnp.sum(count > 0))
        return in_shadow

    def commits_its_draft(spec, ctx, state, step, count, rng, verify_floor):
        """The control: a shadow round (no drafts verified, some drafted) commits a drafting row's first draft."""
        checked, cache = verify_round(spec, ctx, state, step, count, rng, verify_floor)
        drafted_in_shadow = (count == 0) & (step.draft.count > 0) & ~state.done
        first = jnp.where(drafted_in_shadow, step.draft.tokens[:, 0], checked.tokens[:, 0])
        return dataclasses.replace(checked, tokens=checked.tokens.at[:, 0].set(first)), cache

    choose, verify_round = loop._in_shadow, loop._verify_round
    with patched(loop, _in_shadow=counting):
        out = sampled(rows, seed=3)
    assert shadow_rounds and min(r for r, _ in shadow_rounds) < positions - 1, shadow_rounds
    assert sum(n for _, n in shadow_rounds) >= rows // 4  # most rows drafted in a shadow round
    new = out.sequences[:, len(prompt):]
    values = [oracles.goodness_of_fit(new[:, i], exact[i]) for i in range(positions)]
    assert min(values) > oracles.ALPHA, values
    with patched(loop, _verify_round=commits_its_draft):
        broken = sampled(2000, seed=4).sequences[:, len(prompt):]
    assert min(oracles.goodness_of_fit(broken[:, i], exact[i]) for i in range(positions)) < 1e-9


def test_a_drafter_that_could_never_pay_never_probes():
    """Probes look for text the drafter predicts. Where not even text it predicts perfectly (d drafts committing d + 1
    tokens) pays for a round, as for an assistant that costs more than the target with its catch-up (universal
    decoding of Qwen 0.5B by SmolLM2 on a CPU: a block of 2 at 1.97 plain steps, 0.55 a draft, 2.07 a drafting
    round), a probe finds nothing, so the batch never drafts; priced so that a perfectly predicted block would pay,
    the same rows probe."""
    widths, verify = (1, 2, 4, 5), (1.0, 1.974, 3.763, 3.763)
    hopeless = Schedule("adaptive", draft_cost=0.549, round_cost=2.071, widths=widths, verify_costs=verify)
    idle = dataclasses.replace(hopeless.init(4, np.int32(1)), accepted=first_depth(np.zeros(4), 4),
                               judged=first_depth(np.full(4, 5.0), 4), judged_any=np.ones(4, bool))  # due, could it pay
    assert not bool(hopeless.drafting_can_pay())
    assert hopeless.allowed(idle).tolist() == [0] * 4 and not bool(hopeless.probing(idle))
    certain = dataclasses.replace(idle, accepted=first_depth(np.full(4, 5.0), 4))  # even rows that accept everything
    assert hopeless.allowed(certain).tolist() == [0] * 4
    cheaper = dataclasses.replace(hopeless, round_cost=0.5)  # 5 tokens for 3.763 + 4 x 0.549 + 0.5 = 6.46: no
    assert not bool(cheaper.drafting_can_pay())
    cheapest = dataclasses.replace(hopeless, draft_cost=0.1, round_cost=0.1)  # 5 tokens for 4.26: yes
    assert bool(cheapest.drafting_can_pay()) and bool(cheapest.probing(idle))
    # Only the widest block could pay (2 tokens for 2.17 steps, 4 for 4.16, 5 for 4.26), so the probe drafts 4.
    assert cheapest.allowed(idle).tolist() == [4] * 4


def test_a_probe_drafts_enough_to_pay_for_its_round():
    """Where a block of 2 cannot pay even when its draft is accepted, a one-draft probe never pays for its round: every
    probe would count as a miss and the schedule would never learn an acceptance that pays at a longer length. So a
    probe drafts the fewest that fill a verify width whose round could pay on text predicted perfectly. Prices of
    Qwen2.5-Coder-1.5B drafted by the 0.5B on a CPU (blocks of 2, 4 and 5 at 2.39, 2.30 and 2.43 plain steps, 0.32 a
    draft): 3 drafts, 4 tokens for 3.26 steps. (What that does to a decode: tests/e2e/test_simulate_schedule.py.)"""
    widths, verify = (1, 2, 4, 5), (1.0, 2.39, 2.30, 2.43)
    schedule = Schedule("adaptive", draft_cost=0.32, widths=widths, verify_costs=verify)
    assert int(schedule.probe_length()) == 3 and int(schedule.probe_spacing) == 23  # a probe: 2.26 steps more
    # Where a block of 2 can pay (CPU_COSTS: 1.5 steps with a 0.3 draft), a probe is one draft, as it always was.
    assert int(Schedule("adaptive", draft_cost=0.3, **CPU_COSTS).probe_length()) == 1
    # Where only the widest block could pay (3 drafts: 4 tokens for 4.04 steps; 4: 5 tokens for 4.75), 4 drafts.
    assert int(dataclasses.replace(schedule, draft_cost=0.58).probe_length()) == 4
    # Verifying at the ends (widths 1 and 5), one draft in the block of 5 can pay (2 tokens for 1.55 steps): one.
    ends = Schedule("adaptive", draft_cost=0.0, widths=(1, 5), verify_costs=(1.0, 1.55))
    assert int(ends.probe_length()) == 1 and int(ends.probe_spacing) == 6


def test_rows_with_nothing_to_copy_neither_buy_a_block_nor_probe():
    """Prompt lookup knows each row's match before the batch decides (Schedule.with_available): a row without one
    gains nothing from a wide block, so one copying row of eight does not buy [8, W] for the batch, and a batch with
    no match anywhere does not probe."""
    schedule = Schedule("adaptive", draft_cost=0.0, widths=(1, 2, 4, 8), verify_costs=(1.0, 1.3, 1.6, 2.0))
    copying = dataclasses.replace(schedule.init(8, np.int32(1)), accepted=first_depth(np.full(8, 4.0)),
                                  judged=first_depth(np.full(8, 5.0)), cooldown=np.full(8, 3, np.int32))  # a = 0.8
    assert schedule.allowed(copying).tolist() == [7] * 8  # every row may copy: a wide block pays
    one_match = Schedule.with_available(copying, np.array([7, 0, 0, 0, 0, 0, 0, 0]))
    assert schedule.allowed(one_match).tolist() == [0] * 8  # 1 row's gain does not pay 8 rows' block
    # Matches of 2: width 4 (3 drafts), the narrowest that holds them; a wider block would hold nothing more.
    assert schedule.allowed(Schedule.with_available(copying, np.full(8, 2))).tolist() == [3] * 8
    idle = dataclasses.replace(schedule.init(2, np.int32(1)), accepted=first_depth(np.zeros(2)),
                               judged=first_depth(np.full(2, 5.0)), judged_any=np.ones(2, bool))  # due to probe
    assert bool(schedule.probing(idle)) and schedule.allowed(idle).tolist() == [1, 1]
    nothing_to_copy = Schedule.with_available(idle, np.zeros(2, np.int32))
    assert not bool(schedule.probing(nothing_to_copy)) and schedule.allowed(nothing_to_copy).tolist() == [0, 0]


def test_a_batch_decides_its_width_together():
    """A verify block is one forward for the whole batch, as wide as its longest draft: the batch drafts what pays
    summed over its running rows. One copying row among idle ones does not make a wide block pay when every row pays
    for its width; once most rows copy, it does, and every row then drafts that length."""
    schedule = Schedule("adaptive", draft_cost=0.3, **CPU_COSTS)
    state = schedule.init(8, np.int32(1))
    one_hot = dataclasses.replace(state, accepted=first_depth(np.array([5.0] + [0.0] * 7)),
                                  judged=first_depth(np.full(8, 5.0)), cooldown=np.full(8, 4, np.int32))
    assert schedule.allowed(one_hot).tolist() == [0] * 8  # alone, row 0 would draft 7
    row_0 = jax.tree.map(lambda x: x[:1], one_hot)
    assert schedule.allowed(row_0).tolist() == [7]
    most = dataclasses.replace(one_hot, accepted=first_depth(np.array([5.0] * 6 + [0.0] * 2)))
    assert schedule.allowed(most).tolist() == [7] * 8
    # Finished rows do not count: with only row 0 running, it drafts what pays for it alone.
    assert schedule.allowed(one_hot, active=np.array([True] + [False] * 7)).tolist() == [7] * 8


def test_a_batch_drafts_for_its_rows_furthest_from_done():
    """A batch runs until its last row is done, so it drafts for the running rows furthest from their budget
    (`deciding_rows`): drafts that only speed a row already ahead buy the batch nothing. The round is then judged by
    the choice made for those rows: a probe for the row behind is a probe (it backs off), although with the row ahead
    weighed too the same state would have paid for a wide block."""
    loop_state = types.SimpleNamespace(lengths=np.array([10, 12, 12, 11]), budget_end=np.full(4, 20),
                                       done=np.array([False, False, True, False]))
    assert deciding_rows(loop_state).tolist() == [True, False, False, False]  # 10 to go; the done row never decides
    loop_state.lengths = np.array([11, 12, 12, 11])
    assert deciding_rows(loop_state).tolist() == [True, False, False, True]  # ties decide together

    schedule = Schedule("adaptive", draft_cost=0.3, **CPU_COSTS)
    state = dataclasses.replace(schedule.init(2, np.int32(1)), accepted=first_depth(np.array([0.0, 5.0])),
                                judged=first_depth(np.full(2, 5.0)))  # row 0 (behind) accepts nothing, row 1 all
    assert schedule.allowed(state).tolist() == [7, 7]  # both rows weighed: row 1's drafts pay for the block
    behind = np.array([True, False])
    assert schedule.allowed(state, behind).tolist() == [1, 1] and bool(schedule.probing(state, behind))
    result = RoundResult(drafted=np.array([1, 1]), accepted=np.array([0, 1]), committed=np.array([1, 2]), tokens=None,
                         hidden=None, lengths=None, deciding=behind)
    after = schedule.update(state, result, cap=7)
    assert after.misses.tolist() == [1, 1] and after.cooldown[0] == after.cooldown[1] > 0  # a probe that did not pay
    undecided = schedule.update(state, dataclasses.replace(result, deciding=None), cap=7)
    assert undecided.misses.tolist() == [0, 0]  # judged by the other choice it would not count as a probe at all


def test_heuristic_schedule_follows_transformers_rule():
    """+2 after a round in which every draft was accepted (a round without drafts counts), else -1, never below 1."""
    schedule = Schedule("heuristic")
    state = schedule.init(1, initial=2)
    seen = []
    for drafted, accepted in [(2, 2), (4, 4), (6, 1), (5, 0), (4, 0), (3, 0), (2, 0), (1, 0), (0, 0), (3, 3)]:
        result = RoundResult(drafted=np.array([drafted]), accepted=np.array([accepted]), committed=np.array([1]),
                             tokens=None, hidden=None, lengths=None)
        state = schedule.update(state, result, cap=8)
        seen.append(int(state.num_tokens[0]))
    assert seen == [4, 6, 5, 4, 3, 2, 1, 1, 3, 5]


def test_heuristic_schedule_persists_without_recompiling(tiny_llama_dir, target):
    same = jaxspec.load(tiny_llama_dir)
    kwargs = dict(max_new_tokens=20, assistant_model=same, num_assistant_tokens_schedule="heuristic",
                  assistant_confidence_threshold=0.0, eos_token_id=[])
    same.generation_config["num_assistant_tokens"] = 2
    jaxspec.generate(target, [[5, 6, 7]], **kwargs)
    before, lengths = loop.trace_count(), []
    for _ in range(3):
        jaxspec.generate(target, [[5, 6, 7]], **kwargs)
        lengths.append(same.generation_config["num_assistant_tokens"])
    assert lengths[0] > 2 and lengths == sorted(lengths)  # grew, and carried over, as HF's "heuristic" does
    assert max(lengths) <= 16  # the default static cap, max_assistant_tokens
    assert loop.trace_count() == before  # the persisted length moves inside one compiled buffer


@pytest.mark.slow  # tests/decode/test_exactness.py checks speculative sampling with 22,785 rows in the default suite
def test_sampling_is_exact(tiny_llama_dir, target, draft):
    """End to end, 6000 rows: the first three sampled tokens (the prefill's, then a round with up to 3 drafts)
    follow the target's exact law over the whole vocabulary; the lossy ensemble does not."""
    prompt, k, rows = [5, 6, 7, 8], 3, 6000
    exact = oracles.exact_marginals(hf_models.load_hf(tiny_llama_dir), prompt, positions=3)
    common = dict(max_new_tokens=k + 2, do_sample=True, top_k=0, eos_token_id=[], assistant_model=draft,
                  num_assistant_tokens=k, num_assistant_tokens_schedule="constant", assistant_confidence_threshold=0.0)
    out = oracles.sample_rows(lambda ids, seed: jaxspec.generate(target, ids, seed=seed, **common), prompt, rows, 3)
    assert out.accepted_hist[:, 2:].sum() > 100 and out.drafted.sum() >= rows * k  # multi-draft rounds happen
    new = out.sequences[:, len(prompt):]
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i
    lossy = oracles.sample_rows(lambda ids, seed: jaxspec.generate(target, ids, seed=seed, assistant_ensemble_weight=0.3,
                                                                   **common), prompt, rows, 3)
    assert min(oracles.goodness_of_fit(lossy.sequences[:, len(prompt) + i], exact[i]) for i in (1, 2)) < 1e-6


@pytest.mark.slow  # ~35 s: 6000 rows
def test_sampling_is_exact_when_the_adaptive_schedule_drops_doubted_drafts(tiny_llama_dir, target):
    """The adaptive schedule stops before a draft below the confidence threshold (HF's schedules propose it, then
    stop), so a proposed draft follows q restricted to the confident tokens, and is judged by that law. An int8 copy
    of the target drafts for it, so q is close to p: judged by the unrestricted q, nearly every draft would be
    accepted and the confident tokens over-sampled. (The target itself, p = q exactly, costs a full step a draft:
    no length could pay, so the adaptive schedule never drafts for it, probes included.)"""
    prompt, rows = [5, 6, 7, 8], 6000
    exact = oracles.exact_marginals(hf_models.load_hf(tiny_llama_dir), prompt, positions=3)
    out = jaxspec.generate(target, [prompt] * rows, seed=3, max_new_tokens=5, do_sample=True, top_k=0,
                           eos_token_id=[], assistant_model=jaxspec.quantize(target), num_assistant_tokens=3,
                           num_assistant_tokens_schedule="adaptive", assistant_confidence_threshold=0.1)
    assert 0 < out.accepted.sum() < out.drafted.sum()  # with q close to p, mostly the restriction rejects
    new = out.sequences[:, len(prompt):]
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


# -- errors ---------------------------------------------------------------------------------------------------


def test_vocabulary_mismatch_points_to_universal_decoding(tmp_path, target):
    other = jaxspec.load(hf_models.save_tiny("llama", tmp_path, seed=2, vocab_size=100))
    with pytest.raises(ValueError, match="universal assisted decoding"):
        jaxspec.generate(target, [[5, 6]], max_new_tokens=4, assistant_model=other)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_assistant_tokens=0), "num_assistant_tokens must be an integer >= 1"),
    (dict(num_assistant_tokens_schedule="fast"), "Unknown num_assistant_tokens_schedule 'fast'"),
    (dict(assistant_ensemble_weight=1.0), "None for standard"),
    (dict(assistant_ensemble_weight=0.0), "open interval"),
    (dict(assistant_confidence_threshold=1.5), "assistant_confidence_threshold"),
    (dict(num_assistant_tokens=20, max_assistant_tokens=8), r"exceeds max_assistant_tokens \(8\)"),
    (dict(prompt_lookup_num_tokens=3), "Choose one"),
    (dict(max_matching_ngram_size=2), "max_matching_ngram_size is not used by the speculative strategy"),
])
def test_bad_settings(target, draft, kwargs, message):
    before = loop.trace_count()
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(target, [[5, 6]], max_new_tokens=4, assistant_model=draft, **kwargs)
    assert loop.trace_count() == before
