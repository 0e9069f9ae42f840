"""jaxspec against transformers on CPU, side by side in one run: a markdown table of tokens/s and their ratios.

    python scripts/bench.py [--models smollm2-135m,random-500m]
        [--strategies greedy,speculative,speculative-self,prompt_lookup,early_exit]
        [--max-new-tokens 64] [--repeats 3] [--threads T] [--out bench_out/] [--skip-hf]
        [--prompts code_completion,code_editing,chat,summary]
        [--num-assistant-tokens K] [--confidence-threshold C] [--schedule constant]
        [--prompt-lookup-num-tokens 10] [--early-exit E] [--copy-mb 512]

Models: any catalogue name (`jaxspec.catalog`; transformers loads the same GGUF file, dequantized to float32), or
`random-500m` / `random-tiny`: random Llama configs built by transformers with a fixed seed, saved with
`save_pretrained` and loaded from that folder by both libraries. Random models draft with a half-depth random
assistant of the same vocabulary; `speculative-self` drafts with the target itself (every draft accepted: the
ceiling of speculative decoding). Batch 1 and float32 everywhere; greedy decoding, so every strategy must give the
plain greedy tokens.

Timing: each (library, model, strategy) runs the prompt set once untimed (jaxspec compiles there, reported in its
own column), then `--repeats` timed passes; tokens/s is new tokens over the summed per-call seconds of a pass,
median over passes. jaxspec's seconds are `GenerateOutput.decode_seconds` (prefill + decode loop, compile excluded);
transformers' are the wall time of `generate`. The libraries run one after the other per model (all jaxspec
strategies, then all transformers strategies), so only one library's weights are in memory at a time.

Threads: both libraries get the same CPU cores. The process is pinned to the first T cores of its affinity mask
before jax or torch is imported: XLA's CPU client sizes its thread pool from that mask. The often-quoted
`XLA_FLAGS=... intra_op_parallelism_threads=T` is not an XLA flag: jax 0.10 ignores it without dashes and aborts
on `--intra_op_parallelism_threads` as unknown, so it is not set. torch gets `torch.set_num_threads(T)`.

Outputs: the table on stdout and in `{out}/bench.md`, every raw figure in `{out}/bench.json`, and a bar chart
`{out}/bench.png` when matplotlib is installed.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from _bench_prompts import PROMPTS, RANDOM_PROMPT_LENGTHS

# jax, torch, transformers and jaxspec are imported inside functions, never at module level: the thread setting
# (CPU affinity, environment) must be in place before either runtime starts its thread pools.

STRATEGIES = ("greedy", "speculative", "speculative-self", "prompt_lookup", "early_exit")

# Random Llama configs. 49152 is the SmolLM2 vocabulary, so its tokenizer's ids are valid prompts for them too.
RANDOM_COMMON = dict(
    vocab_size=49152, max_position_embeddings=4096, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu",
)
RANDOM_MODELS = {
    # 24 x 15.7M layer params + 2 x 50.3M untied embedding/head = 478M parameters.
    "random-500m": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                        num_key_value_heads=8),
    "random-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2),
}
TARGET_SEED, ASSISTANT_SEED = 0, 1

# Catalogue targets with an installed same-tokenizer assistant (speculative decoding needs the same vocabulary).
CATALOG_ASSISTANTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}

# Source of prompt token ids for random models: the SmolLM2 tokenizer, when its package is installed.
PROMPT_TOKENIZER_MODEL = "smollm2-135m"


# ------------------------------------------------------------------------------------------------------------------
# Data


@dataclasses.dataclass(frozen=True)
class DraftSettings:
    """What the drafting strategies get; both libraries receive exactly these values."""

    num_assistant_tokens: int
    schedule: str
    confidence_threshold: float
    prompt_lookup_num_tokens: int
    early_exit: int


@dataclasses.dataclass
class ModelSource:
    """Where one benchmark model's weights live; the same path goes to both libraries."""

    name: str
    kind: str  # "catalog" or "random"
    path: str  # a .gguf file or an HF folder
    assistant_path: str | None  # same-vocabulary drafter for `speculative`, if there is one
    num_layers: int


@dataclasses.dataclass
class Plan:
    """One strategy on one model: the generate() arguments of each library and the draft config to set."""

    strategy: str
    settings: str  # human-readable, for the table
    drafter: str | None  # "assistant", "target" (self / early exit) or None: whose generation_config HF reads
    jaxspec_kwargs: dict[str, Any]
    hf_kwargs: dict[str, Any]


@dataclasses.dataclass
class Call:
    """One generate() call on one prompt."""

    prompt: str
    tokens: list[int]  # the new tokens
    seconds: float  # timed seconds (jaxspec: decode only)
    compile_seconds: float
    target_forwards: int
    rounds: int  # verification rounds
    round_tokens: int  # tokens committed by those rounds
    drafted: int
    accepted: int


@dataclasses.dataclass
class Measurement:
    """One library x model x strategy over the prompt set: the untimed pass and every timed pass."""

    library: str
    model: str
    strategy: str
    warmup: list[Call]
    passes: list[list[Call]]

    @property
    def new_tokens(self) -> int:
        return sum(len(c.tokens) for c in self.passes[0])

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(self.new_tokens / sum(c.seconds for c in calls) for calls in self.passes)

    @property
    def compile_seconds(self) -> float:
        return sum(c.compile_seconds for c in self.warmup + [c for p in self.passes for c in p])

    def total(self, field: str) -> int:
        return sum(getattr(c, field) for c in self.passes[0])

    @property
    def acceptance_rate(self) -> float:
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else math.nan

    @property
    def mean_accepted_length(self) -> float:
        rounds = self.total("rounds")
        return self.total("round_tokens") / rounds if rounds else math.nan

    def tokens_by_prompt(self) -> dict[str, list[int]]:
        return {c.prompt: c.tokens for c in self.passes[0]}


@dataclasses.dataclass
class Row:
    """One line of the table: one model and strategy, both libraries."""

    model: str
    strategy: str
    settings: str
    jaxspec_tokens_per_second: float
    hf_tokens_per_second: float
    jaxspec_over_hf: float
    jaxspec_compile_seconds: float
    jaxspec_target_forwards: int
    hf_target_forwards: int | None
    jaxspec_acceptance_rate: float
    hf_acceptance_rate: float
    jaxspec_mean_accepted_length: float
    hf_mean_accepted_length: float
    jaxspec_speedup_over_greedy: float
    hf_speedup_over_greedy: float
    jaxspec_equal_hf_greedy: int | None  # prompts whose jaxspec tokens equal transformers' greedy tokens
    prompts: int


@dataclasses.dataclass
class Roofline:
    """Plain greedy against the memory-bandwidth bound: every weight is read once per token."""

    model: str
    parameters: int
    bytes_per_token: int
    bandwidth_gb_s: float
    tokens_per_second: float
    jaxspec_greedy: float
    hf_greedy: float


# ------------------------------------------------------------------------------------------------------------------
# Threads and bandwidth


def pin_threads(threads: int | None) -> list[int]:
    """Restrict this process to `threads` cores (XLA sizes its pool from the affinity mask) and tell torch/OpenMP."""
    available = sorted(os.sched_getaffinity(0))
    threads = threads or len(available)
    if threads > len(available):
        print(f"note: --threads {threads} > {len(available)} cores available; using {len(available)}", file=sys.stderr)
        threads = len(available)
    cores = available[:threads]
    os.sched_setaffinity(0, cores)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    # The default, stated so the run records it: Eigen (XLA's CPU matmuls) uses the whole pool.
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_cpu_multi_thread_eigen" not in flags:
        os.environ["XLA_FLAGS"] = (flags + " --xla_cpu_multi_thread_eigen=true").strip()
    import torch

    torch.set_num_threads(threads)
    return cores


def measure_copy_bandwidth(threads: int, megabytes: int, trials: int = 5) -> float:
    """GB/s of a large numpy copy split over `threads` threads, counting bytes read plus written (STREAM "copy").

    Decoding reads weights with as many threads as it computes with, so the copy uses the same number; numpy
    releases the GIL while copying. Best of `trials`: the first pass also pays the page faults of `dst`.
    """
    src = np.ones(megabytes * 2**20 // 8)
    dst = np.empty_like(src)
    bounds = np.linspace(0, src.size, threads + 1).astype(int)

    def copy(i: int) -> None:
        np.copyto(dst[bounds[i]: bounds[i + 1]], src[bounds[i]: bounds[i + 1]])

    best = math.inf
    with ThreadPoolExecutor(threads) as pool:
        for _ in range(trials):
            start = time.perf_counter()
            list(pool.map(copy, range(threads)))
            best = min(best, time.perf_counter() - start)
    return 2 * src.nbytes / best / 1e9


def weight_bytes_per_token(module) -> tuple[int, int]:
    """(parameters, bytes read per decoded token) of a jaxspec module.

    A tied embedding is read once per token, as the LM head; an untied input embedding contributes one row, which
    is left out. KV-cache reads are left out too: at these context lengths they are small next to the weights.
    """
    import jax
    from flax import nnx

    state = nnx.state(module, nnx.Param)
    leaves = jax.tree.leaves(state)
    parameters = sum(int(x.size) for x in leaves)
    nbytes = sum(int(x.size) * x.dtype.itemsize for x in leaves)
    if not module.cfg.tie_word_embeddings:
        embed = module.embed[...]
        nbytes -= int(embed.size) * embed.dtype.itemsize
    return parameters, nbytes


# ------------------------------------------------------------------------------------------------------------------
# Models and prompts


def resolve_source(name: str, workdir: str) -> ModelSource:
    """Catalogue name -> its GGUF (and assistant's); random name -> target and assistant saved into `workdir`."""
    if name in RANDOM_MODELS:
        overrides = RANDOM_MODELS[name]
        target = save_random_llama(os.path.join(workdir, name), TARGET_SEED, overrides)
        half = dict(overrides, num_hidden_layers=max(1, overrides["num_hidden_layers"] // 2))
        assistant = save_random_llama(os.path.join(workdir, name + "-assistant"), ASSISTANT_SEED, half)
        return ModelSource(name, "random", target, assistant, overrides["num_hidden_layers"])
    from jaxspec import catalog
    from jaxspec.convert.gguf import read_gguf

    path = catalog.resolve(name)
    assistant = catalog.resolve(CATALOG_ASSISTANTS[name]) if name in CATALOG_ASSISTANTS else None
    return ModelSource(name, "catalog", path, assistant, read_gguf(path).hf_config["num_hidden_layers"])


def save_random_llama(folder: str, seed: int, overrides: dict[str, Any]) -> str:
    """A random transformers Llama (default init, fixed seed) saved with save_pretrained: both libraries load it."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**(RANDOM_COMMON | overrides))
    model = transformers.LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    del model
    gc.collect()
    return folder


def prompt_tokenizer(source: ModelSource, jaxspec_model):
    """The model's own tokenizer; for random models SmolLM2's (when installed), whose ids fit their vocabulary."""
    if source.kind == "catalog":
        return jaxspec_model.tokenizer
    try:
        from jaxspec import catalog
        from jaxspec.convert.gguf import read_gguf

        return read_gguf(catalog.resolve(PROMPT_TOKENIZER_MODEL)).load_tokenizer()
    except (FileNotFoundError, ValueError):
        return None


def encode_prompts(tokenizer, vocab_size: int, names: list[str]) -> dict[str, np.ndarray]:
    """Prompt ids: through the chat template when the tokenizer has one; fixed random ids without a tokenizer."""
    if tokenizer is None:
        rng = np.random.default_rng(1234)
        return {n: rng.integers(3, vocab_size, RANDOM_PROMPT_LENGTHS[n]).astype(np.int32) for n in names}
    prompts = {}
    for name in names:
        text = PROMPTS[name]
        if getattr(tokenizer, "chat_template", None):
            text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
        prompts[name] = np.asarray(tokenizer(text, add_special_tokens=False)["input_ids"], np.int32)
    return prompts


def draft_settings(args, source: ModelSource) -> DraftSettings:
    """Flags win; otherwise per-kind defaults.

    Random models get no confidence stop: their draft distributions are nearly flat, so a 0.4 threshold would end
    every draft after one token and the self-drafting ceiling row would show K = 1 instead of K.
    """
    threshold = args.confidence_threshold
    if threshold is None:
        threshold = 0.0 if source.kind == "random" else 0.4
    return DraftSettings(
        num_assistant_tokens=args.num_assistant_tokens,
        schedule=args.schedule,
        confidence_threshold=threshold,
        prompt_lookup_num_tokens=args.prompt_lookup_num_tokens,
        early_exit=args.early_exit or max(1, source.num_layers // 2),
    )


def plan_for(strategy: str, source: ModelSource, s: DraftSettings) -> Plan | str:
    """The plan for `strategy`, or the reason it does not apply to this model."""
    draft = dict(num_assistant_tokens=s.num_assistant_tokens, num_assistant_tokens_schedule=s.schedule,
                 assistant_confidence_threshold=s.confidence_threshold)
    draft_text = f"K={s.num_assistant_tokens} {s.schedule} conf={s.confidence_threshold:g}"
    if strategy == "greedy":
        return Plan(strategy, "", None, {}, {})
    if strategy == "speculative":
        if source.assistant_path is None:
            return "no smaller checkpoint with the same tokenizer is installed"
        return Plan(strategy, f"{os.path.basename(source.assistant_path)} {draft_text}", "assistant", draft, {})
    if strategy == "speculative-self":
        return Plan(strategy, f"target drafts {draft_text}", "target", draft, {})
    if strategy == "prompt_lookup":
        n = s.prompt_lookup_num_tokens
        return Plan(strategy, f"num_tokens={n} ngram=2", None, {"prompt_lookup_num_tokens": n},
                    {"prompt_lookup_num_tokens": n})
    if strategy == "early_exit":
        if not 1 <= s.early_exit < source.num_layers:
            return f"early exit {s.early_exit} is not inside 1..{source.num_layers - 1}"
        return Plan(strategy, f"E={s.early_exit}/{source.num_layers} {draft_text}", "target",
                    draft | {"assistant_early_exit": s.early_exit}, {"assistant_early_exit": s.early_exit})
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


# ------------------------------------------------------------------------------------------------------------------
# Running


def measure(library: str, model: str, strategy: str, call: Callable[[str, np.ndarray], Call],
            prompts: dict[str, np.ndarray], repeats: int) -> Measurement:
    """One untimed pass over the prompts (jaxspec compiles there), then `repeats` timed passes."""
    warmup = [call(name, ids) for name, ids in prompts.items()]
    passes = [[call(name, ids) for name, ids in prompts.items()] for _ in range(repeats)]
    result = Measurement(library, model, strategy, warmup, passes)
    print(f"  {library:12s} {strategy:16s} {result.tokens_per_second:8.2f} tok/s", file=sys.stderr)
    return result


def run_jaxspec(source: ModelSource, strategies: list[str], settings: DraftSettings, prompt_names: list[str],
                max_new_tokens: int, repeats: int, notes: list[str]):
    """All strategies with jaxspec; returns (measurements, prompts, eos ids, pad id, (parameters, bytes/token))."""
    import jaxspec

    target = jaxspec.load(source.path)
    prompts = encode_prompts(prompt_tokenizer(source, target), target.config.vocab_size, prompt_names)
    plans = {s: plan_for(s, source, settings) for s in strategies}
    needs_assistant = any(isinstance(p, Plan) and p.drafter == "assistant" for p in plans.values())
    assistant = jaxspec.load(source.assistant_path) if needs_assistant else None
    eos = list(target.eos_token_ids())
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else (eos[0] if eos else 0)

    def call_for(plan: Plan):
        kwargs = dict(plan.jaxspec_kwargs)
        if plan.drafter == "assistant":
            kwargs["assistant_model"] = assistant
        elif plan.drafter == "target" and "assistant_early_exit" not in kwargs:
            kwargs["assistant_model"] = target

        def call(name: str, ids: np.ndarray) -> Call:
            out = jaxspec.generate(target, ids[None], max_new_tokens=max_new_tokens, eos_token_id=eos,
                                   pad_token_id=pad, **kwargs)
            n = int(out.num_new_tokens[0])
            return Call(name, out.sequences[0, len(ids): len(ids) + n].tolist(), out.decode_seconds,
                        out.compile_seconds, out.target_forwards, out.rounds,
                        n - 1,  # the prefill commits the first token, each round the rest
                        int(out.drafted.sum()), int(out.accepted.sum()))

        return call

    results = {}
    for strategy, plan in plans.items():
        if isinstance(plan, str):
            notes.append(f"{source.name}: {strategy} skipped: {plan}")
            continue
        results[strategy] = measure("jaxspec", source.name, strategy, call_for(plan), prompts, repeats)
    weights = weight_bytes_per_token(target.module)
    del target, assistant
    gc.collect()
    return results, prompts, eos, pad, weights


class HFTally:
    """Counts what transformers' generate does not report: target forwards, and per verification round the drafted
    and accepted tokens (from the candidate generator's `update_candidate_strategy`, called once per round)."""

    def __init__(self, model):
        self.reset()
        model.register_forward_pre_hook(self._forward)
        original = model._get_candidate_generator

        def instrumented(*args, **kwargs):
            generator = original(*args, **kwargs)
            update = generator.update_candidate_strategy

            def counted(input_ids, scores, num_matches):
                self.rounds += 1
                self.drafted += scores.shape[1] - 1
                self.accepted += int(num_matches)
                self.round_tokens += int(num_matches) + 1
                return update(input_ids, scores, num_matches)

            generator.update_candidate_strategy = counted
            return generator

        model._get_candidate_generator = instrumented

    def reset(self) -> None:
        self.forwards = self.rounds = self.round_tokens = self.drafted = self.accepted = 0

    def _forward(self, module, args) -> None:
        self.forwards += 1


def quiet_transformers() -> None:
    """No per-load progress bars, and no warning that HF's own assistant generate() triggers on every round."""
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def load_hf(path: str):
    """transformers' float32 model from an HF folder or (dequantized) from the GGUF file jaxspec reads."""
    import torch
    import transformers

    if path.endswith(".gguf"):
        return transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
            quantization_config=transformers.GgufConfig(dequantize=True),
        ).eval()
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def run_hf(source: ModelSource, strategies: list[str], settings: DraftSettings, prompts: dict[str, np.ndarray],
           eos: list[int], pad: int, max_new_tokens: int, repeats: int):
    import torch

    target = load_hf(source.path)
    tally = HFTally(target)
    plans = {s: plan_for(s, source, settings) for s in strategies}
    plans = {s: p for s, p in plans.items() if isinstance(p, Plan)}
    assistant = load_hf(source.assistant_path) if any(p.drafter == "assistant" for p in plans.values()) else None

    def call_for(plan: Plan):
        kwargs = dict(plan.hf_kwargs)
        drafting_model = {"assistant": assistant, "target": target, None: None}[plan.drafter]
        if plan.strategy in ("speculative", "speculative-self"):
            kwargs["assistant_model"] = drafting_model

        def call(name: str, ids: np.ndarray) -> Call:
            if drafting_model is not None:
                # HF reads draft length / schedule / threshold from the drafting model's generation_config (not
                # from generate's kwargs), and a heuristic schedule writes back into it: reset before every call.
                for key in ("num_assistant_tokens", "num_assistant_tokens_schedule",
                            "assistant_confidence_threshold"):
                    setattr(drafting_model.generation_config, key, plan.jaxspec_kwargs[key])
            input_ids = torch.as_tensor(ids[None].astype(np.int64))
            tally.reset()
            with torch.inference_mode():
                start = time.perf_counter()
                out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                      max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos,
                                      pad_token_id=pad, **kwargs)
                seconds = time.perf_counter() - start
            tokens = out[0, len(ids):].tolist()
            if plan.drafter is None and plan.strategy == "greedy":
                # Plain decoding: one forward per token; the hook counts exactly those.
                return Call(name, tokens, seconds, 0.0, tally.forwards, tally.forwards, len(tokens), 0, 0)
            # Assisted: one target forward per round (the first also holds the prompt). The hook cannot tell them
            # apart from drafting forwards when the target drafts for itself, so rounds are the count.
            return Call(name, tokens, seconds, 0.0, tally.rounds, tally.rounds, tally.round_tokens,
                        tally.drafted, tally.accepted)

        return call

    results = {s: measure("transformers", source.name, s, call_for(p), prompts, repeats) for s, p in plans.items()}
    del target, assistant
    gc.collect()
    return results


# ------------------------------------------------------------------------------------------------------------------
# Rows, checks, reports


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan


def build_rows(model: str, jx: dict[str, Measurement], hf: dict[str, Measurement],
               plans: dict[str, Plan]) -> list[Row]:
    jx_greedy, hf_greedy = jx.get("greedy"), hf.get("greedy")
    reference = hf_greedy.tokens_by_prompt() if hf_greedy else None
    rows = []
    for strategy, j in jx.items():
        h = hf.get(strategy)
        equal = None
        if reference is not None:
            equal = sum(reference[p] == t for p, t in j.tokens_by_prompt().items())
        rows.append(Row(
            model=model, strategy=strategy, settings=plans[strategy].settings,
            jaxspec_tokens_per_second=j.tokens_per_second,
            hf_tokens_per_second=h.tokens_per_second if h else math.nan,
            jaxspec_over_hf=ratio(j.tokens_per_second, h.tokens_per_second if h else None),
            jaxspec_compile_seconds=j.compile_seconds,
            jaxspec_target_forwards=j.total("target_forwards"),
            hf_target_forwards=h.total("target_forwards") if h else None,
            jaxspec_acceptance_rate=j.acceptance_rate,
            hf_acceptance_rate=h.acceptance_rate if h else math.nan,
            jaxspec_mean_accepted_length=j.mean_accepted_length,
            hf_mean_accepted_length=h.mean_accepted_length if h else math.nan,
            jaxspec_speedup_over_greedy=ratio(j.tokens_per_second, jx_greedy.tokens_per_second if jx_greedy else None),
            hf_speedup_over_greedy=ratio(h.tokens_per_second if h else None,
                                         hf_greedy.tokens_per_second if hf_greedy else None),
            jaxspec_equal_hf_greedy=equal,
            prompts=len(j.passes[0]),
        ))
    return rows


def losslessness_notes(model: str, jx: dict[str, Measurement], hf: dict[str, Measurement]) -> list[str]:
    """Greedy assisted decoding must reproduce its own library's plain greedy tokens; say where it does not."""
    notes = []
    for library, results in (("jaxspec", jx), ("transformers", hf)):
        greedy = results.get("greedy")
        if greedy is None:
            continue
        reference = greedy.tokens_by_prompt()
        for strategy, m in results.items():
            for prompt, tokens in m.tokens_by_prompt().items():
                if tokens != reference[prompt]:
                    where = next((i for i, (a, b) in enumerate(zip(tokens, reference[prompt])) if a != b),
                                 min(len(tokens), len(reference[prompt])))
                    notes.append(f"{model}: {library} {strategy} differs from its own greedy on {prompt} "
                                 f"from new token {where}")
    return notes


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def pair(a, b, spec: str = ".2f") -> str:
    return f"{fmt(a, spec)} / {fmt(b, spec)}"


def markdown(rows: list[Row], rooflines: list[Roofline], header: list[str], notes: list[str]) -> str:
    lines = header + [""]
    lines += [
        "| model | strategy | settings | jaxspec tok/s | HF tok/s | jaxspec / HF | jaxspec compile s "
        "| target fwd jx / HF | acceptance jx / HF | mean accepted len jx / HF | speedup vs greedy jx / HF "
        "| jx = HF greedy |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        equal = "–" if r.jaxspec_equal_hf_greedy is None else f"{r.jaxspec_equal_hf_greedy}/{r.prompts}"
        lines.append(
            f"| {r.model} | {r.strategy} | {r.settings} | {fmt(r.jaxspec_tokens_per_second)} "
            f"| {fmt(r.hf_tokens_per_second)} | {fmt(r.jaxspec_over_hf)}x | {fmt(r.jaxspec_compile_seconds, '.1f')} "
            f"| {pair(r.jaxspec_target_forwards, r.hf_target_forwards, 'd')} "
            f"| {pair(r.jaxspec_acceptance_rate, r.hf_acceptance_rate)} "
            f"| {pair(r.jaxspec_mean_accepted_length, r.hf_mean_accepted_length)} "
            f"| {pair(r.jaxspec_speedup_over_greedy, r.hf_speedup_over_greedy)} | {equal} |"
        )
    if rooflines:
        lines += [
            "",
            "Memory-bandwidth roofline of plain greedy (weights read once per token / measured copy bandwidth):",
            "",
            "| model | parameters | weights read / token | copy bandwidth | roofline tok/s | jaxspec greedy "
            "| HF greedy |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rooflines:
            lines.append(
                f"| {r.model} | {r.parameters / 1e6:.1f}M | {r.bytes_per_token / 1e6:.0f} MB "
                f"| {r.bandwidth_gb_s:.1f} GB/s | {r.tokens_per_second:.1f} "
                f"| {fmt(r.jaxspec_greedy)} ({fmt(100 * r.jaxspec_greedy / r.tokens_per_second, '.0f')}%) "
                f"| {fmt(r.hf_greedy)} ({fmt(100 * r.hf_greedy / r.tokens_per_second, '.0f')}%) |"
            )
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def chart(rows: list[Row], path: str) -> str | None:
    """Grouped bars of tokens/s per strategy, one panel per model; a note instead when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no chart written"
    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(1, len(models), figsize=(5 * len(models), 4), squeeze=False)
    for ax, model in zip(axes[0], models):
        mine = [r for r in rows if r.model == model]
        x = np.arange(len(mine))
        ax.bar(x - 0.2, [r.jaxspec_tokens_per_second for r in mine], 0.4, label="jaxspec")
        ax.bar(x + 0.2, [0 if math.isnan(r.hf_tokens_per_second) else r.hf_tokens_per_second for r in mine], 0.4,
               label="transformers")
        ax.set_xticks(x, [r.strategy for r in mine], rotation=30, ha="right")
        ax.set_title(model)
        ax.set_ylabel("tokens/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return None


def environment(cores: list[int], bandwidth: float) -> dict[str, Any]:
    import flax
    import jax
    import torch
    import transformers

    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "pinned_cores": cores, "torch_threads": torch.get_num_threads(), "xla_flags": os.environ.get("XLA_FLAGS"),
        "jax": jax.__version__, "jax_backend": jax.default_backend(), "flax": flax.__version__,
        "transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32", "batch": 1,
        "copy_bandwidth_gb_s": bandwidth,
    }


# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,random-500m",
                        help=f"catalogue names and/or {', '.join(RANDOM_MODELS)}")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=", ".join(STRATEGIES))
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=", ".join(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes; the median is reported")
    parser.add_argument("--threads", type=int, default=None, help="CPU cores for both libraries (default: all)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--skip-hf", action="store_true", help="jaxspec only")
    parser.add_argument("--num-assistant-tokens", type=int, default=4)
    parser.add_argument("--schedule", default="constant", choices=("constant", "heuristic", "heuristic_transient"))
    parser.add_argument("--confidence-threshold", type=float, default=None,
                        help="assistant_confidence_threshold (default 0.4; 0 = off for random models)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--early-exit", type=int, default=None, help="draft layers (default: num_layers // 2)")
    parser.add_argument("--copy-mb", type=int, default=512, help="array size of the bandwidth measurement")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.prompts = [p for p in args.prompts.split(",") if p]
    for s in args.strategies:
        if s not in STRATEGIES:
            parser.error(f"unknown strategy {s!r}; choose from {', '.join(STRATEGIES)}")
    for p in args.prompts:
        if p not in PROMPTS:
            parser.error(f"unknown prompt {p!r}; choose from {', '.join(PROMPTS)}")
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    cores = pin_threads(args.threads)
    quiet_transformers()
    os.makedirs(args.out, exist_ok=True)
    bandwidth = measure_copy_bandwidth(len(cores), args.copy_mb)
    env = environment(cores, bandwidth)
    header = [
        f"# jaxspec vs transformers, CPU, float32, batch 1, greedy, max_new_tokens={args.max_new_tokens}, "
        f"median of {args.repeats}",
        "",
        f"{len(cores)} threads (cores {cores}); jax {env['jax']}, transformers {env['transformers']}, "
        f"torch {env['torch']}; prompts: {', '.join(args.prompts)}. Copy bandwidth {bandwidth:.1f} GB/s.",
    ]
    notes: list[str] = []
    rows: list[Row] = []
    rooflines: list[Roofline] = []
    raw: list[dict[str, Any]] = []
    settings_by_model: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="jaxspec-bench-") as workdir:
        for name in args.models:
            print(f"{name}:", file=sys.stderr)
            try:
                source = resolve_source(name, workdir)
            except (FileNotFoundError, KeyError, ValueError) as error:
                notes.append(f"{name}: skipped: {error}")
                continue
            settings = draft_settings(args, source)
            settings_by_model[name] = dataclasses.asdict(settings)
            jx, prompts, eos, pad, (parameters, nbytes) = run_jaxspec(
                source, args.strategies, settings, args.prompts, args.max_new_tokens, args.repeats, notes)
            hf = {} if args.skip_hf else run_hf(source, list(jx), settings, prompts, eos, pad,
                                                args.max_new_tokens, args.repeats)
            plans = {s: plan_for(s, source, settings) for s in jx}
            rows += build_rows(name, jx, hf, plans)
            notes += losslessness_notes(name, jx, hf)
            roof = bandwidth * 1e9 / nbytes
            rooflines.append(Roofline(name, parameters, nbytes, bandwidth, roof,
                                      jx["greedy"].tokens_per_second if "greedy" in jx else math.nan,
                                      hf["greedy"].tokens_per_second if "greedy" in hf else math.nan))
            raw.append({"model": name, "prompt_lengths": {p: len(ids) for p, ids in prompts.items()},
                        "eos_token_id": eos, "pad_token_id": pad,
                        "measurements": [dataclasses.asdict(m) for m in [*jx.values(), *hf.values()]]})

    note = chart(rows, os.path.join(args.out, "bench.png"))
    if note:
        notes.append(note)
    report = markdown(rows, rooflines, header, notes)
    print(report)
    with open(os.path.join(args.out, "bench.md"), "w", encoding="utf-8") as handle:
        handle.write(report)
    with open(os.path.join(args.out, "bench.json"), "w", encoding="utf-8") as handle:
        json.dump(_plain({"environment": env, "arguments": vars(args), "settings": settings_by_model,
                          "rows": [dataclasses.asdict(r) for r in rows],
                          "rooflines": [dataclasses.asdict(r) for r in rooflines],
                          "models": raw, "notes": notes}), handle, indent=1)


def _plain(value):
    """Strict JSON: NaN (a figure that does not apply, e.g. acceptance of plain greedy) becomes null."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (float, np.floating)):
        return None if math.isnan(value) else float(value)
    if isinstance(value, np.integer):
        return int(value)
    return value


if __name__ == "__main__":
    main()
