"""Declarative HF-name -> parameter conversion with exhaustive checks.

A family declares a list of `Rule`s. Each HF tensor must match exactly one rule (or an explicit ignore pattern,
which carries its reason); each parameter slot (a whole parameter, or one layer of a stacked one) must be filled
exactly once; every converted array must have the slot's shape. Any violation raises one error that names every
offending tensor, so a user with a wrong or truncated checkpoint learns everything at once.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
from typing import Callable, Iterable, Protocol

import numpy as np


class TensorSource(Protocol):
    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str) -> np.ndarray: ...


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF names matching `pattern` fill `param`; a `(\\d+)` group in the pattern is the layer index."""

    pattern: str
    param: str
    transform: Callable[[np.ndarray], np.ndarray] = lambda w: w


def split_heads(width: int, heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """HF projection weight [heads*Dh, D] -> [D, heads, Dh]."""
    return lambda w: w.T.reshape(width, heads, head_dim)


def split_head_bias(heads: int, head_dim: int) -> Callable[[np.ndarray], np.ndarray]:
    """HF projection bias [heads*Dh] -> [heads, Dh]."""
    return lambda b: b.reshape(heads, head_dim)


@dataclasses.dataclass(frozen=True)
class Ignore:
    pattern: str
    reason: str


class CheckpointMismatch(ValueError):
    """The checkpoint's tensors do not match what the config says the model has."""


def convert(
    source: TensorSource,
    rules: Iterable[Rule],
    ignores: Iterable[Ignore],
    param_shapes: dict[str, tuple[int, ...]],
    stacked: set[str],
    dtype: np.dtype,
    layer_offset: Callable[[str], int] = lambda param: 0,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Fill every parameter in `param_shapes` from `source`.

    `stacked` names the parameters with a leading layer axis; their rules carry a layer group. `layer_offset(param)`
    maps an HF layer number to a slot (MTP layers live at `num_hidden_layers + k`).
    """
    rules = [(re.compile(r.pattern + r"\Z"), r) for r in rules]
    ignores = [(re.compile(i.pattern + r"\Z"), i) for i in ignores]
    out = {name: np.empty(shape, dtype) for name, shape in param_shapes.items()}
    filled: set[tuple[str, int | None]] = set()
    unknown, duplicate, bad_shape = [], [], []
    names = sorted(source.shapes)
    for step, hf_name in enumerate(names):
        if progress:
            progress(step, len(names))
        if any(p.match(hf_name) for p, _ in ignores):
            continue
        matches = [(m, r) for p, r in rules if (m := p.match(hf_name))]
        if len(matches) != 1:
            unknown.append(hf_name)
            continue
        m, rule = matches[0]
        if rule.param not in out:
            unknown.append(hf_name)
            continue
        layer = int(m.group(1)) - layer_offset(rule.param) if rule.param in stacked else None
        slot = (rule.param, layer)
        if slot in filled:
            duplicate.append(hf_name)
            continue
        target_shape = param_shapes[rule.param][1:] if layer is not None else param_shapes[rule.param]
        if layer is not None and not 0 <= layer < param_shapes[rule.param][0]:
            unknown.append(hf_name)
            continue
        value = rule.transform(np.asarray(source.read(hf_name)))
        if value.shape != target_shape:
            bad_shape.append(f"{hf_name}: {source.shapes[hf_name]} gives {value.shape}, expected {target_shape}")
            continue
        if layer is None:
            out[rule.param][...] = value
        else:
            out[rule.param][layer] = value
        filled.add(slot)
    missing = _missing_tensors(param_shapes, stacked, filled, [r for _, r in rules], layer_offset)
    _raise_on_mismatch(missing=missing, unknown=unknown, duplicate=duplicate, bad_shape=bad_shape)
    return out


def _raise_on_mismatch(*, missing, unknown, duplicate, bad_shape, ambiguous=()) -> None:
    """One error that names every problem at once."""
    problems = []
    if missing:
        problems.append(f"missing tensors for {missing}")
    if unknown:
        problems.append(f"unexpected tensors (no rule uses them): {unknown}")
    if ambiguous:
        problems.append(f"tensors that several rules claim (a rules bug): {ambiguous}")
    if duplicate:
        problems.append(f"tensors that fill an already-filled parameter: {duplicate}")
    if bad_shape:
        problems.append(f"mis-shaped tensors: {bad_shape}")
    if problems:
        raise CheckpointMismatch("Checkpoint does not match its config: " + "; ".join(problems))


def _missing_tensors(param_shapes, stacked, filled, rules: list[Rule], layer_offset) -> list[str]:
    """HF names of the tensors that would have filled each empty slot, spelled out from the rule patterns."""
    rule_for = {r.param: r for r in rules}
    missing = []
    for name, shape in param_shapes.items():
        slots = [(name, i) for i in range(shape[0])] if name in stacked else [(name, None)]
        for param, layer in slots:
            if (param, layer) in filled:
                continue
            rule = rule_for.get(param)
            if rule is None:
                missing.append(param)
                continue
            hf_name = rule.pattern
            if layer is not None:
                hf_name = hf_name.replace(r"(\d+)", str(layer + layer_offset(param)), 1)
            missing.append(hf_name.replace("\\", ""))
    return missing


# ----------------------------------------------------------------------------------------------------------------
# Rules with several indices and index ranges (MoE checkpoints: per-expert tensors, dense/MoE/MTP layer groups)

_INDEX = r"(\d+)"


@dataclasses.dataclass(frozen=True)
class IndexedRule:
    """HF names matching `pattern` fill one slot of `param`: the i-th `(\\d+)` group, minus `offsets[i]`, indexes
    the param's i-th axis (missing offsets are 0).

    A name whose indices fall outside the param's axes is not this rule's, so one pattern serves several params that
    cover disjoint index ranges: `model.layers.(\\d+).self_attn...` fills the main stack for layers [0, N) and the MTP
    stack (offset N) for layers [N, N + M); per-expert tensors stack on an experts axis with a second group.
    """

    pattern: str
    param: str
    transform: Callable[[np.ndarray], np.ndarray] = lambda w: w
    offsets: tuple[int, ...] = ()

    @property
    def num_indices(self) -> int:
        return self.pattern.count(_INDEX)

    def index(self, match: re.Match) -> tuple[int, ...]:
        offsets = self.offsets + (0,) * (self.num_indices - len(self.offsets))
        return tuple(int(g) - o for g, o in zip(match.groups(), offsets))

    def hf_name(self, index: tuple[int, ...]) -> str:
        """The HF tensor name that fills slot `index` of the param."""
        offsets = self.offsets + (0,) * (self.num_indices - len(self.offsets))
        name = self.pattern
        for i, o in zip(index, offsets):
            name = name.replace(_INDEX, str(i + o), 1)
        return name.replace("\\", "")


def expected_names(rule: IndexedRule, shape: tuple[int, ...]) -> list[str]:
    """Every HF name that `rule` expects for a param of `shape`, in slot order."""
    slots = itertools.product(*(range(n) for n in shape[: rule.num_indices]))
    return [rule.hf_name(index) for index in slots]


def convert_indexed(
    source: TensorSource,
    rules: Iterable[IndexedRule],
    ignores: Iterable[Ignore],
    param_shapes: dict[str, tuple[int, ...]],
    dtype: np.dtype,
    progress: Callable[[int, int], None] | None = None,
    param_dtypes: dict[str, np.dtype] | None = None,
) -> dict[str, np.ndarray]:
    """`convert` for `IndexedRule`s: same exhaustive checks, one error naming every offending tensor.

    `param_dtypes` overrides `dtype` for a few params that must keep precision (e.g. a router's score bias, which
    decides expert choice by small margins and which HF keeps in float32).
    """
    rules = [(re.compile(r.pattern + r"\Z"), r) for r in rules if r.param in param_shapes]
    ignores = [re.compile(i.pattern + r"\Z") for i in ignores]
    param_dtypes = param_dtypes or {}
    out = {name: np.empty(shape, param_dtypes.get(name, dtype)) for name, shape in param_shapes.items()}
    filled: set[tuple[str, tuple[int, ...]]] = set()
    unknown, ambiguous, duplicate, bad_shape = [], [], [], []
    names = sorted(source.shapes)
    for step, hf_name in enumerate(names):
        if progress:
            progress(step, len(names))
        if any(p.match(hf_name) for p in ignores):
            continue
        hits = []
        for pattern, rule in rules:
            if m := pattern.match(hf_name):
                index = rule.index(m)
                shape = param_shapes[rule.param]
                if all(0 <= i < n for i, n in zip(index, shape)):
                    hits.append((rule, index))
        if not hits:
            unknown.append(hf_name)
            continue
        if len(hits) > 1:
            ambiguous.append(f"{hf_name} -> {[r.param for r, _ in hits]}")
            continue
        rule, index = hits[0]
        if (rule.param, index) in filled:
            duplicate.append(hf_name)
            continue
        target_shape = param_shapes[rule.param][len(index) :]
        value = rule.transform(np.asarray(source.read(hf_name)))
        if value.shape != target_shape:
            bad_shape.append(f"{hf_name}: {source.shapes[hf_name]} gives {value.shape}, expected {target_shape}")
            continue
        out[rule.param][index] = value
        filled.add((rule.param, index))
    missing = _missing_indexed(param_shapes, filled, [r for _, r in rules])
    _raise_on_mismatch(missing=missing, unknown=unknown, duplicate=duplicate, bad_shape=bad_shape, ambiguous=ambiguous)
    return out


def _missing_indexed(param_shapes, filled, rules: list[IndexedRule]) -> list[str]:
    rule_for = {r.param: r for r in reversed(rules)}  # the first rule of a param names its tensors
    missing = []
    for name, shape in param_shapes.items():
        rule = rule_for.get(name)
        if rule is None:
            missing.append(name)
            continue
        slots = itertools.product(*(range(n) for n in shape[: rule.num_indices]))
        missing += [rule.hf_name(index) for index in slots if (name, index) not in filled]
    return missing
