"""Trained drafters shipped inside the package (MTP layers, a DFlash drafter), and how a loaded model gets them.

An asset is a folder here with `config.json` (the keys it adds to the model's config: `num_nextn_predict_layers`,
`draft_vocab_size`, optionally `mtp_num_assistant_tokens`, the draft length `use_mtp` uses when `generate` is given
none, and `base`, the catalogue entry it was trained for) and `model.safetensors` holding only the MTP
tensors, in the layout of an HF checkpoint with MTP layers (`model.layers.{N + k}.*`, DeepSeek-V3's names, and
`model.draft_vocab`). A catalogue entry names its asset (`CatalogEntry.mtp_asset`); loading that entry attaches it
(`attach_mtp_asset`). The target's own weights are untouched, so plain decoding is unaffected.

A DFlash drafter shipped here (`CatalogEntry.drafter_assets`) is a checkpoint of its own, in z-lab's `DFlashDraftModel`
layout (config.json, model.safetensors, training.json with its recipe and held-out acceptance): `jaxspec.load` takes
its folder's name, and `--strategy dflash` drafts with it when no `--assistant` is given.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
from typing import Any

import jax.numpy as jnp
from flax import nnx

ASSETS_DIR = os.path.dirname(os.path.abspath(__file__))
MTP_FILE = "model.safetensors"
CONFIG_KEYS = ("num_nextn_predict_layers", "draft_vocab_size", "mtp_num_assistant_tokens")


def asset_folder(name: str) -> str:
    return os.path.join(ASSETS_DIR, name)


def read_asset_config(folder: str) -> dict[str, Any]:
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as handle:
        return json.load(handle)


def attach_mtp_asset(model, folder: str):
    """`model` (a `jaxspec.Model`) with the MTP layers stored in `folder` attached, at the model's dtype."""
    from jaxspec.convert.safetensors_io import SafetensorsFile
    from jaxspec.registry import family_for

    config = read_asset_config(folder)
    hf_config = model.hf_config | {key: config[key] for key in CONFIG_KEYS if key in config}
    family = family_for(hf_config, os.path.join(folder, "config.json"))
    cfg = family.config_from_hf(hf_config)
    convert_mtp_layers = getattr(importlib.import_module(family.convert_module), "convert_mtp_layers", None)
    if convert_mtp_layers is None:
        raise NotImplementedError(f"attaching MTP layers to a {hf_config.get('model_type')} model is not supported.")
    params = convert_mtp_layers(cfg, SafetensorsFile(os.path.join(folder, MTP_FILE)), jnp.dtype(model.dtype))
    return with_params(model, hf_config, params)


def with_params(model, hf_config: dict[str, Any], new_params: dict[str, Any]):
    """A copy of `model` whose module is built from `hf_config` (its family's config reader), holding the model's
    params plus `new_params` (a pure dict of params the new config adds or replaces, e.g. `mtp_layers`)."""
    return _rebuild(model, hf_config, _merge(_pure_params(model.module), new_params))


def strip_mtp(model):
    """`model` without MTP layers or draft vocabulary (the target alone); unchanged if it has none."""
    return _without(model, ("num_nextn_predict_layers", "num_mtp_layers", "draft_vocab_size"),
                    ("mtp_layers", "draft_vocab"))


def strip_draft_vocab(model):
    """`model` drafting with the full head: its draft vocabulary removed (to measure what the vocabulary buys)."""
    return _without(model, ("draft_vocab_size",), ("draft_vocab",))


def _without(model, config_keys, param_names):
    params = _pure_params(model.module)
    if not any(name in params for name in param_names):
        return model
    hf_config = {key: value for key, value in model.hf_config.items() if key not in config_keys}
    return _rebuild(model, hf_config, {k: v for k, v in params.items() if k not in param_names})


def _rebuild(model, hf_config: dict[str, Any], params: dict[str, Any]):
    from jaxspec.loading import build_module
    from jaxspec.registry import family_for

    family = family_for(hf_config, model.source or "model")
    cfg = family.config_from_hf(hf_config)
    from jaxspec.layout import use_cpu_layout

    module = build_module(family.model_cls(), cfg, jnp.dtype(model.dtype), params)
    return use_cpu_layout(dataclasses.replace(model, module=module, config=cfg, hf_config=hf_config))


def _pure_params(module: nnx.Module) -> dict[str, Any]:
    from jaxspec.layout import standard_layout

    return nnx.to_pure_dict(standard_layout(nnx.state(module)))  # the layout build_module fills


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for key, value in update.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out
