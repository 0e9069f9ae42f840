"""Attaching fresh MTP layers to a target, and writing trained ones where `jaxspec.load` finds them.

Two outputs, both read by `use_mtp=True`:
- a jaxspec conversion folder of the whole model (`jaxspec.checkpoint.save`): its config.json has
  `num_nextn_predict_layers`, so `jaxspec.load(folder)` restores the MTP layers with the target;
- an MTP asset (`save_mtp_asset`): only the MTP tensors, in the HF layout (`model.layers.{N + k}.*`, DeepSeek-V3's
  names) as a safetensors file, plus the config keys they need; `jaxspec.assets.attach_mtp_asset` attaches it to a
  loaded target. This is how trained layers ship for a catalogue model whose weights come from elsewhere.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import struct
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxspec.assets import CONFIG_KEYS, MTP_FILE, with_params
from jaxspec.checkpoint import atomic_folder
from jaxspec.models import int8 as I
from jaxspec.registry import family_for

_SAFETENSORS_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
    np.dtype(np.bool_): "BOOL",  # an EAGLE-3 head's t2d
}


def attach_mtp_layers(model, num_layers: int, draft_vocab: np.ndarray | None = None, seed: int = 0,
                      init_layer: int | None = None, eh_proj_std: float = 0.02):
    """`model` (a Llama-family `jaxspec.Model` without MTP layers) with `num_layers` fresh MTP layers attached.

    Every layer starts as the identity on the previous state: eh_proj passes hnorm(h) through unchanged (its token
    half is small and random, N(0, eh_proj_std)), and the decoder block, a copy of the target's layer `init_layer`
    (default: the middle one), has its two residual branches' output projections (wo, w_down) zeroed. So the first
    drafts come from the head over the previous state, and training grows the token's contribution and the block
    from there. A random eh_proj with the last layer copied whole starts from drafts worse than uniform and trains
    to a lower acceptance (see docs/design.md, 'MTP layers and training'). `draft_vocab` (token ids) gives the
    drafts a reduced head over those tokens.
    """
    cfg = model.config
    if cfg.__class__.__name__ != "LlamaConfig":
        raise NotImplementedError(f"attaching new MTP layers to a {type(model.module).__name__} is not supported; "
                                  "DeepSeek-V3 and GLM-4.5 checkpoints bring their own, which train as they are.")
    if getattr(cfg, "num_mtp_layers", 0):
        raise ValueError(f"the model already has {cfg.num_mtp_layers} MTP layer(s); train them as they are.")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}.")
    init_layer = cfg.num_layers // 2 if init_layer is None else init_layer
    if not 0 <= init_layer < cfg.num_layers:
        raise ValueError(f"init_layer must be in 0..{cfg.num_layers - 1}, got {init_layer}.")
    block = {name: np.asarray(I.logical(value)) for name, value in model.module.layers[init_layer].params().items()}
    block["wo"], block["w_down"] = np.zeros_like(block["wo"]), np.zeros_like(block["w_down"])
    d = cfg.hidden_size
    rng = np.random.default_rng(seed)
    layers = {}
    for depth in range(num_layers):
        eh_proj = np.concatenate([eh_proj_std * rng.standard_normal((d, d)), np.eye(d)]).astype(np.float32)
        layers[depth] = block | {"enorm": np.ones(d, np.float32), "hnorm": np.ones(d, np.float32),
                                 "eh_proj": eh_proj, "out_norm": np.ones(d, np.float32)}
    hf_config = model.hf_config | {"num_nextn_predict_layers": num_layers}
    new_params: dict[str, Any] = {"mtp_layers": layers}
    if draft_vocab is not None:
        hf_config["draft_vocab_size"] = int(len(draft_vocab))
        new_params["draft_vocab"] = np.asarray(draft_vocab, np.int32)
    return with_params(model, hf_config, new_params)


def with_trained(model, trainable_state):
    """A copy of `model` whose MTP parameters are `trainable_state` (see `jaxspec.train.step.split_trainable`)."""
    graphdef, state = nnx.split(model.module)
    nnx.replace_by_pure_dict(state, nnx.to_pure_dict(trainable_state))
    return dataclasses.replace(model, module=nnx.merge(graphdef, state))


def save_mtp_asset(model, folder: str, dtype=ml_dtypes.bfloat16, extra_config: dict | None = None) -> str:
    """Write the model's MTP layers (and draft vocabulary) as an asset folder, atomically; return the folder."""
    cfg = model.config
    convert = importlib.import_module(family_for(model.hf_config, model.source or "model").convert_module)
    if not hasattr(convert, "mtp_hf_tensors"):
        raise NotImplementedError(f"{type(model.module).__name__} MTP layers cannot be written as an asset yet; "
                                  "save the whole model with jaxspec.checkpoint.save instead.")
    params = nnx.to_pure_dict(nnx.state(model.module))
    layers = jax.tree.map(lambda x: np.asarray(x).astype(dtype), params["mtp_layers"])
    vocab = np.asarray(params["draft_vocab"]) if "draft_vocab" in params else None
    tensors = convert.mtp_hf_tensors(cfg, layers, vocab)
    config = {key: model.hf_config[key] for key in CONFIG_KEYS if key in model.hf_config} | (extra_config or {})
    folder = os.path.abspath(folder)
    with atomic_folder(folder) as tmp:
        write_safetensors(os.path.join(tmp, MTP_FILE), tensors)
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as handle:
            json.dump(config, handle, indent=2, sort_keys=True)
            handle.write("\n")
    return folder


WEIGHTS_FILE = "model.safetensors"
TRAINING_FILE = "training.json"  # what a drafter was trained on and how well it drafts (not read by loaders)


def write_drafter_folder(folder: str, tensors: dict[str, np.ndarray], config: dict[str, Any],
                         training: dict[str, Any] | None = None) -> str:
    """A drafter checkpoint folder, written atomically: config.json, model.safetensors (`tensors`) and, when given,
    training.json. -> the folder's absolute path."""
    folder = os.path.abspath(folder)
    with atomic_folder(folder) as tmp:
        write_safetensors(os.path.join(tmp, WEIGHTS_FILE), tensors)
        _write_json(os.path.join(tmp, "config.json"), config)
        if training is not None:
            _write_json(os.path.join(tmp, TRAINING_FILE), training)
    return folder


def draft_vocab_tensors(ids: np.ndarray, vocab_size: int) -> dict[str, np.ndarray]:
    """A draft vocabulary's token ids [V'] (ascending) as EAGLE-3 heads store them (convert/rules.py
    `take_vocab_ids` reads them back): `d2t` int64 [V'] (draft id d is token d + d2t[d]) and `t2d` bool [V]."""
    ids = np.asarray(ids, np.int64)
    t2d = np.zeros(vocab_size, np.bool_)
    t2d[ids] = True
    return {"d2t": ids - np.arange(len(ids), dtype=np.int64), "t2d": t2d}


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(data, handle, indent=2, sort_keys=True)
        handle.write("\n")


def write_safetensors(path: str, tensors: dict[str, np.ndarray]) -> None:
    """The safetensors format without torch: an 8-byte header length, a JSON header, then the raw little-endian
    bytes of each tensor in header order (safetensors' numpy binding has no bfloat16)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        value = np.ascontiguousarray(tensors[name])
        blob = value.astype(value.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": _SAFETENSORS_DTYPES[value.dtype], "shape": list(value.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)
