"""Converted checkpoints: a `Model` saved as an orbax checkpoint of Flax params, restored without converting again.

Converting dequantizes GGUF blocks or reads safetensors and re-lays every tensor out; restoring a saved conversion
only reads arrays that already have the module's shapes and dtypes. A conversion folder holds:

    config.json             the HF config dict the module was built from
    jaxspec.json            the marker: format version, dtype, source, jaxspec version, the size of every file
                            under params/ (written last)
    params/                 orbax checkpoint of `nnx.to_pure_dict` of the module's params
    tokenizer files         `tokenizer.save_pretrained`, when the model has a tokenizer
    generation_config.json  when the source had one

`jaxspec.load(folder)` restores a folder that has the marker. `python scripts/convert.py SRC OUT` writes one.

Catalogue names are converted once and cached: `jaxspec.load("smollm2-135m")` restores
`{cache_root()}/converted/{name}-{dtype}` (`~/.cache/jaxspec/converted/smollm2-135m-float32` unless the
`JAXSPEC_CACHE` environment variable names another cache root), converting and writing it the first time. A cached
conversion is reused only if its marker names the same format version, jaxspec version and catalogue sha256;
otherwise it is converted again and replaced. Deleting the folder forces a fresh conversion.

Every folder is written into a temporary sibling (`OUT.tmp-<random>`) and renamed into place only when complete,
so an interrupted or failed conversion never leaves a folder that loads.

Several processes (`jaxspec.distributed`): `save` and `load_cached` are collective, every process calls them with
the same arguments. Each process writes the slices of the params its devices hold (orbax writes global arrays that
way); process 0 alone picks the temporary name (broadcast to the others), writes the JSON and tokenizer files and
the marker, and renames the folder, with barriers between the steps. `restore(folder, mesh=...)` reads each param
straight into its sharding, every process only its own slices. The folder must be on a filesystem that every
process sees (GCS or NFS on a pod).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import secrets
import shutil
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxspec.convert.errors import CheckpointError, read_json_object
from jaxspec.convert.rules import CheckpointMismatch

from . import catalog, distributed, loading
from .head import is_quantized
from .layout import standard_layout
from .loading import Model, _read_json, config_from_hf
from .models.layers import abstract_module
from .tokenizer import class_name as tokenizer_class_name, load_tokenizer

FORMAT_VERSION = 2  # 2: Llama-family layers stored one array per layer (was stacked)
MARKER = "jaxspec.json"
PARAMS_DIR = "params"


def jaxspec_version() -> str:
    """The installed distribution's version; a source checkout that was never installed reports "unknown"."""
    try:
        return importlib.metadata.version("jaxspec")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def is_converted(path: str) -> bool:
    """Whether `path` is a conversion folder (has the marker), as opposed to an HF folder or a GGUF file."""
    return os.path.isfile(os.path.join(path, MARKER))


def read_marker(folder: str) -> dict[str, Any]:
    """The folder's marker, refusing one this jaxspec cannot restore (it names both format versions)."""
    path = os.path.join(folder, MARKER)
    try:
        marker = read_json_object(path)
    except CheckpointError as error:
        raise CheckpointError(f"{error}: not a readable conversion marker; convert the source again.") from None
    found = marker.get("format_version")
    if found != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: conversion format version {found!r}, but this jaxspec ({jaxspec_version()}) reads version "
            f"{FORMAT_VERSION}; convert the source again with scripts/convert.py (or delete the folder if it is "
            "a cached catalogue conversion)."
        )
    if not _is_dtype_name(marker.get("dtype")):
        raise CheckpointError(f"{path}: \"dtype\" is {marker.get('dtype')!r}, not a dtype name; the marker is "
                              "damaged (convert the source again).")
    return marker


def _is_dtype_name(name: Any) -> bool:
    if not isinstance(name, str):
        return False
    try:
        jnp.dtype(name)
    except TypeError:
        return False
    return True


def restore(folder: str, dtype: Any = None, *, mesh=None, sharding_rules=None) -> Model:
    """Rebuild the `Model` saved in `folder`: no tensor source is read and nothing is converted.

    `dtype=None` keeps the dtype the folder was converted to; another dtype casts each param while reading
    (params the module declares float32, like the MoE router bias, stay float32). With a `mesh`, each param is
    restored straight into its sharding by logical axes (`sharding_rules`), each process reading its own slices.
    """
    folder = os.fspath(folder)
    marker = read_marker(folder)
    params_dir = os.path.join(folder, PARAMS_DIR)
    if not os.path.isdir(params_dir):
        raise FileNotFoundError(f"{folder} has a {MARKER} marker but no {PARAMS_DIR}/ folder (orbax checkpoint).")
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{folder} has a {MARKER} marker but no config.json.")
    hf_config = read_json_object(config_path)
    family, cfg = config_from_hf(hf_config, config_path)
    dtype = jnp.dtype(dtype if dtype is not None else marker["dtype"])
    generation_config = _read_json(os.path.join(folder, "generation_config.json"))
    tokenizer = load_tokenizer(folder, marker.get("tokenizer_class"))
    check_params_files(folder, marker)
    return Model(
        module=_restore_module(family.model_cls(), cfg, dtype, params_dir, mesh, sharding_rules),
        config=cfg,
        hf_config=hf_config,
        tokenizer=tokenizer,
        generation_config=generation_config,
        source=folder,
    )


def params_files(params_dir: str) -> dict[str, int]:
    """Every file under `params_dir` (path relative to it, "/"-separated) with its size in bytes."""
    out = {}
    for root, _, files in os.walk(params_dir):
        for name in files:
            path = os.path.join(root, name)
            out[os.path.relpath(path, params_dir).replace(os.sep, "/")] = os.path.getsize(path)
    return dict(sorted(out.items()))


def check_params_files(folder: str, marker: dict[str, Any]) -> None:
    """Every file the marker lists under params/ must be there with the size it was written with: orbax reports a
    missing or cut data file only mid-restore, with an error that is not a ValueError. Markers written before the
    list existed are not checked."""
    recorded = marker.get("params_files")
    if recorded is None:
        return
    marker_path = os.path.join(folder, MARKER)
    if not (isinstance(recorded, dict) and all(type(size) is int for size in recorded.values())):
        raise CheckpointError(f"{marker_path}: \"params_files\" must map file names to sizes; the marker is damaged.")
    params_dir = os.path.join(folder, PARAMS_DIR)
    problems = []
    for name, size in recorded.items():
        path = os.path.join(params_dir, *name.split("/"))
        if not os.path.isfile(path):
            problems.append(f"{name} is missing")
        elif os.path.getsize(path) != size:
            problems.append(f"{name} has {os.path.getsize(path)} bytes, {size} when written")
    if problems:
        more = " ..." if len(problems) > 5 else ""
        raise CheckpointError(f"{params_dir}: the saved params are damaged ({'; '.join(problems[:5])}{more}); "
                              "convert the source again.")


def _restore_module(model_cls, cfg, dtype, params_dir: str, mesh=None, sharding_rules=None) -> nnx.Module:
    """Read the params straight into the shapes, declared dtypes and (with a mesh) shardings of an abstract module
    (no random init)."""
    import orbax.checkpoint as ocp

    from .sharding import ShardingRules, variable_sharding

    graphdef, state = nnx.split(abstract_module(lambda: model_cls(cfg, dtype=dtype)))
    _check_stored_params(params_dir, nnx.to_pure_dict(state))
    if mesh is not None:
        rules = sharding_rules or ShardingRules()

        def target(variable):
            spec = variable.get_value()
            return variable.replace(jax.ShapeDtypeStruct(spec.shape, spec.dtype,
                                                         sharding=variable_sharding(variable, mesh, rules)))

        state = jax.tree.map(target, state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    with ocp.StandardCheckpointer() as checkpointer:
        try:
            params = checkpointer.restore(os.path.abspath(params_dir), nnx.to_pure_dict(state))
        except ValueError as error:  # tensorstore's reports of unreadable data: one line, naming the folder
            raise CheckpointError(f"{params_dir}: orbax cannot restore the params: {_first_line(error)}") from error
    nnx.replace_by_pure_dict(state, params)
    module = nnx.merge(graphdef, state)
    if mesh is not None and hasattr(module, "place_on"):
        module.place_on(mesh, rules)
    return module


def _check_stored_params(params_dir: str, expected: dict[str, Any]) -> None:
    """The orbax checkpoint's own metadata must list exactly the params of the module that config.json describes,
    at their shapes: an edited config.json or a damaged folder is reported by name before any data is read."""
    import orbax.checkpoint as ocp

    if not os.path.isfile(os.path.join(params_dir, "_METADATA")):
        raise CheckpointError(f"{params_dir}: not a complete orbax checkpoint (no _METADATA); convert the source "
                              "again.")
    try:
        with ocp.StandardCheckpointer() as checkpointer:
            metadata = checkpointer.metadata(os.path.abspath(params_dir))
    except ValueError as error:  # a _METADATA that does not parse (JSONDecodeError) or that orbax refuses
        raise CheckpointError(f"{params_dir}: unreadable orbax metadata: {_first_line(error)}") from error
    tree = getattr(metadata, "item_metadata", metadata)
    tree = getattr(tree, "tree", tree)

    def shapes(pure, is_leaf=None):
        leaves = jax.tree_util.tree_leaves_with_path(pure, is_leaf=is_leaf)
        return {"/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path): tuple(leaf.shape)
                for path, leaf in leaves}

    stored = shapes(tree, is_leaf=lambda x: hasattr(x, "shape"))
    if not stored:  # metadata this orbax version lays out otherwise: its own restore checks remain
        return
    wanted = shapes(expected)
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    misshaped = sorted(f"{name}: stored {stored[name]}, expected {wanted[name]}"
                       for name in set(wanted) & set(stored) if stored[name] != wanted[name])
    problems = [f"{label} {names[:5]}{' ...' if len(names) > 5 else ''}" for label, names in
                (("missing", missing), ("unexpected", extra), ("mis-shaped", misshaped)) if names]
    if problems:
        raise CheckpointError(f"{params_dir} does not hold the params that config.json describes: "
                              f"{'; '.join(problems)} (was config.json edited after converting?).")


def _first_line(error: BaseException, limit: int = 300) -> str:
    """The start of an exception's message: tensorstore's run to pages of JSON spec."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return text if len(text) <= limit else text[:limit] + " ..."


def save(model: Model, out: str, *, source: str | None = None, force: bool = False) -> str:
    """Write `model` as a conversion folder at `out`, atomically; return `out`.

    An existing `out` is an error unless `force`, and even then only an earlier conversion (a folder with the
    marker) is replaced, so a mistyped OUT cannot delete an unrelated folder. `source` is recorded in the marker
    (default: `model.source`).
    """
    if is_quantized(model):
        raise NotImplementedError(
            "checkpoint.save: a quantized model (jaxspec.quantize) cannot be saved yet: conversion folders hold "
            "float params. Save the float model and quantize it after loading (a second for a 0.5B model).")
    out = os.path.abspath(os.fspath(out))
    check_replaceable(out, force)
    lead = jax.process_index() == 0
    # One temporary name for every process: process 0's.
    tmp = f"{out}.tmp-{bytes(distributed.broadcast(np.frombuffer(secrets.token_bytes(6), np.uint8))).hex()}"
    distributed.barrier("jaxspec-save-checked")  # nobody renames before every process has checked `out`
    if lead:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        os.mkdir(tmp)
    distributed.barrier("jaxspec-save-tmp")
    try:
        write_folder(model, tmp, source if source is not None else model.source)
        if lead:
            _publish(tmp, out)
        distributed.barrier("jaxspec-save-published")
    except BaseException:
        if lead:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def check_replaceable(out: str, force: bool) -> None:
    """Refuse to write `out` over anything but, with `force`, an earlier conversion; callers check before converting."""
    out = os.path.abspath(os.fspath(out))
    if not os.path.lexists(out):
        return
    if not force:
        raise FileExistsError(f"{out} already exists; pass --force (force=True) to replace an earlier conversion.")
    if not is_converted(out):
        raise FileExistsError(f"{out} exists and is not a jaxspec conversion (no {MARKER}); refusing to replace it.")


def write_folder(model: Model, folder: str, source: str) -> None:
    """Everything a conversion folder holds, the marker last: a folder without the marker is incomplete.
    Collective with several processes: each writes its slices of the params, process 0 everything else."""
    lead = jax.process_index() == 0
    if lead:
        _write_json(os.path.join(folder, "config.json"), model.hf_config)
        if model.generation_config:
            _write_json(os.path.join(folder, "generation_config.json"), model.generation_config)
        if model.tokenizer is not None:
            model.tokenizer.save_pretrained(folder)
    write_params(model.module, os.path.join(folder, PARAMS_DIR))
    distributed.barrier("jaxspec-save-params")
    if lead:
        marker = marker_for(model, source) | {"params_files": params_files(os.path.join(folder, PARAMS_DIR))}
        _write_json(os.path.join(folder, MARKER), marker)


def write_params(module: nnx.Module, params_dir: str) -> None:
    """The module's params as an orbax checkpoint of their pure dict (the layout `_restore_module` reads)."""
    import orbax.checkpoint as ocp

    _, state = nnx.split(module)
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(os.path.abspath(params_dir), nnx.to_pure_dict(standard_layout(state)))


def marker_for(model: Model, source: str) -> dict[str, Any]:
    """What `restore` and the cache check read; the format version guards the folder's layout. The tokenizer's class
    lets `restore` build it without `AutoTokenizer` (jaxspec/tokenizer.py `load_tokenizer`); a marker without it, as
    written before 2026-12-06, leaves the choice to `AutoTokenizer`."""
    marker = {
        "format_version": FORMAT_VERSION,
        "dtype": jnp.dtype(model.dtype).name,
        "source": source,
        "jaxspec_version": jaxspec_version(),
    }
    if model.tokenizer is not None:
        marker["tokenizer_class"] = tokenizer_class_name(model.tokenizer)
    return marker


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)


@contextlib.contextmanager
def atomic_folder(out: str):
    """Write a folder in a temporary sibling (the yielded path) and publish it as `out` only once the block
    completes (`_publish`): an interrupted write leaves nothing at `out`, and a failed one leaves no temporary."""
    out = os.path.abspath(out)
    tmp = f"{out}.tmp-{secrets.token_hex(4)}"
    os.makedirs(tmp)
    try:
        yield tmp
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _publish(tmp: str, out: str) -> None:
    """Rename the finished `tmp` to `out`; an old `out` is moved aside first and deleted only once `tmp` is in place.

    Renaming a folder onto an existing non-empty one fails, so a conversion published meanwhile by another
    process is reported as FileExistsError rather than overwritten.
    """
    old = None
    if os.path.lexists(out):
        old = f"{out}.old-{secrets.token_hex(6)}"
        os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException as error:
        if old is not None:
            os.rename(old, out)
        elif isinstance(error, OSError) and os.path.lexists(out):
            raise FileExistsError(f"{out} appeared while converting; left it as it is.") from error
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def cached_folder(name: str, dtype: Any) -> str:
    """Where the conversion of catalogue model `name` at `dtype` is cached."""
    return os.path.join(catalog.cache_root(), "converted", f"{name}-{jnp.dtype(dtype).name}")


def catalog_source(name: str) -> str:
    """The marker's `source` for a catalogue model: its name and pinned sha256, so a changed entry reconverts."""
    return f"catalog:{name}@sha256:{catalog.get_entry(name).sha256}"


def load_cached(name: str, dtype: Any, progress: bool = False, *, mesh=None, sharding_rules=None) -> Model:
    """Catalogue model `name` at `dtype`: restored from the conversion cache, else converted and cached.
    Collective with several processes; process 0 decides whether the cache is current."""
    folder = cached_folder(name, dtype)
    source = catalog_source(name)
    check_mtp_asset(name)  # before converting: a damaged asset would otherwise fail only after the conversion
    if bool(distributed.broadcast(np.asarray(_is_current(folder, source)))):
        model = restore(folder, mesh=mesh, sharding_rules=sharding_rules)
        _record_tokenizer_class(folder, model)
        return _with_mtp_asset(name, model)
    model = loading.convert(name, dtype, progress, mesh=mesh, sharding_rules=sharding_rules)
    if progress:
        print(f"caching the conversion in {folder}", flush=True)
    try:
        save(model, folder, source=source, force=is_converted(folder))
    except OSError as error:  # the cache only saves time: a full or read-only disk must not fail the load
        if not _is_current(folder, source):  # else another process cached the same conversion first
            warnings.warn(f"could not cache the conversion of {name} in {folder}: {error}", stacklevel=3)
    return _with_mtp_asset(name, model)


def _record_tokenizer_class(folder: str, model: Model) -> None:
    """A cached conversion whose marker predates `tokenizer_class` (`marker_for`) gets it now, so that later loads
    build the tokenizer without `AutoTokenizer`: the cache is current until jaxspec's version changes, and would
    otherwise keep loading the slow way. The marker is replaced whole (a reader sees the old one or the new one); a
    cache that cannot be written only stays slow."""
    if model.tokenizer is None or jax.process_index() != 0:
        return
    path = os.path.join(folder, MARKER)
    marker = read_marker(folder)
    if "tokenizer_class" in marker:
        return
    try:
        _write_json(f"{path}.tmp", marker | {"tokenizer_class": tokenizer_class_name(model.tokenizer)})
        os.replace(f"{path}.tmp", path)
    except OSError:
        pass


def _with_mtp_asset(name: str, model: Model) -> Model:
    """The entry's shipped MTP layers attached, when it has some (jaxspec/assets); the cache holds the target alone,
    so a retrained set needs no reconversion."""
    asset = catalog.get_entry(name).mtp_asset
    if asset is None:
        return model
    from .assets import MTP_FILE, asset_folder, attach_mtp_asset

    folder = asset_folder(asset)
    try:
        return attach_mtp_asset(model, folder)
    except CheckpointMismatch as error:  # the asset's tensors against its config.json: say which asset
        raise CheckpointMismatch(f"{os.path.join(folder, MTP_FILE)}: {error}") from error


def check_mtp_asset(name: str) -> None:
    """The MTP asset of catalogue entry `name`, if it has one, must hold a readable config.json that names its layer
    count and a readable model.safetensors (header checked here, tensors when attached)."""
    asset = catalog.get_entry(name).mtp_asset
    if asset is None:
        return
    from jaxspec.convert.safetensors_io import SafetensorsFile

    from .assets import MTP_FILE, asset_folder

    folder = asset_folder(asset)
    config_path = os.path.join(folder, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"MTP asset {folder} of catalogue model {name!r} has no config.json.")
    layers = read_json_object(config_path).get("num_nextn_predict_layers")
    if not (type(layers) is int and layers > 0):
        raise CheckpointError(f"{config_path}: \"num_nextn_predict_layers\" must be a positive integer (the MTP "
                              f"layers the asset holds), got {layers!r}.")
    weights = os.path.join(folder, MTP_FILE)
    if not os.path.isfile(weights):
        raise FileNotFoundError(f"MTP asset {folder} of catalogue model {name!r} has no {MTP_FILE}.")
    SafetensorsFile(weights)


def _is_current(folder: str, source: str) -> bool:
    """Whether a cached conversion was written by this format and jaxspec version from this exact source."""
    try:
        marker = read_marker(folder)
    except (OSError, ValueError):
        return False
    return marker.get("source") == source and marker.get("jaxspec_version") == jaxspec_version()
