"""Declarative HF-name -> parameter conversion with exhaustive checks.

A family declares a list of `Rule`s. Each HF tensor must match exactly one rule (or an explicit ignore pattern,
which carries its reason); each parameter slot (a whole parameter, or one layer of a stacked one) must be filled
exactly once; every converted array must have the slot's shape. Any violation raises one error that names every
offending tensor, so a user with a wrong or truncated checkpoint learns everything at once.

Transforms that are `Layout`s (split axes, reorder rows, transpose) are data rather than code, so any box of a
parameter can be read from the few HF tensor bytes it comes from: that is how each process of a pod reads only the
slices its own devices hold (`Plan.read`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Callable, Iterable, Protocol, Sequence

import numpy as np

from .errors import CheckpointError
from .safetensors_io import Box, box_shape, normalize_box


class TensorSource(Protocol):
    shapes: dict[str, tuple[int, ...]]

    def read(self, name: str) -> np.ndarray: ...


def read_box(source: TensorSource, name: str, box: Sequence[slice] | None) -> np.ndarray:
    """`source[name][box]`, reading only the box where the source can (safetensors, FP8); others read the tensor."""
    if hasattr(source, "read_box"):
        return source.read_box(name, box)
    value = np.asarray(source.read(name))
    return value[normalize_box(box, value.shape)]


@dataclasses.dataclass(frozen=True)
class Layout:
    """An HF tensor -> param slot transform as data, so that a box of the slot can be read on its own.

    The HF tensor's axes are split first (axis i into the sizes `split[i]`, at most one of them -1; `None` keeps the
    axis whole), which gives a view; `orders` reorders the entries of some view axes (`(axis, order)`: view entry j
    comes from entry order[j]; DeepSeek stores rope rows interleaved); then `perm` transposes the view into the slot.
    A box of the slot maps back to one box of the HF tensor: a split axis is read over whole rows of its outer part
    (inner parts only partly wanted are cut after reading), and an axis with an order is read whole.
    """

    split: tuple[tuple[int, ...] | None, ...]
    perm: tuple[int, ...]
    orders: tuple[tuple[int, tuple[int, ...]], ...] = ()

    def view_shape(self, hf_shape: Sequence[int]) -> tuple[int, ...]:
        """Raises ValueError if the HF shape cannot be split as declared."""
        if len(hf_shape) != len(self.split):
            raise ValueError(f"expected {len(self.split)} axes, got shape {tuple(hf_shape)}")
        view = []
        for size, parts in zip(hf_shape, self.split):
            if parts is None:
                view.append(size)
                continue
            known = math.prod(p for p in parts if p != -1)
            if known == 0 or size % known or (-1 not in parts and known != size):
                raise ValueError(f"axis of size {size} does not split into {parts}")
            view += [size // known if p == -1 else p for p in parts]
        return tuple(view)

    def out_shape(self, hf_shape: Sequence[int]) -> tuple[int, ...]:
        view = self.view_shape(hf_shape)
        return tuple(view[p] for p in self.perm)

    def __call__(self, w: np.ndarray) -> np.ndarray:
        w = np.asarray(w)
        return self.read(lambda box: w[box], w.shape, None)

    def read(self, read_hf: Callable[[Box], np.ndarray], hf_shape: Sequence[int], box: Box | None) -> np.ndarray:
        """Slot[box], reading only `read_hf(hf_box)` of the HF tensor."""
        view = self.view_shape(hf_shape)
        box = normalize_box(box, self.out_shape(hf_shape))
        wanted = [slice(0, n) for n in view]  # the box in view axes
        for j, p in enumerate(self.perm):
            wanted[p] = box[j]
        ordered = dict(self.orders)
        fetched = [slice(0, n) if axis in ordered else wanted[axis] for axis, n in enumerate(view)]
        # Map the view box to the HF box: each HF axis is read over whole rows of its outer view axis.
        hf_box, block_shape, cut, axis = [], [], [], 0
        for parts in self.split:
            width = 1 if parts is None else len(parts)
            outer, inner = fetched[axis], view[axis + 1 : axis + width]
            rows = math.prod(inner)
            hf_box.append(slice(outer.start * rows, outer.stop * rows))
            block_shape += [outer.stop - outer.start, *inner]
            cut.append(slice(None))
            cut += [fetched[a] for a in range(axis + 1, axis + width)]
            axis += width
        block = read_hf(tuple(hf_box)).reshape(block_shape)[tuple(cut)]
        for axis, order in self.orders:
            block = np.take(block, np.asarray(order), axis=axis)[(slice(None),) * axis + (wanted[axis],)]
        return block.transpose(self.perm)


def transposed() -> Layout:
    """HF [out, in] -> [in, out]."""
    return Layout(split=(None, None), perm=(1, 0))


def identity(ndim: int) -> Layout:
    return Layout(split=(None,) * ndim, perm=tuple(range(ndim)))


@dataclasses.dataclass(frozen=True)
class Rule:
    """HF names matching `pattern` fill `param`; a `(\\d+)` group in the pattern is the layer index."""

    pattern: str
    param: str
    transform: Callable[[np.ndarray], np.ndarray] = lambda w: w


def split_heads(width: int, heads: int, head_dim: int) -> Layout:
    """HF projection weight [heads*Dh, D] -> [D, heads, Dh]."""
    return Layout(split=((heads, head_dim), None), perm=(2, 0, 1))


def split_head_bias(heads: int, head_dim: int) -> Layout:
    """HF projection bias [heads*Dh] -> [heads, Dh]."""
    return Layout(split=((heads, head_dim),), perm=(0, 1))


def merge_heads_out(heads: int, head_dim: int) -> Layout:
    """HF output projection [D, heads*Dh] -> [heads, Dh, D]."""
    return Layout(split=(None, (heads, head_dim)), perm=(1, 2, 0))


@dataclasses.dataclass(frozen=True)
class Ignore:
    pattern: str
    reason: str


class CheckpointMismatch(CheckpointError):
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
    `transform` is a `Layout` (a box of the slot reads only its own bytes), any other callable on the whole tensor
    (read whole, then cut), or None (the tensor is the slot as it is).
    """

    pattern: str
    param: str
    transform: Callable[[np.ndarray], np.ndarray] | None = None
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

    def slot_shape(self, hf_shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The converted shape, known without reading for a Layout or no transform (None: only reading tells).
        Raises ValueError when a Layout cannot split the HF shape."""
        if self.transform is None:
            return tuple(hf_shape)
        if isinstance(self.transform, Layout):
            return self.transform.out_shape(hf_shape)
        return None


def expected_names(rule: IndexedRule, shape: tuple[int, ...]) -> list[str]:
    """Every HF name that `rule` expects for a param of `shape`, in slot order."""
    slots = itertools.product(*(range(n) for n in shape[: rule.num_indices]))
    return [rule.hf_name(index) for index in slots]


@dataclasses.dataclass
class Plan:
    """Which HF tensor fills each slot of each param, matched and checked from the checkpoint's header alone.

    `read(source, param, box)` then reads any box of a param (a device's shard), touching only the HF tensors of
    the slots inside the box and, through `Layout`s, only their bytes inside it.
    """

    param_shapes: dict[str, tuple[int, ...]]
    param_dtypes: dict[str, np.dtype]
    slots: dict[str, dict[tuple[int, ...], tuple[str, IndexedRule]]]  # param -> slot index -> (HF name, rule)

    @property
    def num_slots(self) -> int:
        return sum(len(s) for s in self.slots.values())

    def read(self, source: TensorSource, param: str, box: Sequence[slice] | None = None, on_slot=None) -> np.ndarray:
        """param[box] at its dtype. `on_slot()` is called after each HF tensor is read (progress)."""
        shape = self.param_shapes[param]
        box = normalize_box(box, shape)
        out = np.empty(box_shape(box), self.param_dtypes[param])
        slots = self.slots[param]
        depth = len(next(iter(slots)))  # the number of index axes (layer, expert) of this param
        index_box, inner = box[:depth], box[depth:]
        for index in itertools.product(*(range(s.start, s.stop) for s in index_box)):
            hf_name, rule = slots[index]
            at = tuple(i - s.start for i, s in zip(index, index_box))
            out[at] = _read_slot(source, hf_name, rule, shape[depth:], inner)
            if on_slot:
                on_slot()
        return out


def _read_slot(source: TensorSource, hf_name: str, rule: IndexedRule, slot_shape, box: Box) -> np.ndarray:
    transform = rule.transform
    if transform is None:
        return read_box(source, hf_name, box)
    if isinstance(transform, Layout):
        return transform.read(lambda hf_box: read_box(source, hf_name, hf_box), source.shapes[hf_name], box)
    value = transform(np.asarray(source.read(hf_name)))
    if value.shape != tuple(slot_shape):
        raise CheckpointMismatch(
            f"Checkpoint does not match its config: mis-shaped tensors: [{hf_name}: {source.shapes[hf_name]} gives "
            f"{value.shape}, expected {tuple(slot_shape)}]"
        )
    return value[box]


def plan_indexed(
    source: TensorSource,
    rules: Iterable[IndexedRule],
    ignores: Iterable[Ignore],
    param_shapes: dict[str, tuple[int, ...]],
    dtype: np.dtype,
    param_dtypes: dict[str, np.dtype] | None = None,
) -> Plan:
    """Match every HF tensor name to one slot, without reading any tensor data; raise one error naming every
    unknown, ambiguous, duplicate, mis-shaped or missing tensor.

    `param_dtypes` overrides `dtype` for a few params that must keep precision (e.g. a router's score bias, which
    decides expert choice by small margins and which HF keeps in float32).
    """
    rules = [(re.compile(r.pattern + r"\Z"), r) for r in rules if r.param in param_shapes]
    ignores = [re.compile(i.pattern + r"\Z") for i in ignores]
    slots: dict[str, dict[tuple[int, ...], tuple[str, IndexedRule]]] = {name: {} for name in param_shapes}
    unknown, ambiguous, duplicate, bad_shape = [], [], [], []
    for hf_name in sorted(source.shapes):
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
        if index in slots[rule.param]:
            duplicate.append(hf_name)
            continue
        target_shape = param_shapes[rule.param][len(index) :]
        try:
            converted = rule.slot_shape(source.shapes[hf_name])
        except ValueError as error:
            hf_shape = source.shapes[hf_name]
            bad_shape.append(f"{hf_name}: {hf_shape} cannot be laid out ({error}), expected {target_shape}")
            continue
        if converted is not None and converted != target_shape:
            bad_shape.append(f"{hf_name}: {source.shapes[hf_name]} gives {converted}, expected {target_shape}")
            continue
        slots[rule.param][index] = (hf_name, rule)
    filled = {(param, index) for param, s in slots.items() for index in s}
    missing = _missing_indexed(param_shapes, filled, [r for _, r in rules])
    _raise_on_mismatch(missing=missing, unknown=unknown, duplicate=duplicate, bad_shape=bad_shape, ambiguous=ambiguous)
    dtypes = {name: np.dtype((param_dtypes or {}).get(name, dtype)) for name in param_shapes}
    return Plan(dict(param_shapes), dtypes, slots)


def convert_indexed(
    source: TensorSource,
    rules: Iterable[IndexedRule],
    ignores: Iterable[Ignore],
    param_shapes: dict[str, tuple[int, ...]],
    dtype: np.dtype,
    progress: Callable[[int, int], None] | None = None,
    param_dtypes: dict[str, np.dtype] | None = None,
) -> dict[str, np.ndarray]:
    """`convert` for `IndexedRule`s: every param read whole into host memory (see `plan_indexed` for the checks)."""
    plan = plan_indexed(source, rules, ignores, param_shapes, dtype, param_dtypes)
    return read_all(plan, source, progress)


def read_all(plan: Plan, source: TensorSource, progress: Callable[[int, int], None] | None = None):
    """Every param of `plan`, whole, as host arrays."""
    step, total = itertools.count(), plan.num_slots

    def tick():
        if progress:
            progress(next(step), total)

    return {name: plan.read(source, name, on_slot=tick) for name in plan.param_shapes}


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


def gqa_attention_rules(d: int, h: int, k: int, dh: int) -> list[tuple[str, str, Layout | None]]:
    """(HF name under a layer, param, transform) of a grouped-query attention block with optional q/k/v/o biases and
    per-head q/k norms (GLM-4.5, the DFlash drafters): width d, h query heads, k kv heads of width dh. A rule whose
    param a config lacks is never matched (the family's param shapes decide which exist)."""
    return [
        (r"self_attn\.q_proj\.weight", "wq", split_heads(d, h, dh)),
        (r"self_attn\.k_proj\.weight", "wk", split_heads(d, k, dh)),
        (r"self_attn\.v_proj\.weight", "wv", split_heads(d, k, dh)),
        (r"self_attn\.q_proj\.bias", "bq", split_head_bias(h, dh)),
        (r"self_attn\.k_proj\.bias", "bk", split_head_bias(k, dh)),
        (r"self_attn\.v_proj\.bias", "bv", split_head_bias(k, dh)),
        (r"self_attn\.q_norm\.weight", "q_norm", None),
        (r"self_attn\.k_norm\.weight", "k_norm", None),
        (r"self_attn\.o_proj\.weight", "wo", merge_heads_out(h, dh)),
    ]


def draft_vocab_slots(source: TensorSource, draft_size: int, vocab_size: int | None, required: bool,
                      prefix: str = "") -> tuple[dict[str, tuple[int, ...]], dict[str, Any]]:
    """The slots (shapes, dtypes) of a draft vocabulary's tensors, as EAGLE-3 heads store theirs: `d2t` [V'] (draft
    id d is token d + d2t[d]), filled when the checkpoint has it or `required`, and `t2d` [V] (a mask of the same
    tokens), optional. `vocab_size` None (a config that does not name it): t2d's length is the checkpoint's.
    `prefix`: the names' prefix in the checkpoint, as written there (e.g. "model.")."""
    shapes, dtypes = {}, {}
    if prefix + "d2t" in source.shapes or required:
        shapes["d2t"], dtypes["d2t"] = (draft_size,), np.int64
    if prefix + "t2d" in source.shapes:
        length = vocab_size if vocab_size is not None else source.shapes[prefix + "t2d"][0]
        shapes["t2d"], dtypes["t2d"] = (length,), np.bool_
    return shapes, dtypes


def take_vocab_ids(params: dict[str, Any], draft_size: int, vocab_size: int | None) -> np.ndarray:
    """Pop `d2t` (absent: the identity) and `t2d` from converted `params` -> the draft vocabulary's token ids,
    int32 [V']; raises unless they are distinct ids inside the vocabulary and t2d marks exactly them."""
    ids = np.arange(draft_size) + params.pop("d2t", np.zeros(draft_size, np.int64))
    limit = vocab_size if vocab_size is not None else np.inf
    if draft_size and (ids.min() < 0 or ids.max() >= limit or len(np.unique(ids)) != len(ids)):
        raise CheckpointError(f"d2t maps the {draft_size} draft ids to target tokens that are out of range "
                              f"[0, {vocab_size}) or repeated; it is not a draft vocabulary.")
    if "t2d" in params:
        marked = np.asarray(params.pop("t2d"), bool)
        if marked.sum() != len(ids) or ids.max(initial=-1) >= len(marked) or not marked[ids].all():
            raise CheckpointError("t2d does not mark exactly the target tokens that d2t maps the draft ids to "
                                  f"({int(marked.sum())} marked, {len(ids)} draft ids).")
    return ids.astype(np.int32)
