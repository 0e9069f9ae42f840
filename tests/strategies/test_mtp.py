"""use_mtp=True: greedy invariance, HF parity, rollback against the from-scratch chain, exact sampling, errors."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import jaxspec
from jaxspec.models.moe import mtp_chain_from_scratch
from jaxspec import settings as settings_lib
from jaxspec.strategies.base import Context, Counters, DecodeState, PrefillChunk, RoundResult
from jaxspec.strategies.mtp import MtpDrafter
from tests.fixtures import oracles
from tests.fixtures.moe import FAMILIES, HF_CLASSES, save_checkpoint
from tests.fixtures.prompts import PROMPTS, left_padded

N = 24


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(family, MTP layers) -> folder, built once."""
    made = {}

    def get(family: str, layers: int) -> str:
        if (family, layers) not in made:
            folder = tmp_path_factory.mktemp(f"{family}_{layers}")
            made[family, layers] = save_checkpoint(family, str(folder), 2, layers, FAMILIES[family], seed=layers)
        return made[family, layers]

    return get


# Each family with 1, 2 and 3 MTP layers; the default suite runs three of the six (both families, every depth).
SLOW = pytest.mark.slow


@pytest.mark.parametrize("family, layers", [
    ("deepseek_v3", 1), pytest.param("glm4_moe", 2, marks=SLOW), pytest.param("deepseek_v3", 3, marks=SLOW),
    pytest.param("glm4_moe", 1, marks=SLOW), pytest.param("deepseek_v3", 2, marks=SLOW),
    pytest.param("glm4_moe", 3, marks=SLOW),
])
def test_greedy_equals_plain_greedy_and_transformers(checkpoints, family, layers):
    folder = checkpoints(family, layers)
    model = jaxspec.load(folder)
    ids, mask = left_padded(PROMPTS)
    plain = jaxspec.generate(model, ids, mask, max_new_tokens=N)
    # A constant schedule: every round verifies the random layers' drafts (the adaptive one would probe them in the
    # shadow and verify none)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=N, use_mtp=True, num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.accepted_hist.shape[1] == layers + 1 and out.drafted.sum() > 0
    if layers == 3:
        return  # HF parity at 1 and 2 layers keeps the suite short
    hf_class = HF_CLASSES[family][1]
    saved = hf_class._keys_to_ignore_on_load_unexpected
    hf_class._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{2 + k}\..*" for k in range(layers)]
    try:
        hf = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
        for row, prompt in enumerate(PROMPTS):  # transformers' MTP decoding takes one row at a time
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, use_mtp=True).numpy()
            new = expected[0, len(prompt):]
            np.testing.assert_array_equal(out.new_tokens(row)[: len(new)], new)
    finally:
        hf_class._keys_to_ignore_on_load_unexpected = saved


@pytest.mark.slow
def test_extra_drafts_reuse_the_last_layer(checkpoints):
    model = jaxspec.load(checkpoints("deepseek_v3", 1))
    ids, mask = left_padded(PROMPTS)
    plain = jaxspec.generate(model, ids, mask, max_new_tokens=N)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=N, use_mtp=True, num_assistant_tokens=3)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.accepted_hist.shape[1] == 4


def _every_accepted_count(layers: int) -> list[tuple[int, int]]:
    """Rounds (drafts, accepted) that draft K and accept 0, 1, ..., K, twice."""
    return [(layers, index % (layers + 1)) for index in range(2 * (layers + 1))]


def _idle_stretches(layers: int) -> list[tuple[int, int]]:
    """Rounds that draft nothing (no depth runs), one draft (depth 0 alone), then K again: idle depths must catch
    up, over more than one block (CATCH_UP_WIDTH = 16) after the longest stretch."""
    return ([(layers, 1), (0, 0), (0, 0), (layers, layers), (1, 1), (1, 0), (layers, 0)] + [(0, 0)] * 20
            + [(1, 1), (layers, 1), (0, 0), (layers, layers)])


@pytest.mark.parametrize("family, layers, plan", [
    # 60-100 s each (many small compiled calls): slow only. See the docstring for what the default suite runs.
    pytest.param("deepseek_v3", 2, _every_accepted_count, marks=SLOW),
    pytest.param("deepseek_v3", 2, _idle_stretches, marks=SLOW),
    pytest.param("glm4_moe", 3, _every_accepted_count, marks=SLOW),
    pytest.param("glm4_moe", 3, _idle_stretches, marks=SLOW),
])
def test_drafts_equal_the_from_scratch_chain(checkpoints, family, layers, plan):
    """Drive the drafter by hand through a plan of rounds, forcing each round's draft count and accepted count;
    each round's drafts must equal an MTP chain computed from scratch over the committed sequence (the
    definition), whatever ran before: every accepted count, rounds in which no depth ran, rounds in which only the
    first depths ran.

    Slow only: the default suite does not check the drafter round by round against the chain, for every accepted
    count or after idle rounds. It checks the MoE models' MTP step with its caches against the chain after rounds
    that accept 0, 1 and 2 of 2 drafts, without idle rounds (tests/models/test_moe_models.py), greedy MTP output
    against plain greedy and transformers (above), and, on Llama MTP layers, each call's accepted and drafted
    counts against a replay of decoding (tests/train/test_train_mtp.py)."""
    target = jaxspec.load(checkpoints(family, layers)).module
    drafter = MtpDrafter(max_draft=layers, num_layers=layers)
    model = jaxspec.load(checkpoints(family, layers))
    processing = settings_lib.resolve(model, max_new_tokens=8, eos_token_id=[]).processing(target.cfg.vocab_size)
    ctx = Context(target=target, assistant=None, processing=jax.tree.map(jnp.asarray, processing), do_sample=False,
                  ngram_slots=4, draft_inputs={"initial_draft_length": jnp.int32(layers)})
    size, bucket, prompt = 96, 16, [5, 6, 7, 8, 9, 10, 11]
    tokens = np.zeros((1, size), np.int32)
    tokens[0, : len(prompt) + 1] = prompt + [12]  # the prefill's first token
    positions = jnp.arange(bucket)[None]
    _, hidden, cache = target(jnp.asarray(tokens[:, :bucket]), positions, target.init_cache(1, size))
    loop = DecodeState(
        tokens=jnp.asarray(tokens), lengths=jnp.array([len(prompt) + 1]), prompt_lengths=jnp.array([len(prompt)]),
        budget_end=jnp.array([size - layers - 2]), done=jnp.array([False]), cache=cache, drafter=(),
        rng=jax.random.key(0), counters=Counters.zeros(1, layers),
    )
    state = drafter.init(ctx, 1, size)
    for first in range(0, bucket, 8):  # the prompt in two chunks, as the loop's prefill hands it over
        chunk = slice(first, first + 8)
        state = drafter.prefill_chunk(ctx, state, PrefillChunk(
            tokens=jnp.asarray(tokens[:, chunk]), positions=positions[:, chunk], hidden=hidden[:, chunk],
            valid=positions[:, chunk] < len(prompt)))
    draft_fn = jax.jit(lambda loop, state, key: _draft_and_state(drafter.draft(ctx, loop, state, key)))
    update_fn = jax.jit(lambda state, result: drafter.update(ctx, state, result))
    target_fn = jax.jit(target.__call__)
    corrections = np.random.RandomState(0).randint(3, 128, 64)
    checked = 0
    for round_index, (drafts, accepted) in enumerate(plan(layers)):
        length = int(loop.lengths[0])
        # The schedule's length decides the round's draft count (Schedule() without widths drafts num_tokens).
        state = dataclasses.replace(state, length=dataclasses.replace(state.length, num_tokens=jnp.array([drafts])))
        draft, state = draft_fn(loop, state, jax.random.key(round_index))
        assert int(draft.count[0]) == drafts
        if drafts:  # (each length compiles the from-scratch chain anew: idle rounds skip it)
            expected = np.argmax(np.asarray(mtp_chain_from_scratch(target, jnp.asarray(tokens[:, :length]))), -1)
            np.testing.assert_array_equal(np.asarray(draft.tokens)[:, :drafts], expected[:, :drafts])
        checked += drafts
        # Verify by hand: the target reads [last, d_1..d_K]; commit `accepted` drafts and a correction token.
        block = np.concatenate([tokens[:, length - 1: length], np.asarray(draft.tokens)], axis=1)
        block_positions = jnp.asarray(length - 1 + np.arange(layers + 1))[None]
        _, block_hidden, cache = target_fn(jnp.asarray(block), block_positions, loop.cache)
        tokens[0, length: length + accepted] = np.asarray(draft.tokens)[0, :accepted]
        tokens[0, length + accepted] = corrections[round_index % len(corrections)]
        new_length = length + accepted + 1
        result = RoundResult(drafted=jnp.array([drafts]), accepted=jnp.array([accepted]),
                             committed=jnp.array([accepted + 1]), tokens=jnp.asarray(block),
                             hidden=block_hidden, lengths=jnp.array([new_length]))
        state = update_fn(state, result)
        loop = dataclasses.replace(loop, tokens=jnp.asarray(tokens), lengths=jnp.array([new_length]), cache=cache)
    assert checked >= 2 * layers


def test_sampling_is_exact(checkpoints):
    """End to end, 6000 rows, budget K + 2 with K = 2 MTP drafts: the first three sampled tokens follow the target's
    exact law over the whole vocabulary."""
    model = jaxspec.load(checkpoints("glm4_moe", 2))
    module, prompt, rows = model.module, [5, 6, 7, 8], 6000

    @jax.jit
    def last_logits(batch):
        positions = jnp.broadcast_to(jnp.arange(batch.shape[1]), batch.shape)
        return module(batch, positions, module.init_cache(batch.shape[0], batch.shape[1]))[0][:, -1]

    exact = oracles.exact_marginals(lambda batch: last_logits(jnp.asarray(batch)), prompt, positions=3)
    out = jaxspec.generate(model, [prompt] * rows, max_new_tokens=4, do_sample=True, top_k=0, seed=7, eos_token_id=[],
                           use_mtp=True, num_assistant_tokens_schedule="constant")
    assert out.drafted.sum() >= rows * 2 and out.accepted.sum() > 0
    new = out.sequences[:, len(prompt):]
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


@pytest.mark.slow
def test_ensemble_with_mtp_runs(checkpoints):
    model = jaxspec.load(checkpoints("glm4_moe", 1))
    out = jaxspec.generate(model, PROMPTS, max_new_tokens=8, use_mtp=True, assistant_ensemble_weight=0.7,
                           do_sample=True, num_assistant_tokens_schedule="constant")  # every round verifies drafts
    assert (out.num_new_tokens >= 1).all() and out.drafted.sum() > 0


def test_use_mtp_without_mtp_layers_is_an_error(tiny_llama_dir, checkpoints):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        jaxspec.generate(jaxspec.load(tiny_llama_dir), [[5, 6]], max_new_tokens=4, use_mtp=True)
    model = jaxspec.load(checkpoints("glm4_moe", 1))
    with pytest.raises(ValueError, match="assistant_confidence_threshold is not used by the mtp strategy"):
        jaxspec.generate(model, [[5, 6]], max_new_tokens=4, use_mtp=True, assistant_confidence_threshold=0.2)


def _draft_and_state(step):
    """A DraftStep's proposal and the drafter's new state (what these tests follow round by round)."""
    return step.draft, step.state
