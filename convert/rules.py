"""Declarative HF-name -> parameter conversion with exhaustive checks.

A family declares a list of `Rule`s. Each HF tensor must match exactly one rule (or an explicit ignore pattern,
which carries its reason); each parameter slot (a whole parameter, or one layer of a stacked one) must be filled
exactly once; every converted array must have the slot's shape. Any violation raises one error that names every
offending tensor, so a user with a wrong or truncated checkpoint learns everything at once.
"""

from __future__ import annotations

import dataclasses
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
    problems = []
    if missing:
        problems.append(f"missing tensors for {missing}")
    if unknown:
        problems.append(f"unexpected tensors (no rule uses them): {unknown}")
    if duplicate:
        problems.append(f"tensors that fill an already-filled parameter: {duplicate}")
    if bad_shape:
        problems.append(f"mis-shaped tensors: {bad_shape}")
    if problems:
        raise CheckpointMismatch("Checkpoint does not match its config: " + "; ".join(problems))
    return out


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
