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
from jaxspec.sampling import SamplingParams
from jaxspec.strategies.base import Context, Counters, DecodeState, Prefill, RoundResult
from jaxspec.strategies.mtp import MtpDrafter
from tests.test_generate import PROMPTS, left_padded
from tests.test_moe_models import DEEPSEEK, HF_CLASSES, save_checkpoint

N = 24
FAMILIES = {
    "deepseek_v3": DEEPSEEK | dict(first_k_dense_replace=1, q_lora_rank=16, n_group=2, topk_group=1,
                                   num_experts_per_tok=2),
    "glm4_moe": dict(num_key_value_heads=2, first_k_dense_replace=1, num_experts_per_tok=2, n_group=1, topk_group=1,
                     use_qk_norm=True),
}


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


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("layers", [1, 2, 3])
def test_greedy_equals_plain_greedy_and_transformers(checkpoints, family, layers):
    folder = checkpoints(family, layers)
    model = jaxspec.load(folder)
    ids, mask = left_padded(PROMPTS)
    plain = jaxspec.generate(model, ids, mask, max_new_tokens=N)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=N, use_mtp=True)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.accepted_hist.shape[1] == layers + 1 and out.drafted.sum() > 0
    if layers == 3:
        return  # HF parity at 1 and 2 layers keeps the suite short
    hf_class = HF_CLASSES[family][1]
    saved = hf_class._keys_to_ignore_on_load_unexpected
    hf_class._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{2 + k}\..*" for k in range(layers)]
    try:
        hf = hf_class.from_pretrained(folder, dtype=torch.float32).eval()
        for prompt in PROMPTS:
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=N, do_sample=False, use_mtp=True).numpy()
            single = jaxspec.generate(model, [prompt], max_new_tokens=N, use_mtp=True)
            np.testing.assert_array_equal(single.sequences[:, : expected.shape[1]], expected)
    finally:
        hf_class._keys_to_ignore_on_load_unexpected = saved


def test_extra_drafts_reuse_the_last_layer(checkpoints):
    model = jaxspec.load(checkpoints("deepseek_v3", 1))
    ids, mask = left_padded(PROMPTS)
    plain = jaxspec.generate(model, ids, mask, max_new_tokens=N)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=N, use_mtp=True, num_assistant_tokens=3)
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.accepted_hist.shape[1] == 4


@pytest.mark.parametrize("family, layers", [("deepseek_v3", 2), ("glm4_moe", 3)])
def test_drafts_after_any_accepted_count_equal_the_from_scratch_chain(checkpoints, family, layers):
    """Drive the drafter by hand, forcing every possible accepted count; each round's drafts must equal an MTP
    chain computed from scratch over the committed sequence (the definition)."""
    target = jaxspec.load(checkpoints(family, layers)).module
    drafter = MtpDrafter(max_draft=layers, num_layers=layers)
    ctx = Context(target=target, assistant=None, sampling=SamplingParams(), eos_ids=(), pad_id=0)
    size, bucket, prompt = 64, 16, [5, 6, 7, 8, 9, 10, 11]
    tokens = np.zeros((1, size), np.int32)
    tokens[0, : len(prompt) + 1] = prompt + [12]  # the prefill's first token
    positions = jnp.arange(bucket)[None]
    _, hidden, cache = target(jnp.asarray(tokens[:, :bucket]), positions, target.init_cache(1, size))
    loop = DecodeState(
        tokens=jnp.asarray(tokens), lengths=jnp.array([len(prompt) + 1]), prompt_lengths=jnp.array([len(prompt)]),
        budget_end=jnp.array([size - layers - 2]), done=jnp.array([False]), cache=cache, drafter=(),
        rng=jax.random.key(0), counters=Counters.zeros(1, layers),
    )
    state = drafter.init(ctx, Prefill(hidden=hidden, state=loop))
    draft_fn = jax.jit(lambda loop, state, key: drafter.draft(ctx, loop, state, key)[:2])
    update_fn = jax.jit(lambda state, result: drafter.update(ctx, state, result))
    target_fn = jax.jit(target.__call__)
    corrections = np.random.RandomState(0).randint(3, 128, 64)
    for round_index in range(2 * (layers + 1)):
        accepted = round_index % (layers + 1)
        length = int(loop.lengths[0])
        draft, state = draft_fn(loop, state, jax.random.key(round_index))
        expected = np.argmax(np.asarray(mtp_chain_from_scratch(target, jnp.asarray(tokens[:, :length]))), -1)
        np.testing.assert_array_equal(np.asarray(draft.tokens), expected)
        # Verify by hand: the target reads [last, d_1..d_K]; commit `accepted` drafts and a correction token.
        block = np.concatenate([tokens[:, length - 1: length], np.asarray(draft.tokens)], axis=1)
        block_positions = jnp.asarray(length - 1 + np.arange(layers + 1))[None]
        _, block_hidden, cache = target_fn(jnp.asarray(block), block_positions, loop.cache)
        tokens[0, length: length + accepted] = np.asarray(draft.tokens)[0, :accepted]
        tokens[0, length + accepted] = corrections[round_index]
        new_length = length + accepted + 1
        result = RoundResult(drafted=jnp.array([layers]), accepted=jnp.array([accepted]),
                             committed=jnp.array([accepted + 1]), tokens=jnp.asarray(block),
                             hidden=block_hidden, lengths=jnp.array([new_length]))
        state = update_fn(state, result)
        loop = dataclasses.replace(loop, tokens=jnp.asarray(tokens), lengths=jnp.array([new_length]), cache=cache)


def test_sampling_first_tokens_follow_plain_sampling(checkpoints):
    from scipy import stats

    model = jaxspec.load(checkpoints("glm4_moe", 1))
    prompts = [[5, 6, 7, 8]] * 3000
    common = dict(max_new_tokens=3, do_sample=True, temperature=1.5, eos_token_id=[])
    plain = jaxspec.generate(model, prompts, seed=1, **common).sequences[:, 4:6]
    mtp = jaxspec.generate(model, prompts, seed=2, use_mtp=True, **common)
    assert mtp.drafted.sum() > 0
    pairs = [p[:, 0] * 128 + p[:, 1] for p in (plain, mtp.sequences[:, 4:6])]
    cells, counts = np.unique(np.concatenate(pairs), return_counts=True)
    kept = cells[counts >= 20]
    table = np.array([[np.sum(p == c) for c in kept] + [np.sum(~np.isin(p, kept))] for p in pairs])
    assert stats.chi2_contingency(table[:, table.sum(0) > 0]).pvalue > 0.001


def test_ensemble_with_mtp_runs(checkpoints):
    model = jaxspec.load(checkpoints("glm4_moe", 1))
    out = jaxspec.generate(model, PROMPTS, max_new_tokens=8, use_mtp=True, assistant_ensemble_weight=0.7,
                           do_sample=True)
    assert (out.num_new_tokens >= 1).all() and out.drafted.sum() > 0


def test_use_mtp_without_mtp_layers_is_an_error(tiny_llama_dir, checkpoints):
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        jaxspec.generate(jaxspec.load(tiny_llama_dir), [[5, 6]], max_new_tokens=4, use_mtp=True)
    model = jaxspec.load(checkpoints("glm4_moe", 1))
    with pytest.raises(ValueError, match="do not apply to use_mtp"):
        jaxspec.generate(model, [[5, 6]], max_new_tokens=4, use_mtp=True, assistant_confidence_threshold=0.2)
