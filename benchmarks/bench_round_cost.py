"""What a decoding round costs inside the compiled loop, by the number of drafts it verifies, against a plain step.

    python benchmarks/bench_round_cost.py [--model smollm2-135m] [--drafts 0,1,3,7] [--max-draft 10] [--repeats 4]
        [--assistant smollm2-135m --assistant-drafts 1,2 [--whole-vocab]] [--idle mtp,prompt_lookup,dflash,eagle3
        [--without-feature-writes]]
        [--random-config CONFIG.json [--prompt-tokens N]] [--batch B] [--results benchmarks/results]

A drafter that proposes d fixed tokens every round (all of them rejected, so every round commits one token) runs
through `jaxspec.generate`'s loop with K = `--max-draft`, next to plain decoding, on the story prompt of
benchmarks/_bench_prompts.py; 96 new tokens, `--batch` rows of that prompt (default 1). Printed: milliseconds per round
(decode time without the prefill, median of `--repeats` calls, interleaved) and the ratio to plain decoding, side by
side in one run.

- d = 0 is a round of a drafter that drafts nothing: what the loop's structure (the draft buffer, the run-time choice
  of a verify width) costs over plain decoding, the floor of any strategy's overhead where it cannot help.
- d >= 1 adds the verify block of width d + 1 (the target forward, the processors and verification at that width).
- `--assistant`: rounds of that real assistant drafting d tokens each (constant schedule, no confidence stop; another
  tokenizer runs universal decoding). A round's cost minus the fixed-draft round of the same d is what the assistant's
  d drafts cost, in plain steps of the target: the figure the adaptive schedule prices as `draft_cost` per draft.
  A DFlash drafter (`--assistant smollm2-135m-dflash --assistant-drafts 1,3,7`) drafts a block in one forward
  whatever d is: the difference is that forward, the schedule's `round_cost`. An EAGLE-3 head (`--assistant
  smollm2-135m-eagle3 --assistant-drafts 1,4 --max-draft 4`) runs its window of K + 1 entries every round and one
  head step per draft after the first: the difference between its d = 1 and d = 4 rounds, beyond the fixed drafts',
  is three head steps. `--whole-vocab`, for a DFlash drafter with a draft vocabulary (the shipped one has 8,192 of
  SmolLM2's 49,152 tokens): the same drafter's rounds over the whole head too, side by side, what the vocabulary
  saves.

`--idle mtp,prompt_lookup,dflash,eagle3`: each strategy's own loop, as bench_batch.py runs it (the MTP layers, DFlash
drafter and EAGLE-3 head jaxspec ships for SmolLM2) forced to draft nothing, by the same run-time input jaxspec/costs.py
times that round with: what the strategy costs a round in which the adaptive schedule declines to draft, the floor of
its speed on text it cannot predict. The schedule prices its drafts against this round, so a cost here is one its
model does not see (docs/design.md, 'A round that drafts nothing'). `--without-feature-writes` adds, for DFlash and
EAGLE-3, the same idle loop with the committed tokens' features neither kept for the drafter nor projected into its
cache (its drafts would read stale features, but an idle round drafts none): the difference is what those writes
cost a round that drafts nothing (since they are deferred, an append to a ring and a projection of the ring every
PENDING_ROUNDS * (K + 1) - K rounds: jaxspec/strategies/base.py `PendingFeatures`), the A/B an accelerator that
prices EAGLE-3's idle round above a plain step needs (docs/design.md, 'On a GPU').

`--random-config CONFIG.json`: instead of `--model`, a target of that Hugging Face config's shape with random weights
(in jaxspec's default dtype: bfloat16 on accelerators) and a prompt of random token ids as long as the story's. A
round's cost needs no trained weights, since the fixed drafts are timed whatever is accepted, so this times the rounds
of a model too large to bring to the machine (an 8B Llama's config.json is 1 kB; its weights 16 GB). `--assistant`
needs a real target. `--prompt-tokens` sets the random prompt's length: with `--batch`, how large a KV cache the rounds
carry, which is what a run-time branch that copies the cache would pay for (`JAXSPEC_BRANCHES`, jaxspec/inplace.py).

The table also goes to a JSON record in `--results` (benchmarks/_record.py). Run it as a script, as above: its
siblings in benchmarks/ (the prompt set, the record) import because Python puts the script's folder on sys.path.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import os
import statistics
import sys
import tempfile

import numpy as np

from _bench_prompts import STORY, chat_ids
from _record import Record, add_results_argument
from bench_batch import strategy_arguments


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--drafts", default="0,1,3,7")
    p.add_argument("--max-draft", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--assistant", default=None, help="a catalogue name or path: also time its drafting rounds")
    p.add_argument("--assistant-drafts", default="1,2")
    p.add_argument("--whole-vocab", action="store_true",
                   help="with a DFlash --assistant that has a draft vocabulary: also time it over the whole head")
    p.add_argument("--idle", default="", help="strategies whose loop is timed forced to draft nothing: "
                   + ",".join(IDLE_STRATEGIES))
    p.add_argument("--without-feature-writes", action="store_true",
                   help="with --idle dflash or eagle3: also time that idle loop without its feature writes")
    p.add_argument("--random-config", default=None,
                   help="an HF config.json: time a target of its shape with random weights instead of --model")
    p.add_argument("--batch", type=int, default=1, help="rows, each the same prompt")
    p.add_argument("--prompt-tokens", type=int, default=STORY_TOKENS,
                   help=f"the random prompt's length (default {STORY_TOKENS}, the story's); only with --random-config")
    add_results_argument(p)
    args = p.parse_args(argv)
    if args.whole_vocab and not args.assistant:
        p.error("--whole-vocab times a DFlash --assistant over its whole head: name one")
    if args.random_config and (args.assistant or args.idle):
        p.error("--assistant and --idle draft for a trained target: they cannot be combined with --random-config")
    idle = [name for name in args.idle.split(",") if name]
    if set(idle) - set(IDLE_STRATEGIES):
        p.error(f"--idle takes {', '.join(IDLE_STRATEGIES)}, not {', '.join(sorted(set(idle) - set(IDLE_STRATEGIES)))}")
    if args.without_feature_writes and not set(idle) & set(FEATURE_DRAFTERS):
        p.error(f"--without-feature-writes times the idle loops of {' and '.join(FEATURE_DRAFTERS)}: "
                "name one in --idle")
    if args.prompt_tokens != STORY_TOKENS and not args.random_config:
        p.error("--prompt-tokens sets the random prompt of --random-config; --model runs the story prompt")
    if args.batch < 1 or args.prompt_tokens < 1:
        p.error("--batch and --prompt-tokens must be at least 1")
    record = Record("bench_round_cost", __file__, argv, args.results)

    import jax.numpy as jnp

    import jaxspec
    from jaxspec import settings as settings_lib
    from jaxspec.generate import generate_with_drafter
    from jaxspec.strategies.base import Draft, Drafter, DraftStep

    @dataclasses.dataclass(frozen=True)
    class FixedDrafts(Drafter):
        """Proposes `drafts` copies of one token every round (a token the target does not pick)."""

        drafts: int = 0

        def draft(self, ctx, loop, state, rng):
            batch = loop.lengths.shape[0]
            tokens = jnp.full((batch, self.max_draft), 0, jnp.int32)
            count = jnp.full((batch,), self.drafts, jnp.int32)
            return DraftStep(Draft(tokens=tokens, count=count), state, jnp.zeros((), jnp.int32), loop.cache)

    if args.random_config:
        model = random_model(args.random_config)
        c = model.hf_config
        args.model = (f"random {c.get('model_type')} ({c.get('num_hidden_layers')} layers of "
                      f"{c.get('hidden_size')}, {os.path.basename(args.random_config)})")
        ids = [np.random.default_rng(0).integers(0, model.config.vocab_size, args.prompt_tokens).tolist()]
    else:
        model = jaxspec.load(args.model)
        ids = [chat_ids(model.tokenizer, STORY)]
    ids = ids * args.batch  # [batch][prompt]
    settings = settings_lib.resolve(model, max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=[])
    drafters = {"plain decoding": Drafter(0)}
    for d in (int(x) for x in args.drafts.split(",")):
        drafters[f"K={args.max_draft}, {d} draft(s)"] = FixedDrafts(max_draft=args.max_draft, drafts=d)

    def per_round(drafter) -> tuple[float, int]:
        if isinstance(drafter, IdleStrategy):
            without_writes = feature_writes_skipped(drafter.compiled) if drafter.compiled is not None else \
                contextlib.nullcontext()
            with forced_to_draft_nothing(), without_writes:
                out = jaxspec.generate(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=[],
                                       **drafter.arguments)
            if out.drafted.sum():
                raise RuntimeError(f"{drafter.name} drafted although forced not to (its schedule is not priced here)")
        elif isinstance(drafter, dict):  # a real assistant's arguments to jaxspec.generate
            out = jaxspec.generate(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=[], **drafter)
        else:
            out = generate_with_drafter(model, ids, None, drafter, settings)
        return out.seconds_per_round, out.accepted_hist.sum()

    if args.assistant:
        from jaxspec.strategies.dflash import is_block_drafter
        from jaxspec.strategies.eagle3 import is_eagle3_head

        assistant = jaxspec.load(args.assistant)
        # DFlash drafters and EAGLE-3 heads have no confidence stop to turn off.
        feature_drafter = is_block_drafter(assistant) or is_eagle3_head(assistant)
        no_confidence_stop = {} if feature_drafter else {"assistant_confidence_threshold": 0.0}
        assistants = {args.assistant: assistant}
        if args.whole_vocab:
            if not hasattr(getattr(assistant, "module", None), "vocab_ids") or not is_block_drafter(assistant):
                raise SystemExit(f"--whole-vocab: {args.assistant} is not a DFlash drafter with a draft vocabulary")
            from jaxspec.train import with_draft_vocab

            assistants[f"{args.assistant} over the whole head"] = with_draft_vocab(assistant, None)
        for label, model_ in assistants.items():
            for d in (int(x) for x in args.assistant_drafts.split(",")):
                drafters[f"{label}, {d} draft(s)"] = dict(
                    assistant_model=model_, num_assistant_tokens=d, num_assistant_tokens_schedule="constant",
                    **no_confidence_stop)

    for name in idle:
        drafters[f"{name}, forced to draft nothing"] = IdleStrategy(name, strategy_arguments(name, model))
        if args.without_feature_writes and name in FEATURE_DRAFTERS:
            drafters[f"{name}, forced to draft nothing, no feature writes"] = IdleStrategy(
                name, strategy_arguments(name, model), compiled={})

    for drafter in drafters.values():
        per_round(drafter)  # compile
    times = {name: [] for name in drafters}
    for _ in range(args.repeats):
        for name, drafter in drafters.items():
            seconds, _ = per_round(drafter)
            times[name].append(seconds)
    plain = statistics.median(times["plain decoding"])
    title = (f"round cost in the loop: {args.model}, {len(ids[0])}-token prompt, {args.max_new_tokens} new tokens, "
             f"batch {args.batch}, median of {args.repeats}")
    print(f"# {title}\n")
    print("| round | ms | vs a plain step |")
    print("|---|---:|---:|")
    rows = []
    for name in drafters:
        ms = statistics.median(times[name])
        print(f"| {name} | {ms * 1e3:.2f} | {ms / plain:.3f} |")
        rows.append({"table": "rounds", "model": args.model, "round": name, "ms": ms * 1e3,
                     "vs_plain_step": ms / plain})
    record.write(rows, [args.model], title=title,
                 settings={k: v for k, v in vars(args).items() if k not in ("model", "results")})


IDLE_STRATEGIES = ("mtp", "prompt_lookup", "dflash", "eagle3")
FEATURE_DRAFTERS = ("dflash", "eagle3")  # write the committed tokens' target features into their own caches


@dataclasses.dataclass(frozen=True)
class IdleStrategy:
    name: str
    arguments: dict  # jaxspec.generate's arguments that select it
    compiled: dict | None = None  # a variant without feature writes: its own compiled loops (`feature_writes_skipped`)


@contextlib.contextmanager
def forced_to_draft_nothing():
    """Calls of `jaxspec.generate` inside run every round forced to draft nothing at verify width 1: the run-time
    input (`LoopInputs.forcing`) that jaxspec/costs.py times a round of the loop with, applied where a call takes its
    prices."""
    generate_module = sys.modules["jaxspec.generate"]  # the module: `jaxspec.generate` is the function
    priced = generate_module._Call.priced

    def idle(call, prices):
        call = priced(call, prices)
        return dataclasses.replace(call, inputs=call.inputs.forcing(0, 1))

    generate_module._Call.priced = idle
    try:
        yield
    finally:
        generate_module._Call.priced = priced


@functools.cache
def _variant_costs_folder() -> tempfile.TemporaryDirectory:
    """Where the variants' prices go, thrown away with the process; made the first time a variant runs."""
    return tempfile.TemporaryDirectory(prefix="bench_round_cost-")


@contextlib.contextmanager
def feature_writes_skipped(compiled: dict):
    """Calls inside run DFlash's and EAGLE-3's loops with `defer_committed` doing nothing (no committed slot enters the
    pending ring, none is projected). A compiled loop's key cannot see the patch, so the variant's loops live in
    `compiled` between its calls and the loops that write are set aside meanwhile. Its prices (timed where the call is
    priced, which is where the rounds are forced) go to a file of their own, so that the step-cost cache keeps only the
    real loops'."""
    from jaxspec import costs, loop
    from jaxspec.strategies import dflash, eagle3

    writes, cache_path = (dflash.defer_committed, eagle3.defer_committed), costs.cache_path
    writing_loops = dict(loop._compiled)
    loop._compiled.clear()
    loop._compiled.update(compiled)
    folder = _variant_costs_folder().name
    costs.cache_path = lambda: os.path.join(folder, costs.CACHE_FILE)
    dflash.defer_committed = eagle3.defer_committed = lambda drafter, result, pending, write, state: (state, pending)
    try:
        yield
    finally:
        dflash.defer_committed, eagle3.defer_committed = writes
        costs.cache_path = cache_path
        compiled.clear()
        compiled.update(loop._compiled)
        loop._compiled.clear()
        loop._compiled.update(writing_loops)


STORY_TOKENS = 180  # a chat prompt's length in the benchmarks (device_check's two are 176 and 177 SmolLM2 tokens)


def random_model(config_path: str):
    """A target of `config_path`'s shape (an HF config.json) with random weights, built on the default device."""
    import json

    from flax import nnx

    from jaxspec.loading import Model, config_from_hf, default_dtype

    with open(config_path, encoding="utf-8") as handle:
        hf_config = json.load(handle)
    family, cfg = config_from_hf(hf_config, config_path)
    module = family.model_cls()(cfg, dtype=default_dtype(), rngs=nnx.Rngs(0))
    return Model(module, cfg, hf_config, source=config_path)


if __name__ == "__main__":
    sys.exit(main())
