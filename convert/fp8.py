"""FP8 block-scaled checkpoints (the DeepSeek-V3/R1 layout) read as dequantized tensors.

config.json says `quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [b0, b1],
"activation_scheme": "dynamic"}`. Each quantized linear weight `X.weight` [out, in] is float8_e4m3fn and comes with
`X.weight_scale_inv` [ceil(out/b0), ceil(in/b1)] float32: the real weight is `fp8 * scale` block by block, where
the blocks at the right and bottom edges may be partial. Embeddings, the LM head, norms and the router are stored
unquantized (bf16), the router's score-correction bias float32; the MTP layers follow the same layout.

jaxspec dequantizes on every backend: the converters see one float32 tensor per weight, so the family rules, the
sharded reads and every test stay as they are for unquantized checkpoints, and the scale tensors count as used by
the weight they scale. "dynamic" activation quantization is a choice of the runtime that wrote the scales, not
data in the checkpoint; activations here stay in the model dtype, which is what HF's dequantized path computes.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

import ml_dtypes
import numpy as np

from .errors import CheckpointError
from .rules import CheckpointMismatch, TensorSource, read_box
from .safetensors_io import normalize_box

SCALE_SUFFIX = "_scale_inv"  # X.weight_scale_inv scales X.weight
FP8_DTYPES = (np.dtype(ml_dtypes.float8_e4m3fn),)


@dataclasses.dataclass(frozen=True)
class Fp8BlockQuantization:
    block: tuple[int, int]  # weight_block_size: rows (output features) x columns (input features) per scale

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], where: str = "config.json") -> "Fp8BlockQuantization | None":
        """None for an unquantized checkpoint; raises NotImplementedError for a scheme jaxspec cannot read.
        `where` (the config file) opens every error message."""
        quant = hf.get("quantization_config")
        if not quant:
            return None
        if not isinstance(quant, dict):
            raise CheckpointError(f"{where}: quantization_config must be an object, got {quant!r}.")
        method = quant.get("quant_method")
        if method != "fp8":
            raise NotImplementedError(f"{where}: quantized checkpoints (quant_method={method!r}) are not supported; "
                                      "only 'fp8' with block scales (DeepSeek-V3's layout) is.")
        if quant.get("fmt", "e4m3") != "e4m3":
            raise NotImplementedError(f"{where}: fp8 checkpoints in fmt={quant['fmt']!r} are not supported; only "
                                      "'e4m3' is.")
        if quant.get("activation_scheme", "dynamic") != "dynamic":
            raise NotImplementedError(f"{where}: fp8 activation_scheme={quant['activation_scheme']!r} is not "
                                      "supported; only 'dynamic' (no activation scales stored) is.")
        block = quant.get("weight_block_size")
        if block is None:
            raise NotImplementedError(f"{where}: fp8 checkpoints without weight_block_size (one scale per tensor or "
                                      "channel) are not supported; only block scales are.")
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(type(b) is int and b > 0 for b in block)):
            raise CheckpointError(f"{where}: quantization_config.weight_block_size must be two positive integers, "
                                  f"got {block!r}.")
        return cls(block=(block[0], block[1]))


def scale_shape(shape: Sequence[int], block: tuple[int, int]) -> tuple[int, int]:
    return (math.ceil(shape[0] / block[0]), math.ceil(shape[1] / block[1]))


def dequantize(weight: np.ndarray, scale: np.ndarray, block: tuple[int, int], origin=(0, 0)) -> np.ndarray:
    """float32 weight * scale per block. `weight` is the box of the full tensor whose top-left element is at
    `origin`; `scale` covers exactly the blocks that box touches."""
    rows, cols = weight.shape
    r0, c0 = origin[0] % block[0], origin[1] % block[1]  # the box's offset inside its first block
    expanded = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=0), block[1], axis=1)
    return weight.astype(np.float32) * expanded[r0 : r0 + rows, c0 : c0 + cols]


class DequantizedSource:
    """A tensor source over an FP8 block-scaled checkpoint: each FP8 weight reads as its float32 dequantization, and
    its scale tensor is consumed by it (absent from `shapes`). Every FP8 weight must have a scale of the right shape
    and every scale a weight; one error names every tensor that breaks this."""

    def __init__(self, source: TensorSource, quant: Fp8BlockQuantization):
        self._source, self.block = source, quant.block
        shapes = dict(source.shapes)
        scales = {name for name in shapes if name.endswith(SCALE_SUFFIX)}
        self._scale_of: dict[str, str] = {}
        orphans, unscaled, bad = [], [], []
        for scale in sorted(scales):
            weight = scale[: -len(SCALE_SUFFIX)]
            if weight not in shapes:
                orphans.append(scale)
            elif len(shapes[weight]) != 2 or shapes[scale] != scale_shape(shapes[weight], self.block):
                bad.append(f"{scale}: {shapes[scale]} for weight {shapes[weight]} in blocks of {self.block}")
            else:
                self._scale_of[weight] = scale
        for name in sorted(set(shapes) - scales):
            if source.dtype(name) in FP8_DTYPES and name not in self._scale_of:
                unscaled.append(name)
        problems = []
        if orphans:
            problems.append(f"scales without their weight: {orphans}")
        if unscaled:
            problems.append(f"fp8 weights without a {SCALE_SUFFIX} tensor: {unscaled}")
        if bad:
            problems.append(f"scales of the wrong shape: {bad}")
        if problems:
            raise CheckpointMismatch("FP8 checkpoint does not match its quantization_config: " + "; ".join(problems))
        self.shapes = {name: shape for name, shape in shapes.items() if name not in scales}

    def dtype(self, name: str) -> np.dtype:
        return np.dtype(np.float32) if name in self._scale_of else self._source.dtype(name)

    def read(self, name: str) -> np.ndarray:
        return self.read_box(name, None)

    def read_box(self, name: str, box: Sequence[slice] | None) -> np.ndarray:
        if name not in self._scale_of:
            return read_box(self._source, name, box)
        rows, cols = normalize_box(box, self.shapes[name])
        b0, b1 = self.block
        scale_box = (slice(rows.start // b0, -(-rows.stop // b0)), slice(cols.start // b1, -(-cols.stop // b1)))
        weight = read_box(self._source, name, (rows, cols))
        scale = read_box(self._source, self._scale_of[name], scale_box)
        return dequantize(weight, scale, self.block, origin=(rows.start, cols.start))


def quantize(weight: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """float weight [out, in] -> (float8_e4m3fn weight, float32 scale_inv [ceil(out/b0), ceil(in/b1)]), DeepSeek's
    scheme: each block's scale maps its largest magnitude to the fp8 maximum. Used to build test checkpoints."""
    fp8_max = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).max)
    rows, cols = weight.shape
    sr, sc = scale_shape(weight.shape, block)
    padded = np.zeros((sr * block[0], sc * block[1]), np.float32)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(sr, block[0], sc, block[1])
    scale = np.abs(blocks).max(axis=(1, 3)) / fp8_max  # [sr, sc]
    scale = np.where(scale == 0, 1.0, scale).astype(np.float32)
    quantized = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return quantized.astype(ml_dtypes.float8_e4m3fn), scale
