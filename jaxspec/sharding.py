"""Logical axis names -> mesh axes.

Params and caches name their axes (`batch`, `seq`, `embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`,
`experts`, `layers`); one `ShardingRules` maps each name to a mesh axis or to None (replicated). A dimension that
the mesh axis does not divide is replicated instead, so tiny test models and odd head counts still run on any mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec


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
    logical_axes: tuple[str, ...], shape: tuple[int, ...], mesh: Mesh, rules: ShardingRules
) -> PartitionSpec:
    """Spec for one array. Raises if two of its logical axes land on the same mesh axis (a rules bug)."""
    spec, used = [], {}
    for name, size in zip(logical_axes, shape):
        axis = rules.mesh_axis(name)
        if axis is None or axis not in mesh.shape or size % mesh.shape[axis] != 0:
            spec.append(None)
            continue
        if axis in used:
            raise ValueError(f"Logical axes {used[axis]!r} and {name!r} both map to mesh axis {axis!r}.")
        used[axis] = name
        spec.append(axis)
    return PartitionSpec(*spec)


def named_sharding(logical_axes, shape, mesh: Mesh, rules: ShardingRules) -> NamedSharding:
    return NamedSharding(mesh, partition_spec(tuple(logical_axes), tuple(shape), mesh, rules))


def shard_state(state: Any, mesh: Mesh, rules: ShardingRules) -> Any:
    """Place every nnx Variable of a module state by its `logical_axes` metadata."""
    from flax import nnx

    def place(variable):
        if not isinstance(variable, nnx.Variable):
            return variable
        axes = variable.get_metadata().get("logical_axes")
        value = variable[...]
        sharding = named_sharding(axes, value.shape, mesh, rules) if axes else NamedSharding(mesh, PartitionSpec())
        return variable.replace(jax.device_put(value, sharding))

    return jax.tree.map(place, state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def constrain(x: jax.Array, logical_axes: tuple[str, ...], mesh: Mesh | None, rules: ShardingRules) -> jax.Array:
    """with_sharding_constraint by logical names; a no-op without a mesh."""
    if mesh is None:
        return x
    return jax.lax.with_sharding_constraint(x, named_sharding(logical_axes, x.shape, mesh, rules))
