"""Training EAGLE-3 heads (jaxspec.train.eagle3_*): the training-time test against SpecForge's reference forward and
its loss recipe, gradients, the initial head and draft vocabulary, a loss that falls and a replayed acceptance that
rises, exact resume, the export read back by jaxspec (decoding exactly, with the accepted counts the replay
predicts) and by SpecForge's `LlamaForCausalLMEagle3`, heads for a Gemma target, the command line, and the errors for
bad arguments.

The target is the suite's tiny Llama (conftest's `target`: 4 layers, width 32, 128 tokens). The head reads target
layers (2, 0, 1): out of order, so fc's input order is exercised (an EAGLE-3 head never reads the last layer).
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
from jaxspec.train import (Eagle3TrainConfig, OptimConfig, data, dflash_data, draft_vocabulary_for, new_eagle3_head,
                           save_eagle3_head, train_eagle3)
from jaxspec.train.eagle3_losses import embedding_table, replay_layout, ttt_drafts, ttt_logits, ttt_loss
from jaxspec.train.losses import simulate_greedy_rounds
from jaxspec.train.step import split_head
from tests.fixtures import eagle3 as eagle3_fixtures

SEQ = 32  # generated rows: prompt + answer
LAYERS = (2, 0, 1)
DRAFT = 48  # draft vocabulary, of 128 tokens
TTT = 4  # chained drafts per round
DECAY = 0.8


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 127, rng.integers(3, 10))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(target):
    """The target's greedy answers to 8 random prompts, with its taps at LAYERS."""
    return dflash_data.generated_block_corpus(target.module, random_prompts(8, seed=0), SEQ, 8, eos_ids=(),
                                              layer_ids=LAYERS)


@pytest.fixture(scope="module")
def vocab(corpus):
    return draft_vocabulary_for(corpus, DRAFT, 128)


@pytest.fixture(scope="module")
def trained(target, corpus, vocab, tmp_path_factory):
    """A head overfit on the corpus (its held-out set is the corpus itself), exported in float32."""
    head = new_eagle3_head(target, vocab, layer_ids=LAYERS)
    cfg = Eagle3TrainConfig(steps=100, batch_size=4, ttt_steps=TTT, eval_drafts=TTT, eval_every=100,
                            optim=OptimConfig(learning_rate=1e-2, warmup_steps=3))
    result = train_eagle3(head, target, corpus, corpus, cfg, str(tmp_path_factory.mktemp("run")), progress=False)
    folder = save_eagle3_head(result.model, str(tmp_path_factory.mktemp("export") / "head"), dtype=np.float32)
    return result, folder


def perturbed(head, seed: int = 1):
    """The head's module with every parameter moved at random, so no value is left at its structured init (the
    zero output projections would hide most of the midlayer)."""
    graphdef, params, rest = split_head(head.module)
    rng = np.random.default_rng(seed)
    params = jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), params)
    return nnx.merge(graphdef, params, rest)


def reference_head(target, draft_ids, seed: int = 5):
    """A random SpecForge head for the tiny target reading LAYERS, embedding with the target's table (which
    SpecForge copies in), and the same head loaded by jaxspec."""
    reference = eagle3_fixtures.reference({"eagle_config": {"eagle_aux_hidden_state_layer_ids": list(LAYERS)}},
                                          seed=seed, draft_ids=list(draft_ids))
    with torch.no_grad():
        reference.embed_tokens.weight.copy_(torch.tensor(np.asarray(target.module.embed[...])))
    return reference


def reference_as_jaxspec(reference):
    """The reference head, saved without its embedding (it is the target's) and loaded by jaxspec: the module."""
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        return jaxspec.load(eagle3_fixtures.save(reference, folder)).module


def taps(target, tokens):
    """The target's (features [B, T, 3 D], final-normed states [B, T, D]) at LAYERS, float32."""
    return jax.jit(lambda t: dflash_data.target_taps(target.module, t, LAYERS))(jnp.asarray(tokens))


# ----------------------------------------------------------------------------------------------------------------
# The training-time test is SpecForge's


@pytest.mark.parametrize("own_embedding", [False, True])
def test_ttt_logits_equal_the_reference_at_every_index_and_step(target, tmp_path, own_embedding):
    """jaxspec's TTT forward (every index of two rows at once) gives SpecForge's chained logits
    (tests/fixtures/eagle3.py `chained_logits`, one row at a time), with the target's table or the head's own."""
    reference = eagle3_fixtures.reference(seed=3)
    if not own_embedding:
        with torch.no_grad():
            reference.embed_tokens.weight.copy_(torch.tensor(np.asarray(target.module.embed[...])))
    head = jaxspec.load(eagle3_fixtures.save(reference, tmp_path, own_embedding=own_embedding)).module
    generator = torch.Generator().manual_seed(1)
    length = 11
    features = torch.randn(2, length, 3 * 32, generator=generator)
    tokens = torch.randint(0, 128, (2, length + TTT), generator=generator)
    expected = [eagle3_fixtures.chained_logits(reference, features[b: b + 1], tokens[b: b + 1], TTT) for b in (0, 1)]
    got = jax.jit(ttt_logits, static_argnums=4)(head, embedding_table(head, target.module),
                                                 jnp.asarray(features.numpy()), jnp.asarray(tokens.numpy()), TTT)
    for step in range(TTT):
        want = torch.cat([expected[b][step] for b in (0, 1)]).numpy()
        np.testing.assert_allclose(np.asarray(got[step]), want, rtol=1e-4, atol=1e-4)


def test_loss_is_specforges_recipe_on_the_targets_rows(target, corpus, vocab):
    """ttt_loss on two answers equals SpecForge's recipe computed in torch from the reference's chained logits: step
    i at index t against the target's logits at t+1+i restricted to t2d and renormalised (`_compute_target_p`),
    masked where the target's argmax is outside the draft vocabulary (its full argmax, which on greedy rows is the
    row's token ttt_loss checks), to rounds decoding runs and tokens inside the answer, steps weighted 0.8**i."""
    reference = reference_head(target, vocab)
    rows = corpus.take(np.array([1, 5]))
    features, hidden = taps(target, rows.tokens)
    head = reference_as_jaxspec(reference)
    loss, metrics = jax.jit(ttt_loss, static_argnums=(7, 8))(
        head, target.module, jnp.asarray(rows.tokens), jnp.asarray(rows.lengths), jnp.asarray(rows.starts), features,
        hidden, TTT, DECAY)

    t = SEQ
    full_logits = torch.tensor(np.asarray(target.module.logits(hidden)))  # [B, T, V]
    tokens = torch.nn.functional.pad(torch.tensor(rows.tokens, dtype=torch.long), (0, TTT + 1))
    t2d = reference.t2d
    kl_sums, counts = torch.zeros(TTT), torch.zeros(TTT)
    for b in range(2):
        chained = eagle3_fixtures.chained_logits(reference, torch.tensor(np.asarray(features[b: b + 1])),
                                                 tokens[b: b + 1, : t + TTT], TTT)
        for i in range(TTT):
            source = torch.arange(t) + 1 + i  # the target's state whose head gives p of the token at t+2+i
            logits = full_logits[b, source.clamp(max=t - 1)]  # [T, V]
            target_p = torch.softmax(logits[:, t2d], dim=-1)
            log_q = torch.log_softmax(chained[i][0], dim=-1)
            kl = torch.sum(target_p * (torch.log(target_p) - log_q), dim=-1)
            index = torch.arange(t)
            mask = (t2d[logits.argmax(-1)] & (index + 1 >= int(rows.starts[b]))
                    & (index + 2 + i < int(rows.lengths[b])))
            kl_sums[i] += (kl * mask).sum()
            counts[i] += mask.sum()
    weights = DECAY ** torch.arange(TTT, dtype=torch.float32)
    assert counts.min() > 10  # every step has entries
    np.testing.assert_allclose(float(loss), float((weights * kl_sums).sum() / (weights * counts).sum()), rtol=1e-4)
    np.testing.assert_allclose(np.asarray(metrics["step_loss"]), (kl_sums / counts).numpy(), rtol=1e-4)
    np.testing.assert_allclose(float(metrics["weight"]), float((weights * counts).sum()), rtol=1e-6)


@pytest.mark.slow  # ~6 s of finite differences
def test_gradients_reach_every_parameter_and_match_finite_differences(target, corpus, vocab):
    """Every trained parameter gets a finite, non-zero gradient; the gradient along a random direction matches
    the loss's central difference; and what lies past a row's end (tokens, taps) changes nothing."""
    head = perturbed(new_eagle3_head(target, vocab, layer_ids=LAYERS))
    graphdef, params, rest = split_head(head)
    rows = corpus.take(np.arange(4))
    features, hidden = taps(target, rows.tokens)
    arrays = (jnp.asarray(rows.tokens), jnp.asarray(rows.lengths), jnp.asarray(rows.starts), features, hidden)

    @jax.jit
    def loss(params, tokens, lengths, starts, features, hidden):
        module = nnx.merge(graphdef, params, rest)
        return ttt_loss(module, target.module, tokens, lengths, starts, features, hidden, TTT, DECAY)[0]

    value, grads = jax.value_and_grad(loss)(params, *arrays)
    flat = jax.tree.leaves_with_path(grads)
    assert {str(path[0].key) for path, _ in flat} == {"fc", "input_norm", "hidden_norm", "wq", "wk", "wv", "wo",
                                                      "mlp_norm", "w_gate", "w_up", "w_down", "final_norm", "lm_head"}
    for path, g in flat:
        assert np.isfinite(np.asarray(g)).all() and np.abs(np.asarray(g)).max() > 0, path
    rng = np.random.default_rng(2)
    direction = jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape), x.dtype), params)
    directional = sum(float(jnp.sum(g * d)) for g, d in zip(jax.tree.leaves(grads), jax.tree.leaves(direction)))
    eps = 1e-3

    def moved(step):  # params + step * direction
        return jax.tree.map(lambda p, d: p + step * d, params, direction)

    difference = (float(loss(moved(eps), *arrays)) - float(loss(moved(-eps), *arrays))) / (2 * eps)
    np.testing.assert_allclose(difference, directional, rtol=2e-2)
    assert np.isfinite(float(value))
    # Past each row's end (rows cut 3 tokens short): other tokens and taps, the same loss.
    lengths = jnp.asarray(rows.lengths - 3)
    past = np.arange(SEQ)[None, :] >= np.asarray(lengths)[:, None]  # [B, T]
    tokens = np.where(past, 7, rows.tokens)
    other_features = jnp.where(past[..., None], 0.5, features)
    before = loss(params, arrays[0], lengths, arrays[2], features, hidden)
    after = loss(params, jnp.asarray(tokens), lengths, arrays[2], other_features, hidden)
    np.testing.assert_allclose(float(after), float(before), rtol=1e-6)


# ----------------------------------------------------------------------------------------------------------------
# The fresh head and its draft vocabulary


def test_draft_vocabulary_is_the_answers_most_frequent_tokens_ascending(corpus, vocab):
    counts = np.zeros(128, np.int64)
    for row in range(len(corpus)):
        for token in corpus.tokens[row, corpus.starts[row]: corpus.lengths[row]]:  # answers only, not prompts
            counts[token] += 1
    assert np.all(np.diff(vocab) > 0) and len(vocab) == DRAFT
    assert counts[vocab].min() >= np.delete(counts, vocab).max()  # no token left out is used more
    np.testing.assert_array_equal(draft_vocabulary_for(corpus, 500, 128), np.arange(128))  # at least V: all of it


@pytest.mark.slow
def test_fresh_head_drafts_with_the_targets_head_at_its_deepest_layer(target, corpus, vocab):
    """The initial head passes the deepest tapped state through fc and its midlayer (zero output projections), so its
    first drafts are the target's own head over that state, restricted to the draft vocabulary."""
    head = new_eagle3_head(target, vocab, layer_ids=LAYERS)
    assert head.config.layer_ids(4) == LAYERS and head.config.draft_vocab_size == DRAFT
    np.testing.assert_array_equal(np.asarray(head.module.vocab_ids[...]), vocab)
    rows = corpus.take(np.arange(2))
    features, _ = taps(target, rows.tokens)
    tokens = jnp.pad(jnp.asarray(rows.tokens), ((0, 0), (0, TTT)))
    logits = ttt_logits(head.module, embedding_table(head.module, target.module), features, tokens, TTT)
    deepest = features[..., :32]  # layer 2, first in LAYERS
    expected = target.module.logits(target.module.final_hidden(deepest))[..., vocab]
    for step in range(TTT):  # every step passes its input through unchanged
        np.testing.assert_allclose(np.asarray(logits[step]), np.asarray(expected), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------------------------
# Training


@pytest.mark.slow
def test_training_lowers_the_loss_and_raises_the_replayed_acceptance(trained):
    history = trained[0].history
    first, last = np.mean(history["loss"][:5]), np.mean(history["loss"][-10:])
    assert last < 0.5 * first, (first, last)
    before, after = history["evals"][0]["acceptance"], history["evals"][-1]["acceptance"]
    assert set(after) == {"1", "2", "3", "4"}
    assert after["4"]["tokens_per_round"] > before["4"]["tokens_per_round"] + 0.4, (before["4"], after["4"])
    assert after["1"]["acceptance_rate"] > before["1"]["acceptance_rate"] + 0.2, (before["1"], after["1"])
    top1 = np.asarray(history["step_top1"])
    assert top1[-10:, 0].mean() > top1[:5, 0].mean() + 0.2  # the first draft agrees with the target


def test_resume_is_bit_for_bit(target, corpus, vocab, tmp_path):
    head = new_eagle3_head(target, vocab, layer_ids=LAYERS)
    cfg = Eagle3TrainConfig(steps=8, batch_size=4, ttt_steps=2, eval_every=1000, checkpoint_every=3,
                            optim=OptimConfig(learning_rate=3e-3, warmup_steps=2))
    straight = train_eagle3(head, target, corpus, None, cfg, str(tmp_path / "straight"), progress=False)
    partial = train_eagle3(head, target, corpus, None, cfg, str(tmp_path / "resumed"), progress=False, stop_at=5)
    assert partial.history["step"][-1] == 5
    resumed = train_eagle3(head, target, corpus, None, cfg, str(tmp_path / "resumed"), progress=False)
    assert resumed.history["step"] == straight.history["step"] == list(range(1, 9))
    assert resumed.history["loss"] == straight.history["loss"]
    for a, b in zip(*(jax.tree.leaves(nnx.state(result.model.module)) for result in (resumed, straight)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(ValueError, match="other settings"):
        train_eagle3(head, target, corpus, None, dataclasses.replace(cfg, ttt_steps=3), str(tmp_path / "resumed"),
                     progress=False)


# ----------------------------------------------------------------------------------------------------------------
# The export


@pytest.mark.slow
def test_export_is_read_back_by_jaxspec_and_by_specforge(trained, target, corpus, vocab, tmp_path):
    """The folder has SpecForge's layout (no embed_tokens: the head shares the target's); jaxspec.load reads it back
    to the trained params (bfloat16 by default: the params rounded); SpecForge's `from_pretrained` loads it with no
    unexpected tensor and, with the target's table copied in, gives jaxspec's TTT logits."""
    from safetensors import safe_open
    from specforge.modeling.draft.llama3_eagle import LlamaForCausalLMEagle3

    result, folder = trained
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        config = json.load(handle)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(LAYERS)
    assert config["draft_vocab_size"] == DRAFT and "target_hidden_size" not in config
    with safe_open(os.path.join(folder, "model.safetensors"), "np") as f:
        names = set(f.keys())
        assert f.get_tensor("d2t").dtype == np.int64 and f.get_tensor("t2d").dtype == np.bool_
    assert "embed_tokens.weight" not in names and {"fc.weight", "norm.weight", "lm_head.weight"} <= names
    trained_state = nnx.to_pure_dict(nnx.state(result.model.module))
    loaded = jaxspec.load(folder)
    assert loaded.config.layer_ids(4) == LAYERS
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(nnx.state(loaded.module)), trained_state)
    bf16 = jaxspec.load(save_eagle3_head(result.model, str(tmp_path / "bf16")))  # the default dtype
    jax.tree.map(lambda got, want: np.testing.assert_array_equal(
        got, np.asarray(want).astype(ml_dtypes.bfloat16).astype(np.float32) if got.dtype == np.float32 else want),
        nnx.to_pure_dict(nnx.state(bf16.module)), trained_state)

    reference, info = LlamaForCausalLMEagle3.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert set(info["missing_keys"]) == {"embed_tokens.weight"}
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    # transformers 5 builds the model on the meta device and leaves SpecForge's non-persistent rope buffers
    # uninitialised; SpecForge's own `_init_rope` recomputes them from the config (so its rope keys are still read).
    reference.midlayer.self_attn._init_rope()
    with torch.no_grad():  # SpecForge's load_embedding: the target's table
        reference.embed_tokens.weight.copy_(torch.tensor(np.asarray(target.module.embed[...])))
    np.testing.assert_array_equal((reference.d2t + torch.arange(DRAFT)).numpy(), vocab)
    rows = corpus.take(np.array([3]))
    features, _ = taps(target, rows.tokens)
    tokens = np.pad(rows.tokens, ((0, 0), (0, TTT)))
    expected = eagle3_fixtures.chained_logits(reference.float(), torch.tensor(np.asarray(features)),
                                              torch.tensor(tokens, dtype=torch.long), TTT)
    got = ttt_logits(loaded.module, embedding_table(loaded.module, target.module), features, jnp.asarray(tokens), TTT)
    for step in range(TTT):
        np.testing.assert_allclose(np.asarray(got[step]), expected[step].numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rope", [{}, {"rope_llama3": (8.0, 1.0, 4.0, 64)}])
def test_config_rope_is_read_by_jaxspec_and_transformers(target, rope):
    """The config's rope keys (`rope_theta`, `rope_scaling` for llama3) say the target's rope to jaxspec and to
    transformers (whose config SpecForge, vLLM and SGLang read)."""
    import transformers

    from jaxspec.models.eagle3 import Eagle3Config
    from jaxspec.train.eagle3_export import head_config

    target_cfg = dataclasses.replace(target.config, rope_theta=50000.0, **rope)
    config = head_config(target_cfg, DRAFT, LAYERS)
    head_cfg = Eagle3Config.from_hf_config(config)
    assert (head_cfg.rope_theta, head_cfg.rope_llama3) == (50000.0, rope.get("rope_llama3"))
    parameters = transformers.LlamaConfig(**config).rope_parameters
    assert parameters["rope_theta"] == 50000.0
    assert parameters["rope_type"] == ("llama3" if rope else "default")


@pytest.mark.slow
def test_export_decodes_exactly_with_the_replayed_acceptance(trained, target, corpus):
    """Decoding with the exported head (`--strategy eagle3`) gives the target's greedy answers token for token, and
    its accepted and drafted counts are the ones the training loop's replay predicts."""
    head = jaxspec.load(trained[1])
    rows = corpus.take(np.arange(4))
    prompts = [list(rows.tokens[i, : rows.starts[i]]) for i in range(4)]
    steps = int(rows.lengths.min() - rows.starts.max())
    out = jaxspec.generate(target, prompts, max_new_tokens=steps, eos_token_id=[], assistant_model=head,
                           num_assistant_tokens=TTT, num_assistant_tokens_schedule="constant")
    assert out.strategy == "eagle3"
    for i in range(4):  # the corpus rows are the target's greedy answers
        np.testing.assert_array_equal(out.new_tokens(i), rows.tokens[i, rows.starts[i]: rows.starts[i] + steps])
    features, _ = taps(target, rows.tokens)  # float32, as decoding has them
    drafts = np.asarray(jax.jit(ttt_drafts, static_argnums=4)(head.module, target.module, jnp.asarray(rows.tokens),
                                                               features, TTT))
    replay = simulate_greedy_rounds(replay_layout(drafts), rows.tokens, rows.starts, rows.starts + steps, TTT)
    assert (int(out.accepted.sum()), int(out.drafted.sum())) == (replay["accepted"], replay["drafted"])
    assert replay["accepted"] > 0.2 * replay["drafted"]  # the counts compared are not all zeros


# ----------------------------------------------------------------------------------------------------------------
# Gemma targets


@pytest.fixture(scope="module")
def gemma_target(tmp_path_factory):
    """A tiny Gemma 3 (4 layers, sliding window 4, a final norm with a unit offset) and its answers' corpus."""
    from tests.fixtures import hf_models

    folder = hf_models.save_tiny_gemma("gemma3_text", tmp_path_factory.mktemp("gemma3"), seed=0)
    target = jaxspec.load(folder)
    corpus = dflash_data.generated_block_corpus(target.module, random_prompts(8, seed=0), SEQ, 8, eos_ids=(),
                                                layer_ids=LAYERS)
    return target, corpus


def test_a_fresh_head_for_a_gemma_target_drafts_with_its_head(gemma_target):
    """The fresh head of a Gemma target starts as the target's own head read at its deepest tapped layer, as a
    Llama target's does (the final norm's unit offset folded into the head's norm)."""
    target, corpus = gemma_target
    head = new_eagle3_head(target, layer_ids=LAYERS)
    assert head.config.num_heads == target.config.num_heads and head.config.head_dim == target.config.sliding.head_dim
    rows = corpus.take(np.arange(2))
    features = jax.jit(lambda t: dflash_data.target_taps(target.module, t, LAYERS))(jnp.asarray(rows.tokens))[0]
    tokens = jnp.pad(jnp.asarray(rows.tokens), ((0, 0), (0, 2)))
    logits = ttt_logits(head.module, embedding_table(head.module, target.module), features, tokens, 2)
    width = target.config.hidden_size
    expected = target.module.logits(target.module.final_hidden(features[..., :width]))  # layer 2, first in LAYERS
    np.testing.assert_allclose(np.asarray(logits[1]), np.asarray(expected), rtol=1e-4, atol=1e-4)


@pytest.mark.slow  # ~60 s: a short training run and two decoding loops of the Gemma target
def test_a_head_trained_for_a_gemma_target_decodes_exactly(gemma_target, tmp_path):
    target, corpus = gemma_target
    head = new_eagle3_head(target, draft_vocabulary_for(corpus, DRAFT, 128), layer_ids=LAYERS)
    cfg = Eagle3TrainConfig(steps=40, batch_size=4, ttt_steps=2, eval_drafts=2, eval_every=40,
                            optim=OptimConfig(learning_rate=1e-2, warmup_steps=3))
    result = train_eagle3(head, target, corpus, corpus, cfg, str(tmp_path / "run"), progress=False)
    history = result.history
    assert np.mean(history["loss"][-5:]) < np.mean(history["loss"][:5])
    folder = save_eagle3_head(result.model, str(tmp_path / "head"), dtype=np.float32)
    prompts = [[5, 6, 7, 8, 9, 5, 6, 7], [20, 21, 22, 20, 21]]
    plain = jaxspec.generate(target, prompts, max_new_tokens=16, eos_token_id=[])
    # A constant schedule: every round verifies the head's drafts (the adaptive one would probe a head this briefly
    # trained in the shadow, and might verify none)
    out = jaxspec.generate(target, prompts, max_new_tokens=16, eos_token_id=[], assistant_model=jaxspec.load(folder),
                           num_assistant_tokens_schedule="constant")
    assert out.strategy == "eagle3" and out.drafted.sum() > 0
    np.testing.assert_array_equal(out.sequences, plain.sequences)


# ----------------------------------------------------------------------------------------------------------------
# Bad arguments are named before anything compiles


def test_bad_arguments_are_named(target, corpus, vocab, tmp_path):
    with pytest.raises(ValueError, match=r"three distinct target layers in 0..2 \(the last layer, 3, excluded"):
        new_eagle3_head(target, vocab, layer_ids=(0, 1, 3))
    with pytest.raises(ValueError, match="three distinct"):
        new_eagle3_head(target, vocab, layer_ids=(0, 1, 1))
    with pytest.raises(ValueError, match="no three distinct default layers"):
        new_eagle3_head(target, vocab)  # a 4-layer target
    with pytest.raises(ValueError, match="draft_vocab must be distinct token ids in 0..127, in ascending order"):
        new_eagle3_head(target, vocab[::-1], layer_ids=LAYERS)
    with pytest.raises(ValueError, match="draft vocabulary size must be an integer >= 1"):
        draft_vocabulary_for(corpus, 0, 128)

    head = new_eagle3_head(target, vocab, layer_ids=LAYERS)
    cfg = Eagle3TrainConfig(steps=2, batch_size=2, ttt_steps=2)

    def run(head=head, corpus=corpus, cfg=cfg):
        train_eagle3(head, target, corpus, None, cfg, str(tmp_path / "never"), progress=False)

    with pytest.raises(ValueError, match=r"holds taps of target layers \[2, 0, 1\], the head reads \[0, 1, 2\]"):
        run(head=new_eagle3_head(target, vocab, layer_ids=(0, 1, 2)))
    nothing = corpus.take(np.arange(len(corpus)))
    nothing.lengths[3] = nothing.starts[3] + 1  # only the token the prefill produces: nothing to draft
    with pytest.raises(ValueError, match="1 training row.*no token to draft"):
        run(corpus=nothing)
    with pytest.raises(ValueError, match="ttt_steps must be an integer >= 1"):
        run(cfg=dataclasses.replace(cfg, ttt_steps=0))
    with pytest.raises(ValueError, match="step_decay must be positive"):
        run(cfg=dataclasses.replace(cfg, step_decay=0.0))
    with pytest.raises(ValueError, match="fewer than batch_size=9"):
        run(cfg=dataclasses.replace(cfg, batch_size=9))
    with pytest.raises(ValueError, match="train_eagle3 trains an EAGLE-3 head"):
        run(head=target)
    assert not (tmp_path / "never").exists()  # every error came before the run started

    from jaxspec.cli import train_eagle3 as cli

    for flags in (["--target-layers", "1,2"], ["--target-layers", "1,x,2"], ["--ttt-steps", "0"],
                  ["--draft-vocab", "0"], ["--step-decay", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_args(flags)
        assert exit_info.value.code == 2


# ----------------------------------------------------------------------------------------------------------------
# The command line


def test_a_corpus_cached_by_another_trainer_is_reused(target, corpus, tmp_path):
    """The CLI reads a corpus of its exact recipe from its own workdir first, then from --data-from (the DFlash
    trainer's workdir by default), and otherwise names its own workdir's data folder to build into."""
    from jaxspec.cli.train_common import cached_tapped_corpora, data_folder

    recipe = {"model": "tiny", "target_layer_ids": list(LAYERS), "seq_len": SEQ}
    other = tmp_path / "dflash-run"
    for split in ("train", "heldout"):
        data.save(corpus, os.path.join(data_folder(str(other), recipe), split), recipe)
    own = str(tmp_path / "eagle3-run")
    folder, cached = cached_tapped_corpora(own, [str(other)], recipe, data, dflash_data)
    assert folder == data_folder(str(other), recipe)
    np.testing.assert_array_equal(cached[0].features, corpus.features)
    assert tuple(cached[1].layer_ids) == LAYERS
    elsewhere = recipe | {"target_layer_ids": [0, 1, 2]}  # another recipe is another corpus
    found = cached_tapped_corpora(own, [str(other)], elsewhere, data, dflash_data)
    assert found == (data_folder(own, elsewhere), None)


@pytest.mark.slow  # ~25 s: the script times every stage (compiling each) before it runs them
def test_train_script_writes_a_head_that_decodes(tmp_path):
    from jaxspec.cli import train_eagle3 as cli
    from tests.fixtures import hf_models
    from tests.fixtures.text import tiny_tokenizer

    folder = hf_models.save_tiny("llama", tmp_path / "target", seed=0, num_hidden_layers=6)
    tiny_tokenizer().save_pretrained(folder)
    args = ["--model", folder, "--draft-vocab", "64", "--ttt-steps", "3", "--eval-drafts", "3", "--train-prompts", "8",
            "--heldout-prompts", "4", "--seq-len", "32", "--max-prompt-len", "16", "--gen-batch-size", "8",
            "--batch-size", "4", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3",
            "--workdir", str(tmp_path / "work"), "--data-from", str(tmp_path / "nowhere"), "--out", str(tmp_path / "out")]
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["steps"] == 6 and set(summary["heldout"]["acceptance"]) == {"1", "2", "3"}
    assert summary["data"].startswith(str(tmp_path / "work"))
    assert (tmp_path / "work" / "loss.png").is_file()
    training = json.loads((tmp_path / "out" / "training.json").read_text())
    assert training["train_config"]["head"]["layer_ids"] == [1, 2, 3]  # the 6-layer target's default: 1, 2, n-3
    target, head = jaxspec.load(folder), jaxspec.load(str(tmp_path / "out"))
    assert head.config.draft_vocab_size == 64 and head.config.layer_ids(6) == (1, 2, 3)
    ids = [[5, 6, 7, 8], [9, 10]]
    plain = jaxspec.generate(target, ids, max_new_tokens=8, eos_token_id=[])
    out = jaxspec.generate(target, ids, max_new_tokens=8, eos_token_id=[], assistant_model=head)
    assert out.strategy == "eagle3"
    np.testing.assert_array_equal(out.sequences, plain.sequences)


def test_shipped_head_fits_smollm2():
    """The catalogue's SmolLM2 names a shipped EAGLE-3 head that loads by name (without the target) for
    SmolLM2-135M's shapes, with the held-out acceptance its training measured (tests/train/test_trainers_shared.py
    decodes with it)."""
    from jaxspec import catalog
    from jaxspec.assets import asset_folder

    name = catalog.shipped_drafter("smollm2-135m", "eagle3")
    head = jaxspec.load(name)
    cfg = head.config
    assert (cfg.target_hidden_size, cfg.vocab_size) == (576, 49152) and cfg.layer_ids(30) == (1, 14, 27)
    folder = asset_folder(name)
    assert os.path.getsize(os.path.join(folder, "model.safetensors")) < 40e6
    with open(os.path.join(folder, "training.json"), encoding="utf-8") as handle:
        heldout = json.load(handle)["heldout"]["acceptance"]
    assert heldout["4"]["tokens_per_round"] > 1.5
