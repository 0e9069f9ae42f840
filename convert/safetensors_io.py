"""Lazy safetensors reading without torch: parse the header, then read a tensor, or any box of it, with `pread`.

safetensors' own numpy binding has no bfloat16 or float8, which is how most checkpoints ship; the format is simple
enough (8-byte header length, JSON header, raw little-endian row-major bytes) that reading it directly with ml_dtypes
is the smallest dependable path.

Reads go through `os.pread` into fresh arrays rather than a memory map: pages of a mapped file count towards the
process's resident memory for as long as the map lives, so a process that reads its slices of a 600 GB checkpoint
through a map would look (and, under memory pressure, behave) as if it held all of it. `read_box` reads a box of a
tensor (one slice per axis) in chunks of whole rows of at most `CHUNK_BYTES`, so a process that holds one shard of
a tensor never holds more than that shard plus one chunk.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import Mapping, Sequence

import ml_dtypes
import numpy as np

from .errors import CheckpointError, read_json_object

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

# Bits per element of every dtype the safetensors format defines (jaxspec reads the ones in `_DTYPES`); a header
# naming any other dtype is not a safetensors header.
_DTYPE_BITS = {
    "BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16,
    "BF16": 16, "I32": 32, "U32": 32, "F32": 32, "I64": 64, "U64": 64, "F64": 64, "C64": 64, "F4": 4, "F6_E2M3": 6,
    "F6_E3M2": 6,
}
HEADER_LIMIT = 100 << 20  # the safetensors reference refuses headers larger than 100 MB

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CHUNK_BYTES = 64 << 20  # the most a box read holds beyond the box itself

Box = tuple[slice, ...]


def full_box(shape: Sequence[int]) -> Box:
    return tuple(slice(0, n) for n in shape)


def normalize_box(box: Sequence[slice] | None, shape: Sequence[int]) -> Box:
    """Explicit (start, stop) slices for every axis; steps other than 1 are not boxes."""
    if box is None:
        return full_box(shape)
    box = tuple(box) + (slice(None),) * (len(shape) - len(box))
    out = []
    for s, n in zip(box, shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError(f"box slices must have step 1, got {s}")
        out.append(slice(start, max(start, stop)))
    return tuple(out)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in box)


class SafetensorsFile:
    """One .safetensors file: tensor shapes from its header, tensors (or boxes of them) read on demand."""

    def __init__(self, path: str):
        self.path = path
        self._fd: int | None = None
        size = os.path.getsize(path)
        if size < 8:
            raise CheckpointError(f"{path}: {'empty file' if size == 0 else f'only {size} bytes'}; a safetensors "
                                  "file starts with an 8-byte header length (truncated or not a safetensors file?)")
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > min(size - 8, HEADER_LIMIT):
                raise CheckpointError(
                    f"{path}: header length {header_len} does not fit in the file ({size} bytes); not a safetensors "
                    "file, or a damaged one")
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except ValueError as error:  # JSONDecodeError and UnicodeDecodeError
            raise CheckpointError(f"{path}: safetensors header is not valid JSON ({error}); the file is damaged or "
                                  "not a safetensors file") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: safetensors header is a JSON {type(header).__name__}, not an object")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        self._entries = {name: self._checked_entry(name, entry) for name, entry in header.items()}
        self._check_extent(size)

    def _checked_entry(self, name: str, entry) -> dict:
        """The header entry of tensor `name`, refused unless its dtype, shape and byte range agree."""
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise CheckpointError(f"{self.path}: header entry of tensor {name!r} needs dtype, shape and data_offsets; "
                                  f"got {entry!r}")
        dtype, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(dtype, str) or dtype not in _DTYPE_BITS:
            raise CheckpointError(f"{self.path}: tensor {name!r} has dtype {dtype!r}, which is not a safetensors dtype "
                                  f"({', '.join(_DTYPE_BITS)})")
        if not (isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)):
            raise CheckpointError(f"{self.path}: tensor {name!r} has shape {shape!r}; expected a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise CheckpointError(f"{self.path}: tensor {name!r} has data_offsets {offsets!r}; expected [begin, end]")
        needed = math.prod(shape) * _DTYPE_BITS[dtype]
        if offsets[1] - offsets[0] != -(-needed // 8):
            raise CheckpointError(
                f"{self.path}: tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but a {dtype} tensor of shape "
                f"{shape} takes {-(-needed // 8)}; the header is damaged")
        return entry

    def _check_extent(self, size: int) -> None:
        """Every tensor's bytes must lie inside the file: a cut file fails here, naming the tensors it lost."""
        past = sorted(name for name, e in self._entries.items() if self._data_start + e["data_offsets"][1] > size)
        if past:
            end = max(self._data_start + e["data_offsets"][1] for e in self._entries.values())
            raise CheckpointError(
                f"{self.path}: file is truncated: it has {size} bytes, but its header places tensor data up to byte "
                f"{end}; {len(past)} tensor(s) lie past the end: {past[:5]}{' ...' if len(past) > 5 else ''}")

    def __del__(self, _close=os.close):  # bound now: at interpreter exit `os.close` may already be gone
        if getattr(self, "_fd", None) is not None:
            _close(self._fd)

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(e["shape"]) for name, e in self._entries.items()}

    def dtype(self, name: str) -> np.dtype:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise NotImplementedError(
                f"{self.path}: tensor {name} has dtype {entry['dtype']}, which jaxspec cannot read."
            )
        return np.dtype(_DTYPES[entry["dtype"]])

    def read(self, name: str) -> np.ndarray:
        return self.read_box(name, None)

    def read_box(self, name: str, box: Sequence[slice] | None) -> np.ndarray:
        """`tensor[box]` as a new array, reading whole rows (axis 0) in chunks of at most CHUNK_BYTES."""
        dtype = self.dtype(name)
        shape = tuple(self._entries[name]["shape"])
        box = normalize_box(box, shape)
        out = np.empty(box_shape(box), dtype)
        if out.size == 0:
            return out
        if not shape:
            return self._pread(name, 0, 1, dtype).reshape(())
        row = math.prod(shape[1:])  # elements per row of axis 0
        rows_per_chunk = max(1, CHUNK_BYTES // max(1, row * dtype.itemsize))
        rows = box[0]
        for first in range(rows.start, rows.stop, rows_per_chunk):
            last = min(rows.stop, first + rows_per_chunk)
            chunk = self._pread(name, first * row, (last - first) * row, dtype).reshape((last - first, *shape[1:]))
            out[first - rows.start : last - rows.start] = chunk[(slice(None), *box[1:])]
        return out

    def _pread(self, name: str, start: int, count: int, dtype: np.dtype) -> np.ndarray:
        """`count` elements from element `start` of tensor `name`."""
        begin, end = self._entries[name]["data_offsets"]
        offset = self._data_start + begin + start * dtype.itemsize
        nbytes = count * dtype.itemsize
        if begin + (start + count) * dtype.itemsize > end:
            raise ValueError(f"{self.path}: tensor {name} is shorter than its header says.")
        if self._fd is None:
            self._fd = os.open(self.path, os.O_RDONLY)
        buffer = bytearray(nbytes)
        view = memoryview(buffer)
        done = 0
        while done < nbytes:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got == 0:
                raise ValueError(f"{self.path}: file ends inside tensor {name}.")
            done += got
        return np.frombuffer(buffer, dtype)


class SafetensorsCheckpoint:
    """All tensors of an HF checkpoint folder, single-file or sharded by an index, as one lazy name -> tensor map."""

    def __init__(self, folder: str):
        index_path = os.path.join(folder, INDEX_FILE)
        single_path = os.path.join(folder, SINGLE_FILE)
        if os.path.exists(index_path):
            weight_map = _read_weight_map(index_path)
            shard_names = sorted(set(weight_map.values()))
            missing = [s for s in shard_names if not os.path.isfile(os.path.join(folder, s))]
            if missing:
                raise FileNotFoundError(f"{index_path} names shard files that are not in {folder}: {missing}")
            self._files = {s: SafetensorsFile(os.path.join(folder, s)) for s in shard_names}
            self._where = dict(weight_map)
            absent = sorted(f"{name} (in {shard})" for name, shard in weight_map.items()
                            if name not in self._files[shard].shapes)
            if absent:
                raise CheckpointError(f"{index_path} places tensors in shards that do not hold them: "
                                      f"{absent[:5]}{' ...' if len(absent) > 5 else ''}")
        elif os.path.exists(single_path):
            self._files = {SINGLE_FILE: SafetensorsFile(single_path)}
            self._where = {name: SINGLE_FILE for name in self._files[SINGLE_FILE].shapes}
        else:
            raise FileNotFoundError(f"{folder} has neither {SINGLE_FILE} nor {INDEX_FILE}.")
        self.shapes: dict[str, tuple[int, ...]] = {}
        for shard, file in self._files.items():
            for name, shape in file.shapes.items():
                if self._where.get(name) == shard:
                    self.shapes[name] = shape

    def dtype(self, name: str) -> np.dtype:
        return self._files[self._where[name]].dtype(name)

    def read(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].read(name)

    def read_box(self, name: str, box: Sequence[slice] | None) -> np.ndarray:
        return self._files[self._where[name]].read_box(name, box)

    @property
    def nbytes(self) -> int:
        """Bytes of tensor data in the checkpoint."""
        return sum(math.prod(shape) * self.dtype(name).itemsize for name, shape in self.shapes.items())


def _read_weight_map(index_path: str) -> Mapping[str, str]:
    """The index's tensor name -> shard file map, refused unless it is one."""
    weight_map = read_json_object(index_path).get("weight_map")
    if weight_map is None:
        raise CheckpointError(f"{index_path}: no \"weight_map\" (the tensor name -> shard file map of a sharded "
                              "checkpoint)")
    if not (isinstance(weight_map, dict) and all(isinstance(v, str) for v in weight_map.values())):
        raise CheckpointError(f"{index_path}: \"weight_map\" must map tensor names to shard file names")
    return weight_map
