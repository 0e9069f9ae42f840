"""MTP layers for Llama targets, and training them (jaxspec.train): a torch reference for the MTP chain, training
that lowers the loss and raises held-out acceptance, resume, save/load/attach, greedy identity and exact sampling
with the reduced draft vocabulary, fine-tuning DeepSeek-V3 and GLM-4.5 MTP layers.

One tiny target (a random Llama with initializer_range 0.1, whose greedy continuations are predictable enough for
one MTP layer to learn) is trained once per module; the later tests read its result.
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from scipy import stats

import jaxspec
from jaxspec import checkpoint
from jaxspec.assets import attach_mtp_asset, read_asset_config, strip_draft_vocab, strip_mtp
from jaxspec.convert.rules import CheckpointMismatch
from jaxspec.models.moe import mtp_chain_from_scratch
from jaxspec.strategies import DraftingConfig, choose_strategy
from jaxspec.train import OptimConfig, TrainConfig, attach_mtp_layers, data, save_mtp_asset, train
from jaxspec.train.losses import draft_tokens, simulate_greedy_rounds
from tests.fixtures import hf_models
from tests.fixtures.moe import random_mtp_block_extras
from tests.fixtures.paths import BENCHMARKS, REPO_ROOT

SEQ = 48  # generated rows: prompt + continuation
TARGET = dict(initializer_range=0.1)
DRAFT_VOCAB = 64  # of 128 tokens


def random_prompts(count: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [list(rng.integers(3, 128, rng.integers(3, 10))) for _ in range(count)]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return jaxspec.load(hf_models.save_tiny("llama", tmp_path_factory.mktemp("target"), seed=0, **TARGET))


@pytest.fixture(scope="module")
def corpora(target):
    """(training rows, held-out rows): the target's greedy continuations of disjoint random prompt sets."""
    rows = data.greedy_generations(target.module, random_prompts(112, seed=0), SEQ, 16, eos_ids=())
    return rows.take(np.arange(96)), rows.take(np.arange(96, 112))


@pytest.fixture(scope="module")
def trained(target, corpora, tmp_path_factory):
    """Two MTP layers with a 64-token draft vocabulary, trained 300 steps; saved as a conversion folder and as an
    asset."""
    train_rows, heldout = corpora
    vocab = data.draft_vocabulary(data.token_frequencies(train_rows, 128), DRAFT_VOCAB)
    model = attach_mtp_layers(target, 2, draft_vocab=vocab)
    cfg = TrainConfig(steps=300, batch_size=8, draft_vocab=True, eval_every=150,
                      optim=OptimConfig(learning_rate=3e-3, warmup_steps=20))
    result = train(model, train_rows, heldout, cfg, str(tmp_path_factory.mktemp("run")), progress=False)
    folder = checkpoint.save(result.model, str(tmp_path_factory.mktemp("saved") / "model"))
    asset = save_mtp_asset(result.model, str(tmp_path_factory.mktemp("asset") / "mtp"), dtype=np.float32)
    return result, folder, asset


# ----------------------------------------------------------------------------------------------------------------
# The Llama MTP layer against a reference built from transformers' own modules


def save_llama_with_mtp(folder, layers: int, mtp_layers: int, seed: int = 0) -> tuple[str, torch.nn.Module]:
    """An HF folder of a Llama with `mtp_layers` MTP layers at model.layers.{layers + k} (DeepSeek-V3's names),
    and the torch model of layers + mtp_layers decoder layers that supplied their blocks."""
    big = hf_models.build_tiny("llama", seed=seed, num_hidden_layers=layers + mtp_layers)
    scratch = f"{folder}_hf"
    big.save_pretrained(scratch)
    tensors = load_file(os.path.join(scratch, "model.safetensors"))
    gen = torch.Generator().manual_seed(seed + 5)
    d = hf_models.BASE["hidden_size"]
    for k in range(mtp_layers):
        prefix = f"model.layers.{layers + k}."
        tensors |= random_mtp_block_extras(prefix, d, gen)
        tensors[prefix + "embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()  # ignored copies
    os.makedirs(folder, exist_ok=True)
    save_file({name: value.contiguous() for name, value in tensors.items()}, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(scratch, "config.json")) as f:
        config = json.load(f)
    config |= {"num_hidden_layers": layers, "num_nextn_predict_layers": mtp_layers}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    big.mtp_tensors = tensors
    return str(folder), big


def torch_mtp_chain(big, tokens: np.ndarray, layers: int, mtp_layers: int) -> np.ndarray:
    """The from-scratch MTP chain (HF `MTPCandidateGenerator` semantics, as `mtp_chain_from_scratch`) with
    transformers' modules: the main model is `big`'s first `layers` layers; depth k's block is `big`'s layer
    layers + k wrapped in a one-layer LlamaModel whose final norm is shared_head.norm. Returns [B, K, V]."""
    config = big.config
    main = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(config.to_dict() | {"num_hidden_layers": layers})))
    main.load_state_dict(big.state_dict(), strict=False)
    main.eval()
    tensors = big.mtp_tensors
    ids = torch.tensor(tokens)
    with torch.no_grad():
        hidden = main.model(ids[:, :-1]).last_hidden_state  # final-normed
        window, positions, prev = ids[:, 1:], torch.arange(1, ids.shape[1])[None].repeat(len(ids), 1), hidden
        out = []
        for k in range(mtp_layers):
            prefix = f"model.layers.{layers + k}."
            block = transformers.LlamaModel(transformers.LlamaConfig(**(config.to_dict() | {"num_hidden_layers": 1})))
            block.layers[0].load_state_dict(big.model.layers[layers + k].state_dict())
            block.norm.weight.copy_(tensors[prefix + "shared_head.norm.weight"])
            block.eval()
            enorm = transformers.models.llama.modeling_llama.LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
            hnorm = transformers.models.llama.modeling_llama.LlamaRMSNorm(config.hidden_size, config.rms_norm_eps)
            enorm.weight.copy_(tensors[prefix + "enorm.weight"])
            hnorm.weight.copy_(tensors[prefix + "hnorm.weight"])
            x = torch.cat([enorm(main.model.embed_tokens(window)), hnorm(prev)], -1)
            x = x @ tensors[prefix + "eh_proj.weight"].T
            state = block(inputs_embeds=x, position_ids=positions).last_hidden_state
            logits = main.lm_head(state)
            out.append(logits[:, -1].numpy())
            window = torch.cat([window[:, 1:], logits[:, -1].argmax(-1, keepdim=True)], 1)
            positions, prev = positions + 1, state
    return np.stack(out, axis=1)


def test_llama_mtp_chain_equals_transformers_reference(tmp_path):
    folder, big = save_llama_with_mtp(tmp_path / "llama_mtp", layers=2, mtp_layers=2)
    model = jaxspec.load(folder)
    assert model.module.num_mtp_layers == 2
    tokens = np.asarray(random_prompts(1, 3)[0][:1] + list(np.random.default_rng(1).integers(3, 128, 11)))[None]
    tokens = np.concatenate([tokens, tokens[:, ::-1]])  # two rows
    expected = torch_mtp_chain(big, tokens, layers=2, mtp_layers=2)
    got = np.asarray(mtp_chain_from_scratch(model.module, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-4)


def test_missing_mtp_tensors_name_the_setting(tmp_path):
    folder, _ = save_llama_with_mtp(tmp_path / "llama_mtp", layers=2, mtp_layers=1)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config | {"num_nextn_predict_layers": 2}, f)
    with pytest.raises(CheckpointMismatch, match=r"num_nextn_predict_layers=2.*model\.layers\.3\.enorm\.weight"):
        jaxspec.load(folder)


# ----------------------------------------------------------------------------------------------------------------
# Training


def test_training_lowers_the_loss_and_raises_heldout_acceptance(trained):
    history = trained[0].history
    first, last = np.mean(history["loss"][:5]), np.mean(history["loss"][-20:])
    assert last < 0.7 * first, (first, last)
    before, after = history["evals"][0]["acceptance"], history["evals"][-1]["acceptance"]
    assert after["1"]["acceptance_rate"] > before["1"]["acceptance_rate"] + 0.1, (before, after)
    assert after["2"]["acceptance_rate"] > before["2"]["acceptance_rate"] + 0.08, (before, after)  # depth 2 learns


def test_resume_continues_the_same_loss_curve(target, corpora, tmp_path):
    model = attach_mtp_layers(target, 1)
    cfg = TrainConfig(steps=30, batch_size=4, eval_every=1000, checkpoint_every=10,
                      optim=OptimConfig(learning_rate=3e-3, warmup_steps=5))
    rows = corpora[0]
    straight = train(model, rows, None, cfg, str(tmp_path / "straight"), progress=False)
    partial = train(model, rows, None, cfg, str(tmp_path / "resumed"), progress=False, stop_at=13)
    assert partial.history["step"][-1] == 13
    resumed = train(model, rows, None, cfg, str(tmp_path / "resumed"), progress=False)
    assert resumed.history["step"] == straight.history["step"]
    np.testing.assert_allclose(resumed.history["loss"], straight.history["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.tree.map(np.asarray, nnx_params(resumed.model))),
                    jax.tree.leaves(jax.tree.map(np.asarray, nnx_params(straight.model)))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="batch_size"):
        train(model, rows, None, TrainConfig(steps=30, batch_size=8), str(tmp_path / "resumed"), progress=False)


def nnx_params(model):
    from flax import nnx

    return nnx.to_pure_dict(nnx.state(model.module))["mtp_layers"]


# ----------------------------------------------------------------------------------------------------------------
# Saved, loaded and attached layers decode exactly


def test_saved_model_and_asset_load_with_the_trained_layers(trained, target):
    result, folder, asset = trained
    restored = jaxspec.load(folder)
    attached = attach_mtp_asset(target, asset)
    assert read_asset_config(asset) == {"num_nextn_predict_layers": 2, "draft_vocab_size": DRAFT_VOCAB}
    for model in (restored, attached):
        assert model.config.num_mtp_layers == 2 and model.config.draft_vocab_size == DRAFT_VOCAB
        for a, b in zip(jax.tree.leaves(nnx_params(model)), jax.tree.leaves(nnx_params(result.model))):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    stripped = strip_mtp(attached)
    assert stripped.config.num_mtp_layers == 0 and "num_nextn_predict_layers" not in stripped.hf_config


@pytest.mark.parametrize("vocab", ["draft", "full"])
def test_greedy_equals_plain_greedy_and_the_replayed_acceptance(trained, corpora, vocab):
    """use_mtp on held-out prompts, with the draft vocabulary and with the full head: the tokens are plain
    greedy's, and the accepted and drafted counts are what the training loop's replay of decoding predicts."""
    model = jaxspec.load(trained[1])
    if vocab == "full":
        model = strip_draft_vocab(model)
    heldout = corpora[1].take(np.arange(4))
    prompts = [list(heldout.tokens[i, : heldout.starts[i]]) for i in range(4)]
    steps = int(heldout.lengths.min() - heldout.starts.max())
    plain = jaxspec.generate(model, prompts, max_new_tokens=steps, eos_token_id=[])
    # The replay drafts both depths every round: the constant schedule (the adaptive one may draft fewer).
    out = jaxspec.generate(model, prompts, max_new_tokens=steps, eos_token_id=[], use_mtp=True,
                           num_assistant_tokens_schedule="constant")
    np.testing.assert_array_equal(out.sequences, plain.sequences)
    tokens = jnp.asarray(heldout.tokens)
    positions = jnp.broadcast_to(jnp.arange(SEQ), tokens.shape)
    _, hidden, _ = model.module(tokens, positions, model.module.init_cache(4, SEQ))  # float32, as decoding has
    drafts = np.asarray(draft_tokens(model.module, tokens, hidden, 2))
    replay = simulate_greedy_rounds(drafts, heldout.tokens, heldout.starts, heldout.starts + steps, 2)
    assert (int(out.accepted.sum()), int(out.drafted.sum())) == (replay["accepted"], replay["drafted"])
    assert replay["accepted"] > 0.2 * replay["drafted"]


def test_draft_vocabulary_confines_drafts(trained):
    module = jaxspec.load(trained[1]).module
    hidden = jax.random.normal(jax.random.key(0), (3, module.cfg.hidden_size))
    logits = np.asarray(module.draft_logits(hidden))
    vocab = np.asarray(module.draft_vocab[...])
    outside = np.setdiff1d(np.arange(module.cfg.vocab_size), vocab)
    assert np.isneginf(logits[:, outside]).all()
    np.testing.assert_allclose(logits[:, vocab], np.asarray(module.logits(hidden))[:, vocab], rtol=1e-5, atol=1e-5)


def second_token_distribution(model, prompt: list[int]) -> np.ndarray:
    """The exact distribution of the second sampled token (temperature 1, no top-k): sum over t1 of p(t1) p(t2 | t1)."""
    module, v = model.module, model.config.vocab_size
    n = len(prompt)
    rows = jnp.concatenate([jnp.tile(jnp.asarray(prompt)[None], (v, 1)), jnp.arange(v)[:, None]], axis=1)
    positions = jnp.broadcast_to(jnp.arange(n + 1), rows.shape)
    logits, _, _ = module(rows, positions, module.init_cache(v, n + 1))
    first = jax.nn.softmax(logits[0, n - 1])
    second = jax.nn.softmax(logits[:, n], axis=-1)  # [t1, t2]
    probs = np.asarray(first @ second, np.float64)
    return probs / probs.sum()


# The full head is the path tests/strategies/test_mtp.py already checks for exactness; the draft vocabulary is the new
# one.
@pytest.mark.slow  # ~45 s: 8,000 rows
@pytest.mark.parametrize("vocab", ["draft", "full"])
def test_sampling_is_exact(trained, vocab):
    """The second generated token (the first one MTP drafts) follows the target's exact distribution over the whole
    vocabulary: chi-square over 8,000 rows, against the target's own probabilities. With the draft vocabulary, the
    target puts real mass outside it, which only the residual distribution can return."""
    model = jaxspec.load(trained[1])
    if vocab == "full":
        model = strip_draft_vocab(model)
    prompt = random_prompts(1, seed=11)[0]
    expected = second_token_distribution(model, prompt)
    if vocab == "draft":
        outside = np.setdiff1d(np.arange(128), np.asarray(model.module.draft_vocab[...]))
        assert expected[outside].sum() > 0.1
    rows = 8_000
    # The round after the prefill's token drafts one token (the budget of 3 leaves room for one draft and its bonus),
    # verified: a constant schedule, where the adaptive one might judge its first probe in the shadow.
    out = jaxspec.generate(model, [prompt] * rows, max_new_tokens=3, do_sample=True, top_k=0, seed=3,
                           eos_token_id=[], use_mtp=True, num_assistant_tokens_schedule="constant")
    assert out.drafted.sum() > rows // 2 and out.accepted.sum() > rows // 10
    counts = np.bincount(out.sequences[:, len(prompt) + 1], minlength=128)
    frequent = expected * rows >= 5  # the rest pooled into one cell, so every expected count is at least 5
    observed, wanted = counts[frequent], expected[frequent] * rows
    if not frequent.all():
        observed = np.append(observed, counts[~frequent].sum())
        wanted = np.append(wanted, expected[~frequent].sum() * rows)
    assert stats.chisquare(observed, wanted).pvalue > 1e-3


# ----------------------------------------------------------------------------------------------------------------
# Fine-tuning the MTP layers DeepSeek-V3 and GLM-4.5 checkpoints bring


@pytest.mark.parametrize("family", ["glm4_moe", pytest.param("deepseek_v3", marks=pytest.mark.slow)])
def test_finetunes_existing_moe_mtp_layers(family, tmp_path):
    """The trainer takes the MTP layers a DeepSeek-V3 or GLM-4.5 checkpoint brings as they are: their loss falls,
    and nothing but them changes."""
    from flax import nnx

    from tests.fixtures.moe import FAMILIES, save_checkpoint

    model = jaxspec.load(save_checkpoint(family, str(tmp_path / family), 2, 1, FAMILIES[family] | TARGET, seed=1))
    rows = data.greedy_generations(model.module, random_prompts(24, seed=4), 24, 8, eos_ids=())
    cfg = TrainConfig(steps=30, batch_size=8, optim=OptimConfig(learning_rate=3e-3, warmup_steps=5))
    result = train(model, rows, None, cfg, str(tmp_path / "run"), progress=False)
    assert np.mean(result.history["loss"][-5:]) < 0.7 * np.mean(result.history["loss"][:3])
    before, after = (nnx.to_pure_dict(nnx.state(m.module)) for m in (model, result.model))
    changed = {name for name in before if not np.array_equal(np.asarray(before[name]), np.asarray(after[name]))}
    assert changed and all(name.startswith("mtp_") for name in changed), changed


# ----------------------------------------------------------------------------------------------------------------
# The prompt sets


def test_heldout_prompts_are_never_trained_on_and_the_mix_follows_the_share():
    """No prompt, free-text word or stdlib module is in both splits, and neither is any prompt that
    benchmarks/bench_mtp.py reports as unseen (benchmarks/bench.py's and the CLI's default)."""
    import ast

    from jaxspec.train import prompts as sets

    train, heldout = sets.prompt_set(False, 400, stdlib_share=0.25), sets.prompt_set(True, 40, stdlib_share=0.25)
    assert len(train) == 400 and sum(p.stdlib for p in train) == 100
    assert not {p.text for p in train} & {p.text for p in heldout}
    for name in dir(sets):
        if name.startswith("TRAIN_") and hasattr(sets, "HELDOUT_" + name[6:]):
            assert not set(getattr(sets, name)) & set(getattr(sets, "HELDOUT_" + name[6:])), name
    assert not {sets.is_heldout_file(path) for path in sets.training_files()} - {False}

    from _bench_prompts import PROMPTS  # benchmarks/ is on pytest's pythonpath (pyproject.toml)

    with open(os.path.join(BENCHMARKS, "bench_mtp.py"), encoding="utf-8") as handle:
        tree = ast.parse(handle.read())
    cli_default = next(node.value.value for node in tree.body if isinstance(node, ast.Assign)
                       and node.targets[0].id == "CLI_DEFAULT_PROMPT")
    everything_trained = {p.text for p in sets.prompt_set(False, 5000, stdlib_share=0.0)}
    assert not (set(PROMPTS.values()) | {cli_default}) & everything_trained


# ----------------------------------------------------------------------------------------------------------------
# The command line, end to end on a tiny target


@pytest.mark.slow  # ~30 s: the CLI generates, trains and converts; the functions it calls are tested above
def test_train_script_writes_an_asset_and_a_conversion(tmp_path, capsys):
    import importlib.util

    from tests.fixtures.text import tiny_tokenizer

    folder = hf_models.save_tiny("llama", tmp_path / "target", seed=0, **TARGET)
    tiny_tokenizer().save_pretrained(folder)
    from jaxspec.cli import train_mtp as cli
    args = ["--model", folder, "--layers", "1", "--draft-vocab", "32", "--train-prompts", "8", "--heldout-prompts",
            "4", "--stdlib-windows", "4", "--seq-len", "32", "--max-prompt-len", "16", "--gen-batch-size", "8",
            "--batch-size", "4", "--steps", "6", "--eval-every", "3", "--checkpoint-every", "3", "--default-drafts", "2",
            "--workdir", str(tmp_path / "work"), "--asset", str(tmp_path / "asset"), "--out", str(tmp_path / "out")]
    assert cli.main(args) == 0
    summary = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert summary["steps"] == 6 and set(summary["heldout"]["acceptance"]) == {"1"}
    assert (tmp_path / "work" / "loss.png").is_file()
    model = jaxspec.load(str(tmp_path / "out"))
    assert model.config.num_mtp_layers == 1 and model.config.draft_vocab_size == 32
    attached = attach_mtp_asset(jaxspec.load(folder), str(tmp_path / "asset"))
    assert attached.config.num_mtp_layers == 1
    # The asset's recommended draft length is use_mtp's default; an argument overrides it; a bad one is named.
    assert choose_strategy(attached, DraftingConfig(use_mtp=True), do_sample=False).drafter.max_draft == 2
    assert choose_strategy(attached, DraftingConfig(use_mtp=True, num_assistant_tokens=1),
                           do_sample=False).drafter.max_draft == 1
    broken = dataclasses.replace(attached, hf_config=attached.hf_config | {"mtp_num_assistant_tokens": 0})
    with pytest.raises(ValueError, match="mtp_num_assistant_tokens must be an integer >= 1"):
        jaxspec.generate(broken, [[5, 6, 7]], max_new_tokens=4, use_mtp=True)
    ids = [[5, 6, 7]]
    plain = jaxspec.generate(model, ids, max_new_tokens=8, eos_token_id=[])
    np.testing.assert_array_equal(jaxspec.generate(model, ids, max_new_tokens=8, eos_token_id=[],
                                                   use_mtp=True).sequences, plain.sequences)
    # bench_mtp.py's acceptance table runs on the conversion: the fixed prompts and held-out ones, apart and together.
    bench_spec = importlib.util.spec_from_file_location("bench_mtp_cli", os.path.join(BENCHMARKS, "bench_mtp.py"))
    bench = importlib.util.module_from_spec(bench_spec)
    bench_spec.loader.exec_module(bench)
    capsys.readouterr()
    bench.main(["--model", str(tmp_path / "out"), "--acceptance-only", "--prompts", "8", "--max-new-tokens", "6",
                "--results", str(tmp_path / "results")])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "| 1 |" in line]
    assert [row.split(" | ")[0] for row in rows] == ["| bench.py's prompts and the CLI's default (6)",
                                                     "| held-out training-set prompts (2)", "| all (8)"]


# ----------------------------------------------------------------------------------------------------------------
# The layers shipped for the default model

SMOLLM2 = dict(model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
               num_attention_heads=9, num_key_value_heads=3, head_dim=64, rms_norm_eps=1e-5, tie_word_embeddings=True,
               rope_theta=100000.0, max_position_embeddings=8192)


def test_shipped_asset_fits_smollm2():
    """The catalogue's SmolLM2 names a shipped asset whose tensors convert for SmolLM2-135M's shapes (checked
    without the checkpoint; tests/train/test_trainers_shared.py decodes with the real one)."""
    from jaxspec import catalog
    from jaxspec.assets import MTP_FILE, asset_folder
    from jaxspec.convert.llama import convert_mtp_layers
    from jaxspec.convert.safetensors_io import SafetensorsFile
    from jaxspec.models.llama import LlamaConfig

    folder = asset_folder(catalog.get_entry("smollm2-135m").mtp_asset)
    config = read_asset_config(folder)
    cfg = LlamaConfig.from_hf_config(SMOLLM2 | {k: config[k] for k in ("num_nextn_predict_layers", "draft_vocab_size")})
    params = convert_mtp_layers(cfg, SafetensorsFile(os.path.join(folder, MTP_FILE)), np.float32)
    assert len(params["mtp_layers"]) == cfg.num_mtp_layers >= 1
    assert params["draft_vocab"].shape == (cfg.draft_vocab_size,)
    assert os.path.getsize(os.path.join(folder, MTP_FILE)) < 40e6
    assert config["heldout"]["acceptance"]["1"]["acceptance_rate"] > 0.4


def test_shipped_asset_is_package_data():
    """A non-editable install carries every file of every shipped asset (pyproject's package-data patterns)."""
    import fnmatch
    import tomllib

    root = REPO_ROOT
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        patterns = tomllib.load(f)["tool"]["setuptools"]["package-data"]["jaxspec.assets"]
    assets = os.path.join(root, "jaxspec", "assets")
    files = [os.path.relpath(os.path.join(d, n), assets) for d, _, names in os.walk(assets) for n in names
             if d != assets and "__pycache__" not in d]
    assert files and all(any(fnmatch.fnmatch(f, p) for p in patterns) for f in files), (files, patterns)
