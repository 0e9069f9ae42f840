"""What transformers users reach for first: logits processors and stopping rules under every strategy, streaming.

Greedy: each processor and stopping rule gives transformers' output for plain decoding (a batch), and every
strategy gives plain decoding's output (batches; the assistant also against HF's assisted run at batch 1).
Sampling: with processors on, assisted output follows the exact processed law of the target.
"""

from __future__ import annotations

import io
import contextlib

import numpy as np
import pytest
import torch
from transformers import TextStreamer
from transformers.generation import logits_process as hf
from transformers.generation.stopping_criteria import StopStringCriteria

import jaxspec
from tests.fixtures import hf_models, oracles
from tests.fixtures.text import tiny_tokenizer

N = 24
# Equal lengths: transformers' left padding would otherwise put pad tokens into its history (jaxspec excludes them).
ROWS = [[5, 6, 7, 8, 5, 6, 9, 10], [20, 21, 22, 20, 21, 23, 24, 25], [40, 41, 40, 41, 42, 43, 44, 45]]
PROCESSORS = {
    "repetition_penalty": dict(repetition_penalty=1.4),
    "min_new_tokens": dict(min_new_tokens=N - 2),
    "no_repeat_ngram_size": dict(no_repeat_ngram_size=2),
    "bad_words_ids": dict(bad_words_ids=[[93, 121], [107], [21, 22, 23]]),
    "suppress_tokens": dict(suppress_tokens=[11, 12, 13]),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    target = hf_models.save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0)
    tiny_tokenizer().save_pretrained(target)
    draft = hf_models.save_tiny("llama", tmp_path_factory.mktemp("draft"), seed=0, num_hidden_layers=2)
    return target, draft


@pytest.fixture(scope="module")
def models(folders):
    return jaxspec.load(folders[0]), jaxspec.load(folders[1])


@pytest.fixture(scope="module")
def hf_target(folders):
    return hf_models.load_hf(folders[0])


def eos_in_reach(model, kwargs):
    """An EOS id that plain greedy reaches mid-way in row 0, so min_new_tokens has something to hold back."""
    free = jaxspec.generate(model, ROWS, max_new_tokens=N, eos_token_id=[], **kwargs)
    return int(free.sequences[0, len(ROWS[0]) + 3])


@pytest.mark.parametrize("name", sorted(PROCESSORS))
def test_greedy_with_a_processor_equals_transformers_under_every_strategy(models, hf_target, folders, name):
    target, draft = models
    kwargs = dict(PROCESSORS[name])
    eos = eos_in_reach(target, kwargs) if name == "min_new_tokens" else 2
    ids = torch.tensor(ROWS)
    expected = hf_target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                                  eos_token_id=eos, pad_token_id=0, **kwargs).numpy()
    plain = jaxspec.generate(target, ROWS, max_new_tokens=N, eos_token_id=eos, **kwargs)
    np.testing.assert_array_equal(plain.sequences, expected)
    lookup = jaxspec.generate(target, ROWS, max_new_tokens=N, eos_token_id=eos, prompt_lookup_num_tokens=4, **kwargs)
    np.testing.assert_array_equal(lookup.sequences, expected)
    # A constant schedule, as transformers' below: every round verifies drafts through the processors. (The adaptive
    # one would probe this weak assistant in the shadow and verify none of its drafts.)
    assistant = dict(assistant_model=draft, num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                     num_assistant_tokens_schedule="constant")
    batch = jaxspec.generate(target, ROWS, max_new_tokens=N, eos_token_id=eos, **assistant, **kwargs)
    np.testing.assert_array_equal(batch.sequences, expected)
    assert batch.drafted.sum() > 0 and lookup.drafted.sum() > 0
    hf_draft = hf_models.load_hf(folders[1])
    hf_draft.generation_config.update(num_assistant_tokens=3, assistant_confidence_threshold=0.0,
                                      num_assistant_tokens_schedule="constant")
    single = hf_target.generate(ids[:1], assistant_model=hf_draft, max_new_tokens=N, do_sample=False, eos_token_id=eos,
                                pad_token_id=0, **kwargs).numpy()
    np.testing.assert_array_equal(batch.sequences[:1, : single.shape[1]], single)


def test_processors_change_the_output(models):
    """The parity test above would pass for processors that do nothing, were the outputs unaffected by them."""
    target, _ = models
    plain = jaxspec.generate(target, ROWS, max_new_tokens=N).sequences
    for name, kwargs in PROCESSORS.items():
        if name != "min_new_tokens":
            assert (jaxspec.generate(target, ROWS, max_new_tokens=N, **kwargs).sequences != plain).any(), name


def test_ragged_rows_process_their_own_history(models):
    """In a left-padded batch each row's penalties see its own prompt and output only: a batch equals each row
    generated alone."""
    target, draft = models
    rows = [ROWS[0], ROWS[1][:3], ROWS[2][:6]]
    kwargs = dict(repetition_penalty=1.3, no_repeat_ngram_size=2, max_new_tokens=N, assistant_model=draft,
                  num_assistant_tokens=3)
    batch = jaxspec.generate(target, rows, **kwargs)
    for i, row in enumerate(rows):
        alone = jaxspec.generate(target, [row], **kwargs)
        np.testing.assert_array_equal(batch.sequences[i, -N:][: alone.num_new_tokens[0]],
                                      alone.sequences[0, len(row):])


# Processed speculative sampling (q processed too) is slow; the default suite runs prompt lookup's one-hot path.
@pytest.mark.parametrize("strategy", [pytest.param("speculative", marks=pytest.mark.slow), "prompt_lookup"])
def test_sampling_with_processors_is_exact(models, hf_target, tmp_path, strategy):
    """6000 rows, budget K + 2: every new token follows the exact law of the processed target (HF's own
    processors and warpers applied to every prefix), over the whole vocabulary, in runs where many rounds accept
    two drafts or more.

    Speculative: the tiny target, an assistant close to it (`oracles.near_assistant`; the 2-layer assistant's
    drafts are almost never accepted twice in a row here), a permutation of the vocabulary as the prompt; the first
    three tokens are checked (smallest TV bias caught with power 0.9 at alpha 1e-3: 4.2%, 5.7%, 5.9%).

    Prompt lookup: a copy is accepted only where the target predicts what the prompt holds, which a tiny random
    model with attention never does (its next token depends on the whole context), and no-repeat 2-grams would ban
    every copy. So the target is the same model without attention (`oracles.without_attention`, a bigram model),
    the prompt holds its likeliest continuation after each token it may sample first (`oracles.copyable_prompt`),
    and the repetition penalty is below 1 (it favours the prompt's tokens, which copies are made of). No-repeat
    4-grams ban the third copied draft at its own position (its prefix holds the first two, so it completes a
    4-gram of the prompt): no round accepts three, thousands accept two. All K + 2 = 5 tokens are checked (smallest
    TV bias caught: 3.3%, 3.9%, 4.6%, 4.9%, 5.3%, `oracles.detectable_tv`)."""
    target, _ = models
    k, rows = 3, 6000
    if strategy == "speculative":
        penalty, ngram, temperature, top_k, positions = 1.3, 2, 0.8, 20, 3
        prompt = [int(t) for t in np.random.RandomState(1).permutation(np.arange(3, 128))]
        oracles.near_assistant(hf_target).save_pretrained(tmp_path)
        strategy_kwargs = dict(assistant_model=jaxspec.load(str(tmp_path)), num_assistant_tokens=k,
                               assistant_confidence_threshold=0.0)
    else:
        penalty, ngram, temperature, top_k, positions = 0.9, 4, 0.5, 10, k + 2
        hf_target = oracles.without_attention(hf_target)
        hf_target.save_pretrained(tmp_path)
        target = jaxspec.load(str(tmp_path))
        prompt = oracles.copyable_prompt(hf_target, last=9, top=top_k, banned=[11, 12])
        strategy_kwargs = dict(prompt_lookup_num_tokens=k, max_matching_ngram_size=1)
    settings = dict(repetition_penalty=penalty, no_repeat_ngram_size=ngram, suppress_tokens=[11, 12],
                    temperature=temperature, top_k=top_k, min_p=0.02)
    hf_list = hf.LogitsProcessorList([
        hf.RepetitionPenaltyLogitsProcessor(penalty), hf.NoRepeatNGramLogitsProcessor(ngram),
        hf.SuppressTokensLogitsProcessor([11, 12]), hf.TemperatureLogitsWarper(temperature),
        hf.TopKLogitsWarper(top_k), hf.MinPLogitsWarper(0.02)])
    exact = oracles.exact_marginals(hf_target, prompt, positions=positions, processors=hf_list)
    out = jaxspec.generate(target, [prompt] * rows, max_new_tokens=k + 2, do_sample=True, seed=11, eos_token_id=[],
                           num_assistant_tokens_schedule="constant", **settings, **strategy_kwargs)
    assert out.drafted.sum() >= 0.8 * rows * k
    multi = int(out.accepted_hist[:, 2:].sum())
    assert multi >= rows // 2, f"only {multi} rounds accepted two drafts or more, in {rows} rows"
    if strategy == "prompt_lookup":
        third = int(out.accepted_hist[:, 3].sum())
        assert third == 0, f"{third} rounds accepted a third copy, which its own prefix bans"
    new = out.sequences[:, len(prompt):]
    for i in range(positions):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


# -- stopping rules ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def byte_level(tmp_path_factory):
    """A tiny Llama over a byte-level BPE vocabulary (what transformers' StopStringCriteria is built for), with a
    smaller assistant of the same vocabulary."""
    from tests.fixtures.text import CORPUS
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    folder = hf_models.save_tiny("llama", tmp_path_factory.mktemp("bpe"), seed=4, vocab_size=len(tokenizer))
    tokenizer.save_pretrained(folder)
    draft = hf_models.save_tiny("llama", tmp_path_factory.mktemp("bpe_draft"), seed=4, vocab_size=len(tokenizer),
                                num_hidden_layers=2)
    return folder, jaxspec.load(folder), jaxspec.load(draft)


@pytest.mark.parametrize("strategy", [{}, dict(prompt_lookup_num_tokens=4), "assistant"])
def test_stop_strings_end_at_the_completing_token(byte_level, strategy):
    """Rows end at the token whose text completes a stop string, as transformers' StopStringCriteria ends plain
    decoding; every strategy ends at the same token (HF's assisted loop would keep the rest of a verified block)."""
    folder, target, draft = byte_level
    kwargs = dict(assistant_model=draft, num_assistant_tokens=3) if strategy == "assistant" else strategy
    rows = [[40, 41, 42, 43, 40, 41], [60, 61, 62, 63, 64, 65]]
    free = jaxspec.generate(target, rows, max_new_tokens=N, eos_token_id=[])
    # A stop string: the text of a printable token in the second half of row 0 (a random model emits stray bytes).
    pieces = [target.tokenizer.decode([t]) for t in free.sequences[0, 6:].tolist()]
    middle = next(p for p in pieces[N // 2:] if p.strip() and p.isascii() and p.isprintable())
    stops = [middle, "never said"]
    out = jaxspec.generate(target, rows, max_new_tokens=N, eos_token_id=[], stop_strings=stops, **kwargs)
    ids = torch.tensor(rows)
    expected = hf_models.load_hf(folder).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N,
                                                  do_sample=False, eos_token_id=None, pad_token_id=0).numpy()
    criterion = StopStringCriteria(target.tokenizer, stops)  # transformers' own rule, token by token
    assert out.num_new_tokens[0] < N
    for row in range(len(rows)):
        n = int(out.num_new_tokens[row])
        np.testing.assert_array_equal(out.sequences[row, : 6 + n], expected[row, : 6 + n])
        fired = [bool(criterion(torch.tensor(expected[row: row + 1, : 6 + k]), None)) for k in range(1, n + 1)]
        assert fired == [False] * (n - 1) + [n < N]


def test_default_dispatch_lasts_about_the_stream_interval():
    from jaxspec.streaming import MAX_STREAM_ROUNDS, STREAM_INTERVAL, rounds_for_interval

    assert STREAM_INTERVAL == 0.1
    assert rounds_for_interval(1, 0.01) == 10  # 10 ms rounds: 10 of them fill the interval
    assert rounds_for_interval(10, 0.5) == 2  # a dispatch that took too long runs fewer rounds next
    assert rounds_for_interval(1, 2.0) == 1  # rounds slower than the interval: one per dispatch
    assert rounds_for_interval(32, 1e-4) == rounds_for_interval(32, 0.0) == MAX_STREAM_ROUNDS


def test_max_time_ends_the_call(models):
    target, _ = models
    out = jaxspec.generate(target, ROWS, max_new_tokens=200, eos_token_id=[], max_time=1e-6)
    assert (out.num_new_tokens >= 1).all() and (out.num_new_tokens < 200).all()


# -- streaming -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy, per_dispatch", [({}, 1), (dict(prompt_lookup_num_tokens=4), 1), ({}, None)])
def test_streamed_chunks_add_up_to_the_output(models, strategy, per_dispatch):
    """With one round per dispatch there are several chunks (a tiny model's rounds are so fast that the default,
    0.1 s of rounds per dispatch, may send them all at once); either way the chunks are the output."""
    target, _ = models
    chunks = []
    out = jaxspec.generate(target, ROWS, max_new_tokens=N, eos_token_id=[], on_tokens=chunks.append,
                           rounds_per_dispatch=per_dispatch, **strategy)
    assert len(chunks) > 3 if per_dispatch == 1 else len(chunks) >= 1
    for row in range(len(ROWS)):
        streamed = np.concatenate([c[row] for c in chunks])
        np.testing.assert_array_equal(streamed, out.sequences[row, len(ROWS[row]):])


def test_transformers_text_streamer_prints_the_text(models):
    target, _ = models
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        out = jaxspec.generate(target, ROWS[:1], max_new_tokens=N, eos_token_id=[],
                               streamer=TextStreamer(target.tokenizer, skip_prompt=True))
    assert printed.getvalue().strip() == target.tokenizer.decode(out.sequences[0, len(ROWS[0]):].tolist()).strip()


@pytest.mark.parametrize("kwargs, message", [
    (dict(streamer=object()), "streamer must have put"),
    (dict(stop_strings=[""]), "stop_strings must be non-empty strings"),
    (dict(max_time=0), "max_time must be a number of seconds > 0"),
    (dict(rounds_per_dispatch=0), "rounds_per_dispatch must be an integer >= 1"),
])
def test_bad_stream_arguments(models, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        jaxspec.generate(models[0], ROWS[:1], max_new_tokens=4, **kwargs)


def test_a_streamer_with_a_batch_points_to_on_tokens(models):
    with pytest.raises(ValueError, match="on_tokens"):
        jaxspec.generate(models[0], ROWS, max_new_tokens=4, streamer=TextStreamer(models[0].tokenizer))


# -- text in, text out -------------------------------------------------------------------------------------------


def test_generate_text_applies_the_chat_template_and_decodes(models):
    target, draft = models
    tokenizer = target.tokenizer
    tokenizer.chat_template = "{% for m in messages %}w1 {{ m['content'] }} w2 {% endfor %}w3"
    messages = [{"role": "user", "content": "w5 w6 w7"}]
    # (A random assistant doubts every token: no confidence stop, and a constant schedule, so that it drafts and
    # every round verifies; the adaptive one would probe it in the shadow.)
    text, out = jaxspec.generate_text(target, messages, max_new_tokens=8, eos_token_id=[], return_output=True,
                                      assistant_model=draft, num_assistant_tokens=2, assistant_confidence_threshold=0.0,
                                      num_assistant_tokens_schedule="constant")
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    plain = jaxspec.generate(target, [ids], max_new_tokens=8, eos_token_id=[])
    assert text == tokenizer.decode(plain.sequences[0, len(ids):].tolist(), skip_special_tokens=True)
    assert out.drafted.sum() > 0
    batch, out = jaxspec.generate_text(target, ["w5 w6", "w9 w10 w11 w12"], max_new_tokens=5, eos_token_id=[],
                                       skip_special_tokens=False, return_output=True)
    assert [len(t.split()) for t in batch] == out.num_new_tokens.tolist() == [5, 5]
    with pytest.raises(ValueError, match="needs a tokenizer"):
        jaxspec.generate_text(draft, "w5", max_new_tokens=2)


def test_return_logits_are_the_processed_scores_transformers_reports(models, hf_target):
    """Plain decoding's processed logits equal transformers' `scores`; every strategy returns the same logits for the
    same tokens (the verify block computes them at another width: equal to float tolerance)."""
    target, draft = models
    kwargs = dict(max_new_tokens=10, eos_token_id=[], repetition_penalty=1.3, return_logits=True)
    plain = jaxspec.generate(target, ROWS[:1], **kwargs)
    ids = torch.tensor(ROWS[:1])
    hf_out = hf_target.generate(ids, max_new_tokens=10, do_sample=False, repetition_penalty=1.3, eos_token_id=None,
                                pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    expected = torch.stack(hf_out.scores, 1).numpy()  # [1, N, V]
    assert plain.logits.shape == expected.shape
    np.testing.assert_allclose(plain.logits, expected, rtol=1e-4, atol=1e-4)
    for strategy in (dict(prompt_lookup_num_tokens=3), dict(assistant_model=draft, num_assistant_tokens=3)):
        out = jaxspec.generate(target, ROWS[:1], **kwargs, **strategy)
        np.testing.assert_array_equal(out.sequences, plain.sequences)
        np.testing.assert_allclose(out.logits, plain.logits, rtol=1e-4, atol=1e-4)
