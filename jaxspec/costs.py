"""Step costs: measured on the machine that decodes (what the adaptive schedule prices drafts with), and the
weight-share estimates used where nothing is measured.

The adaptive schedule (jaxspec/schedule.py) drafts the length that maximises expected tokens per cost, so it is only
as good as its costs: a verify block of W tokens, in plain decoding steps, and one assistant forward, in target
steps. Both depend on the machine far more than on the model (memory bandwidth moves them from day to day on the
same machine), so `generate` measures them, once per architecture, machine and batch size bucket, and keeps them in
`step_costs.json` in the jaxspec cache folder (`$JAXSPEC_CACHE`, else ~/.cache/jaxspec), in milliseconds, keyed by
machine, backend, model shape, model code, batch and width. A verify block is priced at the batch it runs: on a CPU
a [8, 4] block costs far more plain steps than a [1, 4] block (eight rows already fill the matrix units a single
row leaves idle), so figures measured at batch 1 would make a batch draft where it does not pay. Costs depend on
shapes, not weights, so a model of the same architecture reuses them. A measurement compiles one forward loop per
measured width and runs it a few times.

`JAXSPEC_STEP_COSTS` chooses: `measure` (the default), `default` (the fixed figures of
`jaxspec.schedule.default_verify_costs` and the weight-bytes ratio for an assistant: deterministic, what the test
suite uses), or `remeasure` (measure again on every call and overwrite the stored entries: after the machine changed).
Sharded and multi-process runs keep the fixed figures: a forward timed on one device says little about a mesh.
See docs/design.md, 'Step costs measured on the machine'.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import json
import os
import platform
import tempfile
import time

import jax
import jax.numpy as jnp
from flax import nnx

import numpy as np

from .head import verify_head
from .loading import Model

MODES = ("measure", "default", "remeasure")
CACHE_FILE = "step_costs.json"
CACHE_SIZE = 512  # positions of the cache the timed forwards write (decoding sizes its cache to the call)
START_POSITION = 200  # where the timed forwards start: attention reads a realistic prefix
STEPS = 4  # forwards per timed loop
RUNS = 3  # timed runs per loop; the fastest counts (the others met a busier machine)
MAX_COST_BATCH = 64  # larger batches are priced with costs measured at this many rows


def mode() -> str:
    """`JAXSPEC_STEP_COSTS`, checked: a misspelt value is an error, not a silent fallback."""
    value = os.environ.get("JAXSPEC_STEP_COSTS", "measure").strip().lower() or "measure"
    if value not in MODES:
        raise ValueError(f"JAXSPEC_STEP_COSTS={value!r} is not one of {', '.join(MODES)}.")
    return value


def measurable(*models: Model) -> bool:
    """Whether timing these models here says what decoding will cost: one process, each model on one device."""
    if jax.process_count() > 1:
        return False
    leaves = [leaf for model in models for leaf in jax.tree_util.tree_leaves(nnx.state(model.module, nnx.Param))]
    return all(len(leaf.devices()) == 1 for leaf in leaves)


def forward_milliseconds(model: Model, widths: tuple[int, ...], *, batch: int = 1, verifying: bool = True,
                         remeasure: bool = False) -> dict[int, float]:
    """Milliseconds of one `model` forward of `batch` rows for each width, from the cache file or measured now.

    `verifying`: time the forward as verification runs it (with the CPU verify head of jaxspec/head.py where the
    loop uses one), else as a drafting assistant runs it (its own head)."""
    prefix = _key_prefix(model, verifying)
    shape = "" if batch == 1 else f"{batch}x"  # batch 1 keeps the keys it always had
    keys = {w: f"{prefix}|{shape}{w}" for w in widths}
    stored = _stored(keys.values(), remeasure, lambda missing: {
        keys[w]: ms for w, ms in _measure(model, tuple(w for w in widths if keys[w] in missing), verifying,
                                          batch).items()})
    return {w: stored[keys[w]] for w in widths}


def _stored(keys, remeasure: bool, measure) -> dict[str, float]:
    """{key: milliseconds} for `keys`: from the cache file, and `measure(missing keys) -> {key: ms}` for the rest,
    which are written to it. Rounded as stored, so this call prices the schedule exactly as later ones that read the
    file (the same costs, the same compiled loop)."""
    stored = {} if remeasure else _read_cache()
    missing = [key for key in keys if key not in stored]
    if missing:
        measured = {key: round(ms, 4) for key, ms in measure(missing).items()}
        _write_cache(measured)
        stored = stored | measured
    return {key: float(stored[key]) for key in keys}


def cost_batch(batch: int) -> int:
    """The batch size costs are measured at for a call of `batch` rows: the next power of two, so that nearby batch
    sizes share one measurement (relative costs change slowly with the batch), at most MAX_COST_BATCH."""
    return min(1 << (batch - 1).bit_length(), MAX_COST_BATCH)


def price_schedule(drafter, target: Model, assistant: Model | None, batch: int = 1):
    """`drafter` with its adaptive schedule priced by step costs measured at the call's batch (`cost_batch`): each
    verify width's forward over a plain step's, and, for an assistant that drafts one token per forward, its forward
    over the target's; an MTP draft, one depth step over its window timed the same way; a DFlash round, its drafting
    work (`time_block_drafts`) as the schedule's `round_cost`; an EAGLE-3 round, its window and each further head step
    (`time_head_rounds`). Early exit keeps its draft cost, a share of the
    target's weights (E of L layers and the head: large blocks, whose bytes say what they cost); copied drafts
    (prompt lookup) cost nothing. Unchanged where the schedule is not adaptive, where `JAXSPEC_STEP_COSTS=default`,
    and for sharded or multi-process runs."""
    schedule = getattr(drafter, "schedule", None)
    if schedule is None or schedule.kind != "adaptive" or not schedule.widths:
        return drafter
    chosen = mode()
    models = (target,) if assistant is None else (target, assistant)
    if chosen == "default" or not measurable(*models):
        return drafter
    remeasure = chosen == "remeasure"
    entries = schedule.entry_widths  # a tree's depth d verifies F d + 1 entries
    measured = tuple(sorted({1, 2, max(entries)}))  # widths always hold 1 and K + 1 >= 2
    rows = cost_batch(batch)
    target_ms = forward_milliseconds(target, measured, batch=rows, remeasure=remeasure)
    # A wider block holds a narrower one's work and more, so it never costs less: a measurement that says otherwise
    # met a busier machine for the narrower block, and is raised to it rather than stored as a bargain.
    relative = np.maximum.accumulate([interpolate(target_ms, w) / target_ms[1] for w in entries])
    verify_costs = tuple(round(float(cost), 2) for cost in relative)
    chain_costs = schedule.chain_costs
    if schedule.branches:  # a tree schedule also prices the chain alone, at blocks of w entries
        chain = np.maximum.accumulate([interpolate(target_ms, w) / target_ms[1] for w in schedule.widths])
        chain_costs = tuple(round(float(cost), 2) for cost in chain)
    draft_cost, round_cost = schedule.draft_cost, schedule.round_cost
    if drafter.drafts_with_block_forward:
        block_ms = block_draft_milliseconds(target, assistant, drafter.max_draft, batch=rows, remeasure=remeasure)
        round_cost = round(block_ms / target_ms[1], 3)
    elif drafter.drafts_with_head_steps:
        # Every round runs the head over a window of K + 1 entries first (jaxspec/strategies/eagle3.py)
        one, chain = (head_round_milliseconds(target, assistant, drafts, drafter.max_draft + 1, batch=rows,
                                              remeasure=remeasure) for drafts in (1, drafter.max_draft))
        step_ms = (chain - one) / (drafter.max_draft - 1) if drafter.max_draft > 1 else one
        draft_cost, round_cost = round(step_ms / target_ms[1], 3), round(max(one - step_ms, 0.0) / target_ms[1], 3)
    elif drafter.drafts_with_assistant_forwards and assistant is not target:
        assistant_ms = forward_milliseconds(assistant, (1,), batch=rows, verifying=False, remeasure=remeasure)[1]
        draft_cost = round(assistant_ms / target_ms[1], 3)
    elif drafter.drafts_with_mtp_steps:
        window = drafter.max_draft + 1  # each depth runs over the last K + 1 positions (jaxspec/strategies/mtp.py)
        draft_cost = round(mtp_step_milliseconds(target, window, batch=rows, remeasure=remeasure) / target_ms[1], 3)
    priced = dataclasses.replace(schedule, verify_costs=verify_costs, draft_cost=draft_cost, round_cost=round_cost,
                                 chain_costs=chain_costs)
    return dataclasses.replace(drafter, schedule=priced)


def mtp_step_milliseconds(model: Model, window: int, *, batch: int = 1, remeasure: bool = False) -> float:
    """Milliseconds of one MTP depth step over `window` positions of `batch` rows with its draft head, from the
    cache file or measured now (`time_mtp_steps`)."""
    key = f"{_key_prefix(model, verifying=False)}|mtp|{batch}x{window}"
    return _stored([key], remeasure, lambda missing: {key: time_mtp_steps(model, window, batch=batch)})[key]


def time_mtp_steps(model: Model, window: int, *, batch: int = 1, steps: int = STEPS, runs: int = RUNS,
                   cache_size: int = CACHE_SIZE) -> float:
    """Milliseconds per MTP depth step as a drafting round runs it: depth 0 over `window` positions, writing its
    cache in place, then its draft head on the last position (the head gathered once, as decoding does)."""
    graphdef, state = nnx.split(model.module)
    width = model.config.hidden_size

    def loop(state, caches):
        module = nnx.merge(graphdef, state)
        head = module.draft_head() if getattr(module.cfg, "draft_vocab_size", 0) else None

        def step(i, carry):
            caches, prev, checksum = carry
            tokens = jnp.ones((batch, window), jnp.int32)
            positions = jnp.broadcast_to(START_POSITION + i + jnp.arange(window), (batch, window))  # [B, W]
            out, _, caches = module.mtp_step(0, tokens, prev, positions, caches)
            logits = module.draft_logits(out[:, -1], head) if head is not None else module.logits(out[:, -1])
            return caches, out, checksum + logits[0, 0]  # a result that depends on every step

        start = (caches, jnp.zeros((batch, window, width), model.dtype), jnp.zeros((), jnp.float32))
        return jax.lax.fori_loop(0, steps, step, start)

    run = jax.jit(loop, donate_argnums=1)
    return _best_milliseconds(lambda caches: run(state, caches), model.module.init_mtp_cache(batch, cache_size,
                                                                                             depths=1), steps, runs)


def block_draft_milliseconds(target: Model, drafter: Model, drafts: int, *, batch: int = 1,
                             remeasure: bool = False) -> float:
    """Milliseconds of one DFlash drafting round's own work for `batch` rows and `drafts` drafts, from the cache file
    or measured now (`time_block_drafts`)."""
    drafter_prefix = _key_prefix(drafter, verifying=False)
    key = (f"{_key_prefix(target, verifying=True)}|block|{hashlib.sha256(drafter_prefix.encode()).hexdigest()[:16]}"
           f"|{batch}x{drafts}")
    stored = _stored([key], remeasure, lambda missing: {key: time_block_drafts(target, drafter, drafts, batch=batch)})
    return stored[key]


def time_block_drafts(target: Model, drafter: Model, drafts: int, *, batch: int = 1, steps: int = STEPS,
                      runs: int = RUNS, cache_size: int = CACHE_SIZE) -> float:
    """Milliseconds per DFlash drafting round as jaxspec/strategies/dflash.py runs one: the last round's K + 1 tapped
    states projected and written into the drafter's context cache, one drafter forward over its block, and the
    target's head (as verification holds it) over the `drafts` drafting positions. Besides the drafter's weights, a
    block reads the whole head: on a small target that is a fifth of a step, which the drafter's weight share
    leaves out."""
    target_graphdef, target_state = nnx.split(target.module)
    drafter_graphdef, drafter_state = nnx.split(drafter.module)
    head = verify_head(target, target_state, None)
    features = len(drafter.module.cfg.target_layer_ids) * target.config.hidden_size

    def loop(target_state, drafter_state, head, cache):
        target_module = nnx.merge(target_graphdef, target_state)
        module = nnx.merge(drafter_graphdef, drafter_state)
        head = target_module.head_matrix() if head is None else head

        def step(i, carry):
            cache, checksum = carry
            start = START_POSITION + i * (drafts + 1)
            written = jnp.broadcast_to(start - drafts - 1 + jnp.arange(drafts + 1), (batch, drafts + 1))
            context = module.project_context(jnp.ones((batch, drafts + 1, features), target.dtype))
            cache = module.write_context(context, written, cache)
            block = module.block_tokens(jnp.ones((batch,), jnp.int32))  # [B, W]
            embedded = target_module.embed_tokens(block)[..., : target.config.hidden_size]
            positions = start - 1 + jnp.arange(block.shape[1])[None, :] + jnp.zeros((batch, 1), jnp.int32)
            hidden = module.draft_block(embedded, positions, cache, jnp.full((batch,), start - 1, jnp.int32))
            logits = module.logits(hidden[:, 1:drafts + 1], head)  # [B, K, V]
            return cache, checksum + jnp.argmax(logits, axis=-1).sum().astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, step, (cache, jnp.zeros((), jnp.float32)))

    run = jax.jit(loop, donate_argnums=3)
    return _best_milliseconds(lambda cache: run(target_state, drafter_state, head, cache),
                              drafter.module.init_cache(batch, cache_size), steps, runs)


def head_round_milliseconds(target: Model, head: Model, drafts: int, window: int, *, batch: int = 1,
                            remeasure: bool = False) -> float:
    """Milliseconds of one EAGLE-3 drafting round's own work for `batch` rows, `drafts` drafts and a window of
    `window` entries, from the cache file or measured now (`time_head_rounds`)."""
    head_prefix = _key_prefix(head, verifying=False)
    key = (f"{_key_prefix(target, verifying=True)}|eagle3|{hashlib.sha256(head_prefix.encode()).hexdigest()[:16]}"
           f"|{batch}x{drafts}w{window}")
    stored = _stored([key], remeasure, lambda missing: {
        key: time_head_rounds(target, head, drafts, batch=batch, window=window)})
    return stored[key]


def time_head_rounds(target: Model, head: Model, drafts: int, *, batch: int = 1, steps: int = STEPS,
                     runs: int = RUNS, cache_size: int = CACHE_SIZE, window: int | None = None) -> float:
    """Milliseconds per EAGLE-3 drafting round as jaxspec/strategies/eagle3.py runs one with `drafts` drafts: the
    last round's tapped states projected (fc) and stored, the head over its window of `window` entries (K + 1;
    default drafts + 1), then drafts - 1 width-1 head steps; each draft's logits over the target's vocabulary.
    `price_schedule` takes a draft's cost from the difference between 1 and K drafts, and the rest as the round's."""
    from .strategies.eagle3 import draft_embedding

    target_graphdef, target_state = nnx.split(target.module)
    head_graphdef, head_state = nnx.split(head.module)
    window = window or drafts + 1
    taps = 3 * target.config.hidden_size
    width = head.module.cfg.hidden_size

    def loop(target_state, head_state, cache, features):
        target_module = nnx.merge(target_graphdef, target_state)
        module = nnx.merge(head_graphdef, head_state)

        def embed(tokens):
            return draft_embedding(target_module, module, tokens)

        def step(i, carry):
            cache, features, checksum = carry
            start = START_POSITION + i * window
            positions = jnp.broadcast_to(start + jnp.arange(window), (batch, window))  # [B, W]
            g = module.project_features(jnp.ones((batch, window, taps), target.dtype))
            features = features.at[jnp.arange(batch)[:, None], positions].set(g.astype(features.dtype))
            out, cache = module.step(embed(jnp.ones((batch, window), jnp.int32)), g, positions, cache)
            prev = out[:, -1:]
            token = jnp.argmax(module.target_logits(prev[:, -1]), axis=-1)
            for d in range(1, drafts):
                prev, cache = module.step(embed(token[:, None]), prev, positions[:, -1:] + d, cache)
                token = jnp.argmax(module.target_logits(prev[:, -1]), axis=-1)
            return cache, features, checksum + token.sum().astype(jnp.float32)

        return jax.lax.fori_loop(0, steps, step, (cache, features, jnp.zeros((), jnp.float32)))

    run = jax.jit(loop, donate_argnums=(2, 3))

    def timed(carry):
        cache, features = carry
        cache, features, checksum = run(target_state, head_state, cache, features)
        return (cache, features), checksum

    return _best_milliseconds(timed, (head.module.init_cache(batch, cache_size),
                                      jnp.zeros((batch, cache_size, width), head.dtype)), steps, runs)


def interpolate(milliseconds: dict[int, float], width: int) -> float:
    """A width's cost from the measured ones: linear between the nearest measured widths around it. Only 1, 2 and
    the widest block are measured (each width is a compile of the whole forward, which dominates a measurement);
    between 2 and K + 1 the cost of a CPU verify block grows close to linearly (`python benchmarks/bench_verify_width.py
    --widths 2,4,5,8,11` prints each width's)."""
    if width in milliseconds:
        return milliseconds[width]
    below = max(w for w in milliseconds if w < width)
    above = min(w for w in milliseconds if w > width)
    share = (width - below) / (above - below)
    return (1 - share) * milliseconds[below] + share * milliseconds[above]


def _key_prefix(model: Model, verifying: bool) -> str:
    """Machine, backend, architecture (config and parameter shapes, not values), the model code and head layout; a
    width follows."""
    state = nnx.state(model.module, nnx.Param)
    shapes = sorted((jax.tree_util.keystr(path), tuple(leaf.shape), str(leaf.dtype))
                    for path, leaf in jax.tree_util.tree_leaves_with_path(state))
    architecture = hashlib.sha256(repr((model.config, shapes)).encode()).hexdigest()[:16]
    code = _source_hash(os.path.dirname(inspect.getfile(type(model.module))))
    device = jax.devices()[0]
    machine = f"{platform.node()}/{platform.machine()}/{os.cpu_count()}"
    head = "verify" if verifying else "draft"
    return f"{machine}|{device.platform}:{device.device_kind}|{jax.__version__}|{architecture}|{code}|{head}"


@functools.cache
def _source_hash(folder: str) -> str:
    """A hash of the model package's source: a change to a forward (how attention reads the cache, say) changes
    what a step costs, so figures measured on older code are not reused."""
    digest = hashlib.sha256()
    for name in sorted(os.listdir(folder)):
        if name.endswith(".py"):
            with open(os.path.join(folder, name), "rb") as handle:
                digest.update(name.encode() + handle.read())
    return digest.hexdigest()[:12]


def _measure(model: Model, widths: tuple[int, ...], verifying: bool, batch: int) -> dict[int, float]:
    head = verify_head(model, nnx.split(model.module)[1], None) if verifying else None
    return time_forwards(model, widths, head, batch=batch)


def time_forwards(model: Model, widths: tuple[int, ...], head=None, steps: int = STEPS, runs: int = RUNS,
                  cache_size: int = CACHE_SIZE, batch: int = 1) -> dict[int, float]:
    """Milliseconds per forward of `model` over `batch` rows for each width, with `head` ([D, V], or None: the
    model's own): the best of `runs` timed runs of one compiled loop of `steps` forwards that writes a `cache_size`
    cache in place from position START_POSITION on, as decoding does (the cache is donated). Timing single calls
    instead would add a copy of the whole cache and a dispatch to every width, which hides most of the difference
    between widths."""
    graphdef, state = nnx.split(model.module)

    def loop(state, head, cache, width: int):
        module = nnx.merge(graphdef, state)

        def step(i, carry):
            cache, checksum = carry
            tokens = jnp.ones((batch, width), jnp.int32)
            positions = jnp.broadcast_to(START_POSITION + i * width + jnp.arange(width), (batch, width))  # [B, W]
            logits, _, cache = module(tokens, positions, cache, head=head)
            return cache, checksum + logits[0, 0, 0]  # a result that depends on every step

        return jax.lax.fori_loop(0, steps, step, (cache, jnp.zeros((), jnp.float32)))

    run = jax.jit(loop, static_argnums=3, donate_argnums=2)
    return {width: _best_milliseconds(lambda cache, width=width: run(state, head, cache, width),
                                      model.module.init_cache(batch, cache_size), steps, runs)
            for width in widths}


def _best_milliseconds(run, cache, steps: int, runs: int) -> float:
    """Milliseconds per step of `run(cache) -> (cache, ..., checksum)`, a compiled loop of `steps` steps that
    updates the donated `cache` in place: the best of `runs` timed calls after one that compiles."""
    cache, *_, checksum = run(cache)  # compiles
    jax.block_until_ready(checksum)
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        cache, *_, checksum = run(cache)
        jax.block_until_ready(checksum)
        best = min(best, (time.perf_counter() - start) / steps)
    return best * 1e3


def weight_bytes(module) -> int:
    """Bytes of the params one decoding step reads (what it costs when memory-bound): all but the MTP layers, which
    only the MTP strategy runs (a model with trained MTP layers never reads them as an assistant)."""
    params = nnx.state(module, nnx.Param)
    return sum(int(x.size) * x.dtype.itemsize for path, x in jax.tree_util.tree_leaves_with_path(params)
               if getattr(path[0], "key", None) != "mtp_layers")


def head_share(model: Model) -> float:
    """The LM head's share of the weights a decoding step reads."""
    cfg = model.config
    return min(1.0, cfg.vocab_size * cfg.hidden_size * np.dtype(model.dtype).itemsize / weight_bytes(model.module))


def mtp_draft_cost(model: Model) -> float:
    """One MTP draft in target decoding steps: each depth runs an eh_proj, one decoder block of the target's kind and
    the draft head (over the draft vocabulary where the model has one). A MoE block is priced as if every expert
    were read, which overestimates it."""
    cfg = model.config
    head = head_share(model)
    block = (1 - head) / cfg.num_layers
    eh_proj = 2 * cfg.hidden_size**2 * np.dtype(model.dtype).itemsize / weight_bytes(model.module)
    drafted_vocab = getattr(cfg, "draft_vocab_size", 0) or cfg.vocab_size
    return block + eh_proj + head * drafted_vocab / cfg.vocab_size


def cache_path() -> str:
    from .catalog import cache_root

    return os.path.join(cache_root(), CACHE_FILE)


def _read_cache() -> dict[str, float]:
    """The stored entries; an unreadable file counts as empty (it is rewritten whole on the next measurement)."""
    try:
        with open(cache_path(), encoding="utf-8") as handle:
            entries = json.load(handle)
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def _write_cache(entries: dict[str, float]) -> None:
    """Merge `entries` into the cache file, replacing it atomically. The file only saves time, so a folder that
    cannot be written is not an error: the next process measures again."""
    path = cache_path()
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        merged = _read_cache() | entries
        handle = tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), prefix=f".{CACHE_FILE}.",
                                             suffix=".tmp", delete=False, encoding="utf-8")
        with handle:
            json.dump(merged, handle, indent=0, sort_keys=True)
        os.replace(handle.name, path)
    except OSError:
        pass
