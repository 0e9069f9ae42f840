"""A fresh EAGLE-3 head for a Llama-family (Llama, Qwen2, Qwen3) or Gemma (2, 3, 4) target, its draft vocabulary, and
writing a trained head where `jaxspec.load`, vLLM and SGLang read it (`LlamaForCausalLMEagle3`, SpecForge's layout).

The head is built in that layout (models/eagle3.py): one Llama decoder layer of the target's width, head and MLP
sizes (the head embeds with the target's table, so its width is the target's), `fc` over the concatenated outputs of
three target layers, and a head over a draft vocabulary of V' target tokens. Its config is the config.json the export
writes, read back through `Eagle3Config.from_hf_config`, so a head that trains is exactly one that loads.

Initialisation, as `export.attach_mtp_layers` starts MTP layers (docs/design.md, 'MTP layers and training': there a
random input projection with a target layer copied whole started from drafts worse than uniform and trained to a
lower acceptance than the identity start):
- `fc` passes the deepest of the three tapped states through (an identity block there, zeros for the other two);
- the midlayer's attention output projection and MLP down projection are zero, so every entry's output starts as
  its input state; its q/k/v, gate and up projections are random (N(0, 0.02), the initializer_range SpecForge's heads
  start from), norms one;
- the final norm is the target's (a Gemma norm's unit offset folded into the weight: 1 + w) and the head's rows are
  the target's head rows of the draft tokens.
So the first drafts are the target's own head read at its deepest tapped layer, restricted to the draft vocabulary:
confident guesses of the token before the one drafted, whose KL starts high and falls fast, in the output space the
trained head needs. The midlayer is not copied from a target layer: its attention reads [emb, g], twice the target's
width, which no target matrix fits.

A Gemma target gets the same Llama-layout head: its attention shape is the target's sliding layers' (heads, kv
heads, head width, rope base), and it embeds with the target's raw table rows, unscaled, as every EAGLE-3 head does
(`strategies/eagle3.py draft_embedding`). A Gemma 2 target soft-caps its final logits; the head's initial drafts
are its uncapped logits, which rank the tokens the same way.

The draft vocabulary (`draft_vocabulary_for`): the V' tokens the training answers use most, in ascending id order,
as SpecForge's vocabulary mapping chooses it from its loss-bearing tokens; `d2t`/`t2d` encode it in the export.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
from flax import nnx

from jaxspec.convert.llama import layer_hf_tensors
from jaxspec.loading import Model, build_module
from jaxspec.models import int8 as I
from jaxspec.models.dflash import default_target_layer_ids
from jaxspec.models.eagle3 import EAGLE3, Eagle3Config, Eagle3Head

from .data import draft_vocabulary
from .dflash_data import BlockCorpus
from .export import draft_vocab_tensors, write_drafter_folder

INIT_STD = 0.02  # the random midlayer matrices' scale: transformers' initializer_range, SpecForge's heads' start


def default_head_layers(num_target_layers: int) -> tuple[int, ...]:
    """The three target layers a head reads by default: the ones a 3-layer DFlash drafter taps (z-lab's rule: 1, the
    middle and n-3; (1, 14, 27) for a 30-layer target), so that one cached target corpus
    (`dflash_data.generated_block_corpus`) serves both trainers. SpecForge's default, (1, n//2 - 1, n - 4)
    (`models.eagle3.default_layer_ids`), differs by one at the top layer; the export writes whichever it trained on
    into eagle_config.eagle_aux_hidden_state_layer_ids, which every loader reads."""
    ids = default_target_layer_ids(num_target_layers, 3)
    if len(set(ids)) != 3:
        raise ValueError(f"a {num_target_layers}-layer target has no three distinct default layers for an EAGLE-3 "
                         f"head ({list(ids)}); pass layer_ids.")
    return ids


def check_head_layers(target_cfg, layer_ids: Sequence[int]) -> tuple[int, ...]:
    """`layer_ids` as a tuple, or a ValueError: an EAGLE-3 head reads three distinct layers of the target, not its
    last one. vLLM and SGLang hand a head the inputs of decoder layers, so no engine has the last layer's raw output
    to give it (and the training corpus holds that layer final-normed, `dflash_data.target_taps`)."""
    layer_ids = tuple(int(layer) for layer in layer_ids)
    last = target_cfg.num_layers - 1
    if len(layer_ids) != 3 or len(set(layer_ids)) != 3 or not all(0 <= layer < last for layer in layer_ids):
        raise ValueError(f"an EAGLE-3 head reads three distinct target layers in 0..{last - 1} (the last layer, "
                         f"{last}, excluded: engines capture decoder layers' inputs); got {list(layer_ids)}.")
    return layer_ids


def answer_token_counts(corpus: BlockCorpus, vocab_size: int) -> np.ndarray:
    """How often each token id occurs in the corpus's answers (positions starts..length-1, the tokens a head
    drafts; prompts excluded, as SpecForge counts loss-bearing tokens only): [V]."""
    positions = np.arange(corpus.tokens.shape[1])[None, :]
    answer = (positions >= corpus.starts[:, None]) & (positions < corpus.lengths[:, None])
    return np.bincount(np.asarray(corpus.tokens)[answer], minlength=vocab_size)


def draft_vocabulary_for(corpus: BlockCorpus, size: int, vocab_size: int) -> np.ndarray:
    """The `size` token ids the corpus's answers use most (ties by id), ascending: [V']. All ids when `size` is at
    least the vocabulary."""
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ValueError(f"the draft vocabulary size must be an integer >= 1, got {size!r}.")
    return draft_vocabulary(answer_token_counts(corpus, vocab_size), min(int(size), vocab_size))


def vocabulary_digest(ids: np.ndarray) -> str:
    """The sha256 of a draft vocabulary's ids as int32 bytes: what training.json records, so two drafters' vocabularies
    can be compared without their weights."""
    return hashlib.sha256(np.asarray(ids, np.int32).tobytes()).hexdigest()


def vocabulary_coverage(corpus: BlockCorpus, draft_ids: np.ndarray, vocab_size: int) -> float:
    """The share of the corpus's answer tokens that are in the draft vocabulary: the best greedy acceptance a head
    over it can reach."""
    counts = answer_token_counts(corpus, vocab_size)
    return float(counts[np.asarray(draft_ids)].sum() / max(counts.sum(), 1))


def new_eagle3_head(target, draft_vocab: Sequence[int] | None = None, *, layer_ids: Sequence[int] | None = None,
                    seed: int = 0) -> Model:
    """A fresh EAGLE-3 head (module docstring) for `target`, a Llama, Qwen2, Qwen3 or Gemma `jaxspec.Model`.

    draft_vocab: the target token ids of the draft vocabulary, distinct and ascending (`draft_vocabulary_for`;
    default: the whole vocabulary). layer_ids: the three target layers whose outputs fc reads, in order (default:
    `default_head_layers`). Arguments are checked before anything is built."""
    cfg = target.config
    if type(cfg).__name__ not in ("LlamaConfig", "GemmaConfig"):
        raise NotImplementedError(f"fresh EAGLE-3 heads are built for Llama, Qwen2, Qwen3 and Gemma targets; "
                                  f"{type(target.module).__name__} is not one.")
    layer_ids = default_head_layers(cfg.num_layers) if layer_ids is None else check_head_layers(cfg, layer_ids)
    ids = np.arange(cfg.vocab_size) if draft_vocab is None else np.asarray(draft_vocab)
    if (ids.ndim != 1 or not len(ids) or not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0
            or ids.max() >= cfg.vocab_size or np.any(np.diff(ids) <= 0)):
        raise ValueError(f"draft_vocab must be distinct token ids in 0..{cfg.vocab_size - 1}, in ascending order.")
    if any(isinstance(I.weight(target.module, name), I.Int8Weight) for name in ("embed", "lm_head")
           if hasattr(target.module, name)):
        raise ValueError("a fresh head copies the target's head rows, which must not be quantized; train against the "
                         "float target (jaxspec.load without jaxspec.quantize).")
    hf_config = head_config(cfg, len(ids), layer_ids)
    head_cfg = Eagle3Config.from_hf_config(hf_config)
    head_cfg.check_target(cfg)
    params = initial_params(target, head_cfg, layer_ids, ids.astype(np.int32), seed)
    module = build_module(Eagle3Head, head_cfg, target.dtype, params)
    return Model(module=module, config=head_cfg, hf_config=hf_config)


def attention_shape(target_cfg) -> dict[str, Any]:
    """The head's attention for a target config: a Llama-family target's own; a Gemma target's sliding layers'."""
    if type(target_cfg).__name__ == "GemmaConfig":
        kind = target_cfg.sliding
        return {"num_heads": target_cfg.num_heads, "num_kv_heads": kind.num_kv_heads, "head_dim": kind.head_dim,
                "rope_theta": kind.rope.theta, "rope_llama3": None}
    return {"num_heads": target_cfg.num_heads, "num_kv_heads": target_cfg.num_kv_heads,
            "head_dim": target_cfg.head_dim, "rope_theta": target_cfg.rope_theta,
            "rope_llama3": target_cfg.rope_llama3}


def head_config(target_cfg, draft_vocab_size: int, layer_ids: Sequence[int]) -> dict[str, Any]:
    """The config.json of a head for a Llama-family or Gemma target: a one-layer Llama config with the EAGLE-3 keys.
    Rope is written as `rope_theta` (and `rope_scaling` for llama3), the keys vLLM, SGLang and transformers 5 all
    read."""
    eos = list(target_cfg.eos_token_id)
    shape = attention_shape(target_cfg)
    config = {
        "architectures": [EAGLE3],
        "model_type": "llama",
        "hidden_size": target_cfg.hidden_size,
        "intermediate_size": target_cfg.intermediate_size,
        "num_hidden_layers": 1,
        "num_attention_heads": shape["num_heads"],
        "num_key_value_heads": shape["num_kv_heads"],
        "head_dim": shape["head_dim"],
        "hidden_act": "silu",
        "rms_norm_eps": target_cfg.rms_norm_eps,
        "rope_theta": shape["rope_theta"],
        "max_position_embeddings": target_cfg.max_position_embeddings,
        "vocab_size": target_cfg.vocab_size,
        "draft_vocab_size": int(draft_vocab_size),
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": target_cfg.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": target_cfg.pad_token_id,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(layer_ids), "use_aux_hidden_state": True},
    }
    if shape["rope_llama3"] is not None:
        factor, low, high, original = shape["rope_llama3"]
        config["rope_scaling"] = {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                                  "high_freq_factor": high, "original_max_position_embeddings": original}
    return config


def initial_params(target, cfg: Eagle3Config, layer_ids: Sequence[int], draft_ids: np.ndarray,
                   seed: int) -> dict[str, np.ndarray]:
    """The head's params as a pure dict, made from the target's (module docstring)."""
    d, d_t, f = cfg.hidden_size, cfg.target_hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(seed)

    def random(*shape: int) -> np.ndarray:
        return (INIT_STD * rng.standard_normal(shape)).astype(np.float32)

    fc = np.zeros((3 * d_t, d), np.float32)  # [3 D_t, D]
    deepest = int(np.argmax(layer_ids))
    fc[deepest * d_t: (deepest + 1) * d_t] = np.eye(d_t, d, dtype=np.float32)
    head_rows = np.asarray(target.module.head_matrix(), np.float32)[:, draft_ids]  # [D, V']
    return {
        "fc": fc,
        "input_norm": np.ones(d, np.float32), "hidden_norm": np.ones(d, np.float32),
        "wq": random(2 * d, cfg.num_heads, cfg.head_dim), "wk": random(2 * d, cfg.num_kv_heads, cfg.head_dim),
        "wv": random(2 * d, cfg.num_kv_heads, cfg.head_dim),
        "wo": np.zeros((cfg.num_heads, cfg.head_dim, d), np.float32),
        "mlp_norm": np.ones(d, np.float32), "w_gate": random(d, f), "w_up": random(d, f),
        "w_down": np.zeros((f, d), np.float32),
        # Gemma norms scale by offset + w (its unit offset), the head's Llama norm by w alone.
        "final_norm": (np.asarray(target.module.final_norm[...], np.float32)
                       + getattr(target.config, "norm_offset", 0.0)),
        "lm_head": head_rows,
        "vocab_ids": draft_ids.astype(np.int32),
    }


# ----------------------------------------------------------------------------------------------------------------
# Export


def eagle3_hf_tensors(cfg: Eagle3Config, params: dict[str, Any], dtype=ml_dtypes.bfloat16) -> dict[str, np.ndarray]:
    """The inverse of convert/eagle3.py: the module's pure dict -> the tensors of SpecForge's layout, the weights in
    `dtype`; `d2t` (int64: draft id d is token d + d2t[d]) and `t2d` (bool [V]: the draft tokens) as they are."""
    d = cfg.hidden_size
    weights = {"fc.weight": np.asarray(params["fc"]).T,
               "midlayer.input_layernorm.weight": np.asarray(params["input_norm"]),
               "midlayer.hidden_norm.weight": np.asarray(params["hidden_norm"]),
               "norm.weight": np.asarray(params["final_norm"]),
               "lm_head.weight": np.asarray(params["lm_head"]).T}
    weights |= layer_hf_tensors({name: params[name] for name in ("wq", "wk", "wv")}, 2 * d, "midlayer.")
    weights |= layer_hf_tensors({name: params[name] for name in ("wo", "mlp_norm", "w_gate", "w_up", "w_down")}, d,
                                "midlayer.")
    for index, norm in enumerate(np.asarray(params["fc_norm"]) if "fc_norm" in params else ()):
        weights[f"fc_norm.{index}.weight"] = norm
    if "embed" in params:  # only a head with a table of its own; most share the target's
        weights["embed_tokens.weight"] = np.asarray(params["embed"])
    out = {name: np.ascontiguousarray(value.astype(dtype)) for name, value in weights.items()}
    return out | draft_vocab_tensors(params["vocab_ids"], cfg.vocab_size)


def save_eagle3_head(head: Model, folder: str, dtype=ml_dtypes.bfloat16, training: dict[str, Any] | None = None) -> str:
    """Write `head` in SpecForge's `LlamaForCausalLMEagle3` layout, atomically (config.json, model.safetensors with
    the weights in `dtype`, and `training` as training.json when given); return the folder. `jaxspec.load(folder)`
    reads it as an `assistant_model`, and so do vLLM, SGLang and SpecForge's `from_pretrained`."""
    if not isinstance(head.module, Eagle3Head):
        raise TypeError(f"save_eagle3_head writes EAGLE-3 heads; got a {type(head.module).__name__}.")
    params = nnx.to_pure_dict(nnx.state(head.module))
    tensors = eagle3_hf_tensors(head.config, params, dtype)
    config = head.hf_config | {"dtype": np.dtype(dtype).name}
    return write_drafter_folder(folder, tensors, config, training)
