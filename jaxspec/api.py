"""`jaxspec.load`: one entry point for every kind of checkpoint a user has."""

from __future__ import annotations

import os
from typing import Any

import jax.numpy as jnp

from . import catalog, checkpoint
from .layout import use_cpu_layout
from .loading import Model, convert, default_dtype


def load(path: str, dtype: Any = None, progress: bool = False, *, mesh=None, sharding_rules=None) -> Model:
    """Load an HF folder (config.json + model.safetensors or a sharded index), a `.gguf` file, a catalogue name, a
    drafter shipped for a catalogue model (`"smollm2-135m-dflash"`, in jaxspec/assets) or a conversion folder written
    by `scripts/convert.py` (see `jaxspec.checkpoint`).

    Every tensor is used or explicitly ignored; a missing, extra or mis-shaped tensor raises an error naming it.
    A catalogue name is converted once and then restored from the conversion cache; a conversion folder is
    restored (at its own dtype unless `dtype` is given) without converting. jaxspec never needs torch.

    With a `mesh` (which may span processes: see `jaxspec.distributed`), every param is created sharded on it by its
    logical axes (`sharding_rules`, default `jaxspec.sharding.ShardingRules()`), each process reading only the slices
    its own devices hold; pass the same mesh to `generate`. MoE layers then run expert-parallel.

    A model on one CPU device keeps its decoder layers' projections transposed, the layout XLA:CPU multiplies
    fastest (`jaxspec.layout`); read a param's array in the model code's layout with `jaxspec.layout.logical`.
    """
    path = os.fspath(path)
    if catalog.is_shipped_drafter(path) and not os.path.exists(path):
        from .assets import asset_folder

        path = asset_folder(path)
    if catalog.is_catalog_name(path):
        model = checkpoint.load_cached(path, _dtype_or_default(dtype), progress, mesh=mesh,
                                       sharding_rules=sharding_rules)
    elif checkpoint.is_converted(path):
        model = checkpoint.restore(path, dtype, mesh=mesh, sharding_rules=sharding_rules)
    else:
        model = convert(path, _dtype_or_default(dtype), progress, mesh=mesh, sharding_rules=sharding_rules)
    return use_cpu_layout(model)  # projections stored [out, in] where the model is on one CPU device


# Compiles this long or longer are kept on disk by `enable_compilation_cache`.
CACHE_MIN_COMPILE_SECONDS = 0.5


def enable_compilation_cache(folder: str | None = None) -> str | None:
    """Keep compiled loops on disk (JAX's persistent compilation cache), so a new process with the same model,
    strategy and shapes loads them instead of compiling. Call it before the first `generate`.

    `folder`: default `$JAXSPEC_COMPILATION_CACHE`, else `xla` in the jaxspec cache folder (`$JAXSPEC_CACHE`, else
    `~/.cache/jaxspec`, as for converted checkpoints and step costs); "off" leaves the cache off.
    Executables that compiled in CACHE_MIN_COMPILE_SECONDS or more are kept (JAX's default keeps those over a second:
    a small model's loop compiles in less), or in whatever less the caller already chose. Returns the folder in use,
    or None.
    """
    import jax

    from .catalog import cache_root

    folder = folder or os.environ.get("JAXSPEC_COMPILATION_CACHE") or os.path.join(cache_root(), "xla")
    if folder == "off":
        return None
    jax.config.update("jax_compilation_cache_dir", folder)
    chosen = jax.config.jax_persistent_cache_min_compile_time_secs
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min(chosen, CACHE_MIN_COMPILE_SECONDS))
    return folder


def _dtype_or_default(dtype: Any) -> jnp.dtype:
    return jnp.dtype(dtype) if dtype is not None else default_dtype()
