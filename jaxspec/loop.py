"""The device side of `generate`: one jit-compiled prefill and one round loop (a `lax.while_loop`) per LoopSpec.

The prefill reads the prompt in fixed-width chunks (a loop, so the prompt's length is not a shape) and picks each
row's first token. The round loop then drafts, verifies and commits until every row is done. One round: the drafter
proposes up to K tokens per row; the target scores `[last, d_1 .. d_W-1]` in one forward, with the width W chosen
at run time among a few static sizes (a round with 2 drafts does not pay for K); `verify()` decides what each row
accepts; each row commits its own count, cut at EOS and at its budget. Plain decoding is the K = 0 drafter, not a
second loop.

What recompiles: only shapes and the LoopSpec (the strategy's static settings). Sampling values, processors and the
drafter's run-time settings enter as arrays (`LoopInputs`).
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import functools
import os
import queue
import signal
import sys
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from . import distributed, inplace
from . import tree as tree_lib
from .processors import Processing
from .sampling import select
from .schedule import Prices
from .sharding import ShardingRules, constrain, named_sharding
from .strategies.base import (Context, Counters, DecodeState, Drafter, DraftStep, PrefillChunk, RoundResult,
                             deciding_rows, run_tapped_layers)
from .cache import move_cache_entries
from .verify import leading_true, verify

_trace_count = 0


def trace_count() -> int:
    """How many times a loop executable has been traced (compiled) in this process; tests use it."""
    return _trace_count


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about the loop's executables; equal specs (and argument shapes) share a compilation."""

    target_graphdef: Any
    assistant_graphdef: Any
    drafter: Drafter
    do_sample: bool
    ngram_slots: int
    ensemble_weight: float | None
    prefill_chunk: int
    mesh: Mesh | None
    rules: ShardingRules
    return_logits: bool = False

    @property
    def verify_widths(self) -> tuple[int, ...]:
        return self.drafter.verify_widths


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LoopInputs:
    """The loop's run-time inputs: new values reuse the executables."""

    processing: Processing  # sampling and logits-processing settings (jaxspec.settings)
    draft_inputs: dict[str, jax.Array]  # the drafter's run-time settings (`Drafter.runtime_inputs`)
    head: jax.Array | None  # [D, V] the target's head for verifying forwards, on CPU (jaxspec/head.py); else None
    # The target's decoder layers stacked [L, ...], which its wide forwards loop over on CPU (jaxspec/layer_stack.py)
    layer_stack: Any = None
    prices: Prices | None = None  # the adaptive schedule's prices (None: the drafter's schedule is not priced)
    # [] int32: no verify block narrower than this (1: the narrowest holding the round's drafts). Wider blocks
    # verify the same drafts, so the output is unchanged; jaxspec/costs.py times the loop's rounds at each width.
    verify_floor: jax.Array | int = 1

    def forcing(self, drafts: int, verify_floor: int) -> "LoopInputs":
        """These inputs with every round drafting `drafts` (a chain; -1: the schedule decides) and verifying a block
        of at least `verify_floor`: the same executables, greedy output unchanged (jaxspec/costs.py times rounds
        this way)."""
        prices = dataclasses.replace(self.prices, forced_drafts=jnp.full_like(self.prices.forced_drafts, drafts))
        return dataclasses.replace(self, prices=prices, verify_floor=jnp.full_like(self.verify_floor, verify_floor))

    @staticmethod
    def for_drafter(processing: Processing, drafter: Drafter, head, layer_stack=None) -> "LoopInputs":
        schedule = getattr(drafter, "schedule", None)
        prices = None if schedule is None else schedule.prices()
        return LoopInputs(processing=processing, draft_inputs=jax.tree.map(jnp.asarray, drafter.runtime_inputs()),
                          head=head, layer_stack=layer_stack, prices=jax.tree.map(jnp.asarray, prices),
                          verify_floor=jnp.ones((), jnp.int32))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """One round's verification, padded to K+1 positions (positions past a row's commit are never read)."""

    accepted: jax.Array  # [B] drafts accepted
    tokens: jax.Array  # [B, K+1] accepted drafts, then the target's own token
    hidden: jax.Array  # [B, K+1, D] the target's final-normed hidden states at [last, d_1 .. d_K]
    processed: jax.Array | None  # [B, K+1, V] processed target logits with return_logits, else None
    features: jax.Array | None  # [B, K+1, F*D] the tapped layers' outputs (Drafter.feature_layers), else None
    drafted: jax.Array  # [B] what the schedule counts as drafted: the valid drafts of a chain, the depth of a tree
    on_chain: jax.Array  # [B] accepted drafts that are the drafter's chain (RoundResult.on_chain)


MAX_COMPILED = 32  # a long session (a notebook, a test run) should not keep every executable alive
_compiled: collections.OrderedDict[Any, Compiling] = collections.OrderedDict()


@dataclasses.dataclass(frozen=True, eq=False)
class Compiling:
    """An executable compiling on the worker thread (`compile_in_background`). Calling it waits for the executable;
    `out_info` is its outputs' shapes and dtypes as lowered, known before XLA has compiled (without the shardings,
    which come with the executable)."""

    future: concurrent.futures.Future
    out_info: Any
    key: Any = None  # its entry in `_compiled`: a failed compile is not kept, so the next call tries again

    @classmethod
    def done(cls, executable) -> Compiling:
        """An executable compiled already (benchmarks that compile themselves)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(executable)
        return cls(future, executable.out_info)

    def __call__(self):
        try:
            return self.future.result()
        except BaseException:
            if self.key is not None and _compiled.get(self.key) is self:
                del _compiled[self.key]
            raise

    def then_call(self, *args) -> Callable[[], tuple[Any, float]]:
        """Call the executable on `args` as soon as it has compiled, on the thread that compiled it (or here, if it
        has); -> a function that waits for (its outputs, the time.perf_counter() when it was dispatched). The caller's
        thread is free meanwhile: `generate` traces and lowers the round loop while the prefill compiles and runs."""
        called: concurrent.futures.Future = concurrent.futures.Future()

        def call(compiled: concurrent.futures.Future) -> None:
            try:
                executable = compiled.result()
                dispatched = time.perf_counter()
                called.set_result((executable(*args), dispatched))
            except BaseException as error:  # handed to the caller that waits for it
                called.set_exception(error)

        self.future.add_done_callback(call)

        def wait():
            try:
                return called.result()
            except BaseException:
                self()  # a failed compile: forgotten, as when waited for directly
                raise

        return wait


class _Compiler:
    """Runs compiles in order on one daemon thread: XLA already compiles a module on several threads, and the prefill
    and the rounds never compile at once.

    At exit (`_at_exit`) the compile under way, if any, must not be torn down under XLA: a process that exits while
    this thread is inside XLA's compiler aborts ("terminate called ...", killed by SIGABRT), as a call whose rows all
    ended in the prefill left its round loop compiling. So a process that ends normally, or on an error, waits for the
    compile under way (with the persistent compilation cache on, it is kept for the next process) and starts none of
    those queued behind it. One interrupted (Ctrl-C) while a loop compiles leaves at once, killed by SIGINT as Python
    leaves an interrupted process, rather than wait out XLA. A daemon, so that the interpreter itself never joins it:
    concurrent.futures would wait for every queued compile."""

    def __init__(self):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._worker: threading.Thread | None = None
        self._lock = threading.Lock()
        self._compiling = threading.Event()  # set while a compile runs
        self._closing = False  # set at exit: queued compiles are cancelled, not started
        atexit.register(self._at_exit)

    def submit(self, compile_fn: Callable[[], Any]) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, compile_fn))
        with self._lock:
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="jaxspec-compile", daemon=True)
                self._worker.start()
        return future

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:  # `_at_exit`'s last item: everything before it was started or cancelled
                return
            future, compile_fn = item
            if self._closing:
                future.cancel()
            elif future.set_running_or_notify_cancel():
                self._compiling.set()
                try:
                    future.set_result(compile_fn())
                except BaseException as error:  # handed to the caller that waits for it
                    future.set_exception(error)
                finally:
                    self._compiling.clear()

    def _at_exit(self) -> None:
        """Registered with atexit: wait for the compile under way and cancel the queued ones (see the class)."""
        if self._worker is None or not self._worker.is_alive():
            return
        if self._compiling.is_set() and isinstance(getattr(sys, "last_value", None), KeyboardInterrupt):
            # End as Python ends an interrupted process (killed by SIGINT), before the teardown that would abort.
            sys.stdout.flush()
            sys.stderr.flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
            os._exit(130)  # where a signal does not end the process at once: the status a shell gives Ctrl-C
        self._closing = True
        self._queue.put(None)
        self._worker.join()


_COMPILER = _Compiler()


def compile_in_background(spec: LoopSpec, which: str, args) -> Compiling:
    """Start compiling the loop's `which` executable for `args`; -> a `Compiling`, which waits for it when called.

    The executable is traced and lowered here, in the caller's thread, since tracing reads that thread's JAX context
    (default device, matmul precision); XLA's compile, or the persistent cache's load of a compiled executable, then
    runs on a worker thread, which releases the interpreter. So the caller can run something else meanwhile:
    `generate` runs the prefill, and hands out its first tokens, while the round loop compiles. A compile that is
    under way is shared: a call that never waited for it (every row ended in the prefill) does not start another."""
    leaves, treedef = jax.tree.flatten(args)
    key = (spec, which, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key not in _compiled:
        if which == "prefill":
            fn = jax.jit(functools.partial(_prefill, spec))
        else:
            fn = jax.jit(functools.partial(_rounds, spec), donate_argnums=(2,))  # the loop state is updated in place
        lowered = fn.lower(*args)
        _compiled[key] = Compiling(_COMPILER.submit(lowered.compile), lowered.out_info, key)
        while len(_compiled) > MAX_COMPILED:
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return _compiled[key]


def compiled(which: str) -> list:
    """The `which` ("prefill" or "rounds") executables this process keeps, oldest first, once compiled (tests and
    benchmarks read their HLO)."""
    return [compiling() for key, compiling in list(_compiled.items()) if key[1] == which]


def place(x: np.ndarray, mesh: Mesh | None, rules: ShardingRules) -> jax.Array:
    """Batch-major host arrays go to the mesh split along `batch` (replicated if it does not divide). Every process
    passes the same array; each places only its own devices' slices."""
    if mesh is None:
        return jnp.asarray(x)
    axes = ("batch",) + ("seq",) * (x.ndim - 1)
    return distributed.global_array(x, named_sharding(axes, x.shape, mesh, rules))


def _with_prices(spec: LoopSpec, inputs: LoopInputs) -> LoopSpec:
    """The spec whose drafter's schedule decides by the run-time prices (traced here, so they compile nothing in)."""
    schedule = getattr(spec.drafter, "schedule", None)
    if schedule is None or inputs.prices is None:
        return spec
    return dataclasses.replace(spec, drafter=dataclasses.replace(spec.drafter,
                                                                 schedule=schedule.with_prices(inputs.prices)))


def _context(spec: LoopSpec, target_state, assistant_state, inputs: LoopInputs) -> Context:
    target = nnx.merge(spec.target_graphdef, target_state)
    if inputs.layer_stack is not None:  # for this trace only: the merged module is the trace's own
        target.layer_stack = inputs.layer_stack
    assistant = nnx.merge(spec.assistant_graphdef, assistant_state) if spec.assistant_graphdef else None
    return Context(target=target, assistant=assistant, processing=inputs.processing, do_sample=spec.do_sample,
                   ngram_slots=spec.ngram_slots, draft_inputs=inputs.draft_inputs, head=inputs.head)


def _prefill(spec: LoopSpec, target_state, assistant_state, tokens, prompt_lengths, max_new_tokens, rng,
             inputs: LoopInputs, score_slots) -> DecodeState:
    """Read every prompt in chunks of `spec.prefill_chunk` positions, pick each row's first token, build the state."""
    global _trace_count
    _trace_count += 1
    spec = _with_prices(spec, inputs)
    ctx = _context(spec, target_state, assistant_state, inputs)
    target, drafter = ctx.target, spec.drafter
    batch, size = tokens.shape
    chunk = spec.prefill_chunk
    cache = target.init_cache(batch, size)
    cache = jax.tree.map(lambda x, axes: constrain(x, axes, spec.mesh, spec.rules), cache, type(cache).logical_axes())
    drafter_state = drafter.init(ctx, batch, size)
    rows = jnp.arange(batch)

    def read_chunk(index, carry):
        cache, drafter_state, last_hidden = carry
        first = index * chunk
        chunk_tokens = jax.lax.dynamic_slice_in_dim(tokens, first, chunk, axis=1)  # [B, C]
        positions = jnp.broadcast_to(first + jnp.arange(chunk, dtype=jnp.int32), (batch, chunk))
        embedded = target.embed_tokens(chunk_tokens)
        if drafter.feature_layers:
            x, cache, features = run_tapped_layers(target, embedded, positions, cache, drafter.feature_layers)
        else:
            (x, cache), features = target.run_layers(embedded, positions, cache), None
        hidden = target.final_hidden(x)  # [B, C, D]
        last = prompt_lengths - 1 - first  # the row's last prompt position, within this chunk if in [0, C)
        in_chunk = (last >= 0) & (last < chunk)
        last_hidden = jnp.where(in_chunk[:, None], hidden[rows, jnp.clip(last, 0, chunk - 1)], last_hidden)
        valid = positions < prompt_lengths[:, None]
        drafter_state = drafter.prefill_chunk(ctx, drafter_state,
                                              PrefillChunk(chunk_tokens, positions, hidden, valid, features))
        return cache, drafter_state, last_hidden

    chunks = (jnp.max(prompt_lengths) + chunk - 1) // chunk
    last_hidden = jnp.zeros((batch, target.cfg.hidden_size), target.dtype)
    cache, drafter_state, last_hidden = jax.lax.fori_loop(0, chunks, read_chunk, (cache, drafter_state, last_hidden))
    logits = target.logits(last_hidden, ctx.head)[:, None]  # [B, 1, V]
    processed = ctx.process(logits, tokens, prompt_lengths, prompt_lengths)
    rng, first_rng = jax.random.split(rng)
    first = select(first_rng, processed[:, 0], spec.do_sample)  # [B]
    tokens = tokens.at[rows, prompt_lengths].set(first)
    scores = None
    if spec.return_logits:
        scores = jnp.full((batch, score_slots.shape[0], processed.shape[-1]), -jnp.inf, jnp.float32)
        scores = scores.at[:, 0].set(processed[:, 0])
    done = ctx.is_eos(first) | (max_new_tokens <= 1)
    return DecodeState(
        tokens=tokens,
        lengths=prompt_lengths + 1,
        prompt_lengths=prompt_lengths,
        budget_end=prompt_lengths + max_new_tokens,
        done=done,
        cache=cache,
        drafter=drafter_state,
        rng=rng,
        counters=Counters.zeros(batch, drafter.max_draft),
        scores=scores,
    )


# Plain decoding's step (K = 0) runs nested in a branch on XLA:CPU (a one-trip while loop, jaxspec.inplace), as every
# strategy's round of width 1 already does, rather than at the top of the rounds loop: the same kernels run faster
# there for batches of a few rows, and as fast for one row (figures: docs/design.md, 'Plain steps in a branch'). Read
# while tracing; False is the loop before 2026-12-07, which benchmarks/bench_weight_layout.py times.
NESTED_PLAIN_STEP = True


def _rounds(spec: LoopSpec, target_state, assistant_state, state: DecodeState, inputs: LoopInputs,
            max_rounds) -> DecodeState:
    """Run rounds until every row is done, or `max_rounds` rounds have run (the state then resumes in a next call)."""
    global _trace_count
    _trace_count += 1
    spec = _with_prices(spec, inputs)
    ctx = _context(spec, target_state, assistant_state, inputs)
    size = state.tokens.shape[1]
    k = spec.drafter.draft_slots

    def cond(carry):
        state, rounds_run = carry
        some_row_running = ~jnp.all(state.done)  # every row hit EOS or its budget
        # Cache full: by construction (buffer >= prompt + budget + K + 1, N + 1 for a tree) this never fires; it
        # guards the buffer bounds should that invariant ever be broken.
        room_left = jnp.all(state.done | (state.lengths + k < size))
        within_dispatch = rounds_run < max_rounds  # a caller streaming output asked for control back
        return some_row_running & room_left & within_dispatch

    def body(carry):
        state, rounds_run = carry
        return _round(spec, ctx, state, inputs.verify_floor), rounds_run + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))
    return state


def _round(spec: LoopSpec, ctx: Context, state: DecodeState, verify_floor) -> DecodeState:
    drafter, k = spec.drafter, spec.drafter.max_draft
    rng, draft_rng, verify_rng = jax.random.split(state.rng, 3)
    step = drafter.draft(ctx, state, state.drafter, draft_rng)
    count = jnp.where(state.done, 0, jnp.minimum(step.draft.count, drafter.draft_slots))  # [B] drafts (tree: nodes)
    in_shadow = _in_shadow(drafter, step.state, state, count)  # [] bool, or None
    verified_count = count if in_shadow is None else jnp.where(in_shadow, 0, count)  # a shadow probe: plain step
    checked, cache = _verify_round(spec, ctx, state, step, verified_count, verify_rng, verify_floor)
    n, verified = checked.accepted, checked.tokens

    rows = jnp.arange(count.shape[0])
    committed, hit_eos = _commit_counts(ctx, verified, n, state.lengths, state.budget_end)
    committed = jnp.where(state.done, 0, committed)
    index = jnp.arange(k + 1)[None, :]
    write_positions = jnp.where(index < committed[:, None], state.lengths[:, None] + index, state.tokens.shape[1])
    tokens = state.tokens.at[rows[:, None], write_positions].set(verified, mode="drop")
    lengths = state.lengths + committed
    done = state.done | (hit_eos & (committed > 0)) | (lengths >= state.budget_end)
    scores = state.scores
    if scores is not None:  # each committed token's processed logits, at its index among the row's new tokens
        slots = jnp.where(index < committed[:, None], state.lengths[:, None] - state.prompt_lengths[:, None] + index,
                          scores.shape[1])
        scores = scores.at[rows[:, None], slots].set(checked.processed, mode="drop")

    result = RoundResult(drafted=checked.drafted, accepted=n, committed=committed, tokens=verified,
                         hidden=checked.hidden, lengths=lengths, features=checked.features, on_chain=checked.on_chain,
                         deciding=deciding_rows(state))
    if in_shadow is not None:
        # The drafter drafted and sees its first draft rejected (the plain step's token committed, as a rejection
        # commits the target's); the schedule judges that draft against the token.
        result = dataclasses.replace(result, drafted=jnp.where(in_shadow, count, result.drafted), in_shadow=in_shadow,
                                     shadow_hits=(count > 0) & (step.draft.tokens[:, 0] == verified[:, 0]))
    drafter_state = drafter.update(ctx, step.state, result)
    active = ~state.done
    c = state.counters
    counters = Counters(
        rounds=c.rounds + 1,
        draft_forwards=c.draft_forwards + step.forwards,
        drafted=c.drafted + jnp.where(active, verified_count, 0),
        accepted=c.accepted + jnp.where(active, n, 0),
        accepted_hist=c.accepted_hist + (active[:, None] & (jnp.arange(k + 1)[None, :] == n[:, None])),
        priced_steps=c.priced_steps + _priced_round(drafter, jnp.where(state.done, 0, checked.drafted), count,
                                                    in_shadow=in_shadow),
        tree_rounds=c.tree_rounds + (jnp.max(verified_count - checked.drafted) > 0),  # nodes beyond the depth
    )
    return dataclasses.replace(state, tokens=tokens, lengths=lengths, done=done, cache=cache, drafter=drafter_state,
                               rng=rng, counters=counters, scores=scores)


def _verify_round(spec: LoopSpec, ctx: Context, state: DecodeState, step: DraftStep, count, rng,
                  verify_floor) -> tuple[VerifyResult, Any]:
    """The target scores `[last, d_1 .. d_W-1]` and verify decides: -> (VerifyResult, the target cache).

    The block width W is chosen at run time among `spec.verify_widths`, so a round with few drafts does not pay
    for K. A round without drafts is a plain step at width 1. Each width runs its forward, its processors and
    verification at W positions, and only the small results (tokens, hidden states) are padded to K+1: padding
    the [B, W, V] logits instead, to process and verify once at K+1, moved and reduced K+1 positions of the
    vocabulary every round (6.7 MB a round at K=10 on Qwen's 151,936 tokens) however few drafts it held.
    """
    drafter, k = spec.drafter, spec.drafter.max_draft
    draft, drafter_state = step.draft, step.state
    batch = count.shape[0]
    rows = jnp.arange(batch)

    def to_k1(x):  # [B, W, ...] -> [B, K+1, ...], zero past W (positions no row commits)
        return jnp.pad(x, ((0, 0), (0, k + 1 - x.shape[1])) + ((0, 0),) * (x.ndim - 2))

    def plain_step(cache):
        positions = state.lengths[:, None] - 1  # [B, 1]
        out = drafter.target_forward(ctx, state.last_token[:, None], positions, cache, drafter_state)
        processed = ctx.process(out.logits, state.tokens, state.lengths, state.prompt_lengths)  # [B, 1, V]
        token = select(rng, processed[:, 0], spec.do_sample)
        verified = jnp.zeros((batch, k + 1), jnp.int32).at[:, 0].set(token)
        kept = to_k1(processed) if spec.return_logits else None
        return out.cache, VerifyResult(jnp.zeros((batch,), jnp.int32), verified, to_k1(out.hidden), kept,
                                       _maybe(to_k1, out.features), drafted=jnp.zeros((batch,), jnp.int32),
                                       on_chain=jnp.zeros((batch,), jnp.int32))

    if k == 0:
        if not (NESTED_PLAIN_STEP and jax.default_backend() == "cpu"):
            cache, checked = plain_step(step.target_cache)
            return checked, cache
        # The branch is skipped only where every row is done, which the loop's condition never lets reach a round.
        running = jnp.where(jnp.all(state.done), -1, 0)  # -1: no branch runs
        cache, checked = inplace.switch(running, [plain_step], step.target_cache)
        return checked, cache

    def verify_block(width: int, cache):
        drafts = draft.tokens[:, : width - 1]  # [B, W-1]: every row's count is at most W-1
        block = jnp.concatenate([state.last_token[:, None], drafts], axis=1)  # [B, W]
        positions = state.lengths[:, None] - 1 + jnp.arange(width)[None, :]
        out = drafter.target_forward(ctx, block, positions, cache, drafter_state)
        # Position j judges draft j+1 with the prefix it extends: committed tokens, then d_1 .. d_j.
        draft_positions = state.lengths[:, None] + jnp.arange(width - 1)[None, :]
        with_drafts = state.tokens.at[rows[:, None], draft_positions].set(drafts, mode="drop")
        processed = ctx.process(out.logits, with_drafts, state.lengths, state.prompt_lengths)  # [B, W, V]
        probs = None if draft.probs is None else draft.probs[:, : width - 1]
        n, verified = verify(rng, processed, drafts, count, probs, spec.do_sample, spec.ensemble_weight)
        kept = to_k1(processed) if spec.return_logits else None
        return out.cache, VerifyResult(n, to_k1(verified), to_k1(out.hidden), kept, _maybe(to_k1, out.features),
                                       drafted=count, on_chain=n)

    def verify_tree_block(width: int, cache):
        """The first W-1 nodes (every row's count is at most W-1) as one tree-shaped block; the accepted path's
        entries then move to consecutive slots (jaxspec/tree.py), so the row's cache is a chain's again."""
        tree = draft.tree.truncated(width - 1)
        depth = min(k, width - 1)  # no path through W-1 nodes is deeper
        block, positions = tree_lib.tree_block(tree, state.lengths - 1)
        entries = jnp.concatenate([state.last_token[:, None], tree.tokens], axis=1)  # [B, W]
        out = drafter.target_forward(ctx, entries, positions, cache, drafter_state, tree=block)
        processed = _process_tree(ctx, out.logits, state, tree, depth)  # [B, W, V]
        verdict = tree_lib.verify_tree(rng, processed, tree, depth, spec.drafter.tree.branching, spec.do_sample)
        sources = tree_lib.path_sources(verdict, width)  # [B, W]
        cache = move_cache_entries(out.cache, block.start, sources)
        along_path = sources[:, :depth + 1]  # [B, depth+1]: the block entries the committed tokens came from

        def path_k1(x):  # [B, W, ...] -> [B, K+1, ...] along the accepted path
            index = along_path.reshape(along_path.shape + (1,) * (x.ndim - 2))
            return to_k1(jnp.take_along_axis(x, index, axis=1))

        depths = jnp.where(tree.valid, tree.depths(), 0)
        kept = path_k1(processed) if spec.return_logits else None
        first_ranked = jnp.take_along_axis(tree.ranks, jnp.maximum(verdict.path, 0), axis=1) == 0  # [B, depth]
        on_chain = leading_true(first_ranked & (jnp.arange(depth)[None, :] < verdict.accepted[:, None]))
        return cache, VerifyResult(verdict.accepted, to_k1(verdict.tokens), path_k1(out.hidden), kept,
                                   _maybe(path_k1, out.features), drafted=jnp.max(depths, axis=1), on_chain=on_chain)

    width = jnp.maximum(jnp.max(count) + 1, verify_floor)  # [] the narrowest block that holds every row's drafts

    def drafted_step(cache):
        wide = [w for w in spec.verify_widths if w > 1]
        index = jnp.minimum(jnp.searchsorted(jnp.asarray(wide), width), len(wide) - 1)
        block = verify_block if spec.drafter.tree is None else verify_tree_block
        return inplace.switch(index, [functools.partial(block, w) for w in wide], cache)

    # The cache is the only state the branches update (in place: see jaxspec.inplace).
    cache, checked = inplace.cond(width > 1, drafted_step, plain_step, step.target_cache)
    return checked, cache


def _process_tree(ctx: Context, logits: jax.Array, state: DecodeState, tree: tree_lib.DraftTree,
                  depth: int) -> jax.Array:
    """Processed logits of a tree-shaped block [B, W, V]: each entry with its own history, the committed tokens and
    then its path's (entry 0, the root, has none). Processors read a token buffer and a prefix length, so every
    entry gets its own buffer row and is processed as a block of one."""
    batch, width, vocab = logits.shape
    paths = jnp.concatenate([jnp.zeros((batch, 1, depth), jnp.int32), tree.paths(depth)], axis=1)  # [B, W, depth]
    depths = jnp.concatenate([jnp.zeros((batch, 1), jnp.int32), tree.depths()], axis=1)  # [B, W]
    rows = jnp.arange(batch)[:, None, None]
    entries = jnp.arange(width)[None, :, None]
    positions = state.lengths[:, None, None] + jnp.arange(depth)[None, None, :]  # [B, 1, depth]
    histories = jnp.broadcast_to(state.tokens[:, None, :], (batch, width, state.tokens.shape[1]))
    histories = histories.at[rows, entries, positions].set(paths, mode="drop")  # past an entry's depth: never read
    flat = lambda x: x.reshape((batch * width,) + x.shape[2:])  # noqa: E731
    processed = ctx.process(flat(logits)[:, None], flat(histories), flat(state.lengths[:, None] + depths),
                            jnp.repeat(state.prompt_lengths, width))
    return processed.reshape(batch, width, vocab)


def _in_shadow(drafter: Drafter, drafter_state, state: DecodeState, count) -> jax.Array | None:
    """[] bool: the round is a probe judged in the shadow (`Schedule.in_shadow`, asked of the state the drafter
    decided its drafts from), and some row drafted; None where no probe can be (no adaptive schedule, or one whose
    probes are all verified: `Schedule.shadow`, off for trees and universal decoding)."""
    schedule, length = getattr(drafter, "schedule", None), drafter.schedule_state(drafter_state)
    if schedule is None or length is None or schedule.kind != "adaptive" or not schedule.shadow:
        return None
    return schedule.in_shadow(length, deciding_rows(state)) & jnp.any(count > 0)


def _priced_round(drafter: Drafter, count, nodes=None, in_shadow=None) -> jax.Array:
    """[] what the adaptive schedule's cost model says this round cost, in plain steps, priced as the schedule
    prices a choice: the verify block of the width the round ran (`_verify_round`: the narrowest holding the
    longest draft), `draft_cost` per draft of the longest row, and the fixed cost of a drafting round. 0 for
    schedules that are not priced. The prices are timed on rounds of this loop (jaxspec/costs.py), so what still sets
    it apart from the measured speedup is what those rounds did not hold: catch-up blocks after idle rounds, and
    the machine's noise."""
    schedule = getattr(drafter, "schedule", None)
    if schedule is None or not schedule.priced:
        return jnp.zeros((), jnp.float32)
    # A tree round that verified alternatives beside its chain (count: depths; nodes: what the block held).
    branched = jnp.zeros((), bool) if nodes is None else jnp.max(nodes - count) > 0
    price = schedule.round_price(jnp.max(count), jnp.where(branched, schedule.entries_per_draft, 1))
    if in_shadow is None:
        return price
    # A probe judged in the shadow ran the plain step beside its drafts (count: what was drafted; `nodes`, the same).
    return jnp.where(in_shadow, schedule.shadow_price(jnp.max(nodes)), price)


def _maybe(fn, x):
    """fn(x), or None for an absent optional array."""
    return None if x is None else fn(x)


def _commit_counts(ctx: Context, verified, n, lengths, budget_end):
    """Tokens each row appends: the n accepted drafts + 1, cut at the budget and just after the first EOS."""
    index = jnp.arange(verified.shape[1])[None, :]
    committed = jnp.minimum(n + 1, budget_end - lengths)  # [B]
    is_eos = ctx.is_eos(verified) & (index < committed[:, None])  # [B, K+1]
    first_eos = jnp.argmax(is_eos, axis=1)
    hit_eos = jnp.any(is_eos, axis=1)
    return jnp.where(hit_eos, first_eos + 1, committed), hit_eos
