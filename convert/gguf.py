"""Read llama.cpp GGUF checkpoints as if they were Hugging Face checkpoint folders.

The rest of jaxspec converts HF names and HF layouts. Rather than a second set of conversion rules, this module
presents a GGUF file as an HF `config.json` (a dict), HF tensor names and shapes, and float32 tensors in HF
`[out, in]` layout, dequantized one at a time on request (a 1.5B checkpoint dequantized whole is several GB).
Supported architectures: `llama` (with Llama 3 rope scaling from its `rope_freqs` tensor), `qwen2` and `gemma3`
(the text model, read as HF `gemma3_text`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any

import gguf
import numpy as np

from .errors import CheckpointError

GGUF_MAGIC = b"GGUF"

SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "qwen2", "gemma3")

_HF_CLASS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

_BLOCK_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}

_QWEN2_BLOCK_BIASES = {
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
}

# Gemma 3 has a norm after attention and one before and after the MLP; llama.cpp calls the pre-MLP one `ffn_norm`
# (Llama's `post_attention_layernorm`), and stores every norm weight as w + 1 (HF scales by 1 + w).
_GEMMA3_BLOCK_NAMES = {
    **{k: v for k, v in _BLOCK_NAMES.items() if k != "ffn_norm.weight"},
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

_IGNORED_BLOCK_TENSORS = {
    "attn_rot_embd.weight": "old llama.cpp files store rotary inverse frequencies; HF recomputes them from rope_theta",
}

_BLOCK_RE = re.compile(r"blk\.(\d+)\.(.+)")


@dataclasses.dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file seen through HF eyes: `hf_config` is what `config.json` would hold, tensors use HF names.

    Tensors are not read until `read_tensor` asks for one: the GGUF reader memory-maps the file, so holding this
    object costs only the metadata.
    """

    path: str
    hf_config: dict[str, Any]
    tensor_shapes: dict[str, tuple[int, ...]]
    _reader: gguf.GGUFReader = dataclasses.field(repr=False, compare=False)
    _gguf_tensors: dict[str, gguf.ReaderTensor] = dataclasses.field(repr=False, compare=False)

    def read_tensor(self, hf_name: str) -> np.ndarray:
        """Tensor `hf_name` as float32 in HF layout (`[out, in]` for linear weights), dequantized now."""
        try:
            tensor = self._gguf_tensors[hf_name]
        except KeyError:
            raise KeyError(f"{hf_name!r} is not a tensor of {self.path}") from None
        weights = _dequantize(tensor, self.tensor_shapes[hf_name])
        if self.hf_config["model_type"] == "llama":
            weights = _unpermute_llama_qk(weights, hf_name, self.hf_config)
        if self.hf_config["model_type"] == "gemma3_text" and hf_name.endswith("norm.weight"):
            weights = weights - np.float32(1.0)  # llama.cpp stores w + 1; HF stores w
        return weights

    def load_tokenizer(self) -> Any:
        """The tokenizer embedded in the GGUF metadata, built without torch (see `jaxspec.tokenizer`)."""
        from jaxspec.tokenizer import tokenizer_from_gguf

        return tokenizer_from_gguf(self._reader, where=self.path)


def read_gguf(path: str) -> GGUFCheckpoint:
    """Open a llama, qwen2 or gemma3 GGUF file: parse its metadata, map every tensor to its HF name, read no weights
    (except llama's small `rope_freqs`, which becomes the config's Llama 3 rope parameters).

    Fails on anything it would otherwise convert wrongly: an unsupported architecture, a tensor no rule maps,
    a feature (rope scaling, partial rotary) the HF config built here cannot express.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"GGUF file not found: {path}")
    reader = open_reader(path)
    arch = _metadata(reader, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"{path}: GGUF architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    _reject_rope_scaling(reader, arch, path)
    n_layers = int(_metadata(reader, f"{arch}.block_count"))
    tensors = {}
    for tensor in reader.tensors:
        try:
            hf_name = hf_tensor_name(tensor.name, arch, n_layers)
        except ValueError as error:  # a tensor no rule maps: say in which file
            raise CheckpointError(f"{path}: {error}") from None
        if hf_name is not None:
            tensors[hf_name] = tensor
    shapes = {name: _hf_shape(tensor) for name, tensor in tensors.items()}
    _check_complete(shapes, arch, n_layers, path)
    config = hf_config_from_metadata(reader, arch, shapes)
    rope_freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if rope_freqs is not None:
        factors = _dequantize(rope_freqs, _hf_shape(rope_freqs)).reshape(-1)
        config["rope_parameters"] = llama3_rope_from_factors(
            factors, config["head_dim"], config["rope_parameters"]["rope_theta"], path
        )
    return GGUFCheckpoint(path=path, hf_config=config, tensor_shapes=shapes, _reader=reader, _gguf_tensors=tensors)


class _BoundedReader(gguf.GGUFReader):
    """gguf-py's reader, refusing to read past the end of the file.

    gguf-py slices its memory map without checking the file's length, so a cut file fails somewhere later (a
    reshape of a short tensor, an index past a short array) with an error that names neither the file nor the cut.
    Every read goes through `_get`; checking its byte range there reports any truncation (header, metadata, tensor
    infos or tensor data) before anything is reshaped.
    """

    def __init__(self, path: str):
        self.path = path
        self._itemsizes: dict[Any, int] = {}
        super().__init__(path)

    def _get(self, offset, dtype, count=1, override_order=None):
        itemsize = self._itemsizes.get(dtype)
        if itemsize is None:
            itemsize = self._itemsizes[dtype] = np.dtype(dtype).itemsize
        end = int(offset) + itemsize * int(count)
        if end > self.data.shape[0]:
            raise CheckpointError(
                f"{self.path}: GGUF file is truncated or damaged: it has {self.data.shape[0]} bytes, but its header "
                f"describes data up to byte {end} (cut while downloading or copying?)")
        return super()._get(offset, dtype, count, override_order)


def open_reader(path: str) -> gguf.GGUFReader:
    """A `gguf.GGUFReader` over `path`, or a CheckpointError naming the file: empty, not GGUF, truncated, or a header
    gguf-py refuses (its errors, which do not name the file, are re-raised with the path)."""
    size = os.path.getsize(path)
    if size == 0:
        raise CheckpointError(f"{path}: empty file (0 bytes), not a GGUF checkpoint")
    with open(path, "rb") as f:
        magic = f.read(len(GGUF_MAGIC))
    if magic != GGUF_MAGIC:
        raise CheckpointError(f"{path}: not a GGUF file: it starts with {magic!r}, not {GGUF_MAGIC!r}")
    try:
        return _BoundedReader(path)
    except CheckpointError:
        raise
    except (ValueError, KeyError) as error:  # gguf-py's own header checks: version, duplicate keys, unknown types
        raise CheckpointError(f"{path}: damaged GGUF header: {error}") from error


def hf_tensor_name(gguf_name: str, arch: str, n_layers: int) -> str | None:
    """HF name of a llama.cpp tensor; None for a tensor deliberately ignored; an error for anything else."""
    if gguf_name == "rope_freqs.weight":
        if arch == "llama":
            return None  # Llama 3 rope scaling: read into the config by `read_gguf`, not a weight
        raise NotImplementedError(f"a rope_freqs tensor (per-frequency rope scaling) in a {arch} GGUF is not supported")
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _BLOCK_RE.fullmatch(gguf_name)
    if match is not None and int(match.group(1)) < n_layers:
        layer, suffix = int(match.group(1)), match.group(2)
        block_names = _block_names(arch)
        if suffix in block_names:
            return f"model.layers.{layer}.{block_names[suffix]}"
        if suffix in _IGNORED_BLOCK_TENSORS:
            return None
    raise ValueError(f"GGUF tensor {gguf_name!r} is not used by any {arch} conversion rule")


def _block_names(arch: str) -> dict[str, str]:
    """llama.cpp block tensor suffix -> HF name inside `model.layers.{i}.`, per architecture."""
    if arch == "gemma3":
        return _GEMMA3_BLOCK_NAMES
    return _BLOCK_NAMES | (_QWEN2_BLOCK_BIASES if arch == "qwen2" else {})


def hf_config_from_metadata(
    reader: gguf.GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]]
) -> dict[str, Any]:
    """The `config.json` transformers 5 would write for this model, from GGUF metadata and tensor shapes.

    The vocabulary size comes from the embedding (the metadata may omit it, and the tensor is what must fit);
    head_dim from `attention.key_length`, else from the q projection's rows.
    """
    hidden = int(_metadata(reader, f"{arch}.embedding_length"))
    n_heads = int(_metadata(reader, f"{arch}.attention.head_count"))
    head_dim = _head_dim(reader, arch, shapes, n_heads)
    if arch == "gemma3":
        return _gemma3_config(reader, shapes, hidden, n_heads, head_dim)
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS[arch]],
        "model_type": arch,
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(_metadata(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_metadata(reader, f"{arch}.block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_metadata(reader, f"{arch}.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _decimal(_metadata(reader, f"{arch}.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_metadata(reader, f"{arch}.context_length")),
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": _decimal(_metadata(reader, f"{arch}.rope.freq_base", 10000.0)),
        },
        **_shared_config(reader, shapes),
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, sliding_window=None)
    return config


def _metadata(reader: gguf.GGUFReader, key: str, default: Any = dataclasses.MISSING) -> Any:
    """One scalar metadata value; a missing required key is an error that names it."""
    field = reader.get_field(key)
    if field is None:
        if default is dataclasses.MISSING:
            raise CheckpointError(f"{_where(reader)}: GGUF metadata key {key!r} is missing")
        return default
    try:
        return field.contents()
    except UnicodeDecodeError as error:  # gguf-py decodes strings lazily: bytes that are not UTF-8 mean damage
        raise CheckpointError(f"{_where(reader)}: GGUF metadata {key!r} is not valid UTF-8 text ({error}); the "
                              "file is damaged") from None


def _where(reader: gguf.GGUFReader) -> str:
    """The file a reader reads, for error messages (`open_reader` records it)."""
    return getattr(reader, "path", "GGUF file")


def _shared_config(reader: gguf.GGUFReader, shapes) -> dict:
    """The config entries every family reads alike: a tied head where the file has no output matrix, the special
    token ids (a pad id only where the file names one), and no attention dropout."""
    config = {
        "tie_word_embeddings": "lm_head.weight" not in shapes,
        "bos_token_id": _optional_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _optional_int(reader, "tokenizer.ggml.eos_token_id"),
        "attention_dropout": 0.0,
    }
    pad = _optional_int(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        config["pad_token_id"] = pad
    return config


def _optional_int(reader: gguf.GGUFReader, key: str) -> int | None:
    """An optional integer metadata value (token ids)."""
    value = _metadata(reader, key, None)
    return None if value is None else int(value)


def _decimal(value: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06).

    GGUF stores eps and rope theta as float32; the HF config held the decimal that was rounded, and matching it
    keeps configs comparable with the original `config.json`.
    """
    return float(str(np.float32(value)))


def _head_dim(reader: gguf.GGUFReader, arch: str, shapes: dict[str, tuple[int, ...]], n_heads: int) -> int:
    """Per-head width, checked against the q projection and against the rotary width."""
    q_rows = shapes["model.layers.0.self_attn.q_proj.weight"][0]
    head_dim = int(_metadata(reader, f"{arch}.attention.key_length", q_rows // n_heads))
    if head_dim * n_heads != q_rows:
        raise CheckpointError(f"{_where(reader)}: GGUF head_dim {head_dim} x {n_heads} heads does not match the q "
                              f"projection's {q_rows} rows")
    rotary = _metadata(reader, f"{arch}.rope.dimension_count", head_dim)
    if int(rotary) != head_dim:
        raise NotImplementedError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    return head_dim


def _reject_rope_scaling(reader: gguf.GGUFReader, arch: str, path: str) -> None:
    """The HF config built here expresses default rope (and Gemma 3's linear scaling of its global layers); a file
    asking for other scaling would silently diverge."""
    scaling = _metadata(reader, f"{arch}.rope.scaling.type", "none")
    if scaling != "none" and not (arch == "gemma3" and scaling == "linear"):
        raise NotImplementedError(f"{path}: rope scaling {scaling!r} from GGUF is not supported yet")


def _check_complete(shapes: dict[str, tuple[int, ...]], arch: str, n_layers: int, path: str) -> None:
    """Every tensor the HF model needs must be present; a truncated file should fail here, not mid-conversion."""
    required = ["model.embed_tokens.weight", "model.norm.weight"]
    required += [f"model.layers.{i}.{name}" for i in range(n_layers) for name in _block_names(arch).values()]
    missing = [name for name in required if name not in shapes]
    if missing:
        more = " ..." if len(missing) > 8 else ""
        raise CheckpointError(f"{path}: GGUF lacks tensors for {', '.join(missing[:8])}{more}")


def _hf_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """GGUF lists dimensions fastest-first; HF (and numpy) list them slowest-first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _dequantize(tensor: gguf.ReaderTensor, shape: tuple[int, ...]) -> np.ndarray:
    """Float32 copy of one tensor, owning its memory (an F32 tensor would otherwise be a view of the memmap)."""
    weights = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(shape)
    if np.may_share_memory(weights, tensor.data) or weights.dtype != np.float32:
        weights = np.array(weights, dtype=np.float32)
    return weights


def _unpermute_llama_qk(weights: np.ndarray, hf_name: str, config: dict[str, Any]) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation.

    llama.cpp's converter reorders each head's rows from HF's rotate-half layout (first half, second half) to
    interleaved pairs, because its rope rotates adjacent pairs. Per head, GGUF row 2j+t holds HF row t*half+j.
    """
    if hf_name.endswith("self_attn.q_proj.weight"):
        n_heads = config["num_attention_heads"]
    elif hf_name.endswith("self_attn.k_proj.weight"):
        n_heads = config["num_key_value_heads"]
    else:
        return weights
    rows = weights.shape[0]
    return np.ascontiguousarray(
        weights.reshape(n_heads, rows // n_heads // 2, 2, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)
    )


# ----------------------------------------------------------------------------------------------------------------
# Gemma 3


GEMMA3_LOCAL_ROPE_THETA = 10000.0
GEMMA3_GLOBAL_EVERY = 6
GEMMA3_27B_LAYERS = 62


def _gemma3_config(
    reader: gguf.GGUFReader, shapes: dict[str, tuple[int, ...]], hidden: int, n_heads: int, head_dim: int
) -> dict[str, Any]:
    """The `config.json` of HF `Gemma3ForCausalLM` (`gemma3_text`) for a gemma3 GGUF.

    Files may omit the layer pattern and the local rope base (`attention.sliding_window_pattern`,
    `rope.freq_base_swa`); llama.cpp then fixes them, and so does this: every 6th layer global, local layers at rope
    base 10000. Linear rope scaling, when the file has it, applies to global layers only. The query scale is never
    stored: llama.cpp uses 1/sqrt(head_dim), except for the 62-layer 27B, which it scales by 1/sqrt(hidden / heads).
    """
    n_layers = int(_metadata(reader, "gemma3.block_count"))
    pattern = _metadata(reader, "gemma3.attention.sliding_window_pattern", GEMMA3_GLOBAL_EVERY)
    if isinstance(pattern, list):  # one flag per layer: True where the layer slides
        if len(pattern) != n_layers:
            raise CheckpointError(f"{_where(reader)}: gemma3.attention.sliding_window_pattern lists {len(pattern)} "
                                  f"layers; expected {n_layers}")
        layer_types = ["sliding_attention" if slides else "full_attention" for slides in pattern]
    else:
        layer_types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n_layers)]
    value_length = int(_metadata(reader, "gemma3.attention.value_length", head_dim))
    if value_length != head_dim:
        raise NotImplementedError(f"gemma3 GGUF with value_length {value_length} != key_length {head_dim}")
    global_rope: dict[str, Any] = {"rope_type": "default",
                                   "rope_theta": _decimal(_metadata(reader, "gemma3.rope.freq_base", 1_000_000.0))}
    if _metadata(reader, "gemma3.rope.scaling.type", "none") == "linear":
        global_rope |= {"rope_type": "linear", "factor": _decimal(_metadata(reader, "gemma3.rope.scaling.factor"))}
    config: dict[str, Any] = {
        "architectures": [_HF_CLASS["gemma3"]],
        "model_type": "gemma3_text",
        "vocab_size": shapes["model.embed_tokens.weight"][0],
        "hidden_size": hidden,
        "intermediate_size": int(_metadata(reader, "gemma3.feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_metadata(reader, "gemma3.attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": _decimal(_metadata(reader, "gemma3.attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(_metadata(reader, "gemma3.context_length")),
        "sliding_window": int(_metadata(reader, "gemma3.attention.sliding_window")),
        "layer_types": layer_types,
        "rope_parameters": {
            "full_attention": global_rope,
            "sliding_attention": {
                "rope_type": "default",
                "rope_theta": _decimal(_metadata(reader, "gemma3.rope.freq_base_swa", GEMMA3_LOCAL_ROPE_THETA)),
            },
        },
        "query_pre_attn_scalar": hidden // n_heads if n_layers == GEMMA3_27B_LAYERS else head_dim,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        **_shared_config(reader, shapes),
    }
    return config


# ----------------------------------------------------------------------------------------------------------------
# Llama 3 rope scaling


def llama3_rope_factors(head_dim: int, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter stores as `rope_freqs` for HF llama3 rope parameters: per frequency, the divisor
    of its inverse frequency (1 for short wavelengths, `factor` for long ones, a smooth blend between)."""
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    wavelen = 2 * np.pi / inv_freq
    old_context = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    smooth = (old_context / wavelen - low) / (high - low)
    blended = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_context / high, 1.0, np.where(wavelen > old_context / low, factor, blended))


def llama3_rope_from_factors(factors: np.ndarray, head_dim: int, theta: float, path: str) -> dict[str, Any]:
    """HF llama3 `rope_parameters` that reproduce llama.cpp's `rope_freqs` divisors.

    The divisors fix `factor` (the largest) and, inside the blended band, 1/divisor = (1 - s)/factor + s with
    s = (old_context / wavelength - low) / (high - low), a line in 1/wavelength. Its slope and intercept determine
    high/low and old_context/(high - low) only, and every low gives the same frequencies, so low = 1 (Llama 3's
    value) is taken and the rest solved. The answer is checked by recomputing the divisors.
    """
    if factors.shape != (head_dim // 2,):
        raise ValueError(f"{path}: rope_freqs has shape {factors.shape}; expected ({head_dim // 2},)")
    factors = factors.astype(np.float64)
    factor = float(factors.max())
    inv_freq = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    blended = ~np.isclose(factors, 1.0, rtol=1e-6) & ~np.isclose(factors, factor, rtol=1e-6)
    if factor <= 1.0 or blended.sum() < 2:
        raise NotImplementedError(
            f"{path}: rope_freqs {factors.tolist()} is not Llama 3 rope scaling with a blended band of at least two "
            "frequencies, which is what jaxspec can express as HF llama3 rope parameters"
        )
    s = (1.0 / factors[blended] - 1.0 / factor) / (1.0 - 1.0 / factor)
    slope, intercept = np.polyfit(inv_freq[blended] / (2 * np.pi), s, 1)  # s = slope / wavelength + intercept
    low = 1.0
    high = low - low / intercept
    rope = {
        "rope_type": "llama3",
        "rope_theta": theta,
        "factor": _decimal(factor),
        "low_freq_factor": low,
        "high_freq_factor": round(float(high), 6),
        "original_max_position_embeddings": int(round(slope * (high - low))),
    }
    if not np.allclose(llama3_rope_factors(head_dim, theta, rope), factors, rtol=1e-5):
        raise NotImplementedError(f"{path}: rope_freqs {factors.tolist()} cannot be expressed as HF llama3 rope "
                                  f"parameters (closest: {rope})")
    return rope
