"""The Gemma 4 MTP drafter (assistant_model= a gemma4_assistant checkpoint) against transformers 5.23.

A tiny random Gemma 4 target with KV sharing and a tiny drafter built with transformers (patched so that 5.23 can
instantiate it) are saved and loaded. The sliding window (4) is shorter than every sequence, so the drafter's
windowed layers really drop keys. Checked: one draft step's logits against transformers' drafter; greedy output with
the drafter against plain greedy (a ragged batch) and against transformers' own assisted run (batch 1); every
round's drafts against a from-scratch reference over the committed sequence, for every accepted count, so stale
cache entries of rejected drafts would show; sampling against the target's exact law; the errors; the CLI wiring.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
from jaxspec import checkpoint, settings as settings_lib
from jaxspec.loading import Model
from jaxspec.models.gemma import GemmaConfig, GemmaForCausalLM
from jaxspec.models.gemma4_assistant import Gemma4AssistantConfig, Gemma4AssistantForCausalLM
from jaxspec.schedule import Schedule
from jaxspec.strategies.base import Context, Counters, DecodeState, PrefillChunk, RoundResult
from jaxspec.strategies.gemma4_drafter import Gemma4Drafter
from tests.fixtures import hf_models, oracles
from tests.fixtures.prompts import PROMPTS, left_padded
from tests.fixtures.text import tiny_tokenizer

from jaxspec import loop
TARGET_SEED = 13  # the Gemma 4 target of test_gemma_models.py, whose plain greedy output equals transformers'
K = 3


@dataclasses.dataclass
class Pair:
    hf_target: torch.nn.Module
    hf_drafter: torch.nn.Module
    target: jaxspec.Model
    drafter: jaxspec.Model
    target_dir: str
    drafter_dir: str


def _save(model, folder) -> str:
    model.save_pretrained(folder)
    return os.fspath(folder)


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Pair:
    hf_target = hf_models.build_tiny_gemma("gemma4_text", seed=TARGET_SEED)
    hf_drafter = hf_models.build_tiny_gemma4_assistant(seed=1)
    target_dir = _save(hf_target, tmp_path_factory.mktemp("gemma4_target"))
    tiny_tokenizer().save_pretrained(target_dir)
    drafter_dir = _save(hf_drafter, tmp_path_factory.mktemp("gemma4_drafter"))
    return Pair(hf_target, hf_drafter, jaxspec.load(target_dir), jaxspec.load(drafter_dir), target_dir, drafter_dir)


@torch.no_grad()
def reference_drafts(hf_target, hf_drafter, sequence: list[int], k: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy drafts from scratch: the target reads the committed sequence but its newest token (positions < L-1),
    then the drafter runs k steps from position L-1 on those keys and values and the hidden state at L-2."""
    out = hf_target(torch.tensor([sequence[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
    shared = {name: (kv[0], kv[1]) for name, kv in out.shared_kv_states.items()}
    hidden, token = out.hidden_states[-1][:, -1:], torch.tensor([[sequence[-1]]])
    drafts, logits = [], []
    for _ in range(k):
        inputs = torch.cat([hf_target.get_input_embeddings()(token), hidden], dim=-1)
        step = hf_drafter(inputs_embeds=inputs, position_ids=torch.tensor([[len(sequence) - 1]]),
                          shared_kv_states=shared)
        token, hidden = step.logits.argmax(-1), step.last_hidden_state
        drafts.append(int(token))
        logits.append(step.logits[0, 0].numpy())
    return drafts, logits


@pytest.mark.parametrize("ordered", [False, True], ids=["tied_head", "centroid_head"])
def test_one_draft_step_matches_transformers(pair, tmp_path, ordered):
    """Rows of two lengths in one batch (one inside the sliding window, one past it), against transformers' drafter
    row by row; the centroid head (use_ordered_embeddings) too."""
    if ordered:
        hf_drafter = hf_models.build_tiny_gemma4_assistant(seed=2, use_ordered_embeddings=True, num_centroids=8,
                                                           centroid_intermediate_top_k=2)
        drafter = jaxspec.load(_save(hf_drafter, tmp_path / "ordered")).module
    else:
        hf_drafter, drafter = pair.hf_drafter, pair.drafter.module
    target = pair.target.module
    rng = np.random.RandomState(0)
    lengths = [4, 13]  # L: the drafter reads positions < L-1 and queries from L-1
    tokens = rng.randint(3, 128, (2, max(lengths)))
    hidden_in = rng.randn(2, target.cfg.hidden_size).astype(np.float32)

    @nnx.jit
    def draft_step(target, drafter, tokens, last, hidden, query_positions):
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        _, _, cache = target(tokens, positions, target.init_cache(2, 32))  # row 0's entries past L-1 are not read
        inputs = jnp.concatenate([target.input_embeddings(last), hidden[:, None]], axis=-1)
        shared = {t: target.shared_kv(cache, t) for t in ("sliding_attention", "full_attention")}
        return drafter(inputs, query_positions, shared)

    last = tokens[[0, 1], [lengths[0] - 1, lengths[1] - 1]][:, None]
    logits, projected = draft_step(target, drafter, jnp.asarray(tokens), jnp.asarray(last), jnp.asarray(hidden_in),
                                   jnp.asarray(lengths)[:, None] - 1)
    for row, length in enumerate(lengths):
        with torch.no_grad():
            out = pair.hf_target(torch.tensor(tokens[row: row + 1, : length - 1]), return_shared_kv_states=True)
            hf_inputs = torch.cat([pair.hf_target.get_input_embeddings()(torch.tensor([[tokens[row, length - 1]]])),
                                   torch.tensor(hidden_in[row: row + 1, None])], dim=-1)
            expected = hf_drafter(inputs_embeds=hf_inputs, position_ids=torch.tensor([[length - 1]]),
                                  shared_kv_states={n: (kv[0], kv[1]) for n, kv in out.shared_kv_states.items()})
        np.testing.assert_allclose(np.asarray(logits[row]), expected.logits[0].numpy(), atol=2e-5, rtol=1e-5)
        np.testing.assert_allclose(np.asarray(projected[row]), expected.last_hidden_state[0].numpy(), atol=2e-5,
                                   rtol=1e-5)


def test_conversion_folder_and_bfloat16_keep_the_token_ordering(tmp_path):
    """The centroid head's token ids survive a bfloat16 load (262144 ids do not fit its mantissa) and a conversion
    folder restores to the same params."""
    hf_drafter = hf_models.build_tiny_gemma4_assistant(seed=2, use_ordered_embeddings=True, num_centroids=8,
                                                       centroid_intermediate_top_k=2)
    folder = _save(hf_drafter, tmp_path / "hf")
    ordering = hf_drafter.masked_embedding.token_ordering.numpy()
    half = jaxspec.load(folder, dtype="bfloat16").module
    assert half.embed[...].dtype == jnp.bfloat16 and half.token_ordering[...].dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(half.token_ordering[...]), ordering)
    model = jaxspec.load(folder)
    restored = jaxspec.load(checkpoint.save(model, tmp_path / "converted"))
    assert isinstance(restored.module, Gemma4AssistantForCausalLM)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(model.module)),
                 nnx.to_pure_dict(nnx.state(restored.module)))


def test_greedy_equals_plain_greedy_and_transformers_assisted_run(pair):
    """A ragged batch, the adaptive schedule up to K drafts a round. Plain greedy is transformers' (which jaxspec's
    plain greedy equals for this target: test_gemma_models.py); transformers' own assisted run with the same drafter
    (batch 1, K drafts a round) agrees row by row."""
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(pair.target, ids, mask, max_new_tokens=20, assistant_model=pair.drafter,
                           max_assistant_tokens=K)
    assert out.strategy == "mtp_drafter" and out.accepted_hist.shape == (len(PROMPTS), K + 1)
    assert (out.drafted > 0).all() and out.draft_forwards > 0
    with torch.no_grad():
        plain = pair.hf_target.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=20,
                                        do_sample=False).numpy()
    np.testing.assert_array_equal(out.sequences, plain)
    pair.hf_drafter.generation_config.num_assistant_tokens = K  # 5.23 has no default for this drafter
    for row, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            assisted = pair.hf_target.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False,
                                               assistant_model=pair.hf_drafter)[0, len(prompt):].numpy()
        assert out.num_new_tokens[row] == len(assisted)
        np.testing.assert_array_equal(out.sequences[row, ids.shape[1]: ids.shape[1] + len(assisted)], assisted)


@pytest.mark.slow  # ~40 s: two tree loops of the Gemma 4 pair
@pytest.mark.parametrize("tree", [(2 * K, K), (K + 2, K, 3)])
def test_greedy_trees_equal_plain_greedy(pair, tree):
    """The drafter keeps alternatives at every step (with a budget: the most probable), verified as a tree by the
    Gemma 4 target (shared keys and values, per-layer inputs, sliding windows); ragged rows."""
    ids, mask = left_padded(PROMPTS)
    plain = jaxspec.generate(pair.target, ids, mask, max_new_tokens=20)
    out = jaxspec.generate(pair.target, ids, mask, max_new_tokens=20, assistant_model=pair.drafter, tree=tree,
                           num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    assert out.tree_rounds > 0 and out.accepted.sum() > 0


def test_cli_strategy_mtp_drafter_runs_the_drafter(pair, tiny_llama_dir, capsys):
    """`--strategy mtp_drafter --assistant FOLDER` passes the drafter as assistant_model (`--strategy mtp` means the
    checkpoint's own MTP layers and takes no --assistant); an assistant that is no Gemma 4 drafter is refused before
    generating."""
    from jaxspec.cli import generate as cli

    drafter = jaxspec.load(pair.drafter_dir)
    with_drafter = cli.parse_args(["--model", pair.target_dir, "--strategy", "mtp_drafter", "--assistant",
                                   pair.drafter_dir])
    config = cli.drafting_config(with_drafter, drafter)
    assert config.strategy == "mtp_drafter" and config.assistant_model is drafter and config.use_mtp is None
    assert cli.drafting_config(cli.parse_args(["--model", pair.target_dir, "--strategy", "mtp"])).strategy == "mtp"
    out = jaxspec.generate(jaxspec.load(pair.target_dir), [[5, 6, 7]], max_new_tokens=4, drafting=config)
    assert out.strategy == "mtp_drafter" and out.draft_forwards > 0
    for wrong in ("mtp", "prompt_lookup"):
        with pytest.raises(SystemExit):
            cli.parse_args(["--model", pair.target_dir, "--strategy", wrong, "--assistant", pair.drafter_dir])
    assert cli.main(["--model", pair.target_dir, "--strategy", "mtp_drafter", "--assistant", tiny_llama_dir]) == 2
    assert "strategy 'mtp_drafter' was named, but the arguments select 'speculative'" in capsys.readouterr().err


def test_drafts_after_any_accepted_count_equal_the_from_scratch_reference(pair):
    """Drive the drafter by hand over two rows of different lengths, forcing every accepted count; each round's drafts
    must equal transformers' modules drafting from scratch over the committed sequence. The target cache holds the
    rejected drafts of the previous round (and the prompt chunk's padding) at and past L-1: reading any of them, or
    a stale hidden state, changes the drafts."""
    target, drafter_module = pair.target.module, pair.drafter.module
    drafter = Gemma4Drafter(max_draft=K, schedule=Schedule("constant", initial=K), confidence_threshold=0.0)
    processing = settings_lib.resolve(pair.target, max_new_tokens=8, eos_token_id=[]).processing(128)
    ctx = Context(target=target, assistant=drafter_module, processing=jax.tree.map(jnp.asarray, processing),
                  do_sample=False, ngram_slots=4,
                  draft_inputs={k: jnp.asarray(v) for k, v in drafter.runtime_inputs().items()})
    size, chunk, prompts = 64, 8, [[5, 6, 7, 8, 9, 10, 11, 40, 41, 42, 43], [20, 21, 22, 23, 24, 25]]
    tokens = np.zeros((2, size), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt) + 1] = prompt + [12 + row]  # and the prefill's first token
    prompt_lengths = np.array([len(p) for p in prompts])
    positions = jnp.broadcast_to(jnp.arange(2 * chunk), (2, 2 * chunk))
    _, hidden, cache = target(jnp.asarray(tokens[:, : 2 * chunk]), positions, target.init_cache(2, size))
    state = drafter.init(ctx, 2, size)
    for first in (0, chunk):  # the prompt in two chunks, as the loop's prefill hands it over
        part = slice(first, first + chunk)
        state = drafter.prefill_chunk(ctx, state, PrefillChunk(
            tokens=jnp.asarray(tokens[:, part]), positions=positions[:, part], hidden=hidden[:, part],
            valid=positions[:, part] < jnp.asarray(prompt_lengths)[:, None]))
    lengths = prompt_lengths + 1
    loop_state = DecodeState(
        tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths), prompt_lengths=jnp.asarray(prompt_lengths),
        budget_end=jnp.full((2,), size - K - 2), done=jnp.zeros((2,), bool), cache=cache, drafter=(),
        rng=jax.random.key(0), counters=Counters.zeros(2, K))
    draft_fn = jax.jit(lambda loop_state, state: _draft_and_state(drafter.draft(ctx, loop_state, state,
                                                                                 jax.random.key(0))))
    update_fn = jax.jit(lambda state, result: drafter.update(ctx, state, result))
    target_fn = jax.jit(target.__call__)
    corrections = np.random.RandomState(0).randint(3, 128, (2 * (K + 1), 2))
    for round_index in range(2 * (K + 1)):
        accepted = np.array([round_index % (K + 1), (K - round_index) % (K + 1)])  # each row sees every count
        draft, state = draft_fn(loop_state, state)
        drafts = np.asarray(draft.tokens)
        for row in range(2):
            expected, _ = reference_drafts(pair.hf_target, pair.hf_drafter, tokens[row, : lengths[row]].tolist(), K)
            assert drafts[row].tolist() == expected, (round_index, row)
        # Verify by hand: the target reads [last, d_1..d_K]; each row commits its forced count and a correction.
        block = np.concatenate([tokens[[0, 1], lengths - 1][:, None], drafts], axis=1)
        block_positions = jnp.asarray(lengths[:, None] - 1 + np.arange(K + 1))
        _, block_hidden, cache = target_fn(jnp.asarray(block), block_positions, loop_state.cache)
        for row in range(2):
            start = lengths[row]
            tokens[row, start: start + accepted[row]] = drafts[row, : accepted[row]]
            tokens[row, start + accepted[row]] = corrections[round_index, row]
        lengths = lengths + accepted + 1
        result = RoundResult(drafted=jnp.full((2,), K), accepted=jnp.asarray(accepted),
                             committed=jnp.asarray(accepted + 1), tokens=jnp.asarray(block), hidden=block_hidden,
                             lengths=jnp.asarray(lengths))
        state = update_fn(state, result)
        loop_state = dataclasses.replace(loop_state, tokens=jnp.asarray(tokens), lengths=jnp.asarray(lengths),
                                         cache=cache)


def test_sampling_is_exact(pair):
    """End to end, 2000 rows, K = 3 drafts a round (constant), budget K + 2, temperature 1.5 (the random drafter's
    draws then agree with the target's often enough for multi-draft acceptances): the first three sampled tokens
    follow the target's exact law over the whole vocabulary. Drafts are drawn from the drafter's processed
    distribution, which is also the q of verification (transformers 5.23 drafts argmax against raw q)."""
    prompt, rows, temperature = [5, 6, 7, 8], 2000, 1.5
    exact = oracles.exact_marginals(pair.hf_target, prompt, positions=3, temperature=temperature)
    out = jaxspec.generate(pair.target, [prompt] * rows, max_new_tokens=K + 2, do_sample=True, temperature=temperature,
                           top_k=0, seed=5, eos_token_id=[], assistant_model=pair.drafter, num_assistant_tokens=K,
                           num_assistant_tokens_schedule="constant")
    assert out.drafted.sum() >= rows * K and out.accepted_hist[:, 2:].sum() > 100  # multi-draft rounds accept
    new = out.sequences[:, len(prompt):]
    for i in range(3):
        assert oracles.goodness_of_fit(new[:, i], exact[i]) > 1e-3, i


@pytest.mark.slow  # ~60 s: 2000 batch-1 calls of transformers' assisted generate
def test_transformers_own_sampling_is_lossy(pair):
    """What docs/design.md says of transformers 5.23's Gemma 4 path (it drafts argmax and verifies against the raw
    q), measured: with the prompt, temperature and budget of `test_sampling_is_exact`, transformers' own sampled
    tokens fail the same check against the target's exact law, where jaxspec's pass it. Its first token comes from
    the prefill, so the bias shows from the second."""
    prompt, rows, temperature = [5, 6, 7, 8], 2000, 1.5
    exact = oracles.exact_marginals(pair.hf_target, prompt, positions=3, temperature=temperature)
    pair.hf_drafter.generation_config.num_assistant_tokens = K  # 5.23 has no default for this drafter
    eos = pair.hf_target.generation_config.eos_token_id
    pair.hf_target.generation_config.eos_token_id = None  # the full budget, as exact_marginals counts
    torch.manual_seed(0)
    try:
        with torch.no_grad():
            new = np.stack([pair.hf_target.generate(torch.tensor([prompt]), max_new_tokens=K + 2, do_sample=True,
                                                    temperature=temperature, top_k=0,
                                                    assistant_model=pair.hf_drafter)[0, len(prompt):][:3].numpy()
                            for _ in range(rows)])
    finally:
        pair.hf_target.generation_config.eos_token_id = eos
    p_values = [oracles.goodness_of_fit(new[:, i], exact[i]) for i in range(3)]
    assert p_values[0] > 1e-3 and min(p_values[1:]) < 1e-6, p_values


# -- errors, all before anything compiles ----------------------------------------------------------------------------

GEMMA4 = {"model_type": "gemma4_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
          "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
          "global_head_dim": 16, "sliding_window": 4, "hidden_size_per_layer_input": 8,
          "vocab_size_per_layer_input": 128, "num_kv_shared_layers": 2,
          "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]}
DRAFTER = {"model_type": "gemma4_assistant", "backbone_hidden_size": 32,
           "text_config": {"vocab_size": 128, "hidden_size": 24, "intermediate_size": 48, "num_hidden_layers": 2,
                           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "global_head_dim": 16,
                           "sliding_window": 4, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 0,
                           "layer_types": ["sliding_attention", "full_attention"]}}


def _in_memory(module_cls, cfg) -> Model:
    """A model with abstract params: the checks run before any param is read."""
    return Model(module=nnx.eval_shape(lambda: module_cls(cfg)), config=cfg, hf_config={})


@pytest.mark.parametrize("target_config, drafter_config, message", [
    (GEMMA4 | {"num_kv_shared_layers": 0}, DRAFTER, "no KV sharing"),
    (GEMMA4, DRAFTER | {"text_config": DRAFTER["text_config"] | {"vocab_size": 100}}, r"vocabulary \(100\)"),
    (GEMMA4, DRAFTER | {"backbone_hidden_size": 48}, "backbone_hidden_size"),
], ids=["no_kv_sharing", "vocabulary", "width"])
def test_a_target_the_drafter_cannot_serve_is_an_error(target_config, drafter_config, message):
    target = _in_memory(GemmaForCausalLM, GemmaConfig.from_hf_config(target_config))
    drafter = _in_memory(Gemma4AssistantForCausalLM, Gemma4AssistantConfig.from_hf_config(drafter_config))
    before = loop.trace_count()
    with pytest.raises(ValueError, match=message):
        jaxspec.generate(target, [[5, 6, 7]], max_new_tokens=4, assistant_model=drafter)
    assert loop.trace_count() == before


def test_a_target_that_is_not_gemma4_is_an_error(pair, tiny_llama_dir):
    before = loop.trace_count()
    with pytest.raises(ValueError, match="Gemma 4 target"):
        jaxspec.generate(jaxspec.load(tiny_llama_dir), [[5, 6, 7]], max_new_tokens=4, assistant_model=pair.drafter)
    with pytest.raises(ValueError, match="use_mtp"):  # the drafter is an assistant_model, not a second strategy
        jaxspec.generate(pair.target, [[5, 6, 7]], max_new_tokens=4, assistant_model=pair.drafter, use_mtp=True)
    assert loop.trace_count() == before


def _draft_and_state(step):
    """A DraftStep's proposal and the drafter's new state (what these tests follow round by round)."""
    return step.draft, step.state
