"""Generate text with jaxspec from the command line.

    python scripts/generate.py --prompt "Write a haiku about JAX" --max-new-tokens 64
    python scripts/generate.py --model qwen2.5-coder-1.5b --strategy speculative --assistant qwen2.5-coder-0.5b
        [--assistant-quantization int8]
    python scripts/generate.py --model qwen2.5-coder-0.5b --strategy speculative --assistant smollm2-135m
    python scripts/generate.py --model PATH --strategy prompt_lookup --prompt-lookup-num-tokens 10 --json
    python scripts/generate.py --model DEEPSEEK_OR_GLM_FOLDER --strategy mtp
    python scripts/generate.py --model GEMMA4_FOLDER --strategy mtp --assistant GEMMA4_ASSISTANT_FOLDER
    python scripts/generate.py --model DEEPSEEK_FOLDER --strategy mtp --distributed --mesh data=1,model=8,expert=4

With --distributed (on every host of a TPU slice: the coordinator, process count and id are detected as
`jax.distributed.initialize()` detects them; elsewhere pass --coordinator, --num-processes, --process-id) every
process runs the same command, loads its own slices of the checkpoint and gets the same output; process 0 prints.

--model takes an HF checkpoint folder, a .gguf file, or a catalogue name (offline default: smollm2-135m).
Compiled loops are kept in JAX's persistent compilation cache ($JAXSPEC_COMPILATION_CACHE, default
~/.cache/jaxspec/xla; "off" disables it), so a second run does not pay compile time again. The first assisted run
of a model on a machine also times its forwards once for the adaptive schedule (jaxspec/costs.py; counted in the
compile time it prints, and stored in ~/.cache/jaxspec/step_costs.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

DEFAULT_MODEL = "smollm2-135m"
STRATEGY_CHOICES = ("greedy", "sample", "speculative", "prompt_lookup", "early_exit", "mtp")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=DEFAULT_MODEL, help="HF folder, .gguf file or catalogue name")
    p.add_argument("--prompt", default="Write a Python function that checks whether a number is prime.")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--strategy", choices=STRATEGY_CHOICES, default="greedy")
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
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    p.add_argument("--json", action="store_true", help="print ids, text and counters as one JSON object")
    p.add_argument("--no-stream", action="store_true", help="print the text at the end instead of as it is made")
    p.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--dtype", default=None, help="parameter dtype (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--assistant", default=None, help="assistant model for --strategy speculative (with another tokenizer "
                                                     "it runs universal assisted decoding), or a Gemma 4 MTP "
                                                     "drafter for --strategy mtp (without it, mtp uses the "
                                                     "checkpoint's own MTP layers)")
    p.add_argument("--assistant-quantization", default=None, choices=("int8",),
                   help="run the --assistant with int8 weights and activations (jaxspec.quantize): cheaper drafts, "
                        "same output, since the target verifies every draft")
    p.add_argument("--num-assistant-tokens", type=int, default=None)
    p.add_argument("--num-assistant-tokens-schedule", default=None,
                   choices=("adaptive", "constant", "heuristic", "heuristic_transient"),
                   help="draft-length schedule (default: adaptive; constant is transformers' default)")
    p.add_argument("--assistant-confidence-threshold", type=float, default=None)
    p.add_argument("--assistant-ensemble-weight", type=float, default=None)
    p.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    p.add_argument("--max-matching-ngram-size", type=int, default=None)
    p.add_argument("--exit-layer", type=int, default=None, help="E for --strategy early_exit")
    p.add_argument("--compare-plain", action="store_true",
                   help="also run plain decoding with the same settings and print the strategy's speedup over it "
                        "(both timed on a second call)")
    p.add_argument("--mesh", default=None, help="shard on a device mesh, e.g. data=1,model=8,expert=4 (default with "
                                                "several processes: model=<all devices>)")
    p.add_argument("--distributed", action="store_true",
                   help="join a multi-process run; unset coordinator, process count and id are detected")
    p.add_argument("--coordinator", default=None, help="host:port of process 0 (implies --distributed)")
    p.add_argument("--num-processes", type=int, default=None, help="(implies --distributed)")
    p.add_argument("--process-id", type=int, default=None, help="(implies --distributed)")
    args = p.parse_args(argv)
    if args.strategy == "speculative" and args.assistant is None:
        p.error("--strategy speculative needs --assistant PATH")
    if args.strategy == "early_exit" and args.exit_layer is None:
        p.error("--strategy early_exit needs --exit-layer E")
    if args.assistant is not None and args.strategy not in ("speculative", "mtp"):
        p.error("--assistant is only used with --strategy speculative, or mtp with a Gemma 4 MTP drafter")
    if args.assistant_quantization and args.strategy != "speculative":
        p.error("--assistant-quantization quantizes the --assistant of --strategy speculative")
    return args


def strategy_kwargs(args) -> dict:
    """The strategy's generate() arguments; an option the strategy does not use reaches generate, which names it."""
    draft_length = dict(num_assistant_tokens=args.num_assistant_tokens,
                        num_assistant_tokens_schedule=args.num_assistant_tokens_schedule,
                        assistant_confidence_threshold=args.assistant_confidence_threshold,
                        assistant_ensemble_weight=args.assistant_ensemble_weight)
    if args.strategy in ("greedy", "sample"):
        return {}
    if args.strategy == "prompt_lookup":
        return draft_length | dict(prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
                                   max_matching_ngram_size=args.max_matching_ngram_size)
    if args.strategy == "mtp":  # with --assistant, the drafter is the assistant_model (a Gemma 4 MTP drafter)
        return draft_length | ({} if args.assistant else dict(use_mtp=True))
    if args.strategy == "early_exit":
        return draft_length | dict(assistant_early_exit=args.exit_layer)
    return draft_length


def encode(tokenizer, prompt: str, chat: bool) -> list[int]:
    if chat:
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False))
    return tokenizer(prompt)["input_ids"]


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


def plain_is_sampling(model, common) -> bool:
    """Whether these settings sample (the call's do_sample, else the model's generation_config)."""
    if common["do_sample"] is not None:
        return bool(common["do_sample"])
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
    multiprocess = start_distributed(args)
    import jax

    import jaxspec
    from jaxspec.sharding import make_mesh

    jaxspec.enable_compilation_cache()

    mesh = make_mesh(args.mesh or f"model={jax.device_count()}") if args.mesh or multiprocess else None
    start = time.perf_counter()
    model = jaxspec.load(args.model, dtype=args.dtype, progress=not args.json and jax.process_index() == 0, mesh=mesh)
    assistant = jaxspec.load(args.assistant, dtype=args.dtype, mesh=mesh) if args.assistant else None
    if args.assistant_quantization:
        assistant = jaxspec.quantize(assistant, args.assistant_quantization)
    load_seconds = time.perf_counter() - start
    if args.strategy == "mtp" and assistant is not None and assistant.hf_config.get("model_type") != "gemma4_assistant":
        print(f"--strategy mtp --assistant needs a Gemma 4 MTP drafter (gemma4_assistant); {args.assistant} is "
              f"{assistant.hf_config.get('model_type')!r} (use --strategy speculative for it).", file=sys.stderr)
        return 2
    if model.tokenizer is None:
        print(f"{args.model} has no tokenizer; jaxspec needs one to read --prompt.", file=sys.stderr)
        return 2
    ids = encode(model.tokenizer, args.prompt, args.chat)
    common = dict(max_new_tokens=args.max_new_tokens, do_sample=True if args.do_sample or args.strategy == "sample" else None,
                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                  repetition_penalty=args.repetition_penalty, no_repeat_ngram_size=args.no_repeat_ngram_size,
                  min_new_tokens=args.min_new_tokens, seed=args.seed, mesh=mesh)
    streaming = not (args.json or args.no_stream)
    streamer = None
    if streaming:
        from transformers import TextStreamer

        # Every process must dispatch the loop the same way (each dispatch is a collective); only process 0 prints.
        streamer = TextStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True) \
            if jax.process_index() == 0 else SilentStreamer()
    out = jaxspec.generate(model, [ids], assistant_model=assistant, streamer=streamer, stop_strings=args.stop,
                           **common, **strategy_kwargs(args))
    new_ids = out.new_tokens(0).tolist()
    text = model.tokenizer.decode(new_ids, skip_special_tokens=True)
    report = out.counters() | {"load_seconds": load_seconds}
    if args.compare_plain and args.strategy not in ("greedy", "sample"):
        # Plain decoding runs the way the strategy ran: streamed (into a streamer that prints nothing) or not. Both
        # are timed on a second call: the first call of a freshly compiled loop pays one-time costs (first touches
        # of its code and buffers), which would otherwise all land on the strategy, which runs first.
        def quiet():
            return QuietStreamer(model.tokenizer, skip_prompt=True, skip_special_tokens=True) if streaming else None

        plain = jaxspec.generate(model, [ids], stop_strings=args.stop, streamer=quiet(), **common)
        again = jaxspec.generate(model, [ids], assistant_model=assistant, streamer=quiet(), stop_strings=args.stop,
                                 **common, **strategy_kwargs(args))
        plain = jaxspec.generate(model, [ids], stop_strings=args.stop, streamer=quiet(), **common)
        report["strategy_tokens_per_second_warm"] = again.tokens_per_second
        report["plain_tokens_per_second"] = plain.tokens_per_second
        report["speedup_over_plain"] = again.tokens_per_second / plain.tokens_per_second
        # Greedy output must be identical; sampled outputs come from other random streams and may differ.
        same = plain.sequences.shape == out.sequences.shape and bool((plain.sequences == out.sequences).all())
        report["same_tokens_as_plain"] = same if not plain_is_sampling(model, common) else None
    if jax.process_index() != 0:
        return 0  # every process holds the same outputs; process 0 prints them
    if args.json:
        print(json.dumps({"model": args.model, "prompt_ids": ids, "new_ids": new_ids, "text": text} | report))
        return 0
    if not streaming:
        print(text)
    print()
    print(f"[{out.strategy}] {int(out.num_new_tokens[0])} tokens in {out.decode_seconds:.2f}s = "
          f"{out.tokens_per_second:.1f} tok/s (prefill {out.prefill_seconds:.2f}s of it; load {load_seconds:.1f}s, "
          f"compile {out.compile_seconds:.1f}s apart)")
    print(f"target forwards {out.target_forwards}, rounds {out.rounds}, draft forwards {out.draft_forwards}")
    if int(out.drafted.sum()):
        print(f"acceptance rate {out.acceptance_rate:.2f}, mean accepted length {out.mean_accepted_length:.2f} "
              f"tokens/round, histogram {report['accepted_length_histogram']}")
    if "speedup_over_plain" in report:
        same = report["same_tokens_as_plain"]
        print(f"second calls: {out.strategy} {report['strategy_tokens_per_second_warm']:.1f} tok/s, plain "
              f"{report['plain_tokens_per_second']:.1f} tok/s -> speedup {report['speedup_over_plain']:.2f}x, "
              f"identical tokens: {'n/a (sampling)' if same is None else same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
