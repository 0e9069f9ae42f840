"""Generate text with jaxspec from the command line (`jaxspec-generate`, or `python scripts/generate.py`).

    jaxspec-generate --prompt "Write a haiku about JAX" --max-new-tokens 64
    jaxspec-generate --model qwen2.5-coder-1.5b --strategy speculative --assistant qwen2.5-coder-0.5b
        [--assistant-quantization int8]
    jaxspec-generate --model qwen2.5-coder-0.5b --strategy universal --assistant smollm2-135m
    jaxspec-generate --model PATH --strategy prompt_lookup --prompt-lookup-num-tokens 10 --json
    jaxspec-generate --model DEEPSEEK_OR_GLM_FOLDER --strategy mtp
    jaxspec-generate --strategy dflash            # smollm2-135m's shipped DFlash drafter (else --assistant PATH)
    jaxspec-generate --model PATH --strategy eagle3 --assistant EAGLE3_HEAD_FOLDER
    jaxspec-generate --model GEMMA4_FOLDER --strategy mtp_drafter --assistant GEMMA4_ASSISTANT_FOLDER
    jaxspec-generate --model DEEPSEEK_FOLDER --strategy mtp --distributed --mesh data=1,model=8,expert=4

`--strategy` takes a row name of the strategy table (`jaxspec.STRATEGIES`; `sample` is plain decoding with
sampling), and each strategy option is the `generate()` argument of the same name, spelt with dashes: the choices
and options below are generated from the table, so the CLI and the library share one vocabulary.

With --distributed (on every host of a TPU slice: the coordinator, process count and id are detected as
`jax.distributed.initialize()` detects them; elsewhere pass --coordinator, --num-processes, --process-id) every
process runs the same command, loads its own slices of the checkpoint and gets the same output; process 0 prints.

--model takes an HF checkpoint folder, a .gguf file, or a catalogue name (offline default: smollm2-135m).
Compiled loops are kept in JAX's persistent compilation cache ($JAXSPEC_COMPILATION_CACHE, default xla in the
jaxspec cache folder, $JAXSPEC_CACHE or ~/.cache/jaxspec; "off" disables it), so a second run does not pay compile
time again. The first assisted run of a model and strategy on a machine also times a few of its rounds for the
adaptive schedule's prices (jaxspec/costs.py; counted in the compile time it prints, and stored in step_costs.json
in the jaxspec cache folder).

Mistakes (a missing file, a damaged checkpoint, an option the strategy does not use) print one line and exit 2;
with --compare-plain, greedy output that differs from plain greedy decoding exits 1. An answer that ends at its first
token on a model with a chat template, prompted without --chat, gets a note that suggests --chat.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from jaxspec.strategies import BY_NAME, OPTIONS, STRATEGIES, DraftingConfig

DEFAULT_MODEL = "smollm2-135m"
SAMPLE = "sample"  # plain decoding with sampling: the greedy row with do_sample
STRATEGY_CHOICES = (*BY_NAME, SAMPLE)
# Strategies whose drafter jaxspec ships for catalogue models (`CatalogEntry.drafter_assets`): --assistant optional
SHIPPED_DRAFTERS = {"dflash": "a DFlash drafter", "eagle3": "an EAGLE-3 head"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file or catalogue name")
    p.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default="greedy",
                   help="; ".join(f"{row.name}: {row.summary}" for row in STRATEGIES))
    p.add_argument("--do-sample", action="store_true", help="sample (implied by --strategy sample)")
    # Unset values come from the model's generation_config.json, else HF's defaults (top_k=50 when sampling).
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None, help="0 disables it")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--repetition-penalty", type=float, default=None)
    p.add_argument("--no-repeat-ngram-size", type=int, default=None)
    p.add_argument("--min-new-tokens", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    strategy_options = p.add_argument_group("strategy options (generate()'s arguments of the same names)")
    for option in OPTIONS.values():
        if option.type is not None:
            users = ", ".join(row.name for row in STRATEGIES if option in row.options)
            strategy_options.add_argument(option.cli_flag, dest=option.name, type=option.type,
                                          choices=option.choices or None, default=None,
                                          help=f"{option.help} [{users}]")
    p.add_argument("--assistant-quantization", default=None, choices=("int8",),
                   help="run the --assistant with int8 weights and activations (jaxspec.quantize): cheaper drafts, "
                        "same output, since the target verifies every draft")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print ids, text and counters as one JSON object")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of as it is made")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding with the same settings and print the strategy's speedup over it "
                        "(both timed on a second call); greedy output that differs from it exits 1")
    p.add_argument("--mesh", default=None, help="shard on a device mesh, e.g. data=1,model=8,expert=4 (default with "
                                                "several processes: model=<all devices>)")
    p.add_argument("--distributed", action="store_true",
                   help="join a multi-process run; unset coordinator, process count and id are detected")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (implies --distributed)")
    p.add_argument("--num-processes", type=int, default=None, help="(implies --distributed)")
    p.add_argument("--process-id", type=int, default=None, help="(implies --distributed)")
    args = p.parse_args(argv)
    row = BY_NAME["greedy" if args.strategy == SAMPLE else args.strategy]
    for name in sorted(given_options(args)):
        if name not in row.option_names:
            users = [other.name for other in STRATEGIES if name in other.option_names]
            p.error(f"{OPTIONS[name].cli_flag} is not used by --strategy {args.strategy} (it is an option of "
                    f"{', '.join(users)})")
    if row.name in SHIPPED_DRAFTERS and args.assistant_model is None:  # the drafter shipped for a catalogue model
        from jaxspec.catalog import models_with_drafters, shipped_drafter

        args.assistant_model = shipped_drafter(args.model, row.name)
        if args.assistant_model is None:
            p.error(f"--strategy {row.name} needs --assistant PATH: jaxspec ships {SHIPPED_DRAFTERS[row.name]} only "
                    f"for {', '.join(models_with_drafters(row.name)) or 'no model yet'}, not for {args.model}")
    selector = OPTIONS.get(row.selected_by)
    if selector is not None and selector.type is not None and selector.default is None and \
            getattr(args, selector.name) is None:
        p.error(f"--strategy {row.name} needs {selector.cli_flag}{' PATH' if selector.loads_model else ' N'}")
    if args.assistant_quantization and args.assistant_model is None:
        p.error("--assistant-quantization quantizes the --assistant of a strategy that drafts with one")
    return args


def given_options(args) -> dict:
    """The strategy options given on the command line (by generate()'s names)."""
    return {name: getattr(args, name) for name in OPTIONS if getattr(args, name, None) is not None}


def drafting_config(args, assistant=None) -> DraftingConfig:
    """The run's DraftingConfig: the named row and its options, the --assistant path replaced by the loaded model."""
    options = given_options(args) | ({"assistant_model": assistant} if assistant is not None else {})
    return DraftingConfig(None if args.strategy == SAMPLE else args.strategy, **options)


def encode(tokenizer, prompt: str, chat: bool, model: str) -> list[int]:
    if chat:
        if not getattr(tokenizer, "chat_template", None):  # transformers' own error does not say what to do
            raise ValueError(f"--chat: the tokenizer of {model} has no chat template (a base model); leave --chat "
                             "out to decode the prompt as plain text.")
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(prompt)["input_ids"]


def chat_hint(new_ids: list[int], model, args) -> str | None:
    """A note for a run whose answer ended at once (its only token is an end-of-sequence) on a model with a chat
    template, given a raw prompt: instruct models often answer a bare prompt that way, and the run looks broken."""
    ended_at_once = len(new_ids) == 1 and new_ids[0] in model.eos_token_ids()
    if not ended_at_once or args.chat or not getattr(model.tokenizer, "chat_template", None):
        return None
    return (f"note: {args.model} ended its answer at its first token (end of sequence). It has a chat template: "
            "with --chat the prompt is sent as a user turn, as an instruct model expects.")


class SilentStreamer:
    """The streamer of processes that do not print."""

    def put(self, value) -> None:
        pass

    def end(self) -> None:
        pass


def QuietStreamer(*args, **kwargs):
    """transformers' TextStreamer doing all its work (decoding) but printing nothing: what a fair comparison with a
    streamed run streams into."""
    from transformers import TextStreamer

    class Quiet(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            pass

    return Quiet(*args, **kwargs)


def plain_is_sampling(model, sampling) -> bool:
    """Whether these settings sample (the call's do_sample, else the model's generation_config)."""
    if sampling.do_sample is not None:
        return bool(sampling.do_sample)
    return bool(model.generation_config.get("do_sample", False))


def start_distributed(args) -> bool:
    """Join the other processes before anything else touches JAX (see jaxspec.distributed)."""
    if not (args.distributed or args.coordinator or args.num_processes or args.process_id is not None):
        return False
    from jaxspec import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    return True


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        return run(args)
    except (ValueError, TypeError, NotImplementedError, FileNotFoundError) as error:
        # A user mistake (jaxspec raises these before anything compiles): one line, no traceback.
        print(f"error: {error}", file=sys.stderr)
        return 2


def run(args) -> int:
    multiprocess = start_distributed(args)
    import jax

    import jaxspec
    from jaxspec.sharding import make_mesh

    jaxspec.enable_compilation_cache()

    mesh = make_mesh(args.mesh or f"model={jax.device_count()}") if args.mesh or multiprocess else None
    start = time.perf_counter()
    model = jaxspec.load(args.model, dtype=args.dtype, progress=not args.json and jax.process_index() == 0, mesh=mesh)
    assistant = jaxspec.load(args.assistant_model, dtype=args.dtype, mesh=mesh) if args.assistant_model else None
    if args.assistant_quantization:
        assistant = jaxspec.quantize(assistant, args.assistant_quantization)
    load_seconds = time.perf_counter() - start
    if model.tokenizer is None:
        print(f"{args.model} has no tokenizer; jaxspec needs one to read --prompt.", file=sys.stderr)
        return 2
    ids = encode(model.tokenizer, args.prompt, args.chat, args.model)
    sampling = jaxspec.SamplingConfig(
        max_new_tokens=args.max_new_tokens, do_sample=True if args.do_sample or args.strategy == SAMPLE else None,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
        min_new_tokens=args.min_new_tokens, seed=args.seed)
    drafting = drafting_config(args, assistant)
    streaming = not (args.json or args.no_stream)
    streamer = None
    if streaming:
        from transformers import TextStreamer

        # Every process must dispatch the loop the same way (each dispatch is a collective); only process 0 prints.
        streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True) \
            if jax.process_index() == 0 else SilentStreamer()

    def run_once(drafting, streamer):
        return jaxspec.generate(model, [ids], sampling=sampling, drafting=drafting, mesh=mesh,
                                streaming=jaxspec.StreamingConfig(streamer=streamer, stop_strings=args.stop))

    out = run_once(drafting, streamer)
    new_ids = out.new_tokens(0).tolist()
    hint = chat_hint(new_ids, model, args)
    if hint and jax.process_index() == 0:
        print(hint, file=sys.stderr)
    text = model.tokenizer.decode(new_ids, skip_special_tokens=True)
    report = out.counters() | {"load_seconds": load_seconds}
    if args.compare_plain and args.strategy not in ("greedy", SAMPLE):
        # Plain decoding runs the way the strategy ran: streamed (into a streamer that prints nothing) or not. Both
        # are timed on a second call: the first call of a freshly compiled loop pays one-time costs (first touches
        # of its code and buffers), which would otherwise all land on the strategy, which runs first.
        def quiet():
            return QuietStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True) if streaming else None

        plain = run_once(DraftingConfig(), quiet())
        again = run_once(drafting, quiet())
        plain = run_once(DraftingConfig(), quiet())
        report["strategy_tokens_per_second_warm"] = again.tokens_per_second
        report["plain_tokens_per_second"] = plain.tokens_per_second
        report["speedup_over_plain"] = again.tokens_per_second / plain.tokens_per_second
        # Greedy output must be identical; sampled outputs come from other random streams and may differ.
        same = plain.sequences.shape == out.sequences.shape and bool((plain.sequences == out.sequences).all())
        report["same_tokens_as_plain"] = same if not plain_is_sampling(model, sampling) else None
    if jax.process_index() != 0:
        return 0  # every process holds the same outputs; process 0 prints them
    if args.json:
        print(json.dumps({"model": args.model, "prompt_ids": ids, "new_ids": new_ids, "text": text} | report))
    else:
        print_report(out, report, text, streaming, load_seconds)
    if report.get("same_tokens_as_plain") is False:
        print(f"error: --strategy {args.strategy} gave other tokens than plain greedy decoding", file=sys.stderr)
        return 1
    return 0


def print_report(out, report: dict, text: str, streamed: bool, load_seconds: float) -> None:
    if not streamed:
        print(text)
    print()
    print(f"[{out.strategy}] {int(out.num_new_tokens[0])} tokens in {out.decode_seconds:.2f}s = "
          f"{out.tokens_per_second:.1f} tok/s (prefill {out.prefill_seconds:.2f}s of it; load {load_seconds:.1f}s, "
          f"compile {out.compile_seconds:.1f}s apart; first token {load_seconds + out.first_token_seconds:.1f}s "
          f"after the start)")
    trees = f", tree rounds {out.tree_rounds}" if out.tree_rounds else ""  # the rest verified the chain alone
    print(f"target forwards {out.target_forwards}, rounds {out.rounds}{trees}, draft forwards {out.draft_forwards}")
    if int(out.drafted.sum()):
        print(f"acceptance rate {out.acceptance_rate:.2f}, mean accepted length {out.mean_accepted_length:.2f} "
              f"tokens/round, histogram {report['accepted_length_histogram']}")
    if "speedup_over_plain" in report:
        same = report["same_tokens_as_plain"]
        print(f"second calls: {out.strategy} {report['strategy_tokens_per_second_warm']:.1f} tok/s, plain "
              f"{report['plain_tokens_per_second']:.1f} tok/s -> speedup {report['speedup_over_plain']:.2f}x, "
              f"identical tokens: {'n/a (sampling)' if same is None else same}")
        if out.priced_steps:  # the adaptive schedule's cost model, beside what was measured
            print(f"the schedule's cost model expected {out.modelled_speedup:.2f}x for these rounds")


if __name__ == "__main__":
    sys.exit(main())
