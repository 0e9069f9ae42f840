"""DFlash drafters (models/dflash.py, convert/dflash.py) against their PyTorch references, in float32.

Both public layouts are built tiny and random with their own classes, saved, loaded by jaxspec, and driven the way
their decode loops drive them: transformers' `MuseGlimmerAssistantModel` as `DFlashTokenCandidateGenerator` does
(a `DFlashCache` with past recording, `set_previous_accepted_tokens`, `crop(-block_size)`), z-lab's
`DFlashDraftModel` (PyPI `dflash` 0.1.0, installed with `pip install --no-deps dflash==0.1.0`; it imports with the
test pins) as `dflash_generate` does (a `DynamicCache`, cropped back to the committed length after each block).

The references run one row at a time (both are batch-1 loops); jaxspec runs a ragged batch of two rows with
different context lengths, over two consecutive blocks: the second after writing more context. Rows' unused context
slots are written with garbage at positions past their length, which the block must not see. Each tiny model has a
sliding layer whose window (5) is shorter than the longer row's context, and a negative control shows the window
changes the reference's output.
"""

from __future__ import annotations

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file
from transformers.cache_utils import DFlashCache, DynamicCache

import jaxspec
from jaxspec.convert.errors import CheckpointError
from jaxspec.convert.rules import CheckpointMismatch
from jaxspec.models.dflash import DFLASH, DFlashConfig, DFlashDrafter
from jaxspec.models.layers import spread_to_vocab

# z-lab's reference modeling code; the README's test command installs it (`pip install --no-deps dflash==0.1.0`).
from dflash import model as dflash_model  # noqa: E402

from tests.fixtures import dflash as dflash_fixtures  # noqa: E402

D, V, W, MASK = 32, 96, 4, 95  # width, the target's vocabulary, block size, mask token id
TARGET_LAYERS = [0, 2]
WINDOW = 5
SIZES = dict(hidden_size=D, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             head_dim=8, sliding_window=WINDOW)
MUSE = dict(SIZES, target_layer_ids=TARGET_LAYERS, block_size=W, mask_token_id=MASK,
            layer_types=["sliding_attention", "full_attention"])
ZLAB = dict(SIZES, vocab_size=V, attention_bias=True, use_sliding_window=True, num_target_layers=4, block_size=W,
            layer_types=["full_attention", "sliding_attention"],
            dflash_config={"mask_token_id": MASK, "target_layer_ids": TARGET_LAYERS, "output_multiplier": 0.5,
                           "final_logit_softcapping": 3.0})
ROUNDS = [np.array([7, 3]), np.array([2, 5])]  # context entries committed per row before each block (ragged)
CACHE = 24  # S


def _muse(seed=0, **overrides):
    return dflash_fixtures.muse(MUSE | overrides, seed)


def _zlab(seed=1, **overrides):
    config = transformers.Qwen3Config(**(ZLAB | overrides))
    config.architectures = [DFLASH]
    return dflash_fixtures.randomize(dflash_model.DFlashDraftModel(config), seed)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{layout: (reference model, folder)}."""
    out = {}
    for layout, build in (("muse", _muse), ("zlab", _zlab)):
        model = build()
        folder = tmp_path_factory.mktemp(layout)
        model.save_pretrained(folder)
        out[layout] = model, folder
    return out


@pytest.fixture(scope="module")
def inputs():
    """Random target taps [B, T, n*D], embedding table [V, D], head [D, V] and bonus tokens per round [B]."""
    rng = np.random.default_rng(0)
    total = int(sum(r.max() for r in ROUNDS))
    return dict(taps=rng.standard_normal((2, total + 4, len(TARGET_LAYERS) * D)).astype(np.float32),
                embed=rng.standard_normal((V, D)).astype(np.float32),
                head=(0.3 * rng.standard_normal((D, V))).astype(np.float32),
                bonus=[rng.integers(0, MASK, 2) for _ in ROUNDS])


def _block_embeddings(inputs, round_, scale=1.0):
    tokens = np.concatenate([inputs["bonus"][round_][:, None], np.full((2, W - 1), MASK)], axis=1)  # [B, W]
    return inputs["embed"][tokens] * scale  # [B, W, D]


# ---------------------------------------------------------------------------------------------------------------
# The references, one row at a time, as their decode loops drive them


def muse_reference(model, inputs, row):
    """[(projected context [n, D], hidden [W, D]) per round] as `DFlashTokenCandidateGenerator` computes them."""
    cache = DFlashCache(config=model.config)
    cache.activate_past_recording()
    committed, out = 0, []
    with torch.no_grad():
        for round_, counts in enumerate(ROUNDS):
            n = int(counts[row])
            context = torch.tensor(inputs["taps"][row, committed:committed + n])[None]
            cache.set_previous_accepted_tokens(n)
            if round_:
                cache.crop(-W)  # the previous block's entries
            positions = torch.arange(committed, committed + n + W)[None]
            mask = torch.ones(1, committed + n + W, dtype=torch.long)
            hidden = model(noise_embeds=torch.tensor(_block_embeddings(inputs, round_)[row])[None],
                           context_hidden_states=context, position_ids=positions, attention_mask=mask,
                           past_key_values=cache).last_hidden_state[0]
            out.append((model.encoder(context)[0].numpy(), hidden.numpy()))
            committed += n
    return out


def zlab_reference(model, inputs, row):
    """[(projected context [n, D], hidden [W, D]) per round] as `dflash_generate` computes them."""
    cache = DynamicCache(config=model.config)
    cache.activate_past_recording()
    committed, out = 0, []
    with torch.no_grad():
        for round_, counts in enumerate(ROUNDS):
            n = int(counts[row])
            context = torch.tensor(inputs["taps"][row, committed:committed + n])[None]
            block = torch.tensor(_block_embeddings(inputs, round_)[row])[None]
            hidden = model(target_hidden=context, noise_embedding=block,
                           position_ids=torch.arange(committed, committed + n + W)[None], past_key_values=cache,
                           use_cache=True)[0]
            cache.crop(-(cache.get_seq_length() - (committed + n)))  # `_crop_to(cache, start)`
            out.append((model.hidden_norm(model.fc(context))[0].numpy(), hidden.numpy()))
            committed += n
    return out


def jaxspec_rounds(drafter: DFlashDrafter, inputs):
    """[(context [B, T, D], hidden [B, W, D]) per round] for both rows at once. A row's unused context slots carry
    garbage at positions past its length (they must never be read; the next round overwrites them)."""
    cache = drafter.init_cache(2, CACHE)
    lengths, out = np.zeros(2, np.int64), []
    rng = np.random.default_rng(1)
    for round_, counts in enumerate(ROUNDS):
        t = int(counts.max())
        taps = np.stack([np.concatenate([inputs["taps"][b, lengths[b]:lengths[b] + counts[b]],
                                         rng.standard_normal((t - counts[b], len(TARGET_LAYERS) * D))])
                         for b in range(2)]).astype(np.float32)  # [B, T, n*D]
        positions = lengths[:, None] + np.arange(t)  # [B, T]
        context = drafter.project_context(jnp.asarray(taps))
        cache = drafter.write_context(context, jnp.asarray(positions), cache)
        lengths = lengths + counts
        block = jnp.asarray(_block_embeddings(inputs, round_, drafter.cfg.input_embedding_scale))
        block_positions = jnp.asarray(lengths[:, None] + np.arange(W))
        hidden = drafter.draft_block(block, block_positions, cache, jnp.asarray(lengths))
        out.append((np.asarray(context), np.asarray(hidden)))
    return out


TOL = dict(rtol=1e-5, atol=1e-5)


def _check_rounds(ours, reference_rows):
    for round_, counts in enumerate(ROUNDS):
        context, hidden = ours[round_]
        for row in range(2):
            ref_context, ref_hidden = reference_rows[row][round_]
            np.testing.assert_allclose(context[row, :counts[row]], ref_context, **TOL, err_msg=f"context r{round_}")
            np.testing.assert_allclose(hidden[row], ref_hidden, **TOL, err_msg=f"hidden round {round_} row {row}")


# ---------------------------------------------------------------------------------------------------------------
# Parity


def test_muse_layout_matches_transformers(saved, inputs):
    model, folder = saved["muse"]
    loaded = jaxspec.load(folder)
    assert isinstance(loaded.module, DFlashDrafter) and loaded.config.layout == "muse_glimmer_assistant"
    ours = jaxspec_rounds(loaded.module, inputs)
    reference = [muse_reference(model, inputs, row) for row in range(2)]
    _check_rounds(ours, reference)
    # Logits: the target's head over the drafts (HF: `main_model_output_embeddings(last_hidden_state[:, 1:])`).
    head = torch.nn.Linear(D, V, bias=False)
    head.weight.data = torch.tensor(inputs["head"].T.copy())
    for row in range(2):
        ref_logits = head(torch.tensor(reference[row][1][1][1:])).detach().numpy()
        logits = np.asarray(loaded.module.logits(jnp.asarray(ours[1][1][row, 1:]), jnp.asarray(inputs["head"])))
        np.testing.assert_allclose(logits, ref_logits, **TOL)


def test_zlab_layout_matches_dflash(saved, inputs):
    model, folder = saved["zlab"]
    loaded = jaxspec.load(folder)
    cfg = loaded.config
    assert (cfg.layout, cfg.layer_causal, cfg.layer_reach, cfg.attention_bias) == (DFLASH, (False, True),
                                                                                  (None, WINDOW - 1), True)
    ours = jaxspec_rounds(loaded.module, inputs)
    reference = [zlab_reference(model, inputs, row) for row in range(2)]
    _check_rounds(ours, reference)
    head = torch.nn.Linear(D, V, bias=False)
    head.weight.data = torch.tensor(inputs["head"].T.copy())
    for row in range(2):  # z-lab's `compute_logits`: head, output_multiplier, soft-cap
        with torch.no_grad():
            ref_logits = model.compute_logits(torch.tensor(reference[row][1][1][1:]), head).numpy()
        logits = np.asarray(loaded.module.logits(jnp.asarray(ours[1][1][row, 1:]), jnp.asarray(inputs["head"])))
        np.testing.assert_allclose(logits, ref_logits, **TOL)
        assert np.abs(logits).max() < 3.0  # the cap is in force


@pytest.mark.parametrize("layout", ["muse", "zlab"])
def test_the_window_is_exercised(saved, inputs, layout):
    """Negative control: with the sliding window widened past every context, the references' second block differs
    (row 0 holds 9 context entries against a window of 5), so the parity tests above check the window."""
    model, _ = saved[layout]
    widened = (_muse if layout == "muse" else _zlab)(sliding_window=64)
    widened.load_state_dict(model.state_dict())
    run = muse_reference if layout == "muse" else zlab_reference
    narrow, wide = run(model, inputs, 0)[1][1], run(widened, inputs, 0)[1][1]
    assert np.abs(narrow - wide).max() > 1e-3


def test_block_tokens_and_cache_shape(saved):
    drafter = jaxspec.load(saved["muse"][1]).module
    assert drafter.block_tokens(jnp.array([3, 7])).tolist() == [[3] + [MASK] * (W - 1), [7] + [MASK] * (W - 1)]
    cache = drafter.init_cache(2, CACHE)
    assert cache.k.shape == cache.v.shape == (2, 2, 2, CACHE, 8)  # [L, B, K, S, Dh]


# ---------------------------------------------------------------------------------------------------------------
# Loading: the registry, and errors that name what is wrong


def test_jaxspec_load_routes_zlab(saved):
    """z-lab's config.json says model_type "qwen3"; its architecture names the family."""
    assert isinstance(jaxspec.load(saved["zlab"][1]).module, DFlashDrafter)


def _copy(folder, tmp_path, config=None, drop=(), add=None):
    """A copy of a saved checkpoint with its config replaced and tensors dropped or added."""
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    tensors = {k: v for k, v in tensors.items() if k not in drop} | (add or {})
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    hf = json.load(open(os.path.join(folder, "config.json")))
    json.dump(hf if config is None else config(hf), open(tmp_path / "config.json", "w"))
    return tmp_path


def test_missing_and_unexpected_tensors_are_named(saved, tmp_path):
    folder = _copy(saved["muse"][1], tmp_path, drop={"layers.1.self_attn.k_norm.weight"},
                   add={"layers.0.attention_conv.base_kernel": np.zeros((2, 3, D), np.float32)})
    with pytest.raises(CheckpointMismatch) as error:
        jaxspec.load(folder)
    assert "layers.1.self_attn.k_norm.weight" in str(error.value)
    assert "layers.0.attention_conv.base_kernel" in str(error.value)


def test_names_under_model_prefix_read_alike(saved, tmp_path):
    """A checkpoint saved from a wrapper (every name under `model.`) converts to the same params."""
    folder = saved["muse"][1]
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    prefixed = _copy(folder, tmp_path, drop=set(tensors), add={f"model.{k}": v for k, v in tensors.items()})
    ours, theirs = jaxspec.load(folder).module, jaxspec.load(prefixed).module
    np.testing.assert_array_equal(np.asarray(ours.fc[...]), np.asarray(theirs.fc[...]))
    np.testing.assert_array_equal(np.asarray(ours.layers[1].wo[...]), np.asarray(theirs.layers[1].wo[...]))


def test_zlab_biases_follow_attention_bias(saved, tmp_path):
    """Without attention_bias the bias tensors have no param to fill: each is named."""
    folder = _copy(saved["zlab"][1], tmp_path, config=lambda hf: hf | {"attention_bias": False})
    with pytest.raises(CheckpointMismatch, match=r"layers\.0\.self_attn\.q_proj\.bias"):
        jaxspec.load(folder)


def test_config_errors_name_the_key(saved, tmp_path):
    folder = _copy(saved["muse"][1], tmp_path, config=lambda hf: hf | {"attention_chunk_size": 8})
    with pytest.raises(ValueError, match="attention_chunk_size"):
        jaxspec.load(folder)
    folder = _copy(saved["muse"][1], tmp_path, config=lambda hf: {k: v for k, v in hf.items() if k != "hidden_size"})
    with pytest.raises(CheckpointError, match="hidden_size"):
        jaxspec.load(folder)
    zlab = json.load(open(os.path.join(saved["zlab"][1], "config.json")))
    with pytest.raises(KeyError, match="mask_token_id"):
        DFlashConfig.from_hf_config(zlab | {"dflash_config": {"target_layer_ids": TARGET_LAYERS}})
    with pytest.raises(ValueError, match="selector"):  # a DFlash setting z-lab's DFlashDraftModel does not read
        DFlashConfig.from_hf_config(zlab | {"dflash_config": zlab["dflash_config"] | {"selector": 1}})


def test_a_draft_vocabulary_heads_drafts_over_its_tokens_only(saved, inputs, tmp_path):
    """jaxspec's draft vocabulary (config `draft_vocab_size`, tensors `d2t` / `t2d` as EAGLE-3 heads store theirs):
    the draft logits over the head's rows for those tokens are the whole head's there, output multiplier and soft cap
    included (z-lab's layout here sets both), and -inf at every other token."""
    ids = np.arange(0, V, 3)  # V' = 32 of the 96 tokens
    drafter = jaxspec.load(dflash_fixtures.with_draft_vocab(saved["zlab"][1], tmp_path, ids, V)).module
    np.testing.assert_array_equal(np.asarray(drafter.vocab_ids[...]), ids)
    hidden = jnp.asarray(np.random.default_rng(1).standard_normal((2, 3, D)), jnp.float32)
    head = jnp.asarray(inputs["head"])  # [D, V]
    whole = np.asarray(drafter.logits(hidden, head))
    restricted = np.asarray(spread_to_vocab(drafter.draft_vocab_logits(hidden, head.T[ids]),
                                            drafter.vocab_ids[...], V))  # [2, 3, V]
    np.testing.assert_allclose(restricted[..., ids], whole[..., ids], rtol=1e-5, atol=1e-6)
    assert np.all(restricted[..., np.setdiff1d(np.arange(V), ids)] == -np.inf)


def test_draft_vocabulary_errors_name_the_tensor_or_key(saved, tmp_path):
    ids = np.arange(0, V, 3)
    with_vocab = dflash_fixtures.with_draft_vocab(saved["zlab"][1], tmp_path / "vocab", ids, V)
    tensors = load_file(os.path.join(with_vocab, "model.safetensors"))
    # d2t and t2d where the config sets no draft vocabulary: no slot takes them
    without_key = _copy(with_vocab, _mkdir(tmp_path / "no_key"),
                        config=lambda hf: {k: v for k, v in hf.items() if k != "draft_vocab_size"})
    with pytest.raises(CheckpointMismatch, match="d2t"):
        jaxspec.load(without_key)
    # the config's draft vocabulary without its map
    with pytest.raises(CheckpointMismatch, match="d2t"):
        jaxspec.load(_copy(with_vocab, _mkdir(tmp_path / "no_d2t"), drop={"d2t"}))
    # a map that leaves the vocabulary, and a mask that marks other tokens
    outside = tensors["d2t"].copy()
    outside[-1] += V
    with pytest.raises(CheckpointError, match="d2t"):
        jaxspec.load(_copy(with_vocab, _mkdir(tmp_path / "outside"), add={"d2t": outside}))
    with pytest.raises(CheckpointError, match="t2d"):
        jaxspec.load(_copy(with_vocab, _mkdir(tmp_path / "t2d"), add={"t2d": np.roll(tensors["t2d"], 1)}))
    zlab = json.load(open(os.path.join(saved["zlab"][1], "config.json")))
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DFlashConfig.from_hf_config(zlab | {"draft_vocab_size": V + 1})


def _mkdir(path):
    path.mkdir()
    return path


def test_dflash2_names_what_is_unsupported(saved):
    zlab = json.load(open(os.path.join(saved["zlab"][1], "config.json")))
    dflash2 = zlab | {"architectures": ["DFlash2DraftModel"],
                      "dflash_config": zlab["dflash_config"] | {"selector_rank": 8, "selector_top_k": 4,
                                                                "conv_kernel_size": 3, "conv_group_size": 8}}
    with pytest.raises(NotImplementedError, match="candidate selector") as error:
        DFlashConfig.from_hf_config(dflash2)
    assert "dynamic causal convolutions" in str(error.value)


def test_default_target_layers_follow_zlab(saved):
    """Without target_layer_ids, z-lab spreads them over the target's layers (`build_target_layer_ids`)."""
    zlab = json.load(open(os.path.join(saved["zlab"][1], "config.json")))
    for target_layers, draft_layers in ((36, 5), (28, 1), (40, 3)):
        hf = zlab | {"num_target_layers": target_layers, "num_hidden_layers": draft_layers,
                     "layer_types": ["full_attention"] * draft_layers,
                     "dflash_config": {"mask_token_id": MASK}}
        expected = tuple(dflash_model.build_target_layer_ids(target_layers, draft_layers))
        assert DFlashConfig.from_hf_config(hf).target_layer_ids == expected
