"""A fresh DFlash drafter for a Llama-family target (Llama, Qwen2, Qwen3), and writing a trained one where
`jaxspec.load` and z-lab's `DFlashDraftModel` read it.

The drafter is built in z-lab's layout (models/dflash.py): a Qwen3-style decoder of the target's width, head and
MLP sizes, with `fc` over the concatenated taps of `target_layer_ids`, `hidden_norm`, and no embedding or head of
its own (the target's are used). Its config is the config.json the export writes, read back through
`DFlashConfig.from_hf_config`, so a drafter that trains is exactly one that loads.

Initialisation, so that training starts from a network that already computes something of the target's: each
drafter layer is a copy of one of the target's last layers (the ones that turn late features into next-token
predictions; q/k norms start at one where the target has none, biases at zero where it has none), the final norm
is the target's, and `fc` averages the tapped layers (n identity blocks divided by n), so the context starts as the
normed mean of the target's own states.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from jaxspec.convert.llama import layer_hf_tensors
from jaxspec.loading import Model, build_module
from jaxspec.models import int8 as I
from jaxspec.models.dflash import DFLASH, DFlashConfig, DFlashDrafter, default_target_layer_ids, layer_param_shapes

from .dflash_data import check_layer_ids
from .export import draft_vocab_tensors, write_drafter_folder



def new_dflash_drafter(target, num_layers: int, block_size: int = 16, *,
                       target_layer_ids: Sequence[int] | None = None, mask_token_id: int | None = None,
                       init_layers: Sequence[int] | None = None) -> Model:
    """A fresh DFlash drafter (z-lab's layout) for `target`, a Llama, Qwen2 or Qwen3 `jaxspec.Model`.

    num_layers: drafter layers. block_size: W, the bonus token and W-1 mask tokens (W-1 drafts a round).
    target_layer_ids: the target layers whose outputs form the context, in order (default: z-lab's rule,
    `default_target_layer_ids`, one per drafter layer). mask_token_id: the id of the block's mask token (default:
    the tokenizer's mask token if it has one, else the last id of the vocabulary; DFlash drafters use a dedicated
    token, so for a target without one pick a rarely used id, e.g. `dflash_data.rarest_token`). init_layers: the
    target layers copied into the drafter's (default: its last `num_layers`). Arguments are checked before anything
    is built."""
    cfg = target.config
    if type(cfg).__name__ != "LlamaConfig":
        raise NotImplementedError(f"fresh DFlash drafters are built for Llama, Qwen2 and Qwen3 targets; "
                                  f"{type(target.module).__name__} is not one.")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}.")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 2:
        raise ValueError(f"block_size must be an integer >= 2 (the bonus token and at least one mask token), got "
                         f"{block_size!r}.")
    layer_ids = (default_target_layer_ids(cfg.num_layers, num_layers) if target_layer_ids is None
                 else check_layer_ids(cfg, target_layer_ids))
    mask_token_id = _mask_token(target) if mask_token_id is None else mask_token_id
    if isinstance(mask_token_id, bool) or not isinstance(mask_token_id, (int, np.integer)) \
            or not 0 <= mask_token_id < cfg.vocab_size:
        raise ValueError(f"mask_token_id must be a token id in 0..{cfg.vocab_size - 1}, got {mask_token_id!r}.")
    if init_layers is None:  # the last num_layers (layer 0 repeated first, for a drafter deeper than the target)
        init_layers = tuple(max(cfg.num_layers - num_layers + i, 0) for i in range(num_layers))
    init_layers = tuple(init_layers)
    if len(init_layers) != num_layers or not all(0 <= layer < cfg.num_layers for layer in init_layers):
        raise ValueError(f"init_layers must name {num_layers} target layers in 0..{cfg.num_layers - 1}, got "
                         f"{list(init_layers)}.")
    hf_config = drafter_config(cfg, num_layers, block_size, layer_ids, int(mask_token_id))
    drafter_cfg = DFlashConfig.from_hf_config(hf_config)
    drafter_cfg.check_target(cfg)
    params = initial_params(target, drafter_cfg, init_layers)
    module = build_module(DFlashDrafter, drafter_cfg, target.dtype, params)
    return Model(module=module, config=drafter_cfg, hf_config=hf_config)


def drafter_config(target_cfg, num_layers: int, block_size: int, layer_ids: Sequence[int],
                   mask_token_id: int) -> dict[str, Any]:
    """The config.json of a drafter for a Llama-family target, in z-lab's layout (a Qwen3 config with
    `architectures: ["DFlashDraftModel"]` and the DFlash settings in `dflash_config`). Every layer attends fully:
    without `use_sliding_window` there are no sliding layers, so the block sees all of itself (bidirectional)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": target_cfg.rope_theta}
    if target_cfg.rope_llama3 is not None:
        factor, low, high, original = target_cfg.rope_llama3
        rope = {"rope_type": "llama3", "rope_theta": target_cfg.rope_theta, "factor": factor,
                "low_freq_factor": low, "high_freq_factor": high, "original_max_position_embeddings": original}
    eos = list(target_cfg.eos_token_id)
    return {
        "architectures": [DFLASH],
        "model_type": "qwen3",
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": target_cfg.num_heads,
        "num_key_value_heads": target_cfg.num_kv_heads,
        "head_dim": target_cfg.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_parameters": rope,
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size,
        "attention_bias": bool(target_cfg.qkv_bias or target_cfg.o_bias),
        "use_sliding_window": False,
        "tie_word_embeddings": False,
        "num_target_layers": target_cfg.num_layers,
        "bos_token_id": target_cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": target_cfg.pad_token_id,
        "dflash_config": {"block_size": block_size, "mask_token_id": mask_token_id,
                          "target_layer_ids": list(layer_ids)},
    }


def initial_params(target, drafter_cfg: DFlashConfig, init_layers: Sequence[int]) -> dict[str, Any]:
    """The drafter's params as a pure dict (`fc`, `hidden_norm`, `final_norm`, `layers: {i: {...}}`), made from the
    target's (module docstring)."""
    d, n = drafter_cfg.hidden_size, len(drafter_cfg.target_layer_ids)
    shapes = layer_param_shapes(drafter_cfg)
    layers = {}
    for index, source in enumerate(init_layers):
        copied = {name: I.logical(value) for name, value in target.module.layers[source].params().items()}
        if not all(isinstance(value, jax.Array) for value in copied.values()):  # int8 weights are not
            raise ValueError("fresh drafters copy the target's layers, which must not be quantized; train against "
                             "the float target (jaxspec.load without jaxspec.quantize).")
        layer = {}
        for name, shape in shapes.items():
            if name in copied:
                layer[name] = np.asarray(copied[name], np.float32)
            else:  # q/k norms a Llama or Qwen2 target lacks (one), biases it lacks (zero)
                layer[name] = np.ones(shape, np.float32) if "norm" in name else np.zeros(shape, np.float32)
            if layer[name].shape != shape:
                raise ValueError(f"target layer {source}'s {name} has shape {layer[name].shape}, the drafter's "
                                 f"{shape}.")
        layers[index] = layer
    fc = np.tile(np.eye(d, dtype=np.float32), (n, 1)) / n  # [n*D, D]: the mean of the tapped states
    final_norm = np.asarray(target.module.final_norm[...], np.float32)
    return {"fc": fc, "hidden_norm": np.ones(d, np.float32), "final_norm": final_norm, "layers": layers}


def _mask_token(target) -> int:
    """The tokenizer's mask token where it has one inside the vocabulary, else the vocabulary's last id."""
    vocab = target.config.vocab_size
    mask = getattr(target.tokenizer, "mask_token_id", None) if target.tokenizer is not None else None
    return int(mask) if isinstance(mask, int) and 0 <= mask < vocab else vocab - 1


def with_drafter_state(drafter: Model, state) -> Model:
    """A copy of `drafter` holding the params `state` (an nnx state of its module, e.g. what training returns)."""
    graphdef, current = nnx.split(drafter.module)
    nnx.replace_by_pure_dict(current, nnx.to_pure_dict(state))
    return dataclasses.replace(drafter, module=nnx.merge(graphdef, current))


# ----------------------------------------------------------------------------------------------------------------
# Export


def with_draft_vocab(drafter: Model, ids: Sequence[int] | None) -> Model:
    """A copy of `drafter` whose drafts come from the target's head over token ids `ids` only (distinct, ascending,
    inside the drafter's vocabulary: `draft_vocabulary_for`), or over every token with None. The weights are shared.
    The ids are not trained; a drafter given them before `train_dflash` is trained to draft over them
    (models/dflash.py and dflash_losses, module docstrings)."""
    vocab = drafter.config.vocab_size  # None for transformers' layout, whose config does not say
    hf_config = {key: value for key, value in drafter.hf_config.items() if key != "draft_vocab_size"}
    params = {key: value for key, value in nnx.to_pure_dict(nnx.state(drafter.module)).items() if key != "vocab_ids"}
    if ids is not None:
        ids = np.asarray(ids)
        limit = np.inf if vocab is None else vocab
        if ids.ndim != 1 or not len(ids) or ids.min() < 0 or ids.max() >= limit or np.any(np.diff(ids) <= 0):
            raise ValueError(f"a draft vocabulary is distinct token ids in 0..{limit - 1}, ascending; got {len(ids)} "
                             "ids that are not.")
        hf_config["draft_vocab_size"] = int(len(ids))
        params["vocab_ids"] = ids.astype(np.int32)
    new_cfg = DFlashConfig.from_hf_config(hf_config)
    module = build_module(DFlashDrafter, new_cfg, drafter.module.dtype, params)
    return dataclasses.replace(drafter, module=module, config=new_cfg, hf_config=hf_config)


def dflash_hf_tensors(cfg: DFlashConfig, params: dict[str, Any], dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """The inverse of convert/dflash.py for z-lab's layout: the module's pure dict -> HF tensor names and layouts
    (`fc.weight` [D, n*D], `hidden_norm.weight`, `norm.weight`, `layers.{i}.*` with Qwen3's names), and a draft
    vocabulary's `d2t` / `t2d` where the drafter has one."""
    out = {"fc.weight": np.asarray(params["fc"]).T, "hidden_norm.weight": np.asarray(params["hidden_norm"]),
           "norm.weight": np.asarray(params["final_norm"])}
    for index, layer in params["layers"].items():
        out |= layer_hf_tensors(layer, cfg.hidden_size, f"layers.{int(index)}.")
    out = {name: np.ascontiguousarray(value.astype(dtype)) for name, value in out.items()}
    return out | (draft_vocab_tensors(params["vocab_ids"], cfg.vocab_size) if "vocab_ids" in params else {})


def save_dflash_drafter(drafter: Model, folder: str, dtype=ml_dtypes.bfloat16,
                        training: dict[str, Any] | None = None) -> str:
    """Write `drafter` as a z-lab `DFlashDraftModel` folder, atomically (config.json, model.safetensors in
    `dtype`, and `training` as training.json when given); return the folder. `jaxspec.load(folder)` reads it as an
    `assistant_model`, and so does z-lab's `DFlashDraftModel.from_pretrained`."""
    if drafter.config.layout != DFLASH:
        raise NotImplementedError(f"drafters are written in z-lab's {DFLASH} layout; this one is "
                                  f"{drafter.config.layout!r}.")
    params = nnx.to_pure_dict(nnx.state(drafter.module))
    tensors = dflash_hf_tensors(drafter.config, params, dtype)
    config = drafter.hf_config | {"dtype": np.dtype(dtype).name}
    return write_drafter_folder(folder, tensors, config, training)
