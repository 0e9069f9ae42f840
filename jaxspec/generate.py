"""`generate()`: every strategy runs in the same jit-compiled `lax.while_loop`.

One round: the drafter proposes up to K tokens per row; the target scores `[last, d_1 .. d_W-1]` in one forward,
with the width W chosen at run time among a few static sizes (a round with 2 drafts does not pay for K);
`verify()` decides what each row accepts; each row commits its own count, cut at EOS and at its budget. Plain
decoding is the K = 0 drafter, not a second loop. Prompts are left-aligned inside the loop (a row's cache index is
its position) and padded to a length bucket, so a new prompt length in the same bucket does not recompile.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from .distributed import fetch, global_array
from .loading import Model
from .sampling import SamplingParams, select
from .sharding import ShardingRules, constrain, shard_state
from .strategies import choose_strategy
from .strategies.base import Context, Counters, DecodeState, Drafter, Prefill, RoundResult
from .verify import verify

MIN_PROMPT_BUCKET = 16
CACHE_ROUNDING = 128  # cache sizes are rounded up so nearby budgets share one compiled loop

_trace_count = 0


def trace_count() -> int:
    """How many times the decode loop has been traced (compiled) in this process; tests use it."""
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
    compile_seconds: float
    decode_seconds: float
    strategy: str = "greedy"
    drafter_summary: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)

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
            "decode_seconds": self.decode_seconds,
            "tokens_per_second": self.tokens_per_second,
        }


@dataclasses.dataclass(frozen=True)
class LoopSpec:
    """Everything static about one compiled loop; equal specs share a compilation."""

    target_graphdef: Any
    assistant_graphdef: Any
    drafter: Drafter
    sampling: SamplingParams
    ensemble_weight: float | None
    eos_ids: tuple[int, ...]
    pad_id: int
    prompt_bucket: int
    cache_size: int
    mesh: Mesh | None
    rules: ShardingRules

    @property
    def verify_widths(self) -> tuple[int, ...]:
        """Static verify widths: powers of two below K + 1, then K + 1 itself. Each compiles once."""
        k1 = self.drafter.max_draft + 1
        widths = {1, k1} | {2**i for i in range(k1.bit_length()) if 2**i < k1}
        return tuple(sorted(widths))


# ------------------------------------------------------------------------------------------------------------------
# Host side: validate, bucket, call, unpack


def generate(
    model: Model,
    input_ids: Any,
    attention_mask: Any = None,
    *,
    max_new_tokens: int,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
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
) -> GenerateOutput:
    """Generate `max_new_tokens` per row, plainly or with one assisted strategy, in one compiled loop.

    Arguments mirror HF `generate`. Strategy: `assistant_model` (speculative decoding), `prompt_lookup_num_tokens`
    (n-gram copying), `assistant_early_exit` (the first E layers draft), `use_mtp` (the checkpoint's MTP layers
    draft; `num_assistant_tokens` defaults to their number); at most one. Draft length:
    `num_assistant_tokens`, `num_assistant_tokens_schedule`, `assistant_confidence_threshold` passed here win over
    the drafting model's generation_config, which wins over HF's defaults (20, "constant", 0.4);
    `max_assistant_tokens` is the static cap of the draft buffer. Greedy output equals plain greedy decoding for
    every strategy; sampling is exact except with `assistant_ensemble_weight`, which verifies against the mixture
    w*p + (1-w)*q by design.
    """
    sampling = SamplingParams(do_sample=bool(do_sample), temperature=temperature, top_k=top_k, top_p=top_p)
    choice = choose_strategy(
        model,
        do_sample=sampling.do_sample,
        assistant_model=assistant_model,
        num_assistant_tokens=num_assistant_tokens,
        num_assistant_tokens_schedule=num_assistant_tokens_schedule,
        assistant_confidence_threshold=assistant_confidence_threshold,
        max_assistant_tokens=max_assistant_tokens,
        assistant_ensemble_weight=assistant_ensemble_weight,
        prompt_lookup_num_tokens=prompt_lookup_num_tokens,
        max_matching_ngram_size=max_matching_ngram_size,
        assistant_early_exit=assistant_early_exit,
        use_mtp=use_mtp,
        tokenizer=tokenizer,
        assistant_tokenizer=assistant_tokenizer,
    )
    output = run_drafter(model, input_ids, attention_mask, choice.drafter, choice.assistant, sampling,
                         max_new_tokens=max_new_tokens, seed=seed, eos_token_id=eos_token_id,
                         pad_token_id=pad_token_id, mesh=mesh, sharding_rules=sharding_rules,
                         ensemble_weight=assistant_ensemble_weight, strategy_name=choice.name)
    if choice.name == "speculative" and choice.drafter.schedule == "heuristic":
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
    sampling: SamplingParams,
    *,
    max_new_tokens: int,
    seed: int = 0,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    mesh: Mesh | None = None,
    sharding_rules: ShardingRules | None = None,
    ensemble_weight: float | None = None,
    strategy_name: str = "custom",
) -> GenerateOutput:
    """The loop with a ready-made drafter (for research drafters that `generate`'s arguments do not name)."""
    prompts = _prompt_rows(input_ids, attention_mask)
    _check_budget(model, prompts, max_new_tokens)
    eos_ids = _eos_ids(model, eos_token_id)
    pad_id = _pad_id(model, pad_token_id, eos_ids)
    rules = sharding_rules or ShardingRules()

    batch = len(prompts)
    prompt_lengths = np.array([len(p) for p in prompts], np.int32)
    prompt_bucket = max(MIN_PROMPT_BUCKET, 1 << int(prompt_lengths.max() - 1).bit_length())
    k = drafter.max_draft
    cache_size = -(-(prompt_bucket + max_new_tokens + k + 1) // CACHE_ROUNDING) * CACHE_ROUNDING
    tokens = np.full((batch, cache_size), pad_id, np.int32)
    for row, prompt in enumerate(prompts):
        tokens[row, : len(prompt)] = prompt

    target_graphdef, target_state = nnx.split(model.module)
    assistant_graphdef, assistant_state = nnx.split(assistant.module) if assistant is not None else (None, None)
    if mesh is not None:
        target_state = shard_state(target_state, mesh, rules)
        if assistant_state is not None:
            assistant_state = shard_state(assistant_state, mesh, rules)
    spec = LoopSpec(
        target_graphdef, assistant_graphdef, drafter, sampling, ensemble_weight, eos_ids, pad_id,
        prompt_bucket, cache_size, mesh, rules,
    )
    args = (
        target_state,
        assistant_state,
        _place(jnp.asarray(tokens), mesh, rules),
        _place(jnp.asarray(prompt_lengths), mesh, rules),
        jnp.asarray(max_new_tokens, jnp.int32),
        jax.random.key(seed),
    )
    start = time.perf_counter()
    compiled = _compile(spec, args)
    compile_seconds = time.perf_counter() - start
    start = time.perf_counter()
    final = jax.block_until_ready(compiled(*args))
    decode_seconds = time.perf_counter() - start
    return _unpack(final, input_ids, prompts, prompt_lengths, pad_id, compile_seconds, decode_seconds, strategy_name)


MAX_COMPILED_LOOPS = 32  # a long session (a notebook, a test run) should not keep every executable alive
_compiled: collections.OrderedDict[Any, Any] = collections.OrderedDict()


def _compile(spec: LoopSpec, args):
    """AOT-compile once per (spec, argument shapes) so compile time is measured apart from decode time."""
    leaves, treedef = jax.tree.flatten(args)
    key = (spec, treedef, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves))
    if key not in _compiled:
        _compiled[key] = jax.jit(functools.partial(_decode, spec)).lower(*args).compile()
        while len(_compiled) > MAX_COMPILED_LOOPS:
            _compiled.popitem(last=False)
    _compiled.move_to_end(key)
    return _compiled[key]


def _place(x: jax.Array, mesh: Mesh | None, rules: ShardingRules) -> jax.Array:
    """Batch-major host arrays go to the mesh split along `batch` (replicated if it does not divide)."""
    if mesh is None:
        return x
    from .sharding import named_sharding

    axes = ("batch",) + ("seq",) * (x.ndim - 1)
    return global_array(x, named_sharding(axes, x.shape, mesh, rules))  # each process places its devices' slices


def _prompt_rows(input_ids: Any, attention_mask: Any) -> list[np.ndarray]:
    """Each row's real tokens. Rows may be left- or right-padded (mask zeros at one end), or a ragged list."""
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
    if attention_mask is None:
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
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
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


def _eos_ids(model: Model, eos_token_id) -> tuple[int, ...]:
    if eos_token_id is None:
        return model.eos_token_ids()
    return tuple(int(e) for e in eos_token_id) if isinstance(eos_token_id, (list, tuple)) else (int(eos_token_id),)


def _pad_id(model: Model, pad_token_id, eos_ids) -> int:
    """As HF: the given pad id, else the model's, else the first EOS id, else 0."""
    for candidate in (pad_token_id, model.generation_config.get("pad_token_id"), model.config.pad_token_id):
        if candidate is not None:
            return int(candidate)
    return eos_ids[0] if eos_ids else 0


def _unpack(final, input_ids, prompts, prompt_lengths, pad_id, compile_seconds, decode_seconds, strategy):
    tokens, lengths, counters, drafter_summary = fetch(final)  # in every process, gathered across processes
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
        strategy=strategy,
        drafter_summary={k: np.asarray(v) for k, v in drafter_summary.items()},
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
# Device side: one jitted function, one while_loop


def _decode(spec: LoopSpec, target_state, assistant_state, tokens, prompt_lengths, max_new_tokens, rng):
    global _trace_count
    _trace_count += 1
    target = nnx.merge(spec.target_graphdef, target_state)
    assistant = nnx.merge(spec.assistant_graphdef, assistant_state) if spec.assistant_graphdef else None
    ctx = Context(target=target, assistant=assistant, sampling=spec.sampling, eos_ids=spec.eos_ids, pad_id=spec.pad_id)
    drafter = spec.drafter

    prefill = _prefill(spec, ctx, tokens, prompt_lengths, max_new_tokens, rng)
    state = dataclasses.replace(prefill.state, drafter=drafter.init(ctx, prefill))

    def cond(state: DecodeState):
        some_row_running = ~jnp.all(state.done)  # every row hit EOS or its budget
        # Cache full: by construction (cache_size >= prompt bucket + budget + K + 1) this never fires; it guards
        # the buffer bounds should that invariant ever be broken.
        room_left = jnp.all(state.done | (state.lengths + drafter.max_draft < spec.cache_size))
        return some_row_running & room_left

    final = jax.lax.while_loop(cond, functools.partial(_round, spec, ctx), state)
    return final.tokens, final.lengths, final.counters, drafter.summary(final.drafter)


def _prefill(spec: LoopSpec, ctx: Context, tokens, prompt_lengths, max_new_tokens, rng) -> Prefill:
    """Run the prompt bucket through the target, pick each row's first new token, and build the loop state."""
    target, batch = ctx.target, tokens.shape[0]
    cache = target.init_cache(batch, spec.cache_size)
    cache = jax.tree.map(lambda x, axes: constrain(x, axes, spec.mesh, spec.rules), cache, type(cache).logical_axes())
    bucket = spec.prompt_bucket
    positions = jnp.broadcast_to(jnp.arange(bucket, dtype=jnp.int32), (batch, bucket))
    x, cache = target.run_layers(target.embed_tokens(tokens[:, :bucket]), positions, cache)
    hidden = target.final_hidden(x)  # [B, Tp, D]
    rows = jnp.arange(batch)
    last_logits = target.logits(hidden[rows, prompt_lengths - 1])  # [B, V]
    rng, first_rng = jax.random.split(rng)
    first = select(first_rng, last_logits, ctx.sampling)  # [B]
    tokens = tokens.at[rows, prompt_lengths].set(first)
    done = _is_eos(first, ctx.eos_ids) | (max_new_tokens <= 1)
    state = DecodeState(
        tokens=tokens,
        lengths=prompt_lengths + 1,
        prompt_lengths=prompt_lengths,
        budget_end=prompt_lengths + max_new_tokens,
        done=done,
        cache=cache,
        drafter=(),
        rng=rng,
        counters=Counters.zeros(batch, spec.drafter.max_draft),
    )
    return Prefill(hidden=hidden, state=state)


def _round(spec: LoopSpec, ctx: Context, state: DecodeState) -> DecodeState:
    drafter, k = spec.drafter, spec.drafter.max_draft
    rng, draft_rng, verify_rng = jax.random.split(state.rng, 3)
    draft, drafter_state, draft_forwards, cache = drafter.draft(ctx, state, state.drafter, draft_rng)
    count = jnp.where(state.done, 0, jnp.minimum(draft.count, k))  # [B]

    widths = spec.verify_widths
    width_index = jnp.searchsorted(jnp.asarray(widths), jnp.max(count) + 1)

    def verify_at(width: int):
        def run(operands):
            cache, drafter_state = operands
            block = jnp.concatenate([state.last_token[:, None], draft.tokens[:, : width - 1]], axis=1)  # [B, W]
            positions = state.lengths[:, None] - 1 + jnp.arange(width)[None, :]
            logits, hidden, cache = drafter.target_forward(ctx, block, positions, cache, drafter_state)
            probs = None if draft.probs is None else draft.probs[:, : width - 1]
            n, verified = verify(
                verify_rng, logits, draft.tokens[:, : width - 1], count, probs, spec.sampling, spec.ensemble_weight
            )
            pad = k + 1 - width  # every branch returns the same shapes
            verified = jnp.pad(verified, ((0, 0), (0, pad)), constant_values=spec.pad_id)
            hidden = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
            return n, verified, hidden, cache

        return run

    branches = [verify_at(w) for w in widths]
    operands = (cache, drafter_state)
    if len(branches) == 1:
        n, verified, hidden, cache = branches[0](operands)
    else:
        n, verified, hidden, cache = jax.lax.switch(width_index, branches, operands)

    committed, hit_eos = _commit_counts(verified, n, state.lengths, state.budget_end, ctx.eos_ids)
    committed = jnp.where(state.done, 0, committed)
    index = jnp.arange(k + 1)[None, :]
    rows = jnp.arange(verified.shape[0])[:, None]
    write_positions = jnp.where(index < committed[:, None], state.lengths[:, None] + index, spec.cache_size)
    tokens = state.tokens.at[rows, write_positions].set(verified, mode="drop")
    lengths = state.lengths + committed
    done = state.done | (hit_eos & (committed > 0)) | (lengths >= state.budget_end)

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
        state, tokens=tokens, lengths=lengths, done=done, cache=cache, drafter=drafter_state, rng=rng, counters=counters
    )


def _commit_counts(verified, n, lengths, budget_end, eos_ids):
    """Tokens each row appends: the n accepted drafts + 1, cut at the budget and just after the first EOS."""
    index = jnp.arange(verified.shape[1])[None, :]
    committed = jnp.minimum(n + 1, budget_end - lengths)  # [B]
    is_eos = _is_eos(verified, eos_ids) & (index < committed[:, None])  # [B, K+1]
    first_eos = jnp.argmax(is_eos, axis=1)
    hit_eos = jnp.any(is_eos, axis=1)
    return jnp.where(hit_eos, first_eos + 1, committed), hit_eos


def _is_eos(tokens: jax.Array, eos_ids: tuple[int, ...]) -> jax.Array:
    if not eos_ids:
        return jnp.zeros(tokens.shape, bool)
    return jnp.isin(tokens, jnp.asarray(eos_ids, jnp.int32))
