"""Plain decoding in the shared loop: HF parity, batches, compile reuse, settings resolution, sharding, input errors."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import threading
import time

import jax
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

import jaxspec
from tests.fixtures import hf_models
from tests.fixtures.patching import patched
from tests.fixtures.prompts import PROMPTS, left_padded

from jaxspec import loop
from jaxspec.prompts import buffer_size
from jaxspec.strategies import default_prefill_chunk


@pytest.fixture(scope="module")
def llama(tiny_llama_dir):
    return jaxspec.load(tiny_llama_dir)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_batch_equals_transformers(tmp_path, family):
    folder = hf_models.save_tiny(family, tmp_path, seed=7)
    ids, mask = left_padded(PROMPTS)
    expected = hf_models.load_hf(folder).generate(
        torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=40, do_sample=False
    ).numpy()
    out = jaxspec.generate(jaxspec.load(folder), ids, mask, max_new_tokens=40)
    np.testing.assert_array_equal(out.sequences, expected)
    assert out.sequences.dtype == np.int32


def test_eos_ends_a_row_and_pads_after_it(llama):
    ids, mask = left_padded(PROMPTS)
    free = jaxspec.generate(llama, ids, mask, max_new_tokens=30, eos_token_id=[])
    eos = int(free.sequences[1, ids.shape[1] + 4])  # make row 1's fifth new token the EOS
    out = jaxspec.generate(llama, ids, mask, max_new_tokens=30, eos_token_id=eos, pad_token_id=0)
    first_eos = [int(np.argmax(row[ids.shape[1]:] == eos)) for row in free.sequences]
    for row in range(len(PROMPTS)):
        stop = first_eos[row] + 1 if eos in free.sequences[row, ids.shape[1]:] else 30
        assert out.num_new_tokens[row] == stop
        np.testing.assert_array_equal(out.sequences[row, ids.shape[1]:][:stop], free.sequences[row, ids.shape[1]:][:stop])
        assert (out.sequences[row, ids.shape[1] + stop:] == 0).all()


def test_counters_of_plain_decoding(llama):
    out = jaxspec.generate(llama, [[5, 6, 7]], max_new_tokens=12, eos_token_id=[])
    assert out.target_forwards == 12  # one prefill + one forward per further token
    assert out.num_new_tokens.tolist() == [12]
    assert out.draft_forwards == 0


def test_buffer_sizes_round_up_and_their_settings_are_checked(monkeypatch, user_buffer_sizes):
    assert [buffer_size(n, 64) for n in (5, 256, 257, 2048, 2049)] == [256, 256, 512, 2048, 2560]
    assert buffer_size(40, 64) == 256 and buffer_size(40, 256) == 256
    monkeypatch.setenv("JAXSPEC_MIN_BUFFER", "32")
    assert [buffer_size(5, 8), buffer_size(40, 8), buffer_size(5, 64)] == [32, 64, 64]
    for name, value in [("JAXSPEC_MIN_BUFFER", "48"), ("JAXSPEC_MIN_BUFFER", "4"), ("JAXSPEC_PREFILL_CHUNK", "x")]:
        monkeypatch.setenv(name, value)
        with pytest.raises(ValueError, match=rf"\${name} must be a power of two of at least 8, got '{value}'"):
            buffer_size(5, default_prefill_chunk())
        monkeypatch.delenv(name)


def test_prompt_longer_than_a_prefill_chunk_equals_transformers(tmp_path):
    """The prefill reads prompts in chunks; a prompt spanning several chunks (and rows ending in different chunks)
    must give what one full-prompt forward gives."""
    folder = hf_models.save_tiny("llama", tmp_path, seed=3)
    rows = [[3 + (7 * i) % 120 for i in range(150)], list(range(40, 60))]
    ids, mask = left_padded(rows)
    expected = hf_models.load_hf(folder).generate(
        torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=12, do_sample=False).numpy()
    out = jaxspec.generate(jaxspec.load(folder), ids, mask, max_new_tokens=12)
    np.testing.assert_array_equal(out.sequences, expected)


def test_new_prompts_and_settings_reuse_the_executables(llama, user_buffer_sizes):
    """Only shapes and the strategy are compiled in: prompts of other lengths, seeds, sampling values and
    processors are run-time inputs (at the users' buffer sizes: one cache of 256 positions serves them all)."""
    jaxspec.generate(llama, [[5, 6, 7, 8, 9]], max_new_tokens=8)
    jaxspec.generate(llama, [[5, 6, 7, 8, 9]], max_new_tokens=8, do_sample=True)
    before = loop.trace_count()
    jaxspec.generate(llama, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]], max_new_tokens=8)
    jaxspec.generate(llama, [list(range(1, 100))], max_new_tokens=20, repetition_penalty=1.3, no_repeat_ngram_size=2,
                     min_new_tokens=5, suppress_tokens=[4, 9], bad_words_ids=[[7, 8], [3]])
    for kwargs in (dict(temperature=0.5, seed=3), dict(temperature=1.7, top_k=5), dict(top_p=0.8, min_p=0.05),
                   dict(top_k=0, repetition_penalty=0.9, no_repeat_ngram_size=3)):
        jaxspec.generate(llama, [[9, 8]], max_new_tokens=8, do_sample=True, **kwargs)
    assert loop.trace_count() == before


def test_a_larger_buffer_compiles_once_more(tmp_path):
    model = jaxspec.load(hf_models.save_tiny("llama", tmp_path, seed=0, max_position_embeddings=1024))
    jaxspec.generate(model, [[5, 6, 7]], max_new_tokens=8)
    before = loop.trace_count()
    jaxspec.generate(model, [[1 + i % 100 for i in range(300)]], max_new_tokens=8)  # 308 positions: a 512-token buffer
    assert loop.trace_count() == before + 2  # its prefill and its round loop


class GatedCompiler(concurrent.futures.ThreadPoolExecutor):
    """The loop's compile worker with the round loop held back: the first compile (the prefill's) runs at once, the
    second (the rounds') waits until `release` is set, or `limit` seconds. `finished` counts compiles that ran."""

    def __init__(self, limit: float):
        super().__init__(max_workers=1)
        self.release, self.limit, self.submitted, self.finished = threading.Event(), limit, 0, 0

    def submit(self, compile_fn):
        self.submitted += 1
        gated = self.submitted > 1

        def run():
            if gated:
                self.release.wait(self.limit)
            compiled = compile_fn()
            self.finished += 1
            return compiled

        return super().submit(run)


@pytest.fixture
def gated_compiler():
    compiler = GatedCompiler(limit=120.0)
    with patched(loop, jax_caches=False, _COMPILER=compiler):  # loops compile again, through the gate
        yield compiler
        compiler.release.set()
        compiler.shutdown(wait=True)


def test_streamed_first_tokens_come_before_the_round_loop_has_compiled(llama, gated_compiler):
    """The prefill runs while the round loop compiles on a worker thread, and a streamed call hands out the
    prefill's tokens before it waits for that compile. If it waited first, the first callback would come only after
    the gate's limit, with the round loop compiled; here the callback itself releases the round loop."""
    gated_compiler.release.set()
    plain = jaxspec.generate(llama, [[5, 6, 7, 8]], max_new_tokens=10, eos_token_id=[])
    gated_compiler.release.clear()
    gated_compiler.submitted = gated_compiler.finished = 0
    loop._compiled.clear()
    compiled_before = []

    def on_tokens(fresh):
        compiled_before.append(gated_compiler.finished)
        gated_compiler.release.set()

    out = jaxspec.generate(llama, [[5, 6, 7, 8]], max_new_tokens=10, eos_token_id=[], on_tokens=on_tokens)
    assert gated_compiler.submitted == 2  # the prefill, then the rounds
    assert compiled_before[0] == 1  # the first tokens came while the round loop was still held back
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.first_token_seconds <= out.compile_seconds + out.decode_seconds


def test_a_call_whose_rows_end_in_the_prefill_waits_for_no_round_loop(llama, gated_compiler):
    """max_new_tokens=1 is the prefill's token alone: the call returns without waiting for the round loop's compile,
    which goes on in the background, and a second call shares it rather than starting another."""
    first = jaxspec.generate(llama, [[5, 6, 7, 8]], max_new_tokens=1)
    again = jaxspec.generate(llama, [[5, 6, 7, 8]], max_new_tokens=1)
    assert gated_compiler.finished == 1 and gated_compiler.submitted == 2  # the prefill compiled; the rounds wait
    assert first.num_new_tokens.tolist() == again.num_new_tokens.tolist() == [1]
    np.testing.assert_array_equal(first.sequences, again.sequences)


def test_the_round_loop_lowered_before_the_prefill_compiled_is_the_one_lowered_after(llama):
    """generate lowers the round loop while the prefill is still compiling, from the prefill's outputs as lowered,
    placed on the params' device (`_Call._prefilled_state`). Its HLO must be the one lowered from the compiled
    prefill's outputs, with the shardings and layouts XLA gave them: the same program, the same persistent-cache
    entry, and none of the prefill's choices lost."""
    import functools

    from jaxspec.prompts import PromptBatch
    from jaxspec.settings import SamplingConfig
    from jaxspec.sharding import ShardingRules
    from jaxspec.strategies import DraftingConfig, choose_strategy

    generate_module = sys.modules["jaxspec.generate"]
    choice = choose_strategy(llama, DraftingConfig(prompt_lookup_num_tokens=3), do_sample=False)
    settings = SamplingConfig(max_new_tokens=8).resolve(llama)
    prompts = PromptBatch.parse([[5, 6, 7, 8], [9, 10]], None, settings.pad_id, settings.eos_ids)
    call = generate_module._lay_out(llama, None, prompts, choice.drafter, settings, mesh=None, rules=ShardingRules(),
                                    chunk=default_prefill_chunk(), ensemble_weight=None, return_logits=False)
    prefill = call.compile_prefill()
    rounds = jax.jit(functools.partial(loop._rounds, call.spec), donate_argnums=(2,))

    def rounds_hlo(state) -> str:
        return rounds.lower(call.target_state, None, state, call.inputs, jax.numpy.asarray(0)).as_text()

    before = call._prefilled_state(prefill)
    assert all(info.sharding is not None for info in jax.tree.leaves(before))
    assert rounds_hlo(before) == rounds_hlo(prefill().out_info)


def _run_child(code: str, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=100)
    return done, time.perf_counter() - started


@pytest.mark.parametrize("ending", ["normally", "interrupted"])
def test_a_process_whose_rows_ended_in_the_prefill_exits_cleanly(tiny_llama_dir, ending):
    """A call whose rows all end in the prefill returns while its round loop still compiles in the background. A
    process that then ends, normally or interrupted (Ctrl-C), must not be torn down under XLA's compiler: it aborted
    ("terminate called ...", killed by SIGABRT) until the compile worker handled the exit."""
    code = ("import sys, jaxspec\n"
            "out = jaxspec.generate(jaxspec.load(sys.argv[1]), [[5, 6, 7, 8]], max_new_tokens=1)\n"
            "print('tokens', out.num_new_tokens.tolist(), flush=True)\n"
            "if sys.argv[2] == 'interrupted':\n    raise KeyboardInterrupt")
    done, _ = _run_child(code, str(tiny_llama_dir), ending)
    expected = 0 if ending == "normally" else -signal.SIGINT  # as Python leaves an interrupted process
    assert done.returncode == expected and "tokens [1]" in done.stdout, done.stderr[-2000:]
    assert "terminate called" not in done.stderr


def test_a_process_ending_waits_for_the_compile_under_way_and_starts_no_other():
    """At exit the compile that runs is finished (with the persistent cache on, the next process loads it) and the
    ones queued behind it are cancelled, not started."""
    code = ("import time\nfrom jaxspec import loop\n"
            "loop._COMPILER.submit(lambda: (time.sleep(2), print('first compiled', flush=True)))\n"
            "loop._COMPILER.submit(lambda: print('second compiled', flush=True))\n"
            "time.sleep(0.5)\nprint('exiting', flush=True)")
    done, _ = _run_child(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["exiting", "first", "compiled"]


def test_an_interrupted_process_leaves_at_once():
    """A process interrupted (Ctrl-C at the first tokens) while a loop compiles leaves without waiting out the
    compile, killed by SIGINT as Python leaves an interrupted process."""
    code = ("import threading, time\nfrom jaxspec import loop\n"
            "loop._COMPILER.submit(lambda: threading.Event().wait(120))\n"
            "time.sleep(0.5)\nprint('interrupting', flush=True)\nraise KeyboardInterrupt")
    done, seconds = _run_child(code)
    assert done.returncode == -signal.SIGINT and "interrupting" in done.stdout, done.stderr[-2000:]
    assert seconds < 60  # importing jaxspec takes seconds; the compile it left, 120


def test_ragged_list_equals_padded_batch(llama):
    ids, mask = left_padded(PROMPTS)
    padded = jaxspec.generate(llama, ids, mask, max_new_tokens=10)
    ragged = jaxspec.generate(llama, PROMPTS, max_new_tokens=10)
    np.testing.assert_array_equal(ragged.sequences, padded.sequences)


def test_attention_mask_is_inferred_from_pad_tokens_as_hf_does(tiny_llama_dir, llama):
    ids, mask = left_padded(PROMPTS, pad=0)  # the tiny model's pad id is 0 and its EOS is 2
    with_mask = jaxspec.generate(llama, ids, mask, max_new_tokens=10)
    inferred = jaxspec.generate(llama, ids, max_new_tokens=10)
    np.testing.assert_array_equal(inferred.sequences, with_mask.sequences)
    expected = hf_models.load_hf(tiny_llama_dir).generate(torch.tensor(ids), max_new_tokens=10, do_sample=False)
    np.testing.assert_array_equal(inferred.sequences, expected.numpy())
    # A list of rows is taken as it is: a pad id inside a row (an end-of-turn token, say) is a real token.
    row = [5, 0, 7]
    listed = jaxspec.generate(llama, [row], max_new_tokens=4, pad_token_id=0, eos_token_id=[])
    np.testing.assert_array_equal(listed.sequences,
                                  jaxspec.generate(llama, np.array([row]), np.ones((1, 3)), max_new_tokens=4,
                                                   pad_token_id=0, eos_token_id=[]).sequences)


def test_generation_config_supplies_the_defaults(tiny_llama_dir):
    model = jaxspec.load(tiny_llama_dir)
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9)
    from_config = jaxspec.generate(model, PROMPTS, max_new_tokens=12, seed=4).sequences
    explicit = jaxspec.generate(model, PROMPTS, max_new_tokens=12, seed=4, do_sample=True, temperature=0.6,
                                top_p=0.9).sequences
    np.testing.assert_array_equal(from_config, explicit)
    # HF's top_k default (50) applies when neither the call nor the config sets it: it is not "no top-k".
    hot = dict(max_new_tokens=12, seed=4, top_p=1.0, temperature=3.0)
    default_k = jaxspec.generate(model, PROMPTS, **hot).sequences
    np.testing.assert_array_equal(default_k, jaxspec.generate(model, PROMPTS, top_k=50, **hot).sequences)
    assert (default_k != jaxspec.generate(model, PROMPTS, top_k=0, **hot).sequences).any()  # 128 tokens, hot
    greedy = jaxspec.generate(model, PROMPTS, max_new_tokens=12, do_sample=False).sequences  # the call wins
    np.testing.assert_array_equal(greedy, jaxspec.generate(jaxspec.load(tiny_llama_dir), PROMPTS,
                                                           max_new_tokens=12).sequences)


# -- sampling ---------------------------------------------------------------------------------------------------


def test_sampling_is_reproducible_for_a_seed(llama):
    kwargs = dict(max_new_tokens=20, do_sample=True, temperature=1.3, top_p=0.9)
    a = jaxspec.generate(llama, PROMPTS, seed=11, **kwargs).sequences
    b = jaxspec.generate(llama, PROMPTS, seed=11, **kwargs).sequences
    c = jaxspec.generate(llama, PROMPTS, seed=12, **kwargs).sequences
    np.testing.assert_array_equal(a, b)
    assert (a != c).any()


def test_top_k_one_is_greedy(llama):
    greedy = jaxspec.generate(llama, PROMPTS, max_new_tokens=20).sequences
    sampled = jaxspec.generate(llama, PROMPTS, max_new_tokens=20, do_sample=True, top_k=1, temperature=2.0, seed=5)
    np.testing.assert_array_equal(sampled.sequences, greedy)


# -- several devices --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [pytest.param((1, 4), marks=pytest.mark.slow), (2, 2)])
def test_sharded_equals_single_device(llama, shape):
    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(shape), ("data", "model"))
    prompts = PROMPTS + [[7, 7, 7, 1]]
    single = jaxspec.generate(llama, prompts, max_new_tokens=24)
    sharded = jaxspec.generate(llama, prompts, max_new_tokens=24, mesh=mesh)
    np.testing.assert_array_equal(sharded.sequences, single.sequences)
    sampled_single = jaxspec.generate(llama, prompts, max_new_tokens=24, do_sample=True, seed=2)
    sampled_sharded = jaxspec.generate(llama, prompts, max_new_tokens=24, do_sample=True, seed=2, mesh=mesh)
    np.testing.assert_array_equal(sampled_sharded.sequences, sampled_single.sequences)


# -- bad input: one clear error each, before anything compiles ---------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(input_ids=[[]]), "row 0 is empty"),
        (dict(input_ids=np.zeros((1, 0), np.int32)), "row 0 is empty"),
        (dict(max_new_tokens=0), "max_new_tokens must be an integer >= 1"),
        (dict(max_new_tokens=None), "Pass max_new_tokens"),
        (dict(max_new_tokens=300), "exceeds the model's max_position_embeddings"),
        (dict(input_ids=[[5, 999]]), "outside the vocabulary"),
        (dict(attention_mask=[[1, 0, 1]]), "padding between real tokens"),
        (dict(input_ids=np.array([[5, 0, 7]]), pad_token_id=0, eos_token_id=[]),
         "No attention_mask was given.*pad_token_id=0"),
        (dict(do_sample=True, temperature=0.0), "temperature must be > 0"),
        (dict(do_sample=True, top_p=1.5), "top_p must be in"),
        (dict(do_sample=True, top_k=-1), "top_k must be an integer >= 0"),
        (dict(do_sample=True, min_p=2.0), "min_p must be in"),
        (dict(do_sample="yes"), "do_sample must be True or False"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(no_repeat_ngram_size=-2), "no_repeat_ngram_size must be an integer >= 0"),
        (dict(min_new_tokens=1.5), "min_new_tokens must be an integer"),
        (dict(suppress_tokens=[5, 500]), "suppress_tokens must be token ids"),
        (dict(bad_words_ids=[[5], []]), "bad_words_ids must be a list of non-empty lists"),
        (dict(max_matching_ngram_size=3), "max_matching_ngram_size is not used by plain decoding"),
        (dict(num_assistant_tokens=3), "num_assistant_tokens is not used by plain decoding"),
    ],
)
def test_bad_input_raises_before_compiling(llama, kwargs, message):
    call = dict(input_ids=[[5, 6, 7]], max_new_tokens=8) | kwargs
    before = loop.trace_count()
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(llama, call.pop("input_ids"), **call)
    assert loop.trace_count() == before
