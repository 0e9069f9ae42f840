"""Step costs: the adaptive schedule's prices, measured by running the compiled loop on the machine that decodes,
and the weight-share estimates used where nothing is measured.

The adaptive schedule (jaxspec/schedule.py) drafts the length that maximises expected tokens per cost, so it is only
as good as its prices: a verify block of each width, one draft, and a drafting round's fixed work, in rounds that
draft nothing (plain steps). They depend on the machine far more than on the model (memory bandwidth moves them
from day to day on the same machine), and on everything a round does besides its forwards: processors, verification,
cache writes, a drafter's windows and catch-up. So the prices are run-time inputs of the loop (`Prices`), and
`generate` measures them by running the call's own executables with every round forced to a verify width or a
draft length (`time_loop`): nothing compiles for it, and a price is what the loop really spends. They are measured
once per machine, model, drafter and batch size bucket and kept in `step_costs.json` in the jaxspec cache folder
(`$JAXSPEC_CACHE`, else ~/.cache/jaxspec), in milliseconds a round. A verify block is priced at the batch it runs:
on a CPU a [8, 4] block costs far more plain steps than a [1, 4] block (eight rows already fill the matrix units a
single row leaves idle), so figures measured at batch 1 would make a batch draft where it does not pay.

`JAXSPEC_STEP_COSTS` chooses: `measure` (the default), `default` (the drafter's own estimates: the fixed figures of
`jaxspec.schedule.default_verify_costs` and weight-bytes ratios for drafts; deterministic, what the test suite uses),
or `remeasure` (measure again on every call and overwrite the stored entries: after the machine changed). Sharded
and multi-process runs keep the estimates. See docs/design.md, 'Step costs measured on the machine'.
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

from . import inplace
from .loading import Model
from .prompts import choice_setting
from .schedule import Prices, Schedule
from .tree import TreeShape

MODES = ("measure", "default", "remeasure")
CACHE_FILE = "step_costs.json"
CACHE_SIZE = 512  # positions of the cache the timed forwards write (decoding sizes its cache to the call)
START_POSITION = 200  # where the timed forwards start: attention reads a realistic prefix
STEPS = 4  # forwards per timed loop (time_forwards)
RUNS = 3  # timed runs of a forward (time_forwards); the fastest counts (the others met a busier machine, or warmed it)
# time_loop: each configuration runs LOOP_RUNS timed calls (the fastest counts) of a few rounds each. A CPU's rounds
# take tens of milliseconds, so a call of 4 lasts 0.1-0.4 s, and three such calls priced SmolLM2's DFlash loop as
# closely as two of 8 did, 1.3 s sooner (docs/design.md, 'Step costs measured on the machine'). An accelerator's
# rounds take milliseconds, about what a call costs besides them (subtracted, but it jitters): 8 there.
LOOP_ROUNDS = {"cpu": 4}  # rounds per timed call, by backend
DEFAULT_LOOP_ROUNDS = 8
LOOP_RUNS = 3
# ... but a configuration stops after LOOP_MIN_RUNS where its timed calls so far agree within LOOP_AGREEMENT: a third
# call there moves no price, it only lengthens a first run
LOOP_MIN_RUNS = 2
LOOP_AGREEMENT = 0.05
# After the first run, each configuration's calls run as many rounds as last about as long as the unit's call (a
# round at width 1), and at least LOOP_MIN_ROUNDS: a round that costs three plain steps is timed in calls of 2, not
# 4. Equal durations give every configuration about the same protection from the machine's jitter, and the
# expensive configurations (wide blocks, long drafts, large batches) stop dominating a first run
# (docs/design.md, 'Step costs measured on the machine').
LOOP_MIN_ROUNDS = 2
MAX_COST_BATCH = 64  # larger batches are priced with costs measured at this many rows


def mode() -> str:
    """`JAXSPEC_STEP_COSTS`, checked: a misspelt value is an error, not a silent fallback."""
    return choice_setting("JAXSPEC_STEP_COSTS", MODES)


def measurable(*models: Model) -> bool:
    """Whether timing these models here says what decoding will cost: one process, each model on one device."""
    if jax.process_count() > 1:
        return False
    leaves = [leaf for model in models for leaf in jax.tree_util.tree_leaves(nnx.state(model.module, nnx.Param))]
    return all(len(leaf.devices()) == 1 for leaf in leaves)


def _stored(keys, remeasure: bool, measure) -> dict[str, float]:
    """{key: milliseconds} for `keys`: from the cache file, and `measure(missing keys) -> {key: ms}` for the rest,
    which are written to it. Rounded as stored, so this call prices the schedule exactly as later ones that read the
    file (the same costs, the same compiled loop)."""
    stored = {} if remeasure else read_cache()
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


def price_loop(call, prefill, rounds, target: Model, assistant: Model | None, batch: int) -> Prices | None:
    """The adaptive schedule's prices for this compiled loop, measured by running it (`time_loop`) at the call's
    batch and stored for its batch bucket (`cost_batch`), or read from the cache file. None where the schedule is
    not priced, where `JAXSPEC_STEP_COSTS=default`, and for sharded or multi-process runs: the loop then keeps the
    drafter's own estimates.

    Each price is in rounds that draft nothing (plain steps): a verify block of each width, one draft, and the fixed
    work of a round that drafts at all. Every width the loop compiled is timed: on a CPU the cost of a block is not
    linear in its width, and prices interpolated on a line made the schedule buy middle widths that did not pay
    (docs/design.md, 'Step costs measured on the machine', has the figures)."""
    spec = call.spec
    schedule = getattr(spec.drafter, "schedule", None)
    if schedule is None or not schedule.priced or spec.mesh is not None:
        return None
    chosen = mode()
    models = (target,) if assistant is None else (target, assistant)
    if chosen == "default" or not measurable(*models):
        return None
    widths = tuple(sorted({1} | set(spec.verify_widths)))
    drafts = _drafts_timed(spec.drafter)
    prefix = _loop_key_prefix(spec, target, assistant, cost_batch(batch), call.inputs.layer_stack is not None)
    keys = {f"{prefix}|verify|{w}": ("verify", w) for w in widths}
    keys |= {f"{prefix}|{part}": (part, 0) for part in ("draft", "round") if drafts}
    stored = _stored(keys, chosen == "remeasure", lambda missing: time_loop(call, prefill, rounds, widths, drafts,
                                                                            prefix))
    milliseconds = {keys[key]: ms for key, ms in stored.items()}
    return loop_prices(schedule, {w: milliseconds["verify", w] for w in widths},
                       milliseconds.get(("draft", 0)), milliseconds.get(("round", 0)))


def loop_prices(schedule: Schedule, verify_ms: dict[int, float], draft_ms: float | None = None,
                round_ms: float | None = None) -> Prices:
    """`schedule`'s prices from the loop's timings, in milliseconds a round: verify blocks by width (width 1, a
    round that drafts nothing, is the unit) and, for a drafter whose drafts cost work, one draft and the fixed work
    of a drafting round; a drafter whose drafts are not timed keeps its own draft prices."""
    unit = verify_ms[1]

    def relative(widths):
        # A wider block holds a narrower one's work and more, so it never costs less: a measurement that says
        # otherwise met a busier machine for the narrower block, and is raised to it rather than kept as a bargain.
        costs = np.maximum.accumulate([interpolate(verify_ms, w) / unit for w in widths])
        return tuple(round(float(cost), 3) for cost in costs)

    priced = dataclasses.replace(schedule, verify_costs=relative(schedule.entry_widths),
                                 chain_costs=relative(schedule.widths) if schedule.branches else ())
    if draft_ms is not None:
        priced = dataclasses.replace(priced, draft_cost=round(draft_ms / unit, 3), round_cost=round(round_ms / unit, 3))
    return priced.prices()


def _drafts_timed(drafter) -> tuple[int, ...]:
    """The forced draft lengths `time_loop` times: 1 and K for a drafter whose drafts cost work (its schedule's
    estimate says so), none for copied drafts (prompt lookup)."""
    schedule = drafter.schedule
    if schedule.draft_cost == 0 and schedule.round_cost == 0:
        return ()
    return tuple(sorted({1, drafter.max_draft}))


def time_loop(call, prefill, rounds, widths: tuple[int, ...], drafts: tuple[int, ...], prefix: str = "",
              rounds_per_run: int | None = None, runs: int = LOOP_RUNS,
              min_runs: int = LOOP_MIN_RUNS, match_durations: bool = True) -> dict[str, float]:
    """Milliseconds a round of the compiled loop itself, on the call's own prompts and batch.

    - `{prefix}|verify|{w}`: rounds that draft nothing and verify a block of w (the loop's `verify_floor`);
    - with `drafts` (chains forced to d drafts for each d, verified at width d + 1): `{prefix}|draft`, one more
      draft, and `{prefix}|round`, a drafting round's fixed work beyond its block and its drafts.

    Every run reuses the executables: the prices, the verify floor, the forced length, the EOS tokens (none, so rows run
    their rounds) and the confidence threshold (0, so every forced draft is proposed) are run-time inputs. A run calls
    the loop for `rounds_per_run` rounds (default: LOOP_ROUNDS for the backend), and for none: what a call costs besides
    its rounds (dispatching its arguments, reading its counters back) is the second call's time, and is not charged to
    the rounds: on a GPU it is milliseconds, enough to inflate a small model's rounds by a third and make every verify
    width look nearly free beside them (docs/design.md, 'On a GPU'). With `match_durations`, runs after the first
    size each configuration's calls to last about as long as the unit's (`matched_rounds`). Of up to `runs` runs the
    fastest round of each configuration counts; the configurations take turns, and stop after `min_runs` once every
    configuration's calls agree within LOOP_AGREEMENT.

    The prompts are read once: what a configuration forces is read by the rounds alone (tests/decode/test_costs.py
    checks that the prefilled states are equal), so every call that runs rounds starts from a copy of one prefilled
    state. Before the timed runs each configuration runs one untimed round: on XLA:CPU a branch's first execution in a
    process costs more, most for the widest blocks (figures: docs/design.md, 'Step costs measured on the machine')."""
    rounds_per_run = rounds_per_run or LOOP_ROUNDS.get(jax.default_backend(), DEFAULT_LOOP_ROUNDS)
    tokens, prompt_lengths = call.prefill_args[2], call.prefill_args[3]
    room = int(tokens.shape[1]) - int(np.max(np.asarray(prompt_lengths))) - call.spec.drafter.draft_slots - 2
    budget = jnp.full_like(call.prefill_args[4], max(room, 2))
    # The configurations take turns, run after run, so that a machine that slows down or speeds up while they are
    # timed moves all of them alike: timed one after the other, a drift became a false ratio between widths.
    configs = [(0, w) for w in widths] + [(d, 1) for d in drafts]
    timed = {config: timing_inputs(call.inputs, *config) for config in configs}
    prefill_args = call.prefill_args[:4] + (budget,) + call.prefill_args[5:6] + (timed[configs[0]],) + \
        call.prefill_args[7:]
    prefilled = prefill(*prefill_args)

    def one_call(inputs, max_rounds: int, state=None):
        """((seconds, rounds run, drafts proposed by the longest row), the state it left) of one call of the loop
        from `state`, else from a copy of the prefilled state (the loop takes over the buffers it is given)."""
        if state is None:
            state = jax.block_until_ready(jax.tree.map(jnp.copy, prefilled))
        start = time.perf_counter()
        state = rounds(call.target_state, call.assistant_state, state, inputs, jnp.asarray(max_rounds, jnp.int32))
        ran = int(state.counters.rounds)  # waits for the rounds
        return (time.perf_counter() - start, ran, float(np.max(np.asarray(state.counters.drafted)))), state

    for config in configs:
        one_call(timed[config], 1)
    calls = {config: [] for config in configs}  # each configuration's timed calls: (seconds, rounds, drafted)
    call_seconds = float("inf")  # a call that runs no round
    rounds_a_call = dict.fromkeys(configs, rounds_per_run)

    def seconds_a_round(this) -> float:
        seconds, ran, _ = this
        return max(seconds - call_seconds, 0.0) / ran if ran else float("inf")

    def agreeing(config) -> bool:
        times = [seconds_a_round(this) for this in calls[config]]
        return max(times) <= (1 + LOOP_AGREEMENT) * min(times)

    for run in range(runs):
        if run >= min_runs and all(agreeing(config) for config in configs):
            break
        for config in configs:
            this, left = one_call(timed[config], rounds_a_call[config])
            calls[config].append(this)
            # A call that runs no round reads nothing of its state, so it takes the one just left rather than a copy
            # of the prefilled state (a copy is tens of milliseconds at batch 8).
            call_seconds = min(call_seconds, one_call(timed[config], 0, state=left)[0][0])
        if run == 0 and match_durations:
            first = {config: seconds_a_round(calls[config][0]) for config in configs}
            # the unit: a round that drafts nothing at the narrowest width (1, as price_loop times it)
            rounds_a_call = matched_rounds(first, unit=(0, widths[0]), rounds_per_run=rounds_per_run)

    def per_round(config) -> tuple[float, float]:
        """(milliseconds a round, drafts a round of the longest row) of the configuration's fastest timed call."""
        fastest = min(calls[config], key=seconds_a_round)
        _, ran, drafted = fastest
        if not ran:
            return float("inf"), 0.0
        return seconds_a_round(fastest) * 1e3, drafted / ran

    measured = {f"{prefix}|verify|{w}": per_round((0, w))[0] for w in widths}
    if drafts:
        verify = {w: measured[f"{prefix}|verify|{w}"] for w in widths}
        draft_ms, round_ms = fit_drafting(verify, [per_round((d, 1))[::-1] for d in drafts])
        measured[f"{prefix}|draft"], measured[f"{prefix}|round"] = draft_ms, round_ms
    return measured


def matched_rounds(seconds_a_round: dict, unit, rounds_per_run: int) -> dict:
    """{configuration: rounds a timed call} so that each call lasts about as long as one of `rounds_per_run` rounds of
    the `unit` configuration, from what a round of each took: at least LOOP_MIN_ROUNDS, at most `rounds_per_run`."""
    target = rounds_per_run * seconds_a_round[unit]
    return {config: int(np.clip(round(target / seconds) if 0 < seconds < float("inf") else rounds_per_run,
                                min(LOOP_MIN_ROUNDS, rounds_per_run), rounds_per_run))
            for config, seconds in seconds_a_round.items()}


def timing_inputs(inputs, drafts: int, verify_floor: int):
    """The loop's inputs for a timed run (`LoopInputs.forcing`): every round drafting `drafts` (-1: the schedule
    decides) at a verify width of at least `verify_floor`, no EOS token (so rows run their rounds), and no
    confidence threshold (so every forced draft is proposed)."""
    processing = dataclasses.replace(inputs.processing, eos=jnp.full_like(inputs.processing.eos, -1))
    draft_inputs = dict(inputs.draft_inputs)
    if "confidence_threshold" in draft_inputs:
        draft_inputs["confidence_threshold"] = jnp.zeros_like(draft_inputs["confidence_threshold"])
    return dataclasses.replace(inputs.forcing(drafts, verify_floor), processing=processing, draft_inputs=draft_inputs)


def fit_drafting(verify_ms: dict[int, float], rounds: list[tuple[float, float]]) -> tuple[float, float]:
    """(milliseconds a draft, milliseconds of a drafting round's fixed work) from timed drafting rounds, each
    (drafts a round of the longest row, milliseconds a round). A round of d drafts costs its verify block (width
    d + 1, interpolated in `verify_ms`: the forced lengths 1 and K verify at exactly 2 and K + 1, both loop widths),
    d drafts and the fixed work: a line through the rounds timed,
    by the drafts the rows really proposed (a drafter may propose fewer than it was asked: universal decoding maps
    some drafts to nothing). Neither part is negative: a busier machine during one run must not make drafts free."""
    widest = max(verify_ms)
    work = {max(drafts, 1e-3): ms - interpolate(verify_ms, min(widest, int(np.ceil(drafts)) + 1))
            for drafts, ms in rounds}
    (low, low_ms), (high, high_ms) = min(work.items()), max(work.items())
    draft_ms = max((high_ms - low_ms) / (high - low) if high - low >= 0.5 else low_ms / low, 0.0)
    return draft_ms, max(low_ms - low * draft_ms, 0.0)


def _loop_key_prefix(spec, target: Model, assistant: Model | None, batch: int, layers_looped: bool = False) -> str:
    """What a loop's round costs depend on: the machine and the target (`_key_prefix`), the assistant, the
    drafter's static settings (its simple fields: lengths, layers, widths, tree), sampling, how run-time branches
    run (`inplace.MODE`), whether wide forwards loop over the layers (jaxspec/layer_stack.py), and the batch."""
    drafter, schedule = spec.drafter, spec.drafter.schedule
    simple = (int, float, str, bool, tuple, TreeShape, type(None))
    settings = sorted((field.name, repr(getattr(drafter, field.name))) for field in dataclasses.fields(drafter)
                      if field.compare and isinstance(getattr(drafter, field.name), simple))
    assistant_key = None if assistant is None or assistant is target else _key_prefix(assistant, verifying=False)
    described = repr((type(drafter).__name__, settings, schedule.kind, schedule.widths, schedule.entries_per_draft,
                      schedule.node_budget, spec.verify_widths, spec.do_sample, assistant_key, inplace.MODE)
                     + (("layers looped",) if layers_looped else ()))
    package = os.path.dirname(__file__)
    code = _source_hash(package) + _source_hash(os.path.join(package, "strategies"))  # the loop's own code
    described = hashlib.sha256((described + code).encode()).hexdigest()[:16]
    return f"{_key_prefix(target, verifying=True)}|loop|{described}|{batch}x"


def interpolate(milliseconds: dict[int, float], width: int) -> float:
    """A width's cost from the measured ones: the measured figure, else linear between the nearest measured widths
    around it. `price_loop` times every width the loop compiles, so this only fills in widths a caller did not time
    (a drafting round's fractional block in `fit_drafting`)."""
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


def time_forwards(model: Model, widths: tuple[int, ...], head=None, steps: int = STEPS, runs: int = RUNS,
                  cache_size: int = CACHE_SIZE, batch: int = 1) -> dict[int, float]:
    """Milliseconds per forward of `model` over `batch` rows for each width, with `head` ([D, V], or None: the
    model's own): the best of `runs` timed runs of one compiled loop of `steps` forwards that writes a `cache_size`
    cache in place from position START_POSITION on, as decoding does (the cache is donated). Timing single calls
    instead would add a copy of the whole cache and a dispatch to every width, which hides most of the difference
    between widths."""
    from .head import for_rows

    graphdef, state = nnx.split(model.module)

    def loop(state, head, cache, width: int):
        module = nnx.merge(graphdef, state)

        def step(i, carry):
            cache, checksum = carry
            tokens = jnp.ones((batch, width), jnp.int32)
            positions = jnp.broadcast_to(START_POSITION + i * width + jnp.arange(width), (batch, width))  # [B, W]
            logits, _, cache = module(tokens, positions, cache, head=for_rows(head, batch * width))  # as verifying
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
    only the MTP strategy runs (a model with trained MTP layers never reads them as an assistant). Each array
    counts once: the members of a fused group (jaxspec/layout.py) share one."""
    params = nnx.state(module, nnx.Param)
    read = {id(x): x for path, x in jax.tree_util.tree_leaves_with_path(params)
            if getattr(path[0], "key", None) != "mtp_layers"}
    return sum(int(x.size) * x.dtype.itemsize for x in read.values())


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


def read_cache() -> dict[str, float]:
    """The stored prices: milliseconds a round, keyed by a loop's `_loop_key_prefix` and the part timed (`|verify|W`,
    `|draft`, `|round`). An unreadable file counts as empty (it is rewritten whole on the next measurement)."""
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
        merged = read_cache() | entries
        handle = tempfile.NamedTemporaryFile("w", dir=os.path.dirname(path), prefix=f".{CACHE_FILE}.",
                                             suffix=".tmp", delete=False, encoding="utf-8")
        with handle:
            json.dump(merged, handle, indent=0, sort_keys=True)
        os.replace(handle.name, path)
    except OSError:
        pass
