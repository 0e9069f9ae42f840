"""Real catalogue checkpoints: assembly, hashes, configs, SmolLM2's dequantized tensors against transformers' own
GGUF loader, and greedy output against transformers'. Slow only (hundreds of MB to hash and parse): the default suite
checks the catalogue on small fake part packages (tests/convert/test_catalog.py). Each test needs its model's
packages installed; a missing one fails the test with the pip command that installs it, never skips it."""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest

from jaxspec import catalog
from jaxspec.convert.gguf import read_gguf

pytestmark = pytest.mark.slow

# Architecture as MODELS.md states it: (arch, layers, d_model, q heads, kv heads, vocab, tied).
EXPECTED = {
    "smollm2-135m": ("llama", 30, 576, 9, 3, 49152, True),
    "qwen2.5-coder-0.5b": ("qwen2", 24, 896, 14, 2, 151936, None),
    "qwen2.5-coder-1.5b": ("qwen2", 28, 1536, 12, 2, 151936, False),
    "gemma3-270m": ("gemma3", 18, 640, None, None, 262144, True),
}


def _require_installed(name: str) -> None:
    """Fail when `name`'s packages are missing, with catalog.py's error, which names the pip command of its pinned
    requirements: these tests exist to check the real checkpoint, and a run that skipped them would check nothing."""
    try:
        catalog.find_part_files(catalog.CATALOG[name])
        return
    except FileNotFoundError as error:
        missing = str(error)
    pytest.fail(f"{missing}\n(a slow test checks the real checkpoint: a missing package fails it)", pytrace=False)


@pytest.fixture(scope="module")
def smollm2_path() -> str:
    _require_installed("smollm2-135m")
    return catalog.resolve("smollm2-135m")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_resolves_to_the_stated_architecture(name):
    _require_installed(name)
    path = catalog.resolve(name)
    assert catalog.sha256_of(path) == catalog.CATALOG[name].sha256
    arch, layers, d_model, heads, kv_heads, vocab, tied = EXPECTED[name]
    if arch == "gemma3":
        reader = gguf.GGUFReader(path)
        assert reader.get_field("general.architecture").contents() == "gemma3"
        assert reader.get_field("gemma3.block_count").contents() == layers
        assert reader.get_field("gemma3.embedding_length").contents() == d_model
        return
    cfg = read_gguf(path).hf_config
    assert cfg["model_type"] == arch
    assert (cfg["num_hidden_layers"], cfg["hidden_size"]) == (layers, d_model)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (heads, kv_heads, vocab)
    if tied is not None:
        assert cfg["tie_word_embeddings"] is tied


def test_smollm2_matches_transformers_bit_for_bit(smollm2_path):
    """Q4_1 and Q8_0 dequantization plus the llama q/k un-permutation, against the PyTorch reference."""
    import torch
    import transformers

    ckpt = read_gguf(smollm2_path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_path),
        gguf_file=os.path.basename(smollm2_path),
        dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True),
    ).state_dict()
    names = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.v_proj.weight",
        "model.layers.29.self_attn.k_proj.weight",
        "model.layers.29.self_attn.o_proj.weight",
        "model.layers.15.mlp.down_proj.weight",
        "model.layers.15.input_layernorm.weight",
    ]
    for name in names:
        got = ckpt.read_tensor(name)
        assert got.shape == ckpt.tensor_shapes[name]
        np.testing.assert_array_equal(got, reference[name].numpy(), err_msg=name)
    assert "lm_head.weight" not in ckpt.tensor_shapes


def test_smollm2_tokenizer_round_trips(smollm2_path):
    tokenizer = read_gguf(smollm2_path).load_tokenizer()
    text = "def add(a, b):\n    return a + b"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"])
def test_greedy_equals_transformers_on_the_real_checkpoint(name, tmp_path, monkeypatch):
    """Load through the conversion cache (convert, then restore) and decode 32 greedy tokens; transformers,
    reading the same GGUF, must produce the same tokens."""
    import torch
    import transformers

    import jaxspec

    _require_installed(name)
    monkeypatch.setenv("JAXSPEC_CACHE", str(tmp_path))
    path = catalog.resolve(name)
    first = jaxspec.load(name)  # converts and writes the cache
    assert os.path.isdir(tmp_path / "converted")
    restored = jaxspec.load(name)  # restores it
    prompt = "def fibonacci(n):\n    "
    ids = restored.tokenizer(prompt)["input_ids"]
    out = jaxspec.generate(restored, [ids], max_new_tokens=32, eos_token_id=[])
    del first
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
        quantization_config=transformers.GgufConfig(dequantize=True)).eval()
    expected = reference.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    np.testing.assert_array_equal(out.sequences[0], expected[0].numpy())
