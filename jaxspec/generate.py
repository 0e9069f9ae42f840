"""`generate()`: every strategy runs in the same jit-compiled `lax.while_loop`.

Two executables per (model, strategy, shapes): the prefill reads the prompt in fixed-width chunks (a loop, so the
prompt's length is not a shape) and picks each row's first token; the round loop then drafts, verifies and commits
until every row is done. One round: the drafter proposes up to K tokens per row; the target scores
`[last, d_1 .. d_W-1]` in one forward, with the width W chosen at run time among a few static sizes (a round with
2 drafts does not pay for K); `verify()` decides what each row accepts; each row commits its own count, cut at EOS
and at its budget. Plain decoding is the K = 0 drafter, not a second loop.

What recompiles: only shapes and the choice of strategy. Prompts are left-aligned in a token buffer whose length
is rounded up (`buffer_size`), so prompts and budgets of similar size share executables;
sampling settings and processors are run-time arrays (jaxspec.settings).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from . import distributed, inplace, settings as settings_lib
from .costs import price_schedule
from .head import verify_head
from .loading import Model
from .sampling import select
from .settings import Settings
from .sharding import ShardingRules, constrain, named_sharding, shard_state
from .strategies import choose_strategy, default_prefill_chunk
from .strategies.base import Context, Counters, DecodeState, Drafter, PrefillChunk, RoundResult, verify_widths
from .verify import verify

MIN_BUFFER = 256  # smallest token buffer / cache length
LARGE_BUFFER = 2048  # buffers up to this are powers of two ...
BUFFER_STEP = 512  # ... longer ones multiples of this

_trace_count = 0


def trace_count() -> int:
    """How many times a loop executable has been traced (compiled) in this process; tests use it."""
    return _trace_count


@dataclasses.dataclass
class GenerateOutput:
    sequences: np.ndarray  # [B, T_in + N] int32: the prompts as given, new tokens, then padding (HF layout)
    num_new_tokens: np.ndarray  # [B]
    target_forwards: int  # prefill + verification rounds
    rounds: int
    draft_forwards: int
    drafted: np.ndarray  # [B]
    accepted: np.ndarray  # [B]
    accepted_hist: np.ndarray  # [B, K+1]: rounds in which a row accepted exactly i drafts
    compile_seconds: float  # the loop's compiles, and the adaptive schedule's step costs when measured (costs.py)
    decode_seconds: float  # prefill + rounds, compile excluded
    prefill_seconds: float = float("nan")
    strategy: str = "greedy"
    drafter_summary: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    # [B, N, V] float32 with return_logits=True: the processed target logits each new token was chosen from (what
    # plain decoding would have used at that position), -inf rows past a row's end; else None.
    logits: np.ndarray | None = None

    def new_tokens(self, row: int = 0) -> np.ndarray:
        """Row `row`'s new tokens: up to and including its EOS, without the padding after it. [N_row] int32"""
        start = self.sequences.shape[1] - int(self.num_new_tokens.max())
        return self.sequences[row, start: start + int(self.num_new_tokens[row])]

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens over the batch (nan when nothing was drafted)."""
        drafted = int(self.drafted.sum())
        return float(self.accepted.sum()) / drafted if drafted else float("nan")

    @property
    def mean_accepted_length(self) -> float:
        """Tokens committed per verification round and row (accepted drafts + the target's own token)."""
        row_rounds = int(self.accepted_hist.sum())
        first_tokens = len(self.num_new_tokens)  # produced by the prefill, not by a round
        return float(self.num_new_tokens.sum() - first_tokens) / row_rounds if row_rounds else float("nan")

    @property
    def tokens_per_second(self) -> float:
        return float(self.num_new_tokens.sum()) / self.decode_seconds if self.decode_seconds else float("nan")

    def counters(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "new_tokens": self.num_new_tokens.tolist(),
            "target_forwards": self.target_forwards,
            "rounds": self.rounds,
            "draft_forwards": self.draft_forwards,
            "drafted": self.drafted.tolist(),
            "accepted": self.accepted.tolist(),
            "acceptance_rate": self.acceptance_rate,
            "mean_accepted_length": self.mean_accepted_length,
            "accepted_length_histogram": self.accepted_hist.sum(0).tolist(),
            "compile_seconds": self.compile_seconds,
            "prefill_seconds": self.prefill_seconds,
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


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
        return verify_widths(self.drafter.max_draft)


# ------------------------------------------------------------------------------------------------------------------
# Host side: resolve, validate, place, run, unpack


def generate(
    model: Model,
    input_ids: Any,
    attention_mask: Any = None,
    *,
    max_new_tokens: int | None = None,
    do_sample: bool | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
    repetition_penalty: float | None = None,
    no_repeat_ngram_size: int | None = None,
    min_new_tokens: int | None = None,
    bad_words_ids: Sequence[Sequence[int]] | None = None,
    suppress_tokens: Sequence[int] | None = None,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    mesh: Mesh | None = None,
    sharding_rules: ShardingRules | None = None,
    assistant_model: Model | None = None,
    num_assistant_tokens: int | None = None,
    num_assistant_tokens_schedule: str | None = None,
    assistant_confidence_threshold: float | None = None,
    max_assistant_tokens: int | None = None,
    assistant_ensemble_weight: float | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    assistant_early_exit: int | None = None,
    use_mtp: bool = False,
    tokenizer: Any = None,
    assistant_tokenizer: Any = None,
    stop_strings: str | Sequence[str] | None = None,
    max_time: float | None = None,
    streamer: Any = None,
    on_tokens: Callable[[list[np.ndarray]], None] | None = None,
    rounds_per_dispatch: int | None = None,
    return_logits: bool = False,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row, plainly or with one assisted strategy, in one compiled loop.

    Arguments mirror HF `generate`; each sampling and processing value comes from the call, else the model's
    generation_config.json, else HF's default (jaxspec.settings). Strategy: `assistant_model` (speculative
    decoding), `prompt_lookup_num_tokens` (n-gram copying), `assistant_early_exit` (the first E layers draft),
    `use_mtp` (the checkpoint's MTP layers draft); at most one. Draft length: see jaxspec.strategies (jaxspec's
    default schedule, "adaptive", stops drafting while a row's drafts keep being rejected). Greedy output equals
    plain greedy decoding for every strategy; sampling is exact except with `assistant_ensemble_weight`, which
    verifies against the mixture w*p + (1-w)*q by design. Only shapes and the strategy are compiled in: new
    sampling values, penalties or prompts of similar length reuse the executables.

    Output as it is made: `streamer` follows transformers' protocol (`put(prompt ids)`, then `put(new ids)` as
    rounds commit, then `end()`; `TextStreamer` and `TextIteratorStreamer` work) for a batch of one row;
    `on_tokens(rows)` is called with each row's newly committed tokens (a list of int32 arrays, possibly empty)
    for any batch. `stop_strings` end a row at the token that completes one (decoded with `tokenizer`, default the
    model's); `max_time` (seconds) ends the call after the round in progress. These run the same compiled loop
    `rounds_per_dispatch` rounds at a time (default: as many as fill about STREAM_INTERVAL = 0.1 s) and check
    between dispatches.

    `return_logits=True` also returns, for every new token, the processed target logits it was chosen from
    (`GenerateOutput.logits`, [B, N, V]); it compiles its own loop, which keeps them.
    """
    resolved = settings_lib.resolve(
        model, max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        min_p=min_p, repetition_penalty=repetition_penalty, no_repeat_ngram_size=no_repeat_ngram_size,
        min_new_tokens=min_new_tokens, bad_words_ids=bad_words_ids, suppress_tokens=suppress_tokens,
        eos_token_id=eos_token_id, pad_token_id=pad_token_id, seed=seed,
    )
    choice = choose_strategy(
        model, do_sample=resolved.do_sample, assistant_model=assistant_model,
        num_assistant_tokens=num_assistant_tokens, num_assistant_tokens_schedule=num_assistant_tokens_schedule,
        assistant_confidence_threshold=assistant_confidence_threshold, max_assistant_tokens=max_assistant_tokens,
        assistant_ensemble_weight=assistant_ensemble_weight, prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size, assistant_early_exit=assistant_early_exit,
        use_mtp=use_mtp, tokenizer=tokenizer, assistant_tokenizer=assistant_tokenizer,
    )
    control = HostControl.build(stop_strings=stop_strings, max_time=max_time, streamer=streamer,
                                on_tokens=on_tokens, rounds_per_dispatch=rounds_per_dispatch,
                                tokenizer=tokenizer if tokenizer is not None else model.tokenizer)
    output = run_drafter(model, input_ids, attention_mask, choice.drafter, choice.assistant, resolved, mesh=mesh,
                         sharding_rules=sharding_rules, ensemble_weight=assistant_ensemble_weight,
                         strategy_name=choice.name, control=control, return_logits=return_logits)
    if choice.name in ("speculative", "universal") and choice.drafter.schedule.kind == "heuristic":
        # As HF: the "heuristic" schedule's adapted length carries over to the assistant's next call.
        final = output.drafter_summary["num_assistant_tokens"]
        assistant_model.generation_config["num_assistant_tokens"] = int(round(float(final.mean())))
    return output


def run_drafter(
    model: Model,
    input_ids: Any,
    attention_mask: Any,
    drafter: Drafter,
    assistant: Model | None,
    settings: Settings,
    *,
    mesh: Mesh | None = None,
    sharding_rules: ShardingRules | None = None,
    ensemble_weight: float | None = None,
    strategy_name: str = "custom",
    prefill_chunk: int | None = None,
    control: HostControl | None = None,
    return_logits: bool = False,
) -> GenerateOutput:
    """The loop with a ready-made drafter (for research drafters that `generate`'s arguments do not name)."""
    control = control or HostControl()
    started = time.perf_counter()
    prompts = prompt_rows(input_ids, attention_mask, settings.pad_id, settings.eos_ids)
    control.check_batch(len(prompts))
    _check_budget(model, prompts, settings.max_new_tokens)
    setup = time.perf_counter()
    if mesh is None:  # a sharded run keeps the fixed costs (jaxspec/costs.py)
        drafter = price_schedule(drafter, model, assistant)
    setup_seconds = time.perf_counter() - setup  # measuring step costs compiles too: counted with the compiles
    rules = sharding_rules or ShardingRules()
    chunk = prefill_chunk or default_prefill_chunk()
    batch = len(prompts)
    prompt_lengths = np.array([len(p) for p in prompts], np.int32)
    size = buffer_size(int(prompt_lengths.max()) + settings.max_new_tokens + drafter.max_draft + 1, chunk)
    drafter = drafter.for_prompts(prompts, size)
    tokens = np.zeros((batch, size), np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt

    target_graphdef, target_state = nnx.split(model.module)
    assistant_graphdef, assistant_state = nnx.split(assistant.module) if assistant is not None else (None, None)
    if mesh is not None:
        target_state = shard_state(target_state, mesh, rules)
        if assistant_state is not None:
            assistant_state = shard_state(assistant_state, mesh, rules)
    spec = LoopSpec(target_graphdef, assistant_graphdef, drafter, settings.do_sample, settings.ngram_slots,
                    ensemble_weight, chunk, mesh, rules, bool(return_logits))
    # Run-time inputs: new values reuse the executables.
    inputs = jax.tree.map(jnp.asarray, (settings.processing(model.config.vocab_size), drafter.runtime_inputs()))
    inputs = (*inputs, verify_head(model, target_state, mesh))
    prefill_args = (
        target_state,
        assistant_state,
        _place(tokens, mesh, rules),
        _place(prompt_lengths, mesh, rules),
        jnp.asarray(settings.max_new_tokens, jnp.int32),
        jax.random.key(settings.seed),
        inputs,
        # The score buffer's length is a shape: only with return_logits does the budget key the compile cache.
        np.zeros(1 << (settings.max_new_tokens - 1).bit_length() if return_logits else 0, np.int8),
    )
    start = time.perf_counter()
    prefill = _compile(spec, "prefill", prefill_args)
    rounds_args = (target_state, assistant_state, prefill.out_info, inputs, jnp.asarray(0, jnp.int32))
    rounds = _compile(spec, "rounds", rounds_args)
    compile_seconds = time.perf_counter() - start + setup_seconds

    start = time.perf_counter()
    state = jax.block_until_ready(prefill(*prefill_args))
    prefill_seconds = time.perf_counter() - start
    if not control.active:
        no_round_limit = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
        state = jax.block_until_ready(rounds(target_state, assistant_state, state, inputs, no_round_limit))
    else:
        # The same executable, a few rounds per dispatch; the state stays on the device between dispatches and
        # the host reads only lengths and the token buffer.
        control.begin(prompts, prompt_lengths, deadline_from=started)
        per_dispatch, dispatched = control.rounds_per_dispatch or 1, None
        while True:
            tokens, lengths, done = distributed.fetch((state.tokens, state.lengths, state.done))
            if dispatched is not None and control.rounds_per_dispatch is None:
                per_dispatch = rounds_for_interval(per_dispatch, time.perf_counter() - dispatched)
            stop = control.after_dispatch(tokens, lengths)
            if (done | stop).all() or control.out_of_time():
                break
            if stop.any():
                state = dataclasses.replace(state, done=_place(done | stop, mesh, rules))
            dispatched = time.perf_counter()
            state = rounds(target_state, assistant_state, state, inputs, jnp.asarray(per_dispatch, jnp.int32))
        control.finish()
    decode_seconds = time.perf_counter() - start
    final = distributed.fetch((state.tokens, state.lengths, state.counters, drafter.summary(state.drafter),
                               state.scores))
    output = _unpack(final, input_ids, prompts, prompt_lengths, settings.pad_id, compile_seconds, decode_seconds,
                     prefill_seconds, strategy_name)
    return control.crop(output, input_ids, prompts, settings.pad_id)


# When the host watches the output (streaming, stop strings, max_time), each dispatch runs as many rounds as fill
# about STREAM_INTERVAL seconds, judged from the previous dispatch: every dispatch costs a host round trip (a few
# ms), which one round per dispatch would pay per token. Text still appears several times a second, and a stop
# string or max_time is noticed within that interval (tokens past a stop string are cropped, never returned).
STREAM_INTERVAL = 0.1
MAX_STREAM_ROUNDS = 64


def rounds_for_interval(rounds: int, seconds: float, interval: float = STREAM_INTERVAL) -> int:
    """Rounds for the next dispatch, from the last one's `rounds` and its wall time `seconds`."""
    if seconds <= 0:
        return min(2 * rounds, MAX_STREAM_ROUNDS)
    return int(np.clip(round(rounds * interval / seconds), 1, MAX_STREAM_ROUNDS))


@dataclasses.dataclass
class HostControl:
    """What the host does between dispatches of the round loop: hand new tokens to a streamer or callback, end rows
    whose text completed a stop string, and end the call past `max_time`.

    A stop string ends its row at the token whose text completes it (transformers' StopStringCriteria stops at the
    same token in plain decoding; in its assisted loop a whole verified block is kept, past the stop string). Text
    is each row's decoded new tokens: a stop string that starts inside the prompt is not seen.
    """

    stop_strings: tuple[str, ...] = ()
    max_time: float | None = None
    streamer: Any = None
    on_tokens: Callable[[list[np.ndarray]], None] | None = None
    rounds_per_dispatch: int | None = None  # None: about STREAM_INTERVAL seconds of rounds per dispatch
    tokenizer: Any = None

    @classmethod
    def build(cls, *, stop_strings, max_time, streamer, on_tokens, rounds_per_dispatch, tokenizer) -> "HostControl":
        """Validated settings (errors before anything compiles)."""
        if isinstance(stop_strings, str):
            stop_strings = (stop_strings,)
        stop_strings = tuple(stop_strings or ())
        if not all(isinstance(text, str) and text for text in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}.")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need a tokenizer to read the text: pass tokenizer= (this model has none).")
        if max_time is not None and not (isinstance(max_time, (int, float)) and max_time > 0):
            raise ValueError(f"max_time must be a number of seconds > 0, got {max_time!r}.")
        if streamer is not None and not (hasattr(streamer, "put") and hasattr(streamer, "end")):
            raise TypeError("streamer must have put(ids) and end() (transformers' streamer protocol).")
        if rounds_per_dispatch is not None and (isinstance(rounds_per_dispatch, bool) or
                                                not isinstance(rounds_per_dispatch, int) or rounds_per_dispatch < 1):
            raise ValueError(f"rounds_per_dispatch must be an integer >= 1, got {rounds_per_dispatch!r}.")
        return cls(stop_strings, max_time, streamer, on_tokens, rounds_per_dispatch, tokenizer)

    @property
    def active(self) -> bool:
        return bool(self.stop_strings or self.max_time or self.streamer is not None or self.on_tokens is not None)

    def check_batch(self, batch: int) -> None:
        if self.streamer is not None and batch != 1:
            raise ValueError(f"a streamer follows transformers' protocol, which streams one row; this batch has {batch}. "
                             "Pass on_tokens=callback instead: it gets every row's new tokens.")

    def begin(self, prompts, prompt_lengths, deadline_from: float) -> None:
        self._prompt_lengths = prompt_lengths
        self._emitted = prompt_lengths.copy()  # [B] tokens handed out so far, prompt included
        self._stop_at = np.full(len(prompts), -1)  # [B] new tokens kept when a stop string ended the row
        self._deadline = None if self.max_time is None else deadline_from + self.max_time
        if self.streamer is not None:
            self.streamer.put(np.asarray(prompts[0])[None])

    def out_of_time(self) -> bool:
        return self._deadline is not None and time.perf_counter() > self._deadline

    def after_dispatch(self, tokens: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Hand out what the rows committed since the last dispatch; -> [B] rows that a stop string ends."""
        stop = self._stop_at >= 0
        for row in np.flatnonzero(~stop):
            if self.stop_strings:
                new = tokens[row, self._prompt_lengths[row]: lengths[row]]
                kept = self._stop_point(new, already=self._emitted[row] - self._prompt_lengths[row])
                if kept is not None:
                    self._stop_at[row] = kept
                    lengths = lengths.copy()
                    lengths[row] = self._prompt_lengths[row] + kept
                    stop[row] = True
        fresh = [tokens[row, self._emitted[row]: max(lengths[row], self._emitted[row])] for row in range(len(lengths))]
        self._emitted = np.maximum(self._emitted, lengths)
        if self.streamer is not None and len(fresh[0]):
            self.streamer.put(fresh[0])
        if self.on_tokens is not None:
            self.on_tokens(fresh)
        return stop

    def _stop_point(self, new: np.ndarray, already: int) -> int | None:
        """The number of new tokens up to the one whose text completes a stop string, or None."""
        text = self.tokenizer.decode(new.tolist())
        if not any(s in text for s in self.stop_strings):
            return None
        for kept in range(max(already, 1), len(new) + 1):  # the text up to `already` had no stop string
            text = self.tokenizer.decode(new[:kept].tolist())
            if any(s in text for s in self.stop_strings):
                return kept
        return len(new)

    def finish(self) -> None:
        if self.streamer is not None:
            self.streamer.end()

    def crop(self, output: GenerateOutput, input_ids, prompts, pad_id) -> GenerateOutput:
        """Rows a stop string ended keep their tokens up to it; the rest of the row becomes padding."""
        if not self.stop_strings or (self._stop_at < 0).all():
            return output
        width = output.sequences.shape[1] - int(output.num_new_tokens.max())
        kept = np.where(self._stop_at >= 0, np.minimum(self._stop_at, output.num_new_tokens), output.num_new_tokens)
        sequences = output.sequences[:, : width + int(kept.max())].copy()
        for row, n in enumerate(kept):
            sequences[row, width + n:] = pad_id
        return dataclasses.replace(output, sequences=sequences, num_new_tokens=kept.astype(np.int32))


def buffer_size(needed: int, chunk: int) -> int:
    """Token buffer / cache length for `needed` positions, rounded so that nearby prompt lengths and budgets share
    executables: a power of two up to LARGE_BUFFER, then a multiple of BUFFER_STEP (a long context wastes less than
    a step of cache); at least MIN_BUFFER, and a multiple of the prefill chunk, so that its chunks tile it exactly."""
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"prefill_chunk must be a power of two, got {chunk}.")
    if needed <= LARGE_BUFFER:
        size = max(MIN_BUFFER, 1 << (needed - 1).bit_length())
    else:
        size = -(-needed // BUFFER_STEP) * BUFFER_STEP
    return -(-size // chunk) * chunk


MAX_COMPILED = 32  # a long session (a notebook, a test run) should not keep every executable alive
_compiled: collections.OrderedDict[Any, Any] = collections.OrderedDict()


def _compile(spec: LoopSpec, which: str, args):
    """AOT-compile once per (spec, executable, argument shapes) so compile time is measured apart from decode time."""
    leaves, treedef = jax.tree.flatten(args)
    key = (spec, which, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key not in _compiled:
        if which == "prefill":
            fn = jax.jit(functools.partial(_prefill, spec))
        else:
            fn = jax.jit(functools.partial(_rounds, spec), donate_argnums=(2,))  # the loop state is updated in place
        _compiled[key] = fn.lower(*args).compile()
        while len(_compiled) > MAX_COMPILED:
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return _compiled[key]


def _place(x: np.ndarray, mesh: Mesh | None, rules: ShardingRules) -> jax.Array:
    """Batch-major host arrays go to the mesh split along `batch` (replicated if it does not divide). Every process
    passes the same array; each places only its own devices' slices."""
    if mesh is None:
        return jnp.asarray(x)
    axes = ("batch",) + ("seq",) * (x.ndim - 1)
    return distributed.global_array(x, named_sharding(axes, x.shape, mesh, rules))


def prompt_rows(input_ids: Any, attention_mask: Any, pad_id: int, eos_ids: tuple[int, ...]) -> list[np.ndarray]:
    """Each row's real tokens. Rows may be left- or right-padded (mask zeros at one end), or a list of rows.

    Without a mask, an array of ids gets one inferred from the pad id when the ids contain it and it is not an EOS
    id, as HF does (`_prepare_attention_mask_for_generation`). A list of rows without a mask is taken as it is,
    each row exactly its tokens: a chat template's end-of-turn token is often the pad token too.
    """
    if isinstance(input_ids, (list, tuple)) and input_ids and isinstance(input_ids[0], (list, tuple, np.ndarray)):
        if attention_mask is None:
            rows = [np.asarray(r, np.int64) for r in input_ids]
            if any(r.ndim != 1 for r in rows):
                raise ValueError("input_ids rows must be 1-D sequences of token ids.")
            return _checked_rows(rows)
        input_ids = np.asarray(input_ids)
    ids = np.asarray(input_ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2:
        raise ValueError(f"input_ids must have shape [batch, length]; got {ids.shape}.")
    if ids.shape[0] == 0:
        raise ValueError("input_ids has no rows.")
    inferred = attention_mask is None
    if inferred:
        if pad_id in ids and pad_id not in eos_ids:
            attention_mask = ids != pad_id
        else:
            return _checked_rows(list(ids))
    mask = np.asarray(attention_mask)
    if mask.ndim == 1:
        mask = mask[None]
    if mask.shape != ids.shape:
        raise ValueError(f"attention_mask shape {mask.shape} does not match input_ids shape {ids.shape}.")
    rows = []
    for b in range(ids.shape[0]):
        real = np.flatnonzero(mask[b])
        if len(real) and real[-1] - real[0] + 1 != len(real):
            if inferred:
                raise ValueError(
                    f"No attention_mask was given, so padding was inferred from pad_token_id={pad_id} (as "
                    f"transformers does when it is not an EOS id), but row {b} holds that token between real tokens "
                    "(a chat template's end-of-turn token, say). Pass attention_mask, or the rows as a list of "
                    "token lists.")
            raise ValueError(f"attention_mask row {b} has padding between real tokens; only left or right padding "
                             "is supported.")
        rows.append(ids[b, real])
    return _checked_rows(rows)


def _checked_rows(rows: list[np.ndarray]) -> list[np.ndarray]:
    for b, row in enumerate(rows):
        if len(row) == 0:
            raise ValueError(f"Prompt row {b} is empty: every row needs at least one token.")
    return [np.asarray(r, np.int32) for r in rows]


def _check_budget(model: Model, prompts: list[np.ndarray], max_new_tokens: int) -> None:
    longest = max(len(p) for p in prompts)
    limit = model.config.max_position_embeddings
    if longest + max_new_tokens > limit:
        raise ValueError(
            f"Prompt length {longest} + max_new_tokens {max_new_tokens} = {longest + max_new_tokens} exceeds the "
            f"model's max_position_embeddings ({limit})."
        )
    vocab = model.config.vocab_size
    for b, p in enumerate(prompts):
        if p.min() < 0 or p.max() >= vocab:
            raise ValueError(f"Prompt row {b} has token ids outside the vocabulary [0, {vocab}).")


def _unpack(final, input_ids, prompts, prompt_lengths, pad_id, compile_seconds, decode_seconds, prefill_seconds,
            strategy):
    tokens, lengths, counters, drafter_summary, scores = final
    new_counts = lengths - prompt_lengths
    width = int(new_counts.max())
    given = _given_layout(input_ids, prompts, pad_id)
    sequences = np.full((len(prompts), given.shape[1] + width), pad_id, np.int32)
    sequences[:, : given.shape[1]] = given
    for row, (p, n) in enumerate(zip(prompt_lengths, new_counts)):
        sequences[row, given.shape[1] : given.shape[1] + n] = tokens[row, p : p + n]
    return GenerateOutput(
        sequences=sequences,
        num_new_tokens=new_counts.astype(np.int32),
        target_forwards=int(counters.rounds) + 1,
        rounds=int(counters.rounds),
        draft_forwards=int(counters.draft_forwards),
        drafted=np.asarray(counters.drafted),
        accepted=np.asarray(counters.accepted),
        accepted_hist=np.asarray(counters.accepted_hist),
        compile_seconds=compile_seconds,
        decode_seconds=decode_seconds,
        prefill_seconds=prefill_seconds,
        strategy=strategy,
        drafter_summary={k: np.asarray(v) for k, v in drafter_summary.items()},
        logits=None if scores is None else np.asarray(scores)[:, :width],
    )


def _given_layout(input_ids, prompts, pad_id) -> np.ndarray:
    """The prompts as the caller laid them out (HF returns them unchanged ahead of the new tokens)."""
    try:
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim == 2 and ids.dtype != object:
            return ids.astype(np.int32)
    except ValueError:
        pass
    longest = max(len(p) for p in prompts)  # a ragged list: left-pad it, as HF tokenizers do for generation
    out = np.full((len(prompts), longest), pad_id, np.int32)
    for row, p in enumerate(prompts):
        out[row, longest - len(p):] = p
    return out


# ------------------------------------------------------------------------------------------------------------------
# Device side: the prefill and the round loop


def _context(spec: LoopSpec, target_state, assistant_state, inputs) -> Context:
    target = nnx.merge(spec.target_graphdef, target_state)
    assistant = nnx.merge(spec.assistant_graphdef, assistant_state) if spec.assistant_graphdef else None
    processing, draft_inputs, head = inputs
    return Context(target=target, assistant=assistant, processing=processing, do_sample=spec.do_sample,
                   ngram_slots=spec.ngram_slots, draft_inputs=draft_inputs, head=head)


def _prefill(spec: LoopSpec, target_state, assistant_state, tokens, prompt_lengths, max_new_tokens, rng,
             inputs, score_slots) -> DecodeState:
    """Read every prompt in chunks of `spec.prefill_chunk` positions, pick each row's first token, build the state."""
    global _trace_count
    _trace_count += 1
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
        x, cache = target.run_layers(target.embed_tokens(chunk_tokens), positions, cache)
        hidden = target.final_hidden(x)  # [B, C, D]
        last = prompt_lengths - 1 - first  # the row's last prompt position, within this chunk if in [0, C)
        in_chunk = (last >= 0) & (last < chunk)
        last_hidden = jnp.where(in_chunk[:, None], hidden[rows, jnp.clip(last, 0, chunk - 1)], last_hidden)
        valid = positions < prompt_lengths[:, None]
        drafter_state = drafter.prefill_chunk(ctx, drafter_state, PrefillChunk(chunk_tokens, positions, hidden, valid))
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


def _rounds(spec: LoopSpec, target_state, assistant_state, state: DecodeState, inputs, max_rounds) -> DecodeState:
    """Run rounds until every row is done, or `max_rounds` rounds have run (the state then resumes in a next call)."""
    global _trace_count
    _trace_count += 1
    ctx = _context(spec, target_state, assistant_state, inputs)
    size = state.tokens.shape[1]
    k = spec.drafter.max_draft

    def cond(carry):
        state, rounds_run = carry
        some_row_running = ~jnp.all(state.done)  # every row hit EOS or its budget
        # Cache full: by construction (buffer >= prompt + budget + K + 1) this never fires; it guards the buffer
        # bounds should that invariant ever be broken.
        room_left = jnp.all(state.done | (state.lengths + k < size))
        within_dispatch = rounds_run < max_rounds  # a caller streaming output asked for control back
        return some_row_running & room_left & within_dispatch

    def body(carry):
        state, rounds_run = carry
        return _round(spec, ctx, state), rounds_run + 1

    state, _ = jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))
    return state


def _round(spec: LoopSpec, ctx: Context, state: DecodeState) -> DecodeState:
    drafter, k = spec.drafter, spec.drafter.max_draft
    rng, draft_rng, verify_rng = jax.random.split(state.rng, 3)
    draft, drafter_state, draft_forwards, cache = drafter.draft(ctx, state, state.drafter, draft_rng)
    count = jnp.where(state.done, 0, jnp.minimum(draft.count, k))  # [B]
    n, verified, hidden, cache, processed = _verify_round(spec, ctx, state, draft, count, cache, drafter_state,
                                                          verify_rng)

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
        scores = scores.at[rows[:, None], slots].set(processed, mode="drop")

    result = RoundResult(drafted=count, accepted=n, committed=committed, tokens=verified, hidden=hidden, lengths=lengths)
    drafter_state = drafter.update(ctx, drafter_state, result)
    active = ~state.done
    c = state.counters
    counters = Counters(
        rounds=c.rounds + 1,
        draft_forwards=c.draft_forwards + draft_forwards,
        drafted=c.drafted + jnp.where(active, count, 0),
        accepted=c.accepted + jnp.where(active, n, 0),
        accepted_hist=c.accepted_hist + (active[:, None] & (jnp.arange(k + 1)[None, :] == n[:, None])),
    )
    return dataclasses.replace(
        state, tokens=tokens, lengths=lengths, done=done, cache=cache, drafter=drafter_state, rng=rng, counters=counters,
        scores=scores,
    )


def _verify_round(spec: LoopSpec, ctx: Context, state: DecodeState, draft, count, cache, drafter_state, rng):
    """The target scores `[last, d_1 .. d_W-1]` and verify decides: -> (n [B], tokens [B, K+1], hidden
    [B, K+1, D], cache, processed logits [B, K+1, V] with return_logits, else None).

    The block width W is chosen at run time among `spec.verify_widths`, so a round with few drafts does not pay
    for K. A round without drafts is a plain step at width 1. Each width runs its forward, its processors and
    verification at W positions, and only the small results (tokens, hidden states) are padded to K+1: padding
    the [B, W, V] logits instead, to process and verify once at K+1, moved and reduced K+1 positions of the
    vocabulary every round (6.7 MB a round at K=10 on Qwen's 151,936 tokens) however few drafts it held.
    """
    drafter, k = spec.drafter, spec.drafter.max_draft
    batch = count.shape[0]
    rows = jnp.arange(batch)

    def to_k1(x):  # [B, W, ...] -> [B, K+1, ...], zero past W (positions no row commits)
        return jnp.pad(x, ((0, 0), (0, k + 1 - x.shape[1])) + ((0, 0),) * (x.ndim - 2))

    def plain_step(cache):
        positions = state.lengths[:, None] - 1  # [B, 1]
        logits, hidden, cache = drafter.target_forward(ctx, state.last_token[:, None], positions, cache, drafter_state)
        processed = ctx.process(logits, state.tokens, state.lengths, state.prompt_lengths)  # [B, 1, V]
        token = select(rng, processed[:, 0], spec.do_sample)
        verified = jnp.zeros((batch, k + 1), jnp.int32).at[:, 0].set(token)
        kept = to_k1(processed) if spec.return_logits else None
        return cache, (jnp.zeros((batch,), jnp.int32), verified, to_k1(hidden), kept)

    if k == 0:
        cache, (n, verified, hidden, kept) = plain_step(cache)
        return n, verified, hidden, cache, kept

    def verify_block(width: int, cache):
        drafts = draft.tokens[:, : width - 1]  # [B, W-1]: every row's count is at most W-1
        block = jnp.concatenate([state.last_token[:, None], drafts], axis=1)  # [B, W]
        positions = state.lengths[:, None] - 1 + jnp.arange(width)[None, :]
        logits, hidden, cache = drafter.target_forward(ctx, block, positions, cache, drafter_state)
        # Position j judges draft j+1 with the prefix it extends: committed tokens, then d_1 .. d_j.
        draft_positions = state.lengths[:, None] + jnp.arange(width - 1)[None, :]
        with_drafts = state.tokens.at[rows[:, None], draft_positions].set(drafts, mode="drop")
        processed = ctx.process(logits, with_drafts, state.lengths, state.prompt_lengths)  # [B, W, V]
        probs = None if draft.probs is None else draft.probs[:, : width - 1]
        n, verified = verify(rng, processed, drafts, count, probs, spec.do_sample, spec.ensemble_weight)
        kept = to_k1(processed) if spec.return_logits else None
        return cache, (n, to_k1(verified), to_k1(hidden), kept)

    def drafted_step(cache):
        wide = [w for w in spec.verify_widths if w > 1]
        index = jnp.searchsorted(jnp.asarray(wide), jnp.max(count) + 1)
        return inplace.switch(index, [functools.partial(verify_block, w) for w in wide], cache)

    # The cache is the only state the branches update (in place: see jaxspec.inplace).
    cache, (n, verified, hidden, kept) = inplace.cond(jnp.max(count) > 0, drafted_step, plain_step, cache)
    return n, verified, hidden, cache, kept


def _commit_counts(ctx: Context, verified, n, lengths, budget_end):
    """Tokens each row appends: the n accepted drafts + 1, cut at the budget and just after the first EOS."""
    index = jnp.arange(verified.shape[1])[None, :]
    committed = jnp.minimum(n + 1, budget_end - lengths)  # [B]
    is_eos = ctx.is_eos(verified) & (index < committed[:, None])  # [B, K+1]
    first_eos = jnp.argmax(is_eos, axis=1)
    hit_eos = jnp.any(is_eos, axis=1)
    return jnp.where(hit_eos, first_eos + 1, committed), hit_eos
