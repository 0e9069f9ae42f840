"""Training DFlash drafters (jaxspec.train.dflash_*): the objective against a decoding round run through the decode
strategy's own code, a loss that falls and a replayed acceptance that rises, exact resume, the export read back by
jaxspec (decoding exactly, with the accepted counts the replay predicts) and by z-lab's `DFlashDraftModel`, and the
errors for bad arguments.

The target is the suite's tiny Llama (conftest's `target`: 4 layers, width 32, 128 tokens). The drafter taps target
layers (3, 1): out of order, and the last layer, whose tap enters the context final-normed, so both of the
strategy's special cases are exercised.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
from jaxspec.strategies.base import Context, run_target
from jaxspec.strategies.dflash import BlockDrafter
from jaxspec.train import (DFlashTrainConfig, OptimConfig, dflash_data, new_dflash_drafter, save_dflash_drafter,
                           train_dflash)
from jaxspec.train.dflash_losses import block_drafts, block_hidden, block_loss, position_weights, replay_layout
from jaxspec.train.losses import simulate_greedy_rounds

SEQ = 32  # generated rows: prompt + answer
BLOCK = 5  # the bonus token and 4 mask tokens: 4 drafts a round
LAYERS = (3, 1)
MASK = 127
DECAY = 3.0


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 127, rng.integers(3, 10))) for _ in range(count)]


@pytest.fixture(scope="module")
def corpus(target):
    """The target's greedy answers to 8 random prompts, with its taps at LAYERS."""
    return dflash_data.generated_block_corpus(target.module, random_prompts(8, seed=0), SEQ, 8, eos_ids=(),
                                              layer_ids=LAYERS)


@pytest.fixture(scope="module")
def trained(target, corpus, tmp_path_factory):
    """A one-layer drafter overfit on the corpus (its held-out set is the corpus itself), exported in float32."""
    drafter = new_dflash_drafter(target, 1, BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK)
    cfg = DFlashTrainConfig(steps=150, batch_size=4, anchors_per_row=8, loss_decay=DECAY, eval_every=150,
                            optim=OptimConfig(learning_rate=1e-2, warmup_steps=3))
    result = train_dflash(drafter, target, corpus, corpus, cfg, str(tmp_path_factory.mktemp("run")), progress=False)
    folder = save_dflash_drafter(result.model, str(tmp_path_factory.mktemp("export") / "drafter"), dtype=np.float32)
    return result, folder


def perturbed(drafter, seed: int = 1):
    """The drafter's module with every parameter moved at random, so no value is left at its structured init."""
    graphdef, state = nnx.split(drafter.module)
    rng = np.random.default_rng(seed)
    return nnx.merge(graphdef, jax.tree.map(lambda x: x + 0.1 * rng.standard_normal(x.shape, np.float32), state))


# ----------------------------------------------------------------------------------------------------------------
# The objective is what decoding drafts


def decode_round_kl(target, module, tokens: jax.Array, anchor: jax.Array) -> jax.Array:
    """KL(p || q) of the W-1 drafts of the round anchored at `anchor` (those past the row are garbage), computed the
    way jaxspec/strategies/dflash.py runs a round: the target's taps from its tapped forward (`run_target`), written
    into the drafter's cache by the strategy's own `_write` at the committed positions 0 .. anchor-1 only, then one
    `draft_block` over [token at anchor, mask x 4] with lengths = anchor. p: the target's own logits. `target` and
    `module` are the target's and the drafter's modules; tokens: [1, T]."""
    t = tokens.shape[1]
    positions = jnp.arange(t)[None]
    out = run_target(target, tokens, positions, target.init_cache(1, t), None, tuple(sorted(LAYERS)))
    drafter = BlockDrafter(max_draft=BLOCK - 1, feature_layers=tuple(sorted(LAYERS)), context_layers=LAYERS,
                           final_layer=target.cfg.num_layers - 1)
    ctx = Context(target=target, assistant=module, processing=None, do_sample=False, ngram_slots=0, draft_inputs={})
    cache = module.init_cache(1, 2 * t)
    cache = drafter._write(ctx, out.features, jnp.where(positions < anchor, positions, cache.size), cache)
    block = module.block_tokens(tokens[:, anchor])
    embedded = target.embed_tokens(block)[..., : module.cfg.hidden_size]
    hidden = module.draft_block(embedded, anchor + jnp.arange(BLOCK)[None], cache, anchor[None])
    log_q = jax.nn.log_softmax(module.logits(hidden[0, 1:], target.head_matrix()), axis=-1)  # [W-1, V]
    logits = out.logits[0, jnp.minimum(anchor + jnp.arange(BLOCK - 1), t - 1)]  # p of the token at anchor + k
    log_p = jax.nn.log_softmax(logits, axis=-1)
    return jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)


def test_loss_at_an_anchor_is_the_decoding_rounds_weighted_kl(target, corpus):
    """block_loss at one anchor equals the position-weighted KL of the round decoding would run there: at the first
    answer token, inside the answer, and at the last anchor (one draft inside the row). Several anchors at once
    pool their weights. The cached bfloat16 features are the float32 taps, rounded."""
    module = perturbed(new_dflash_drafter(target, 2, BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK))
    row = 1
    tokens, length, start = corpus.tokens[row: row + 1], int(corpus.lengths[row]), int(corpus.starts[row])
    anchors = [start, (start + length) // 2, length - 2]

    @jax.jit
    def compare(tokens, length, anchors):
        features, hidden = dflash_data.target_taps(target.module, tokens, LAYERS)  # float32

        def loss(at):  # block_loss at anchors `at` [A]
            return block_loss(module, target.module, tokens, length[None], features, hidden, at[None],
                              jnp.ones((1, len(at)), bool), DECAY)[0]

        singles = jnp.stack([loss(anchors[i:i + 1]) for i in range(3)])
        reference = jnp.stack([decode_round_kl(target.module, module, tokens, anchors[i]) for i in range(3)])
        return features, singles, loss(anchors), reference

    features, singles, pooled, reference = compare(jnp.asarray(tokens), jnp.asarray(length), jnp.asarray(anchors))
    np.testing.assert_allclose(np.asarray(corpus.features[row], np.float32), features[0], rtol=1e-2, atol=1e-2)
    weights = np.asarray(position_weights(BLOCK, DECAY))
    in_row = np.arange(1, BLOCK)[None] < length - np.asarray(anchors)[:, None]  # [3, W-1]: drafts inside the row
    assert in_row.sum(axis=1).tolist() == [BLOCK - 1, BLOCK - 1, 1]
    expected = np.sum(in_row * weights * reference, axis=1) / np.sum(in_row * weights, axis=1)
    np.testing.assert_allclose(singles, expected, rtol=1e-4, atol=1e-6)
    pooled_expected = np.sum(in_row * weights * reference) / np.sum(in_row * weights)
    np.testing.assert_allclose(float(pooled), pooled_expected, rtol=1e-4)


def test_loss_over_a_draft_vocabulary_is_the_renormalised_kl_on_its_tokens(target, corpus):
    """With a draft vocabulary V', block_loss is the weighted KL between the target's and the drafter's distributions
    restricted to V' and renormalised (decoding's q is zero outside V'), over the entries whose row token is in V';
    with every token in V' it is the loss without one. The drafts are V' ids, the argmax over V' that decoding takes."""
    from jaxspec.train import with_draft_vocab

    model = new_dflash_drafter(target, 1, BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK)
    model = dataclasses.replace(model, module=perturbed(model))
    ids = np.sort(np.random.default_rng(3).choice(128, 48, replace=False))
    tokens, lengths = jnp.asarray(corpus.tokens[:2]), jnp.asarray(corpus.lengths[:2])
    anchors = jnp.asarray(np.stack([corpus.starts[:2], corpus.starts[:2] + 2], axis=1))  # [2, 2]
    valid = jnp.ones((2, 2), bool)

    @jax.jit
    def run(module, features, hidden):
        loss, metrics = block_loss(module, target.module, tokens, lengths, features, hidden, anchors, valid, DECAY)
        states = block_hidden(module, target.module, tokens, features, anchors)
        return loss, metrics["weight"], states, block_drafts(module, target.module, tokens, features, anchors)

    features, hidden = (jnp.asarray(x[:2]) for x in (corpus.features, corpus.hidden))
    whole = run(model.module, features, hidden)
    every = run(with_draft_vocab(model, np.arange(128)).module, features, hidden)
    np.testing.assert_allclose(float(every[0]), float(whole[0]), rtol=1e-5)
    np.testing.assert_array_equal(every[3], whole[3])
    loss, weight, states, drafts = run(with_draft_vocab(model, ids).module, features, hidden)

    # The reference, in numpy from the whole head's logits.
    head = np.asarray(target.module.head_matrix())
    log_q = jax.nn.log_softmax((np.asarray(states[:, :, 1:]) @ head)[..., ids], axis=-1)  # [2, 2, W-1, V']
    predicted = np.asarray(anchors)[..., None] + np.arange(1, BLOCK)  # [2, 2, W-1]
    source = np.asarray(hidden, np.float32)[np.arange(2)[:, None, None], predicted - 1]
    log_p = jax.nn.log_softmax((source @ head)[..., ids], axis=-1)
    kl = np.sum(np.exp(log_p) * (log_p - log_q), axis=-1)
    row_tokens = np.asarray(tokens)[np.arange(2)[:, None, None], np.minimum(predicted, SEQ - 1)]
    counts = (predicted < np.asarray(lengths)[:, None, None]) & np.isin(row_tokens, ids)
    assert 0 < counts.sum() < (predicted < np.asarray(lengths)[:, None, None]).sum()  # V' leaves some entries out
    weights = counts * np.asarray(position_weights(BLOCK, DECAY))
    np.testing.assert_allclose(float(weight), weights.sum(), rtol=1e-6)
    np.testing.assert_allclose(float(loss), np.sum(weights * kl) / weights.sum(), rtol=1e-4)
    np.testing.assert_array_equal(drafts, ids[np.argmax(log_q, axis=-1)])


def test_a_drafter_trained_over_a_draft_vocabulary_decodes_as_its_replay_predicts(target, corpus, tmp_path):
    """Training over a draft vocabulary keeps it frozen and records it (a resumed run with another vocabulary is
    refused); decoding with the trained drafter gives the target's greedy answers, with the accepted and drafted
    counts the trainer's replay over V' predicts."""
    from jaxspec.train import draft_vocabulary_for, with_draft_vocab

    ids = draft_vocabulary_for(corpus, 48, 128)
    drafter = with_draft_vocab(new_dflash_drafter(target, 1, BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK),
                               ids)
    cfg = DFlashTrainConfig(steps=40, batch_size=4, anchors_per_row=8, loss_decay=DECAY, eval_every=40,
                            optim=OptimConfig(learning_rate=1e-2, warmup_steps=3))
    result = train_dflash(drafter, target, corpus, corpus, cfg, str(tmp_path / "run"), progress=False)
    np.testing.assert_array_equal(np.asarray(result.model.module.vocab_ids[...]), ids)
    assert result.history["settings"]["drafter"]["draft_vocab_size"] == 48
    first, last = np.mean(result.history["loss"][:3]), np.mean(result.history["loss"][-5:])
    assert last < 0.7 * first, (first, last)

    rows = corpus.take(np.arange(4))
    prompts = [list(rows.tokens[i, : rows.starts[i]]) for i in range(4)]
    steps = int(rows.lengths.min() - rows.starts.max())
    out = jaxspec.generate(target, prompts, max_new_tokens=steps, eos_token_id=[], assistant_model=result.model,
                           num_assistant_tokens_schedule="constant")
    for i in range(4):
        np.testing.assert_array_equal(out.new_tokens(i), rows.tokens[i, rows.starts[i]: rows.starts[i] + steps])

    @jax.jit
    def every_anchors_drafts(tokens):
        features, _ = dflash_data.target_taps(target.module, tokens, LAYERS)
        anchors = jnp.broadcast_to(jnp.arange(SEQ), (4, SEQ))
        return block_drafts(result.model.module, target.module, tokens, features, anchors)

    drafts = np.asarray(every_anchors_drafts(jnp.asarray(rows.tokens)))
    assert np.isin(drafts, ids).all()
    replay = simulate_greedy_rounds(replay_layout(drafts), rows.tokens, rows.starts, rows.starts + steps, BLOCK - 1)
    assert (int(out.accepted.sum()), int(out.drafted.sum())) == (replay["accepted"], replay["drafted"])
    assert replay["accepted"] > 0.1 * replay["drafted"]

    other = with_draft_vocab(drafter, draft_vocabulary_for(corpus, 40, 128))
    with pytest.raises(ValueError, match="other settings"):
        train_dflash(other, target, corpus, None, cfg, str(tmp_path / "run"), progress=False)


# ----------------------------------------------------------------------------------------------------------------
# Training


def test_training_lowers_the_loss_and_raises_the_replayed_acceptance(trained):
    history = trained[0].history
    first, last = np.mean(history["loss"][:5]), np.mean(history["loss"][-10:])
    assert last < 0.6 * first, (first, last)
    before, after = history["evals"][0]["acceptance"], history["evals"][-1]["acceptance"]
    assert set(after) == {"1", "2", "3", "4"}
    assert after["4"]["tokens_per_round"] > before["4"]["tokens_per_round"] + 0.3, (before["4"], after["4"])
    assert after["1"]["acceptance_rate"] > before["1"]["acceptance_rate"] + 0.2, (before["1"], after["1"])
    top1 = np.asarray(history["position_top1"])
    assert top1[-10:, 0].mean() > top1[:5, 0].mean() + 0.2  # the first draft of a block agrees with the target


def test_resume_computes_the_same_losses(target, corpus, tmp_path):
    drafter = new_dflash_drafter(target, 1, BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK)
    cfg = DFlashTrainConfig(steps=10, batch_size=4, anchors_per_row=4, eval_every=1000, checkpoint_every=4,
                            optim=OptimConfig(learning_rate=3e-3, warmup_steps=2))
    straight = train_dflash(drafter, target, corpus, None, cfg, str(tmp_path / "straight"), progress=False)
    partial = train_dflash(drafter, target, corpus, None, cfg, str(tmp_path / "resumed"), progress=False, stop_at=6)
    assert partial.history["step"][-1] == 6
    resumed = train_dflash(drafter, target, corpus, None, cfg, str(tmp_path / "resumed"), progress=False)
    assert resumed.history["step"] == straight.history["step"] == list(range(1, 11))
    np.testing.assert_allclose(resumed.history["loss"], straight.history["loss"], rtol=1e-5)
    for a, b in zip(*(jax.tree.leaves(nnx.state(result.model.module)) for result in (resumed, straight)), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="other settings"):
        train_dflash(drafter, target, corpus, None, dataclasses.replace(cfg, anchors_per_row=5),
                     str(tmp_path / "resumed"), progress=False)


# ----------------------------------------------------------------------------------------------------------------
# The export


def test_export_loads_and_decodes_exactly_with_the_replayed_acceptance(trained, target, corpus):
    """jaxspec.load reads the exported folder back to the trained params; decoding with it gives the target's
    greedy answers token for token, and its accepted and drafted counts are the ones the training loop's replay
    predicts."""
    result, folder = trained
    drafter = jaxspec.load(folder)
    assert drafter.config.target_layer_ids == LAYERS and drafter.config.mask_token_id == MASK
    loaded, trained_leaves = (jax.tree.leaves(nnx.state(m.module)) for m in (drafter, result.model))
    for a, b in zip(loaded, trained_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rows = corpus.take(np.arange(4))
    prompts = [list(rows.tokens[i, : rows.starts[i]]) for i in range(4)]
    steps = int(rows.lengths.min() - rows.starts.max())
    out = jaxspec.generate(target, prompts, max_new_tokens=steps, eos_token_id=[], assistant_model=drafter,
                           num_assistant_tokens_schedule="constant")  # every round drafts the whole block
    assert out.strategy == "dflash"
    for i in range(4):  # the corpus rows are the target's greedy answers (plain decoding's, data.greedy_generations)
        np.testing.assert_array_equal(out.new_tokens(i), rows.tokens[i, rows.starts[i]: rows.starts[i] + steps])

    @jax.jit
    def every_anchors_drafts(tokens):  # [4, T, W-1], from float32 taps as decoding has them
        features, _ = dflash_data.target_taps(target.module, tokens, LAYERS)
        anchors = jnp.broadcast_to(jnp.arange(SEQ), (4, SEQ))
        return block_drafts(drafter.module, target.module, tokens, features, anchors)

    drafts = np.asarray(every_anchors_drafts(jnp.asarray(rows.tokens)))
    replay = simulate_greedy_rounds(replay_layout(drafts), rows.tokens, rows.starts, rows.starts + steps, BLOCK - 1)
    assert (int(out.accepted.sum()), int(out.drafted.sum())) == (replay["accepted"], replay["drafted"])
    assert replay["accepted"] > 0.1 * replay["drafted"]  # the counts compared are not all zeros


def test_export_is_read_by_zlabs_reference_model(trained, target, corpus):
    """z-lab's `DFlashDraftModel` (PyPI dflash) loads the folder with no missing or unexpected tensor, and drafts
    the same block states as jaxspec from the same context."""
    from dflash import model as dflash_model

    folder = trained[1]
    reference, info = dflash_model.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    drafter = jaxspec.load(folder)
    row, anchor = 2, int(corpus.starts[2]) + 3

    @jax.jit
    def jaxspec_block(tokens):  # the taps, the block's embedding and its hidden states [W, D]
        features, _ = dflash_data.target_taps(target.module, tokens, LAYERS)
        embedded = target.module.embed_tokens(drafter.module.block_tokens(tokens[:, anchor]))
        return features, embedded, block_hidden(drafter.module, target.module, tokens, features,
                                                jnp.asarray([[anchor]]))[0, 0]

    features, embedded, expected = jaxspec_block(jnp.asarray(corpus.tokens[row: row + 1]))
    with torch.no_grad():
        got = reference(target_hidden=torch.tensor(np.asarray(features[:, :anchor])),
                        noise_embedding=torch.tensor(np.asarray(embedded)),
                        position_ids=torch.arange(anchor + BLOCK)[None])[0]
    np.testing.assert_allclose(got.numpy(), np.asarray(expected), rtol=1e-4, atol=1e-4)


def test_a_draft_vocabulary_round_trips_through_the_export(trained, target, corpus, tmp_path):
    """A drafter given the training answers' most used tokens as its draft vocabulary exports them as `d2t` / `t2d`
    (EAGLE-3's tensors), loads back with them, and still decodes the target's greedy answers; z-lab's reference reads
    the same folder and leaves exactly those two tensors unused (it drafts over the whole head)."""
    from dflash import model as dflash_model

    from jaxspec.train import draft_vocabulary_for, save_dflash_drafter, with_draft_vocab

    result, _ = trained
    ids = draft_vocabulary_for(corpus, 32, 128)
    folder = save_dflash_drafter(with_draft_vocab(result.model, ids), str(tmp_path / "vocab"))
    drafter = jaxspec.load(folder)
    assert drafter.config.draft_vocab_size == 32
    np.testing.assert_array_equal(np.asarray(drafter.module.vocab_ids[...]), ids)
    rows = corpus.take(np.arange(4))
    prompts = [list(rows.tokens[i, : rows.starts[i]]) for i in range(4)]
    steps = int(rows.lengths.min() - rows.starts.max())
    out = jaxspec.generate(target, prompts, max_new_tokens=steps, eos_token_id=[], assistant_model=drafter,
                           num_assistant_tokens_schedule="constant")
    for i in range(4):
        np.testing.assert_array_equal(out.new_tokens(i), rows.tokens[i, rows.starts[i]: rows.starts[i] + steps])
    assert out.accepted.sum() > 0
    _, info = dflash_model.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert sorted(info["unexpected_keys"]) == ["d2t", "t2d"] and not info["missing_keys"]
    whole = with_draft_vocab(drafter, None)
    assert whole.config.draft_vocab_size == 0 and not hasattr(whole.module, "vocab_ids")
    with pytest.raises(ValueError, match="distinct token ids in 0..127, ascending"):
        with_draft_vocab(result.model, [5, 3])


# ----------------------------------------------------------------------------------------------------------------
# Bad arguments are named before anything compiles


def test_bad_arguments_are_named(target, corpus, tmp_path):
    with pytest.raises(ValueError, match="block_size must be an integer >= 2"):
        new_dflash_drafter(target, 1, 1)
    with pytest.raises(ValueError, match=r"taps target layers \[1, 4\].*layers 0..3 only \(no layer \[4\]\)"):
        new_dflash_drafter(target, 1, BLOCK, target_layer_ids=(1, 4))
    with pytest.raises(ValueError, match="mask_token_id must be a token id in 0..127"):
        new_dflash_drafter(target, 1, BLOCK, mask_token_id=128)
    with pytest.raises(ValueError, match="layers 0..3 only"):
        dflash_data.generated_block_corpus(target.module, random_prompts(2, 0), SEQ, 2, (), layer_ids=(7,))

    drafter = new_dflash_drafter(target, 1, BLOCK, target_layer_ids=LAYERS, mask_token_id=MASK)
    cfg = DFlashTrainConfig(steps=2, batch_size=2, anchors_per_row=2)

    def run(drafter=drafter, corpus=corpus, cfg=cfg):
        train_dflash(drafter, target, corpus, None, cfg, str(tmp_path / "never"), progress=False)

    # A drafter made for a deeper target.
    deeper = dataclasses.replace(drafter, config=dataclasses.replace(drafter.config, target_layer_ids=(1, 6)))
    with pytest.raises(ValueError, match=r"taps target layers \[1, 6\]; the target has 4 layers"):
        run(drafter=deeper)
    with pytest.raises(ValueError, match=r"holds taps of target layers \[3, 1\], the drafter reads \[1\]"):
        run(drafter=new_dflash_drafter(target, 1, BLOCK, target_layer_ids=(1,), mask_token_id=MASK))
    no_room = corpus.take(np.arange(len(corpus)))
    no_room.lengths[3] = no_room.starts[3] + 1  # an answer of one token: nothing after the bonus to draft
    with pytest.raises(ValueError, match="1 training row.*no position to anchor a block at"):
        run(corpus=no_room)
    with pytest.raises(ValueError, match=f"anchors_per_row=31 exceeds the {SEQ - 2} positions"):
        run(cfg=dataclasses.replace(cfg, anchors_per_row=31))
    with pytest.raises(ValueError, match="loss_decay"):
        run(cfg=dataclasses.replace(cfg, loss_decay=0.0))
    with pytest.raises(ValueError, match="train_dflash trains a DFlash drafter"):
        run(drafter=target)
    assert not (tmp_path / "never").exists()  # every error came before the run started

    from jaxspec.cli import train_dflash as cli

    for flags in (["--block-size", "1"], ["--anchors", "300"], ["--target-layers", "1,x"], ["--layers", "0"],
                  ["--draft-vocab", "-1"]):
        with pytest.raises(SystemExit) as exit_info:
            cli.parse_args(flags)
        assert exit_info.value.code == 2


# ----------------------------------------------------------------------------------------------------------------
# The command line, end to end on a tiny target


@pytest.mark.slow  # ~20 s: the script times every stage (compiling each) before it runs them
def test_train_script_writes_a_drafter_that_decodes(tmp_path):
    import json

    from jaxspec.cli import train_dflash as cli
    from tests.fixtures import hf_models
    from tests.fixtures.text import tiny_tokenizer

    folder = hf_models.save_tiny("llama", tmp_path / "target", seed=0)
    tiny_tokenizer().save_pretrained(folder)
    args = ["--model", folder, "--layers", "1", "--target-layers", "3,1", "--block-size", "4", "--anchors", "4",
            "--train-prompts", "8", "--heldout-prompts", "4", "--stdlib-windows", "2", "--seq-len", "32",
            "--max-prompt-len", "16", "--gen-batch-size", "8", "--batch-size", "4", "--steps", "6", "--eval-every", "3",
            "--checkpoint-every", "3", "--draft-vocab", "64", "--workdir", str(tmp_path / "work"),
            "--out", str(tmp_path / "out")]
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["steps"] == 6 and set(summary["heldout"]["acceptance"]) == {"1", "2", "3"}
    assert (tmp_path / "work" / "loss.png").is_file()
    training = json.loads((tmp_path / "out" / "training.json").read_text())
    assert training["train_config"]["drafter"]["target_layer_ids"] == [3, 1]
    target, drafter = jaxspec.load(folder), jaxspec.load(str(tmp_path / "out"))
    assert drafter.config.block_size == 4 and drafter.config.target_layer_ids == (3, 1)
    assert drafter.config.draft_vocab_size == 64 == training["train_config"]["draft_vocab"]["size"]
    ids = [[5, 6, 7, 8], [9, 10]]
    plain = jaxspec.generate(target, ids, max_new_tokens=8, eos_token_id=[])
    out = jaxspec.generate(target, ids, max_new_tokens=8, eos_token_id=[], assistant_model=drafter)
    assert out.strategy == "dflash"
    np.testing.assert_array_equal(out.sequences, plain.sequences)


def test_shipped_drafter_fits_smollm2():
    """The catalogue's SmolLM2 names a shipped DFlash drafter that loads by name (without the target) for
    SmolLM2-135M's shapes, with the held-out acceptance its training measured and its draft vocabulary
    (tests/train/test_trainers_shared.py decodes with it)."""
    import hashlib
    import json
    import os

    from jaxspec import catalog
    from jaxspec.assets import asset_folder

    name = catalog.shipped_drafter("smollm2-135m", "dflash")
    drafter = jaxspec.load(name)
    cfg = drafter.module.cfg
    assert (cfg.hidden_size, drafter.config.vocab_size) == (576, 49152)
    assert all(0 <= layer < 30 for layer in cfg.target_layer_ids) and cfg.block_size >= 2
    folder = asset_folder(name)
    assert os.path.getsize(os.path.join(folder, "model.safetensors")) < 40e6
    with open(os.path.join(folder, "training.json"), encoding="utf-8") as handle:
        training = json.load(handle)
    assert training["heldout"]["acceptance"][str(cfg.block_size - 1)]["tokens_per_round"] > 1.3
    # Its draft vocabulary: the 8,192 tokens its training answers use most, the ids its training recorded (sha256
    # over int32 ids), which it was trained over.
    ids = np.asarray(drafter.module.vocab_ids[...], np.int32)
    assert cfg.draft_vocab_size == len(ids) == 8192 and np.all(np.diff(ids) > 0)
    assert hashlib.sha256(ids.tobytes()).hexdigest() == training["train_config"]["draft_vocab"]["sha256"]
