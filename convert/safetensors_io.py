"""Lazy safetensors reading without torch: parse the header, memory-map the file, read one tensor at a time.

safetensors' own numpy binding has no bfloat16, which is how most checkpoints ship; the format is simple enough
(8-byte header length, JSON header, raw little-endian bytes) that reading it directly with ml_dtypes is the
smallest dependable path.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import ml_dtypes
import numpy as np

_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class SafetensorsFile:
    """One .safetensors file: tensor shapes from its header, tensors read on demand from a memory map."""

    def __init__(self, path: str):
        self.path = path
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(header_len))
        header.pop("__metadata__", None)
        self._entries = header
        self._data_start = 8 + header_len
        self._mmap: np.memmap | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: tuple(e["shape"]) for name, e in self._entries.items()}

    def read(self, name: str) -> np.ndarray:
        entry = self._entries[name]
        if entry["dtype"] not in _DTYPES:
            raise NotImplementedError(f"{self.path}: tensor {name} has dtype {entry['dtype']}, which jaxspec cannot read.")
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        begin, end = entry["data_offsets"]
        raw = self._mmap[self._data_start + begin : self._data_start + end]
        return raw.view(_DTYPES[entry["dtype"]]).reshape(entry["shape"])


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

    def read(self, name: str) -> np.ndarray:
        return self._files[self._where[name]].read(name)
