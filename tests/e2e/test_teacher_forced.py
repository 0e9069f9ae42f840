"""benchmarks/teacher_forced.py replays an assistant's rounds from its teacher-forced matches: the replay must be the
loop's own rounds, or what it says about runs of acceptance says nothing about the loop."""

from __future__ import annotations

import numpy as np
import pytest

import jaxspec
from tests.fixtures import hf_models, oracles
from tests.fixtures.prompts import PROMPTS

N = 24
K, THRESHOLD = 4, 0.4  # transformers' default threshold: some of the near assistant's drafts are doubted


@pytest.fixture(scope="module")
def near_draft(tiny_llama_dir, tmp_path_factory):
    """An assistant that matches the target often, and often not: rounds of every length to replay."""
    folder = tmp_path_factory.mktemp("near_draft")
    oracles.near_assistant(hf_models.load_hf(tiny_llama_dir)).save_pretrained(folder)
    return jaxspec.load(str(folder))


def test_the_replay_is_the_loops_rounds(target, near_draft):
    import teacher_forced  # benchmarks/ is on sys.path (pyproject's pythonpath)

    replayed_rounds, ended_early, doubted = 0, 0, 0
    for prompt in PROMPTS:
        matches, top, ended = teacher_forced.teacher_forced(target, near_draft, list(prompt), N)
        out = jaxspec.generate(target, [prompt], max_new_tokens=N, assistant_model=near_draft,
                               num_assistant_tokens=K, num_assistant_tokens_schedule="constant",
                               assistant_confidence_threshold=THRESHOLD)
        assert out.num_new_tokens[0] == len(matches) and ended == (len(matches) < N)
        rounds = teacher_forced.replay_constant(matches, top >= THRESHOLD, K, N, ended)
        assert out.rounds == len(rounds)
        assert out.accepted_hist.sum(0).tolist() == oracles.histogram(rounds, K)
        replayed_rounds += len(rounds)
        ended_early += ended
        doubted += int(np.sum(top < THRESHOLD))
    assert 0 < np.mean(matches) < 1 and replayed_rounds < len(PROMPTS) * (N - 1)  # some drafts accepted, some not
    assert ended_early and doubted  # and an answer that ends with an EOS, and drafts that end their round doubted


def test_the_order_of_the_matches_decides_the_rounds():
    """The same matches, once where each miss falls on a round's own token and once shuffled: the shuffle is what
    the table compares an answer with, so it must move the rounds where the order does."""
    import teacher_forced

    periodic = ([True] * 4 + [False]) * 4  # positions 0-19; the prefill commits 0
    rounds = teacher_forced.replay_constant(periodic, [True] * 20, 4)
    assert rounds == [3, 4, 4, 4]  # 1-3 and the correction at 4; then 5-8 and the target's 9; ...
    assert teacher_forced.tokens_per_round(rounds) == 4.75
    assert teacher_forced.shuffled_tokens_per_round(periodic, [True] * 20, 4) < 4.0
    assert teacher_forced.transitions(periodic) == (0.75, 1.0)


def test_a_doubted_draft_ends_its_round():
    import teacher_forced

    # Position 0 comes from the prefill; the first round drafts 1, 2, 3 and stops after doubting 2.
    rounds = teacher_forced.replay_constant([True] * 6, [True, True, False, True, True, True], 4)
    assert rounds == [2, 1]  # 2 accepted (positions 1-2), the target's 3; then 4 drafted, the target's 5
