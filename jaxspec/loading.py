"""Converting a source checkpoint (an HF folder, a GGUF file, a catalogue name) into a `Model` handle.

`jaxspec.load` (jaxspec/api.py) picks between converting here and restoring a saved conversion (jaxspec/checkpoint.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.convert.errors import CheckpointError, read_json_object
from jaxspec.convert.rules import CheckpointMismatch

from .models.layers import abstract_module
from .registry import family_for
from .tokenizer import load_tokenizer


@dataclasses.dataclass
class Model:
    """What `generate` needs: the Flax module (params inside), its config, and the checkpoint's extras."""

    module: nnx.Module
    config: Any  # the family's frozen config dataclass
    hf_config: dict[str, Any]
    tokenizer: Any | None = None
    generation_config: dict[str, Any] = dataclasses.field(default_factory=dict)
    source: str = ""
    # (embedding it was made from, mesh, [D, V] copy): the CPU verify head of `jaxspec.head.verify_head`
    head_cache: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # (layer weights it was made from, their stack): the CPU layer stack of `jaxspec.layer_stack.layer_stack`
    layer_stack_cache: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)

    @property
    def dtype(self):
        return self.module.dtype

    def eos_token_ids(self) -> tuple[int, ...]:
        """EOS ids as HF resolves them: the generation config's, else the model config's."""
        eos = self.generation_config.get("eos_token_id", None)
        if eos is None:
            return tuple(self.config.eos_token_id)
        return tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)


def default_dtype() -> jnp.dtype:
    """float32 on CPU (XLA's CPU bf16 matmuls are many times slower), bfloat16 on accelerators."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def convert(path: str, dtype: Any, progress: bool = False, mesh=None, sharding_rules=None) -> Model:
    """Convert a source checkpoint (HF folder, `.gguf` file, catalogue name, hub id) into a `Model`.

    The conversion cache is neither read nor written here: `jaxspec.load`, `scripts/convert.py` and the cache call
    this. With a `mesh`, every param is created sharded on it by its logical axes (`sharding_rules`, default
    `ShardingRules()`), and each process reads only the slices its own devices hold (see `build_sharded_module`).
    """
    from . import catalog

    dtype = jnp.dtype(dtype)
    if catalog.is_catalog_name(path):
        path = catalog.resolve(path)
    elif not os.path.exists(path) and _looks_like_hub_id(path):
        path = _download_from_hub(path)
    if path.endswith(".gguf"):
        return _load_gguf(path, dtype, progress, mesh, sharding_rules)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"No checkpoint folder or .gguf file at {path!r}.")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path} has no config.json; jaxspec needs it to know the model's architecture.")
    hf_config = read_json_object(config_path)
    family, cfg = config_from_hf(hf_config, config_path)
    # The small files first: a damaged one is reported before the weights are read.
    generation_config = _read_json(os.path.join(path, "generation_config.json"))
    tokenizer = load_tokenizer(path)
    with _naming_checkpoint(path):
        source = open_safetensors(path, hf_config)
        cfg = _complete_config(family, cfg, source)
        module = _build(family, cfg, dtype, source, _progress_bar(path) if progress else None, mesh, sharding_rules)
    return Model(
        module=module,
        config=cfg,
        hf_config=hf_config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        source=path,
    )


def config_from_hf(hf_config: dict[str, Any], where: str):
    """(family, family config) for an HF config dict read from `where` (the config file, named in errors).

    The families' `from_hf_config` index the dict for the keys they require; a config that lacks one is a damaged or
    foreign file, reported here as one CheckpointError naming the file and the key rather than a bare KeyError.
    """
    family = family_for(hf_config, where)
    try:
        return family, family.config_from_hf(hf_config)
    except KeyError as error:
        key = error.args[0] if error.args else "?"
        raise CheckpointError(f"{where}: required key {key!r} is missing (model_type "
                              f"{hf_config.get('model_type')!r} needs it)") from None


@contextlib.contextmanager
def _naming_checkpoint(path: str):
    """Open a CheckpointMismatch from the converters (missing, extra or mis-shaped tensors, which they name) with
    the checkpoint it is about."""
    try:
        yield
    except CheckpointMismatch as error:
        raise CheckpointMismatch(f"{path}: {error}") from error


def _looks_like_hub_id(name: str) -> bool:
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "~"))


def _download_from_hub(repo_id: str) -> str:
    """A Hugging Face hub id: fetch its config, tokenizer and safetensors where a network exists."""
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer*", "*.model"])
    except Exception as error:  # the hub client raises many types for "no network"; all mean the same here
        raise FileNotFoundError(
            f"{repo_id!r} is not a local path or a catalogue name, and downloading it from the Hugging Face hub "
            f"failed ({type(error).__name__}: {error}). Offline, pass a local folder, a .gguf file, or one of the "
            "catalogue names in jaxspec.catalog.CATALOG."
        ) from error


def open_safetensors(folder: str, hf_config: dict[str, Any]):
    """The folder's tensors as a lazy source; FP8 block-scaled weights read dequantized (convert/fp8.py)."""
    from jaxspec.convert.fp8 import DequantizedSource, Fp8BlockQuantization
    from jaxspec.convert.safetensors_io import SafetensorsCheckpoint

    source = SafetensorsCheckpoint(folder)
    quantization = Fp8BlockQuantization.from_hf_config(hf_config, os.path.join(folder, "config.json"))
    return source if quantization is None else DequantizedSource(source, quantization)


def _complete_config(family, cfg, source):
    """The config as the checkpoint's tensors complete it, for families whose layout leaves a part optional that
    config.json does not mention (an EAGLE-3 head's own embedding: convert/eagle3.py `config_for_source`)."""
    complete = getattr(importlib.import_module(family.convert_module), "config_for_source", None)
    return cfg if complete is None else complete(cfg, source)


def _build(family, cfg, dtype, source, progress, mesh, sharding_rules) -> nnx.Module:
    if mesh is not None:
        return build_sharded_module(family, cfg, dtype, source, mesh, sharding_rules, progress)
    params = family.converter()(cfg, source, np.dtype(dtype), progress=progress)
    return build_module(family.model_cls(), cfg, dtype, params)


def build_sharded_module(family, cfg, dtype, source, mesh, sharding_rules=None, progress=None) -> nnx.Module:
    """The module with every param created sharded on `mesh` by its logical axes, straight from `source`.

    Families whose converter can plan (`plan_checkpoint`: DeepSeek-V3, GLM-4.5) read, in each process, only the
    boxes of each param that the process's own devices hold, and only the bytes of the HF tensors inside those
    boxes; a process never holds more than its own shards plus one box in flight, so the whole checkpoint never
    passes through one host. Other families (Llama, Qwen2, GGUF files) convert whole on every host first and then
    keep their slices, which suits models that fit one host. The module remembers the mesh (`place_on`), which
    turns on expert parallelism in MoE layers.
    """
    import itertools

    from .distributed import array_from_blocks
    from .sharding import ShardingRules, variable_sharding

    rules = sharding_rules or ShardingRules()
    graphdef, state = nnx.split(abstract_module(lambda: family.model_cls()(cfg, dtype=dtype)))
    planner = getattr(importlib.import_module(family.convert_module), "plan_checkpoint", None)
    if planner is not None:
        plan = planner(cfg, source, np.dtype(dtype))

        def read(path, box):
            (name,) = path
            return plan.read(source, name, box)
    else:
        params = family.converter()(cfg, source, np.dtype(dtype), progress=progress)

        def read(path, box):
            value = params
            for key in path:
                value = value[key]
            return np.asarray(value)[box]

    def is_variable(x):
        return isinstance(x, nnx.Variable)

    total, done = len(jax.tree.leaves(state, is_leaf=is_variable)), itertools.count(1)

    def place(path, variable):
        keys = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)  # e.g. ("we_gate",), ("layers", 0, "wq")
        value = variable.get_value()  # abstract: shape and declared dtype
        sharding = variable_sharding(variable, mesh, rules)
        array = array_from_blocks(value.shape, value.dtype, sharding, lambda box: read(keys, box))
        if progress and planner is not None:
            progress(next(done) - 1, total)
        return variable.replace(array)

    state = jax.tree_util.tree_map_with_path(place, state, is_leaf=is_variable)
    module = nnx.merge(graphdef, state)
    if hasattr(module, "place_on"):
        module.place_on(mesh, rules)
    return module


def build_module(model_cls, cfg, dtype, params: dict[str, np.ndarray]) -> nnx.Module:
    """Instantiate the module abstractly (no random init at real sizes), then fill in the converted params."""
    abstract = abstract_module(lambda: model_cls(cfg, dtype=dtype))
    graphdef, state = nnx.split(abstract)
    # Each param takes the dtype the module declares: most follow `dtype`, but some must stay float32
    # (e.g. the MoE router's score-correction bias, whose rounding would change expert choices).
    declared = nnx.to_pure_dict(state)
    pure = jax.tree.map(lambda value, spec: jnp.asarray(value, dtype=spec.dtype), params, declared)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


def _load_gguf(path: str, dtype, progress: bool, mesh=None, sharding_rules=None) -> Model:
    from jaxspec.convert.gguf import read_gguf

    ckpt = read_gguf(path)
    family, cfg = config_from_hf(ckpt.hf_config, path)
    source = _GGUFSource(ckpt)
    with _naming_checkpoint(path):
        module = _build(family, cfg, dtype, source, _progress_bar(path) if progress else None, mesh, sharding_rules)
    return Model(
        module=module,
        config=cfg,
        hf_config=ckpt.hf_config,
        tokenizer=ckpt.load_tokenizer(),
        generation_config=_generation_config_from(ckpt.hf_config),
        source=path,
    )


def _generation_config_from(hf_config: dict[str, Any]) -> dict[str, Any]:
    """What HF's `GenerationConfig.from_model_config` keeps of a config: its special token ids."""
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: hf_config[key] for key in keys if hf_config.get(key) is not None}


class _GGUFSource:
    """Adapts a GGUF checkpoint (already in HF names and layout) to the converter's tensor-source protocol."""

    def __init__(self, ckpt):
        self._ckpt = ckpt
        self.shapes = dict(ckpt.tensor_shapes)

    def read(self, name: str) -> np.ndarray:
        return self._ckpt.read_tensor(name)


def _read_json(path: str) -> dict[str, Any]:
    """The JSON object in an optional file (generation_config.json): {} when absent, an error naming it when
    damaged."""
    if not os.path.exists(path):
        return {}
    return read_json_object(path)


def _progress_bar(label: str):
    def report(step: int, total: int):
        if step % max(1, total // 20) == 0 or step == total - 1:
            print(f"\rconverting {os.path.basename(label)}: {step + 1}/{total} tensors", end="", flush=True)
            if step == total - 1:
                print()

    return report
