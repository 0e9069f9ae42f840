"""Int8 weights with dynamic int8 activations (W8A8): the projections of a quantized model.

A quantized weight keeps int8 values and one float32 scale per output channel (its symmetric absmax over the
contracted axes, over 127). A product quantizes its input the same way per token, multiplies int8 by int8 into
int32, and rescales by both scales. Each matmul of a decoding step then reads a quarter of its float32 bytes and
multiplies integers, which is what makes a small assistant cheaper per draft (see docs/design.md, 'int8
assistants'). A drafter's errors cost acceptance, never correctness: the target verifies every draft.

Names: `project(spec, x, w)` is `jnp.einsum(spec, x, w)` for a plain array and the W8A8 product for an
`Int8Weight`, so model code has one call for both; a `TransposedWeight` (a float weight stored with its contracted
axes last, as jaxspec lays projections out on a CPU: jaxspec/layout.py) multiplies as the weight it stands for.
Specs contract the trailing axes of `x` with leading or trailing axes of `w` and share no batch axis between them,
as every projection of the model families does.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import jax
import jax.numpy as jnp
from flax import nnx

INT8_MAX = 127.0


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Int8Weight:
    """A weight stored as int8 `values` times a float32 `scale` that has the weight's rank, with size 1 on the
    contracted axes (one scale per output channel)."""

    values: jax.Array  # int8, the weight's shape
    scale: jax.Array  # float32, the weight's shape with its contracted axes of size 1

    @property
    def T(self) -> "Int8Weight":  # noqa: N802 (the array attribute it stands in for)
        return Int8Weight(self.values.T, self.scale.T)

    def __getitem__(self, ids: jax.Array) -> "Int8Weight":
        """Rows `ids` of a [V, D] table whose scale is per row ([V, 1]), still quantized (a draft head's rows)."""
        return Int8Weight(self.values[ids], self.scale[ids])


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class TransposedWeight:
    """A float weight stored as its transpose by `perm`, which puts the contracted axes last ([out, in] for a
    matrix). `project` contracts the stored array directly (no transpose is computed); `logical()` is the weight in
    the layout the model code names (e.g. wq [D, H, Dh], stored [H, Dh, D]).

    A member of a fused group (`fuse`: a layer's q, k and v, or its gate and up) holds the whole group's buffer in
    `values`, its members concatenated along the first stored axis, and is slice `member` of it: every member of
    the group holds the same array, so the group costs one weight's memory, and `project_group` multiplies it once.
    """

    values: jax.Array  # the weight transposed by `perm`; in a fused group, every member's, concatenated on axis 0
    perm: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))  # stored axis i is logical axis perm[i]
    # A fused group's members' sizes along the first stored axis, in order (empty: not fused), and this one's place
    group: tuple[int, ...] = dataclasses.field(default=(), metadata=dict(static=True))
    member: int = dataclasses.field(default=0, metadata=dict(static=True))
    # A layer's slice of the CPU layer stack, read inside a loop over the layers (jaxspec/layer_stack.py). XLA:CPU
    # copies such a slice out before any of its product kernels reads it, so the one-pass `_multiply_reduce` gains
    # nothing there, and from 8 rows loses: such a weight keeps its matrix products (`multiply_reduce_pays`).
    sliced: bool = dataclasses.field(default=False, metadata=dict(static=True))

    def __getitem__(self, key):
        """`param[...]`, as nnx reads a Variable's value: the weight itself (only `...` is meaningful)."""
        if key is not Ellipsis:
            raise TypeError("A TransposedWeight is indexed whole ([...]); call .logical() for its array.")
        return self

    def __setitem__(self, key, value):
        """`param[...] = w`, as nnx writes a Variable's value: `w` in the logical layout, stored transposed. A fused
        member leaves its group (its own array from now on; the others keep theirs in the group's buffer)."""
        if key is not Ellipsis or tuple(value.shape) != self.shape:
            raise TypeError(f"A TransposedWeight is written whole ([...] = an array of shape {self.shape}).")
        self.values = jnp.transpose(jnp.asarray(value, self.values.dtype), self.perm)
        self.group, self.member = (), 0

    @property
    def shape(self) -> tuple[int, ...]:
        stored = (self.group[self.member],) + self.values.shape[1:] if self.group else self.values.shape
        return tuple(stored[self.perm.index(axis)] for axis in range(len(self.perm)))

    @property
    def dtype(self):
        return self.values.dtype

    @property
    def stored(self) -> jax.Array:
        """This weight's own stored array: `values`, or a fused member's slice of its group's buffer."""
        if not self.group:
            return self.values
        start = sum(self.group[: self.member])
        return jax.lax.slice_in_dim(self.values, start, start + self.group[self.member], axis=0)

    def logical(self) -> jax.Array:
        return jnp.transpose(self.stored, [self.perm.index(axis) for axis in range(len(self.perm))])

    def stored_axes(self, w_axes: str) -> str:
        """The stored array's axis letters for a spec that names the logical weight's axes `w_axes`."""
        return "".join(w_axes[axis] for axis in self.perm)


def contracted_last(w: jax.Array, contracted: tuple[int, ...]) -> TransposedWeight:
    """`w` stored with its `contracted` axes last, the others first in their order ([in, out] -> [out, in])."""
    perm = tuple(a for a in range(w.ndim) if a not in contracted) + tuple(contracted)
    return TransposedWeight(jnp.transpose(w, perm), perm)


def fuse(weights: list[TransposedWeight]) -> list[TransposedWeight]:
    """`weights` (projections of one input, stored alike but for their first stored axis) as the members of one
    fused group: one buffer, their stored arrays concatenated along that axis, which each member holds."""
    buffer = jnp.concatenate([w.values for w in weights], axis=0)
    group = tuple(int(w.values.shape[0]) for w in weights)
    return [TransposedWeight(buffer, w.perm, group, i) for i, w in enumerate(weights)]


def fusable(weights) -> bool:
    """Whether `fuse` can join `weights`: unfused float TransposedWeights of one dtype whose stored arrays differ in
    their first axis only."""
    first = weights[0]
    return all(isinstance(w, TransposedWeight) and not w.group and w.perm == first.perm and w.dtype == first.dtype
               and w.values.shape[1:] == first.values.shape[1:] for w in weights)


def head_weight(module):
    """A causal LM's [D, V] head as `project` reads it fastest: a tied head is the embedding through `tied_head`
    (read in place on XLA:CPU), an untied head its own weight."""
    return tied_head(weight(module, "embed")) if module.cfg.tie_word_embeddings else weight(module, "lm_head")


def head_rows(module, ids: jax.Array):
    """[V', D]: the rows of a causal LM's head for token ids [V'] (a draft vocabulary), gathered from the tied
    embedding or the untied head, still quantized where the model is. Gathering reads as many bytes as one product
    over the rows, so a decoding call gathers them once, not every draft step."""
    table = weight(module, "embed") if module.cfg.tie_word_embeddings else logical(weight(module, "lm_head")).T
    return table[ids]


def tied_head(embed):
    """A tied [V, D] embedding as the [D, V] head: on XLA:CPU a `TransposedWeight` (a row's logits are then the
    matrix-vector product embed @ h, the embedding read in place), elsewhere the transposed view XLA folds in."""
    if isinstance(embed, Int8Weight) or jax.default_backend() != "cpu":
        return embed.T
    return TransposedWeight(embed, (1, 0))


def logical(w):
    """A param as the model code names its layout: the array behind a `TransposedWeight`, anything else as is."""
    return w.logical() if isinstance(w, TransposedWeight) else w


SCALE_SUFFIX = "_scale"  # a quantized param `w` of a module has its scales in the param `w_scale`


def weight(module, name: str):
    """The module's param `name`: an `Int8Weight` when the module holds its scales, else the array."""
    values = getattr(module, name)[...]
    scale = getattr(module, name + SCALE_SUFFIX, None)
    return values if scale is None else Int8Weight(values, scale[...])


def layer_params(module) -> dict:
    """{name: array or Int8Weight} of every param of a layer module, scales folded into their weights."""
    names = [name for name, v in vars(module).items() if isinstance(v, nnx.Param)]
    return {name: weight(module, name) for name in names if not _is_scale(module, name)}


def _is_scale(module, name: str) -> bool:
    return name.endswith(SCALE_SUFFIX) and hasattr(module, name[: -len(SCALE_SUFFIX)])


def lookup(table, ids: jax.Array, dtype) -> jax.Array:
    """Embedding rows `ids` of a [V, D] table, plain or quantized per row: [..., D] in `dtype`."""
    if isinstance(table, Int8Weight):
        return table.values[ids].astype(dtype) * table.scale[ids].astype(dtype)
    return table[ids]


def quantize(w: jax.Array, contracted: tuple[int, ...]) -> tuple[jax.Array, jax.Array]:
    """Symmetric per-channel int8: (values int8 [w.shape], scale float32 [w.shape, contracted axes of size 1])."""
    w = w.astype(jnp.float32)
    scale = jnp.max(jnp.abs(w), axis=contracted, keepdims=True) / INT8_MAX
    scale = jnp.where(scale > 0, scale, 1.0)  # an all-zero channel stays zero
    return jnp.clip(jnp.round(w / scale), -INT8_MAX, INT8_MAX).astype(jnp.int8), scale


def project(spec: str, x: jax.Array, w, preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)`, or the W8A8 product when `w` is an `Int8Weight` (result in x's dtype, or
    `preferred_element_type`)."""
    if isinstance(w, TransposedWeight):
        return _transposed_product(spec, x, w, preferred_element_type)
    if not isinstance(w, Int8Weight):
        return jnp.einsum(spec, x, w, preferred_element_type=preferred_element_type)
    x_axes, w_axes, out_axes = _parse(spec, x.ndim)
    contracted = [a for a in x_axes if a in w_axes and a not in out_axes]
    if set(x_axes) & set(w_axes) - set(contracted):
        raise NotImplementedError(f"int8 products need specs without batch axes shared by both operands: {spec!r}")

    x32, x_axes, out_axes, unit_axis = _with_unit_axis(x.astype(jnp.float32), x_axes, w_axes, out_axes, contracted)
    x_contracted = tuple(x_axes.index(a) for a in contracted)
    x_scale = jnp.max(jnp.abs(x32), axis=x_contracted, keepdims=True) / INT8_MAX  # per token
    x_scale = jnp.where(x_scale > 0, x_scale, 1.0)
    x_q = jnp.clip(jnp.round(x32 / x_scale), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    x_q, pad_axis = _pad_single_row(x_q, x_axes, contracted)
    product = jnp.einsum(f"{x_axes},{w_axes}->{out_axes}", x_q, w.values, preferred_element_type=jnp.int32)
    if pad_axis is not None:
        product = jax.lax.slice_in_dim(product, 0, 1, axis=out_axes.index(x_axes[pad_axis]))
    out = (product.astype(jnp.float32) * _to_output(x_scale, x_axes, contracted, out_axes)
           * _to_output(w.scale, w_axes, contracted, out_axes))
    if unit_axis is not None:
        out = jnp.squeeze(out, out_axes.index(unit_axis))
    return out.astype(preferred_element_type or x.dtype)


def project_group(spec: str, x: jax.Array, weights) -> tuple[jax.Array, ...]:
    """`tuple(project(spec, x, w) for w in weights)`, as one product where `weights` are the members of one fused
    group in order (`fuse`: XLA:CPU spreads one product over its threads better than several small ones, 'Weights
    on a CPU' in docs/design.md), split along the output axis of the first stored one."""
    first = weights[0]
    whole = (isinstance(first, TransposedWeight) and len(first.group) == len(weights)
             and all(isinstance(w, TransposedWeight) and w.group == first.group and w.member == i
                     for i, w in enumerate(weights)))
    if not whole:
        return tuple(project(spec, x, w) for w in weights)
    out = _transposed_product(spec, x, dataclasses.replace(first, group=(), member=0), None)
    x_axes, w_axes, out_axes = _parse(spec, x.ndim)
    axis = out_axes.index(first.stored_axes(w_axes)[0])
    return tuple(jnp.split(out, list(itertools.accumulate(first.group[:-1])), axis=axis))


# A weight is multiplied by a few rows as an elementwise product and a sum (`_multiply_reduce`): XLA:CPU's matrix
# multiply of a few rows reads its weight more slowly than one row's product does, and the elementwise product reads
# it once for all rows. From 2 rows; to 32 for a weight of LARGE_WEIGHT elements or more (a tied head, a large model's
# MLP), to 16 for the others (at 32 rows they gained nothing measurable in plain steps of SmolLM2, Gemma 3 or
# Qwen2.5-0.5B). Until 2026-12-07 only large weights took it, from 3 rows: benchmarks/bench_weight_layout.py times that
# rule beside this one (its side "large weights only"; docs/design.md, 'Every weight by 2-16 rows').
MULTIPLY_REDUCE_MIN_ROWS, MULTIPLY_REDUCE_MAX_ROWS = 2, 32
LARGE_WEIGHT = 1 << 23
SMALL_WEIGHT_MAX_ROWS = 16


def multiply_reduce_pays(w: TransposedWeight, rows: int) -> bool:
    """Whether `_transposed_product` multiplies `rows` rows by `w` as `_multiply_reduce`: on XLA:CPU, from
    MULTIPLY_REDUCE_MIN_ROWS rows to MULTIPLY_REDUCE_MAX_ROWS (a large weight) or SMALL_WEIGHT_MAX_ROWS, unless `w` is
    a slice of the layer stack read inside the layer loop (`TransposedWeight.sliced`)."""
    most = MULTIPLY_REDUCE_MAX_ROWS if math.prod(w.shape) >= LARGE_WEIGHT else SMALL_WEIGHT_MAX_ROWS
    return jax.default_backend() == "cpu" and not w.sliced and MULTIPLY_REDUCE_MIN_ROWS <= rows <= most


def _transposed_product(spec: str, x: jax.Array, w: TransposedWeight, preferred_element_type) -> jax.Array:
    """`project` for a weight stored contracted axes last, as matrix products that XLA:CPU runs on it in place.

    The weight is flattened to [O, C] and x to [N, C]. One row is the matrix-vector product w @ x, the weight as the
    left operand: as the right one, XLA would first copy it into [C, O] (its dot canonicalization wants a right
    operand's contracted axes first). More rows multiply x by the weight's 2-D transpose, which the matrix multiply
    reads in place, where `multiply_reduce_pays` does not send them to `_multiply_reduce` (2 to 16 or 32 rows on
    XLA:CPU). A spec whose contracted axes are not x's trailing ones in the stored order falls back to an einsum (no
    model code has one)."""
    x_axes, w_axes, out_axes = _parse(spec, x.ndim)
    stored = w.stored_axes(w_axes)
    contracted = "".join(a for a in stored if a in x_axes and a not in out_axes)
    free_x, free_w = x_axes[: len(x_axes) - len(contracted)], stored[: len(stored) - len(contracted)]
    if not (x_axes.endswith(contracted) and stored.endswith(contracted)) or sorted(out_axes) != sorted(free_x + free_w):
        return jnp.einsum(f"{x_axes},{stored}->{out_axes}", x, w.stored, preferred_element_type=preferred_element_type)
    rows, inner = math.prod(x.shape[: len(free_x)]), math.prod(x.shape[len(free_x):])
    values = w.stored
    w2 = values.reshape(-1, inner)  # [O, C]
    x2 = x.reshape(rows, inner)  # [N, C]
    if rows == 1:
        out = jnp.matmul(w2, x2[0], preferred_element_type=preferred_element_type)[None]  # [1, O]
    elif multiply_reduce_pays(w, rows):
        out = _multiply_reduce(x2, w2, preferred_element_type)
    else:
        out = jnp.matmul(x2, w2.T, preferred_element_type=preferred_element_type)  # [N, O]
    out = out.reshape(x.shape[: len(free_x)] + values.shape[: len(free_w)])
    return jnp.transpose(out, [(free_x + free_w).index(a) for a in out_axes])


def _multiply_reduce(x2: jax.Array, w2: jax.Array, preferred_element_type) -> jax.Array:
    """x2 [N, C] by w2 [O, C] -> [N, O], as one elementwise product summed over C in [O, N, C] order.

    For 2 to 32 rows (`multiply_reduce_pays`), XLA:CPU runs this as one pass that reads each weight row once for all
    N rows, where its matrix multiply of a few rows reads the weight more slowly than one row's product does. Beyond 4
    rows, x2 is padded with zero rows to a multiple of 8, which XLA:CPU vectorizes better (figures: docs/design.md, 'A
    head by 3-32 rows' and 'Every weight by 2-16 rows')."""
    rows = x2.shape[0]
    padded = rows if rows <= 4 else -(-rows // 8) * 8
    x2 = jnp.pad(x2, ((0, padded - rows), (0, 0)))
    dtype = preferred_element_type or jnp.result_type(x2, w2)
    return jnp.sum(w2[:, None, :].astype(dtype) * x2[None, :, :].astype(dtype), axis=-1).T[:rows]  # [N, O]


def _with_unit_axis(x: jax.Array, x_axes: str, w_axes: str, out_axes: str, contracted: list[str]):
    """On XLA:CPU, an input with a single free (not contracted) axis gets a leading unit axis.
    -> (x, x_axes, out_axes, the added axis or None).

    Against a weight read through a transpose (a tied int8 head: the [V, D] embedding read as [D, V]), XLA:CPU
    lowers the s8 x s8 product of a [T, D] input by converting both operands to int32 and running a generic integer
    dot, many times slower than the int8 kernel it picks for the same product of a [1, T, D] input. A catch-up
    computes its assistant's logits from [B, D] hidden states, so without the unit axis an int8 assistant would pay
    that on every drafting round (see docs/design.md, 'int8 assistants')."""
    if jax.default_backend() != "cpu" or sum(a not in contracted for a in x_axes) != 1:
        return x, x_axes, out_axes, None
    unit = next(c for c in "abcdefghijklmnopqrstuvwxyz" if c not in x_axes + w_axes + out_axes)
    return x[None], unit + x_axes, unit + out_axes, unit


def _parse(spec: str, x_ndim: int) -> tuple[str, str, str]:
    """The spec's three axis strings, with `...` spelt out as letters the spec does not use."""
    inputs, out_axes = spec.replace(" ", "").split("->")
    x_axes, w_axes = inputs.split(",")
    if "..." in x_axes:
        free = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in spec]
        ellipsis = "".join(free[: x_ndim - (len(x_axes) - 3)])
        x_axes, out_axes = x_axes.replace("...", ellipsis), out_axes.replace("...", ellipsis)
    return x_axes, w_axes, out_axes


def _pad_single_row(x_q: jax.Array, x_axes: str, contracted: list[str]) -> tuple[jax.Array, int | None]:
    """On XLA:CPU a one-row int8 product falls back to a slow generic kernel, while two rows take the fast integer
    path: a single row is padded with a zero row (whose product is sliced off). -> (x_q, padded axis or None)."""
    rows = [i for i, a in enumerate(x_axes) if a not in contracted]
    if jax.default_backend() != "cpu" or not rows or math.prod(x_q.shape[i] for i in rows) != 1:
        return x_q, None
    axis = rows[-1]
    return jnp.concatenate([x_q, jnp.zeros_like(x_q)], axis=axis), axis


def _to_output(scale: jax.Array, axes: str, contracted: list[str], out_axes: str) -> jax.Array:
    """`scale` (rank of `axes`, size 1 on the contracted ones) laid out to broadcast against the output."""
    kept = [a for a in axes if a not in contracted]
    squeezed = scale.reshape([scale.shape[i] for i, a in enumerate(axes) if a not in contracted])
    ordered = jnp.transpose(squeezed, [kept.index(a) for a in out_axes if a in kept])
    return ordered.reshape([squeezed.shape[kept.index(a)] if a in kept else 1 for a in out_axes])
