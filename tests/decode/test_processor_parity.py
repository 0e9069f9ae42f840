"""History-reading processors (repetition_penalty, no_repeat_ngram_size) in a ragged, left-padded batch.

jaxspec's history of a row is that row's real tokens, its prompt and its output, never its left padding: each row of
a padded batch decodes as the row alone. transformers 5.23 differs for no-repeat n-grams: its
NoRepeatNGramLogitsProcessor reads `input_ids` as they are, so the pad tokens of a left-padded row take part in its
n-grams. Its repetition penalty does not: `generate` hands it the padding lengths (`prompt_ignore_length`, from the
attention mask). README, "Departures from transformers 5.23": processor history.

Checked here, greedy, on the suite's tiny Llama: (a) each jaxspec row of a padded batch equals transformers' run of
that row alone (no padding), token for token; (b) the departure, on a constructed case where it provably shows:
the pad id is the token a short row picks first alone, so transformers' padded batch bans it in that row and decodes
otherwise, while jaxspec's row is still the row alone; and the repetition penalty, on a case where counting the pads
would provably change the first token, leaves transformers' padded row equal to the row alone.
"""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

import jaxspec
from tests.fixtures import hf_models
from tests.fixtures.prompts import PROMPTS, left_padded

N = 16
EOS = 2  # the tiny models' eos_token_id
SHORT = 1  # PROMPTS[1], three tokens: six pad tokens in a batch with the nine-token row


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    return jaxspec.load(tiny_llama_dir), hf_models.load_hf(tiny_llama_dir)


def hf_alone(hf, row, **settings) -> list[int]:
    """transformers' greedy new tokens for `row` by itself: batch 1, no padding."""
    ids = torch.tensor([row])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False, pad_token_id=0,
                      **settings)
    return out[0, len(row):].tolist()


def hf_padded(hf, rows, pad, **settings) -> list[list[int]]:
    """transformers' greedy new tokens (up to each row's EOS) for `rows` as one left-padded batch whose pad token is
    `pad`."""
    ids, mask = left_padded(rows, pad)
    out = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=N, do_sample=False,
                      pad_token_id=pad, **settings)
    return [through_eos(row[ids.shape[1]:].tolist()) for row in out]


def through_eos(tokens: list[int]) -> list[int]:
    """`tokens` up to and including the first EOS (transformers pads a finished row of a batch after it)."""
    return tokens[: tokens.index(EOS) + 1] if EOS in tokens else tokens


def jaxspec_padded(model, rows, pad, **settings) -> list[list[int]]:
    """jaxspec's greedy new tokens (up to each row's EOS) for `rows` as one left-padded batch padded with `pad`."""
    ids, mask = left_padded(rows, pad)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=N, **settings)
    return [out.new_tokens(i).tolist() for i in range(len(rows))]


def first_pick_alone(hf, **settings) -> int:
    """The first token the short row decodes alone: as a pad id, the token that padding would make history."""
    return hf_alone(hf, PROMPTS[SHORT], **settings)[0]


def test_each_row_of_a_padded_batch_equals_transformers_row_alone(models):
    """(a) Repetition penalty and no-repeat bigrams on a ragged batch: every jaxspec row is transformers' row alone,
    with the pad id a token the short row really decodes (jaxspec never reads it)."""
    model, hf = models
    settings = dict(repetition_penalty=1.3, no_repeat_ngram_size=2)
    alone = [hf_alone(hf, row, **settings) for row in PROMPTS]
    pad = first_pick_alone(hf, **settings)
    assert len({len(row) for row in PROMPTS}) == len(PROMPTS)  # ragged: every row but the longest is padded
    assert jaxspec_padded(model, PROMPTS, pad, **settings) == alone


def test_transformers_padded_batch_puts_pad_tokens_in_no_repeat_ngrams(models):
    """(b) no_repeat_ngram_size=1 bans every token of the history. The pad id is the short row's first pick alone
    (so not one of its prompt tokens): transformers' padded batch bans it in that row, whose output then differs
    from the row alone from its first token; the unpadded row is unchanged. jaxspec's rows all equal the rows
    alone."""
    model, hf = models
    settings = dict(no_repeat_ngram_size=1)
    alone = [hf_alone(hf, row, **settings) for row in PROMPTS]
    pad = alone[SHORT][0]
    assert pad not in PROMPTS[SHORT]
    padded = hf_padded(hf, PROMPTS, pad, **settings)
    assert padded[SHORT][0] != pad and padded[SHORT] != alone[SHORT]  # the pad tokens were history
    longest = max(range(len(PROMPTS)), key=lambda i: len(PROMPTS[i]))
    assert padded[longest] == alone[longest]
    assert jaxspec_padded(model, PROMPTS, pad, **settings) == alone


def test_transformers_repetition_penalty_skips_left_padding(models):
    """(b) The same construction for the repetition penalty, strong enough (100) that penalising the pad id would
    change the short row's first token (HF's processor, given the padded row without the padding lengths, shows it
    would): transformers' padded batch still decodes that row as it does alone, as jaxspec does."""
    model, hf = models
    settings = dict(repetition_penalty=100.0)
    row = PROMPTS[SHORT]
    pad = first_pick_alone(hf, **settings)
    width = max(map(len, PROMPTS))
    with torch.no_grad():
        logits = hf(torch.tensor([row])).logits[:, -1]
    counted = RepetitionPenaltyLogitsProcessor(100.0)(torch.tensor([[pad] * (width - len(row)) + row]), logits)
    assert int(counted.argmax()) != pad  # were the pads history, the first token would differ
    alone = [hf_alone(hf, r, **settings) for r in PROMPTS]
    assert hf_padded(hf, PROMPTS, pad, **settings) == alone
    assert jaxspec_padded(model, PROMPTS, pad, **settings) == alone
