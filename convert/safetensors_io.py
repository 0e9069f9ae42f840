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
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + header_len
        self._fd: int | None = None

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            os.close(self._fd)

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
            with open(index_path) as f:
                weight_map: Mapping[str, str] = json.load(f)["weight_map"]
            shard_names = sorted(set(weight_map.values()))
            missing = [s for s in shard_names if not os.path.exists(os.path.join(folder, s))]
            if missing:
                raise FileNotFoundError(f"{index_path} names shard files that are not in {folder}: {missing}")
            self._files = {s: SafetensorsFile(os.path.join(folder, s)) for s in shard_names}
            self._where = dict(weight_map)
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
