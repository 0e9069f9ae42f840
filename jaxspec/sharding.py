"""Logical axis names -> mesh axes.

Params and caches name their axes (`batch`, `seq`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`,
`experts`, `layers`); one `ShardingRules` maps each name to a mesh axis or to None (replicated). A dimension that
the mesh axis does not divide is replicated instead, so tiny test models and odd head counts still run on any mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .models.int8 import logical


@dataclasses.dataclass(frozen=True)
class ShardingRules:
    batch: str | None = "data"
    seq: str | None = None
    embed: str | None = None
    heads: str | None = "model"
    kv_heads: str | None = "model"
    head_dim: str | None = None
    mlp: str | None = "model"
    vocab: str | None = "model"
    experts: str | None = "expert"
    layers: str | None = None

    def mesh_axis(self, logical: str) -> str | None:
        if not hasattr(self, logical):
            raise ValueError(f"Unknown logical axis {logical!r}; known: {[f.name for f in dataclasses.fields(self)]}.")
        return getattr(self, logical)


def partition_spec(
    logical_axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh | Mapping[str, int], rules: ShardingRules
) -> PartitionSpec:
    """Spec for one array. Raises if two of its logical axes land on the same mesh axis (a rules bug).

    `mesh` may also be a plain {axis name: size} mapping: the planner (scripts/plan.py) sizes meshes it does not have.
    """
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    spec, used = [], {}
    for name, size in zip(logical_axes, shape):
        axis = rules.mesh_axis(name)
        if axis is None or axis not in sizes or size % sizes[axis] != 0:
            spec.append(None)
            continue
        if axis in used:
            raise ValueError(f"Logical axes {used[axis]!r} and {name!r} both map to mesh axis {axis!r}.")
        used[axis] = name
        spec.append(axis)
    return PartitionSpec(*spec)


def named_sharding(logical_axes, shape, mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(tuple(logical_axes), tuple(shape), mesh, rules))


def shard_shape(logical_axes, shape, mesh: Mesh | Mapping[str, int], rules: ShardingRules) -> tuple[int, ...]:
    """The shape of one device's shard."""
    sizes = mesh.shape if isinstance(mesh, Mesh) else mesh
    spec = tuple(partition_spec(tuple(logical_axes or ()), tuple(shape), mesh, rules))
    spec += (None,) * (len(shape) - len(spec))  # axes without a logical name are replicated
    return tuple(n // (sizes[axis] if axis else 1) for n, axis in zip(shape, spec))


def variable_sharding(variable, mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    """Where an nnx Variable lives: by its `logical_axes` metadata, replicated without any."""
    axes = variable.get_metadata().get("logical_axes")
    shape = variable.get_value().shape
    return named_sharding(axes, shape, mesh, rules) if axes else NamedSharding(mesh, PartitionSpec())


def shard_state(state: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """Place every nnx Variable of a module state by its `logical_axes` metadata."""
    from flax import nnx

    def place(variable):
        if not isinstance(variable, nnx.Variable):
            return variable
        value = logical(variable.get_value())  # the rules name the model code's layout (jaxspec/layout.py)
        return variable.replace(jax.device_put(value, variable_sharding(variable, mesh, rules)))

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, logical_axes: tuple[str, ...], mesh: Mesh | None, rules: ShardingRules) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(logical_axes, x.shape, mesh, rules))


def make_mesh(axes: str | Mapping[str, int], devices=None) -> Mesh:
    """A mesh over every device of every process (or `devices`), from "data=1,model=8,expert=4" or a mapping, axes
    in the order given. The sizes must multiply to the number of devices."""
    if isinstance(axes, str):
        sizes = {}
        for part in axes.split(","):
            name, _, size = part.partition("=")
            if not name.strip() or not size.strip().isdigit() or int(size) < 1:
                raise ValueError(f"A mesh is written name=size,... (e.g. data=1,model=8,expert=4); got {axes!r}.")
            sizes[name.strip()] = int(size)
        axes = sizes
    devices = jax.devices() if devices is None else list(devices)
    count = 1
    for size in axes.values():
        count *= size
    if count != len(devices):
        raise ValueError(f"Mesh {dict(axes)} has {count} positions, but there are {len(devices)} devices.")
    return Mesh(np.asarray(devices).reshape(tuple(axes.values())), tuple(axes))
