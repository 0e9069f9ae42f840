"""`jaxspec.generate`: the public call. It takes transformers' argument names, builds the three config objects from
them, picks the strategy's row of the strategy table, and runs the compiled loop (jaxspec/loop.py).

Greedy output equals plain greedy decoding for every strategy; sampling is exact except with
`assistant_ensemble_weight`, which verifies against the mixture w*p + (1-w)*q by design. Only shapes and the
strategy are compiled in: new sampling values, penalties or prompts of similar length reuse the executables.
"""

from __future__ import annotations

import dataclasses
import difflib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from . import distributed, loop
from .costs import mode as step_cost_mode, price_loop
from .head import verify_head
from .layer_stack import layer_stack
from .loading import Model
from .output import FinalState, GenerateOutput, Timings, unpack
from .prompts import PromptBatch, buffer_size, check_budget
from .settings import SamplingConfig, Settings
from .sharding import ShardingRules, shard_state
from .strategies import OPTIONS, DraftingConfig, Drafter, choose_strategy, default_prefill_chunk
from .streaming import HostControl, StreamingConfig, rounds_for_interval

_SAMPLING_NAMES = frozenset(field.name for field in dataclasses.fields(SamplingConfig))
_STREAMING_NAMES = frozenset(field.name for field in dataclasses.fields(StreamingConfig))


def generate(
    model: Model,
    input_ids: Any,
    attention_mask: Any = None,
    *,
    sampling: SamplingConfig | None = None,
    drafting: DraftingConfig | None = None,
    streaming: StreamingConfig | None = None,
    tokenizer: Any = None,
    mesh: Mesh | None = None,
    sharding_rules: ShardingRules | None = None,
    return_logits: bool = False,
    **kwargs: Any,
) -> GenerateOutput:
    """Generate up to `max_new_tokens` per row, plainly or with one assisted strategy, in one compiled loop.

    `kwargs` are transformers' `generate` arguments, each one a field of `SamplingConfig` (max_new_tokens,
    do_sample, temperature, top_k, ...), an option of a strategy in `jaxspec.STRATEGIES` (assistant_model,
    num_assistant_tokens, prompt_lookup_num_tokens, assistant_early_exit, use_mtp, ...; see `DraftingConfig`), or a
    field of `StreamingConfig` (streamer, on_tokens, stop_strings, max_time, rounds_per_dispatch). The config
    objects may be passed instead, or as well, as long as no value is given twice. Unset sampling values come from
    the model's generation_config.json, then transformers' defaults.

    `tokenizer`: the target's tokenizer where the model has none (stop strings, universal decoding). `mesh`: params
    and caches sharded by logical axes (`sharding_rules`), across processes too. `return_logits=True` also returns,
    for every new token, the processed target logits it was chosen from (`GenerateOutput.logits`, [B, N, V]); it
    compiles its own loop, which keeps them.
    """
    sampling, drafting, streaming = configs_from_kwargs(kwargs, sampling, drafting, streaming)
    settings = sampling.resolve(model)
    choice = choose_strategy(model, drafting, do_sample=settings.do_sample, tokenizer=tokenizer)
    control = HostControl.build(streaming, tokenizer if tokenizer is not None else model.tokenizer)
    output = generate_with_drafter(model, input_ids, attention_mask, choice.drafter, settings,
                                   assistant=choice.assistant, mesh=mesh, sharding_rules=sharding_rules,
                                   ensemble_weight=drafting.assistant_ensemble_weight, strategy_name=choice.name,
                                   control=control, return_logits=return_logits)
    if choice.strategy.persist is not None:
        choice.strategy.persist(choice, output)
    return output


def configs_from_kwargs(kwargs: dict[str, Any], sampling: SamplingConfig | None, drafting: DraftingConfig | None,
                        streaming: StreamingConfig | None) -> tuple[SamplingConfig, DraftingConfig, StreamingConfig]:
    """Each keyword argument into the config whose field or option it names; the given objects are the base."""
    sampling, streaming = sampling or SamplingConfig(), streaming or StreamingConfig()
    drafting = drafting or DraftingConfig()
    unknown = sorted(set(kwargs) - _SAMPLING_NAMES - _STREAMING_NAMES - set(OPTIONS))
    if unknown:
        known = sorted(_SAMPLING_NAMES | _STREAMING_NAMES | set(OPTIONS))
        hints = [f" (did you mean {match[0]!r}?)" if (match := difflib.get_close_matches(name, known, n=1)) else ""
                 for name in unknown]
        raise TypeError("generate() got unexpected keyword argument(s) "
                        + ", ".join(f"{name!r}{hint}" for name, hint in zip(unknown, hints)) + ".")

    def merged(config, names):
        given = {name: value for name, value in kwargs.items() if name in names}
        twice = sorted(name for name in given if _is_set(config, name))
        if twice:
            raise ValueError(f"{', '.join(twice)} given both as keyword argument(s) and in {type(config).__name__}; "
                             "give each value once.")
        return given

    sampling = dataclasses.replace(sampling, **merged(sampling, _SAMPLING_NAMES))
    streaming = dataclasses.replace(streaming, **merged(streaming, _STREAMING_NAMES))
    drafting = drafting.replace(**merged(drafting, OPTIONS))
    return sampling, drafting, streaming


def _is_set(config, name: str) -> bool:
    if isinstance(config, DraftingConfig):
        return name in config.options
    default = next(field.default for field in dataclasses.fields(config) if field.name == name)
    return getattr(config, name) != default


def generate_with_drafter(
    model: Model,
    input_ids: Any,
    attention_mask: Any,
    drafter: Drafter,
    settings: Settings,
    *,
    assistant: Model | None = None,
    mesh: Mesh | None = None,
    sharding_rules: ShardingRules | None = None,
    ensemble_weight: float | None = None,
    strategy_name: str = "custom",
    prefill_chunk: int | None = None,
    control: HostControl | None = None,
    return_logits: bool = False,
) -> GenerateOutput:
    """The compiled loop with a ready-made drafter (research drafters that no row of the strategy table names):
    check the prompts, price the schedule, lay out and place the call, compile, run, and unpack."""
    control = control or HostControl()
    started = time.perf_counter()
    prompts = PromptBatch.parse(input_ids, attention_mask, settings.pad_id, settings.eos_ids)
    control.check_batch(prompts.size)
    check_budget(model, prompts.rows, settings.max_new_tokens)
    step_cost_mode()  # read again when the schedule is priced, after the compile: a misspelt value fails here
    call = _lay_out(model, assistant, prompts, drafter, settings, mesh=mesh, rules=sharding_rules or ShardingRules(),
                    chunk=prefill_chunk or default_prefill_chunk(), ensemble_weight=ensemble_weight,
                    return_logits=return_logits)
    compile_started = time.perf_counter()
    # The prefill compiles on a worker thread and runs as soon as it has compiled, while this thread traces and
    # lowers the round loop, which then compiles on the worker too: on a CPU, XLA's compile of the prefill and the
    # Python of the rounds' tracing share the cores instead of taking turns. A streamed call hands out its first
    # tokens before waiting for the rounds.
    prefill = call.compile_prefill()
    prefilled = prefill.then_call(*call.prefill_args)
    rounds_compiled = call.compile_rounds(prefill)
    lowered = time.perf_counter()
    state, prefill_dispatched = prefilled()
    lowered = max(lowered, prefill_dispatched)  # a prefill that compiled past the rounds' lowering: compile time
    state = jax.block_until_ready(state)
    prefill_done = time.perf_counter()
    if control.active:
        control.begin(prompts.rows, prompts.lengths, deadline_from=started)

    def ready():
        """The round loop, and the call with its schedule priced: timed by running these executables once per
        machine (jaxspec/costs.py); the prices are run-time inputs, so nothing compiles again."""
        rounds = rounds_compiled()
        prices = price_loop(call, prefill(), rounds, model, assistant, batch=prompts.size)
        return (call if prices is None else call.priced(prices)), rounds

    rounds_started = time.perf_counter()
    state, waited = _run_rounds(ready, state, control)
    finished = time.perf_counter()
    # The parts add up to the call's wall time. The rounds' lowering ran beside the prefill and counts as compile;
    # the prefill counts for what it ran past it (on a warm call, nothing was lowered: all of it).
    compile_seconds = (lowered - compile_started) + waited
    prefill_seconds = prefill_done - lowered
    decode_seconds = prefill_seconds + (finished - rounds_started) - waited
    final = FinalState(*distributed.fetch((state.tokens, state.lengths, state.counters,
                                           call.spec.drafter.summary(state.drafter), state.scores)))
    output = unpack(final, prompts.given, prompts.lengths, settings.pad_id,
                    Timings(compile_seconds, prefill_seconds, decode_seconds, prefill_done - started), strategy_name)
    return control.crop(output, settings.pad_id)


def _run_rounds(ready, state, control: HostControl):
    """Run the round loop from the prefilled `state`; -> (final state, seconds spent in `ready()`, which returns the
    priced call and the compiled round loop). A call whose rows all ended in the prefill waits for neither."""
    if control.active:
        return _run_watched(ready, state, control)
    if bool(np.all(distributed.fetch(state.done))):
        return state, 0.0
    waiting = time.perf_counter()
    call, rounds = ready()
    waited = time.perf_counter() - waiting
    no_round_limit = jnp.asarray(np.iinfo(np.int32).max, jnp.int32)
    return jax.block_until_ready(rounds(call.target_state, call.assistant_state, state, call.inputs,
                                        no_round_limit)), waited


@dataclasses.dataclass(frozen=True)
class _Call:
    """One call laid out for the device: the static spec, the placed states and the prefill's arguments."""

    spec: loop.LoopSpec
    target_state: Any
    assistant_state: Any
    inputs: loop.LoopInputs
    prefill_args: tuple

    def priced(self, prices) -> "_Call":
        """This call with the adaptive schedule's prices replaced (run-time inputs: the executables stay)."""
        schedule = self.spec.drafter.schedule.with_prices(prices.on_host())
        spec = dataclasses.replace(self.spec, drafter=dataclasses.replace(self.spec.drafter, schedule=schedule))
        inputs = dataclasses.replace(self.inputs, prices=jax.tree.map(jnp.asarray, prices))
        return dataclasses.replace(self, spec=spec, inputs=inputs)

    def compile_prefill(self) -> loop.Compiling:
        """Start compiling the prefill (or find it in the compile cache, when this spec and these shapes ran
        before)."""
        return loop.compile_in_background(self.spec, "prefill", self.prefill_args)

    def compile_rounds(self, prefill: loop.Compiling) -> loop.Compiling:
        """Start compiling the round loop that continues `prefill`'s state."""
        rounds_args = (self.target_state, self.assistant_state, self._prefilled_state(prefill), self.inputs,
                       jnp.asarray(0, jnp.int32))
        return loop.compile_in_background(self.spec, "rounds", rounds_args)

    def _prefilled_state(self, prefill: loop.Compiling):
        """The prefill's output state as abstract arrays on the devices it will be on. On one device that is the
        device of the call's params, so the round loop lowers before the prefill has compiled; on a mesh the
        partitioner picks the state's shardings, so they are read from the compiled prefill."""
        if self.spec.mesh is not None:
            return prefill().out_info
        sharding = jax.tree.leaves(self.target_state)[0].sharding
        return jax.tree.map(lambda info: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=sharding),
                            prefill.out_info)

    def compile(self):
        """(prefill, rounds) executables, waited for."""
        prefill = self.compile_prefill()
        return prefill(), self.compile_rounds(prefill)()


def _committed(state):
    """`state` with every array committed to the device it is on, without a copy. A model converted in this process
    holds uncommitted arrays and one restored from the conversion cache committed ones; the compiled loop's cache key
    includes the difference, so without this a first run's executables never served the processes after it."""
    return jax.tree.map(lambda x: jax.device_put(x, x.sharding) if isinstance(x, jax.Array) and not x.committed else x,
                        state)


def _lay_out(model: Model, assistant: Model | None, prompts: PromptBatch, drafter: Drafter, settings: Settings, *,
             mesh: Mesh | None, rules: ShardingRules, chunk: int, ensemble_weight: float | None,
             return_logits: bool) -> _Call:
    """Size the token buffer, give the drafter the prompts, shard the weights and split static from run-time."""
    size = buffer_size(int(prompts.lengths.max()) + settings.max_new_tokens + drafter.draft_slots + 1, chunk)
    drafter = drafter.for_prompts(prompts.rows, size)
    target_graphdef, target_state = nnx.split(model.module)
    assistant_graphdef, assistant_state = nnx.split(assistant.module) if assistant is not None else (None, None)
    if mesh is not None:
        target_state = shard_state(target_state, mesh, rules)
        if assistant_state is not None:
            assistant_state = shard_state(assistant_state, mesh, rules)
    else:
        target_state, assistant_state = _committed(target_state), _committed(assistant_state)
    spec = loop.LoopSpec(target_graphdef, assistant_graphdef, drafter, settings.do_sample, settings.ngram_slots,
                         ensemble_weight, chunk, mesh, rules, bool(return_logits))
    inputs = loop.LoopInputs.for_drafter(jax.tree.map(jnp.asarray, settings.processing(model.config.vocab_size)),
                                         drafter, verify_head(model, target_state, mesh), layer_stack(model, mesh))
    prefill_args = (
        target_state,
        assistant_state,
        loop.place(prompts.token_buffer(size), mesh, rules),
        loop.place(prompts.lengths, mesh, rules),
        jnp.asarray(settings.max_new_tokens, jnp.int32),
        jax.random.key(settings.seed),
        inputs,
        # The score buffer's length is a shape: only with return_logits does the budget key the compile cache.
        np.zeros(1 << (settings.max_new_tokens - 1).bit_length() if return_logits else 0, np.int8),
    )
    return _Call(spec, target_state, assistant_state, inputs, prefill_args)


def _run_watched(ready, state, control: HostControl):
    """The round loop a few rounds per dispatch, the host streaming and stopping between dispatches; the state stays
    on the device, and the host reads only lengths and the token buffer. The prefill's tokens are handed out before
    the first dispatch waits for `ready()` (the priced call and the compiled round loop); -> (final state, seconds
    spent in it)."""
    call = rounds = None
    waited = 0.0
    per_dispatch, dispatched = control.rounds_per_dispatch or 1, None
    while True:
        tokens, lengths, done = distributed.fetch((state.tokens, state.lengths, state.done))
        if dispatched is not None and control.rounds_per_dispatch is None:
            per_dispatch = rounds_for_interval(per_dispatch, time.perf_counter() - dispatched)
        stop = control.after_dispatch(tokens, lengths)
        if (done | stop).all() or control.out_of_time():
            break
        if rounds is None:
            waiting = time.perf_counter()
            call, rounds = ready()
            waited = time.perf_counter() - waiting
        mesh, rules = call.spec.mesh, call.spec.rules
        if stop.any():
            state = dataclasses.replace(state, done=loop.place(done | stop, mesh, rules))
        dispatched = time.perf_counter()
        state = rounds(call.target_state, call.assistant_state, state, call.inputs,
                       jnp.asarray(per_dispatch, jnp.int32))
    control.finish()
    return state, waited
