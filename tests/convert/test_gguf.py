"""`read_gguf` against tiny random HF models written to GGUF the way llama.cpp's converter writes them.

Two oracles: the HF tensors the file was written from (so the q/k un-permutation must invert llama.cpp's
permutation), and transformers' own GGUF loader reading the same file (so the direction matches the reference).
"""

from __future__ import annotations

import os

import gguf
import numpy as np
import pytest
import torch
import transformers

from jaxspec.convert.gguf import GGUFCheckpoint, read_gguf
from tests.fixtures.gguf import (HIDDEN, INTERMEDIATE, LAYERS, N_HEADS, N_KV_HEADS, VOCAB, add_shape_metadata,
                                 add_tokenizer, hf_state, tiny_config, tiny_model, write_gguf)


def transformers_state(path: str) -> dict[str, np.ndarray]:
    """What transformers' own GGUF loader makes of the file: the reference for names and permutation."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return {name: t.detach().numpy() for name, t in model.state_dict().items()}


def assert_same_tensors(ckpt: GGUFCheckpoint, expected: dict[str, np.ndarray]) -> None:
    """Same names, shapes, dtype and values; float32 storage must round-trip exactly."""
    assert set(ckpt.tensor_shapes) == set(expected)
    for name, want in expected.items():
        got = ckpt.read_tensor(name)
        assert got.dtype == np.float32, name
        assert got.shape == ckpt.tensor_shapes[name] == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


@pytest.mark.parametrize("arch,tied", [("llama", True), ("llama", False), ("qwen2", False), ("qwen2", True)])
def test_f32_round_trip_and_config(tmp_path, arch, tied):
    model = tiny_model(arch, tied)
    path = str(tmp_path / f"{arch}.gguf")
    expected = write_gguf(model, path)
    ckpt = read_gguf(path)
    assert_same_tensors(ckpt, expected)
    assert ("lm_head.weight" in ckpt.tensor_shapes) == (not tied)
    cfg = ckpt.hf_config
    want = {
        "model_type": arch,
        "architectures": ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": N_HEADS,
        "num_key_value_heads": N_KV_HEADS,
        "head_dim": HIDDEN // N_HEADS,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 128,
        "tie_word_embeddings": tied,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    }
    assert {key: cfg.get(key) for key in want} == want
    if arch == "qwen2":
        assert cfg["use_sliding_window"] is False
        assert "model.layers.1.self_attn.k_proj.bias" in ckpt.tensor_shapes


def test_config_rebuilds_the_same_hf_model(tmp_path):
    """The config dict is a valid `config.json`: transformers builds a model with the same parameter shapes."""
    model = tiny_model("qwen2", tied=False)
    path = str(tmp_path / "m.gguf")
    write_gguf(model, path)
    ckpt = read_gguf(path)
    rebuilt = transformers.AutoConfig.for_model(**ckpt.hf_config)
    shapes = {n: tuple(t.shape) for n, t in transformers.AutoModelForCausalLM.from_config(rebuilt).state_dict().items()}
    assert shapes == ckpt.tensor_shapes


@pytest.mark.parametrize("arch,tied", [("llama", False), ("qwen2", True)])
def test_q8_0_dequantizes_like_gguf(tmp_path, arch, tied):
    model = tiny_model(arch, tied)
    path = str(tmp_path / "q8.gguf")
    expected = write_gguf(model, path, gguf.GGMLQuantizationType.Q8_0)
    ckpt = read_gguf(path)
    assert_same_tensors(ckpt, expected)
    for name, want in hf_state(model).items():
        np.testing.assert_allclose(ckpt.read_tensor(name), want, atol=0.02, err_msg=name)


@pytest.mark.parametrize(
    "arch,tied,qtype",
    [
        ("llama", False, gguf.GGMLQuantizationType.F32),
        ("llama", True, gguf.GGMLQuantizationType.Q8_0),
        ("qwen2", False, gguf.GGMLQuantizationType.F32),
    ],
)
def test_matches_transformers_gguf_loader(tmp_path, arch, tied, qtype):
    """The oracle for the permutation direction: transformers un-permutes llama q/k itself."""
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model(arch, tied), path, qtype)
    reference = transformers_state(path)
    ckpt = read_gguf(path)
    for name in ckpt.tensor_shapes:
        np.testing.assert_array_equal(ckpt.read_tensor(name), reference[name], err_msg=name)


def test_load_tokenizer(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model("llama", True), path)
    tokenizer = read_gguf(path).load_tokenizer()
    assert tokenizer.convert_tokens_to_ids(["<s>", "</s>", "ab"]) == [1, 2, 29]


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        read_gguf(str(tmp_path / "nope.gguf"))


def test_unsupported_architecture(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model("llama", True), path, arch="falcon")
    with pytest.raises(ValueError, match=r"'falcon'.*supported: llama, qwen2, gemma3"):
        read_gguf(path)


def _with_extra_tensor(tmp_path, name: str) -> str:
    """A valid llama file plus one tensor `name`, to exercise the unmapped-tensor rules."""
    path = str(tmp_path / "m.gguf")
    model = tiny_model("llama", True)
    writer_path = str(tmp_path / "base.gguf")
    write_gguf(model, writer_path)
    reader = gguf.GGUFReader(writer_path)
    writer = gguf.GGUFWriter(path, "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.array(tensor.data))
    writer.add_tensor(name, np.ones(HIDDEN // N_HEADS // 2, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unmapped_tensor_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q_norm\.weight"):
        read_gguf(_with_extra_tensor(tmp_path, "blk.0.attn_q_norm.weight"))


def test_rope_freqs_that_are_not_llama3_scaling_are_refused(tmp_path):
    """All-ones divisors (what `_with_extra_tensor` writes) are no Llama 3 scaling; silently using them could not be
    told apart from a file whose scaling jaxspec misread."""
    with pytest.raises(NotImplementedError, match="not Llama 3 rope scaling"):
        read_gguf(_with_extra_tensor(tmp_path, "rope_freqs.weight"))


def test_rotary_buffer_is_ignored(tmp_path):
    ckpt = read_gguf(_with_extra_tensor(tmp_path, "blk.1.attn_rot_embd.weight"))
    assert not any("rot" in name for name in ckpt.tensor_shapes)


def test_unknown_tensor_name_raises_key_error(tmp_path):
    path = str(tmp_path / "m.gguf")
    write_gguf(tiny_model("llama", True), path)
    with pytest.raises(KeyError, match="lm_head"):
        read_gguf(path).read_tensor("lm_head.weight")


def jitted_logits(model, ids: np.ndarray) -> np.ndarray:
    """The loaded model's logits for every position of `ids` (one compile instead of op-by-op dispatch)."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    graphdef, state = nnx.split(model.module)

    @jax.jit
    def run(state, tokens):
        module = nnx.merge(graphdef, state)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        return module(tokens, positions, module.init_cache(*tokens.shape))[0]

    return np.asarray(run(state, jnp.asarray(ids)))


# -- Llama 3 rope scaling: llama.cpp stores it as a `rope_freqs` tensor, not as metadata -----------------------------

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 100.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def llama_cpp_rope_freqs(config) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf's `LlamaModel.generate_extra_tensors` for llama3 rope: per frequency, the
    divisor of its inverse frequency."""
    rope, dim = config.rope_parameters, config.head_dim
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old_context = rope["original_max_position_embeddings"]
    low_wavelen = old_context / rope["low_freq_factor"]
    high_wavelen = old_context / rope["high_freq_factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * np.pi / freq
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(rope["factor"])
        else:
            smooth = (old_context / wavelen - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            factors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return np.asarray(factors, np.float32)


def test_llama3_rope_loads_from_rope_freqs(tmp_path):
    """Theta 100 and an original context of 64 put two of the four frequencies in the blended band, one above and
    one below it: the config read back is the HF one, and the logits are the HF model's."""
    import jaxspec

    torch.manual_seed(0)
    config = tiny_config("llama", tied=True)
    config.rope_parameters = dict(LLAMA3_ROPE)
    model = transformers.LlamaForCausalLM(config).eval()
    factors = llama_cpp_rope_freqs(model.config)
    assert 1.0 < factors[1] < factors[2] < 8.0 and factors[0] == 1.0 and factors[3] == 8.0
    path = str(tmp_path / "llama3.gguf")
    write_gguf(model, path, extra_tensors={"rope_freqs.weight": factors})
    ckpt = read_gguf(path)
    assert ckpt.hf_config["rope_parameters"] == LLAMA3_ROPE
    assert "rope_freqs.weight" not in ckpt.tensor_shapes
    ids = np.random.RandomState(0).randint(0, VOCAB, (1, 40))
    logits = jitted_logits(jaxspec.load(path), ids)
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-4, rtol=1e-4)


# -- gemma3 --------------------------------------------------------------------------------------------------------

_GEMMA3_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
GEMMA3_WINDOW = 4


def tiny_gemma3() -> transformers.Gemma3ForCausalLM:
    """6 layers (the 6th global, as llama.cpp assumes for every gemma3 file), a 4-token window, linear rope scaling
    on the global layer, and the query scale llama.cpp uses (1/sqrt(head_dim))."""
    from tests.fixtures import hf_models

    return hf_models.build_tiny_gemma(
        "gemma3_text", seed=5, vocab_size=VOCAB, num_hidden_layers=6, layer_types=None, query_pre_attn_scalar=8,
        head_dim=8, sliding_window=GEMMA3_WINDOW, rms_norm_eps=1e-6,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1000000.0}})


def write_gemma3_gguf(model, path: str, qtype=gguf.GGMLQuantizationType.F32) -> None:
    """As llama.cpp writes gemma3: its names, every norm weight stored as w + 1, no q/k permutation."""
    config = model.config
    writer = gguf.GGUFWriter(path, "gemma3")
    add_shape_metadata(writer, config)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    writer.add_rope_scaling_factor(config.rope_parameters["full_attention"]["factor"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_sliding_window(config.sliding_window)
    add_tokenizer(writer)
    for hf_name, w in hf_state(model).items():
        if hf_name == "model.embed_tokens.weight":
            name = "token_embd.weight"
        elif hf_name == "model.norm.weight":
            name = "output_norm.weight"
        else:
            _, _, layer, rest = hf_name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            name = f"blk.{layer}.{_GEMMA3_BLOCK[module]}.{kind}"
        if hf_name.endswith("norm.weight"):
            w = w + np.float32(1.0)
        if w.ndim == 2 and qtype != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(w, qtype)
            writer.add_tensor(name, data, raw_shape=data.shape, raw_dtype=qtype)
        else:
            writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("qtype", [gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0], ids=["f32", "q8_0"])
def test_gemma3_tensors_match_transformers_gguf_loader(tmp_path, qtype):
    """Names, the w + 1 norms and dequantization, against transformers' own gemma3 GGUF reader."""
    model = tiny_gemma3()
    path = str(tmp_path / "g3.gguf")
    write_gemma3_gguf(model, path, qtype)
    ckpt = read_gguf(path)
    reference = transformers_state(path)
    assert set(ckpt.tensor_shapes) == set(reference) - {"lm_head.weight"}
    for name in ckpt.tensor_shapes:
        np.testing.assert_array_equal(ckpt.read_tensor(name), reference[name], err_msg=name)
    for name, want in hf_state(model).items():
        np.testing.assert_allclose(ckpt.read_tensor(name), want, atol=0.02 if want.ndim == 2 else 1e-6, err_msg=name)


def test_gemma3_config_and_logits_match_transformers(tmp_path):
    """The config read from metadata is the model's own (window, layer pattern, both rope bases and the global
    layer's linear scaling), and the loaded model gives its logits over a sequence 6 times the window."""
    import jaxspec

    model = tiny_gemma3()
    path = str(tmp_path / "g3.gguf")
    write_gemma3_gguf(model, path)
    cfg = read_gguf(path).hf_config
    want = model.config.to_dict()
    for key in ("model_type", "sliding_window", "layer_types", "rope_parameters", "query_pre_attn_scalar", "head_dim",
                "num_key_value_heads", "rms_norm_eps", "tie_word_embeddings"):
        assert cfg[key] == want[key], key
    ids = np.random.RandomState(0).randint(0, VOCAB, (2, 6 * GEMMA3_WINDOW))
    logits = jitted_logits(jaxspec.load(path), ids)
    with torch.no_grad():
        expected = model(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(np.asarray(logits), expected, atol=2e-4, rtol=1e-4)
