"""jaxspec against transformers on CPU, side by side in one run: a markdown table of tokens/s and their ratios.

    python scripts/bench.py [--models smollm2-135m,random-500m]
        [--strategies greedy,speculative,speculative-self,prompt_lookup,early_exit,universal,
                      speculative-int8,universal-int8]
        [--universal-assistant smollm2-135m]
        [--max-new-tokens 64] [--repeats 3] [--threads T] [--out bench_out/] [--skip-hf]
        [--prompts code_completion,code_editing,chat,summary]
        [--num-assistant-tokens K] [--confidence-threshold C] [--schedule constant]
        [--prompt-lookup-num-tokens 10] [--early-exit E] [--bandwidth-mb 1024]

Models: any catalogue name (`jaxspec.catalog`; transformers loads the same GGUF file, dequantized to float32), or
`random-500m` / `random-tiny`: random Llama configs built by transformers with a fixed seed, saved with
`save_pretrained` and loaded from that folder by both libraries. Random models draft with a half-depth random
assistant of the same vocabulary; `speculative-self` drafts with the target itself (every draft accepted: the
ceiling of speculative decoding). `universal` drafts with `--universal-assistant`, a catalogue model with another
tokenizer (SmolLM2-135M for a Qwen target): jaxspec maps the vocabularies in its loop, transformers runs its
universal assisted decoding with the same two tokenizers. `speculative-int8` and `universal-int8` run the same
assistants with int8 weights and activations (`jaxspec.quantize`), jaxspec only. Batch 1 and float32 everywhere
else; greedy decoding, so every strategy must give the plain greedy tokens. Besides the table over all prompts, a
second table gives each strategy's speedup over its own library's greedy per prompt.

Timing: each (library, model, strategy) runs the prompt set once untimed (jaxspec compiles there, reported in its
own column), then `--repeats` (at least 3) timed passes; tokens/s is new tokens over the summed per-call seconds of a
pass, and the table shows the median over passes with the range (min-max) beside it. Both libraries are timed the
same way: the wall time of the whole `generate` call, host work included (jaxspec's executables are compiled by then
and come from its cache). Both libraries hold the model at once, and a timed pass takes the prompts in turn and
runs every (library, strategy) on a prompt back to back. So a change of load on the machine lands on a strategy and
its greedy baseline alike, and a speedup over greedy is the median over passes of a paired ratio (the strategy's
calls over greedy's calls of the same pass), not a ratio of two medians taken minutes apart.
Peak memory is therefore both libraries' float32 weights (random-500m with its assistant: about 7 GB).

Roofline: decoding one token reads every weight once, so the best possible greedy rate is (read bandwidth) / (weight
bytes). The read bandwidth is measured read-only, the way decoding reads: a jitted float32 matrix-vector product over
a `--bandwidth-mb` matrix, best of several runs.

Draft schedules: jaxspec runs its default ("adaptive") unless `--schedule` says otherwise; transformers has no adaptive
schedule and runs "constant" then (its default).

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
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import numpy as np

from _bench_prompts import PROMPTS, RANDOM_PROMPT_LENGTHS

# jax, torch, transformers and jaxspec are imported inside functions, never at module level: the thread setting
# (CPU affinity, environment) must be in place before either runtime starts its thread pools.

STRATEGIES = ("greedy", "speculative", "speculative-self", "prompt_lookup", "early_exit", "universal",
              "speculative-int8", "universal-int8")
# `speculative-int8` and `universal-int8`: the same assistant with int8 weights and activations (jaxspec.quantize).
# jaxspec only: transformers' assisted generate has no int8 CPU assistant to compare with.
INT8 = "-int8"

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
# `random-500m-prefix`: random-500m whose layers past the first PREFIX_LAYERS add nothing (zero output and down
# projections), with those first layers (and the shared embedding, norm and head) as its assistant. The assistant
# then predicts exactly what the target predicts at a fraction of its cost: every draft is accepted and the
# target still reads all its weights per forward. This isolates the loop's own overhead at full acceptance.
PREFIX_LAYERS = 2

# Catalogue targets with an installed same-tokenizer assistant (speculative decoding needs the same vocabulary).
CATALOG_ASSISTANTS = {"qwen2.5-coder-1.5b": "qwen2.5-coder-0.5b"}

# The default assistant of `universal` (an assistant with another tokenizer than the target's).
UNIVERSAL_ASSISTANT = "smollm2-135m"

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
    universal_path: str | None = None  # drafter with another tokenizer for `universal` (--universal-assistant)


@dataclasses.dataclass
class Plan:
    """One strategy on one model: the generate() arguments of each library and the draft-length settings."""

    strategy: str
    settings: str  # human-readable, for the table
    # Whose generation_config HF reads: "assistant", "universal", "target" (self / early exit) or None.
    drafter: str | None
    jaxspec_kwargs: dict[str, Any]
    hf_kwargs: dict[str, Any]
    draft_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # jaxspec's generate() arguments
    hf_draft_config: dict[str, Any] = dataclasses.field(default_factory=dict)  # set on HF's drafting model


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
    def per_pass(self) -> list[float]:
        return [self.new_tokens / sum(c.seconds for c in calls) for calls in self.passes]

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(self.per_pass)

    @property
    def spread(self) -> tuple[float, float]:
        return min(self.per_pass), max(self.per_pass)

    @property
    def compile_seconds(self) -> float:
        return sum(c.compile_seconds for c in self.warmup + [c for p in self.passes for c in p])

    def total(self, field: str) -> int:
        """A counter summed over the prompts of the first timed pass (greedy: every pass counts the same)."""
        return sum(getattr(c, field) for c in self.passes[0])

    @property
    def acceptance_rate(self) -> float:
        drafted = self.total("drafted")
        return self.total("accepted") / drafted if drafted else math.nan

    @property
    def mean_accepted_length(self) -> float:
        rounds = self.total("rounds")
        return self.total("round_tokens") / rounds if rounds else math.nan

    def speedups_over(self, base: "Measurement", prompt: str | None = None) -> list[float]:
        """This strategy's tokens/s over `base`'s (the same library's greedy), pass by pass: in pass r, the calls
        of both on a prompt ran back to back (see measure_all), so each ratio compares neighbours in time and a
        slow stretch of the machine cancels out of it. `prompt`: that prompt only; else the whole pass."""
        def rate(calls: list[Call]) -> float:
            chosen = [c for c in calls if prompt is None or c.prompt == prompt]
            return sum(len(c.tokens) for c in chosen) / sum(c.seconds for c in chosen)

        return [rate(mine) / rate(theirs) for mine, theirs in zip(self.passes, base.passes)]

    def acceptance_by_prompt(self) -> dict[str, float]:
        return {c.prompt: c.accepted / c.drafted if c.drafted else math.nan for c in self.passes[0]}

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
    jaxspec_range: tuple[float, float]
    hf_range: tuple[float, float]
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


def measure_read_bandwidth(megabytes: int, trials: int = 7) -> float:
    """GB/s at which XLA reads a float32 matrix in a matrix-vector product: what decoding does with every weight.

    Read-only (the vector and the result are tiny), on the same threads the decode loop uses. Best of `trials`.
    """
    import jax
    import jax.numpy as jnp

    columns = 4096
    matrix = jnp.ones((megabytes * 2**20 // 4 // columns, columns), jnp.float32)
    vector = jnp.ones((columns,), jnp.float32)
    matvec = jax.jit(lambda m, v: m @ v)
    jax.block_until_ready(matvec(matrix, vector))
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready(matvec(matrix, vector))
        best = min(best, time.perf_counter() - start)
    return matrix.nbytes / best / 1e9


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


def resolve_source(name: str, workdir: str, universal_assistant: str | None = None) -> ModelSource:
    """Catalogue name -> its GGUF (and assistant's); random name -> target and assistant saved into `workdir`."""
    if name.endswith("-prefix") and name.removesuffix("-prefix") in RANDOM_MODELS:
        overrides = RANDOM_MODELS[name.removesuffix("-prefix")]
        target, assistant = save_prefix_pair(os.path.join(workdir, name), TARGET_SEED, overrides)
        return ModelSource(name, "random", target, assistant, overrides["num_hidden_layers"])
    if name in RANDOM_MODELS:
        overrides = RANDOM_MODELS[name]
        target = save_random_llama(os.path.join(workdir, name), TARGET_SEED, overrides)
        half = dict(overrides, num_hidden_layers=max(1, overrides["num_hidden_layers"] // 2))
        assistant = save_random_llama(os.path.join(workdir, name + "-assistant"), ASSISTANT_SEED, half)
        return ModelSource(name, "random", target, assistant, overrides["num_hidden_layers"])
    from jaxspec import catalog
    from jaxspec.convert.gguf import read_gguf

    if not catalog.is_catalog_name(name):
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join([*RANDOM_MODELS, *catalog.CATALOG])}")
    path = catalog.resolve(name)
    assistant = catalog.resolve(CATALOG_ASSISTANTS[name]) if name in CATALOG_ASSISTANTS else None
    universal = None
    if universal_assistant and universal_assistant != name:
        try:
            universal = catalog.resolve(universal_assistant)
        except FileNotFoundError:  # not installed: `universal` is skipped with a note
            pass
    return ModelSource(name, "catalog", path, assistant, read_gguf(path).hf_config["num_hidden_layers"], universal)


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


def save_prefix_pair(folder: str, seed: int, overrides: dict[str, Any]) -> tuple[str, str]:
    """A target whose layers past PREFIX_LAYERS are inert, and its first PREFIX_LAYERS as an exact assistant."""
    import torch
    import transformers

    torch.manual_seed(seed)
    target = transformers.LlamaForCausalLM(transformers.LlamaConfig(**(RANDOM_COMMON | overrides))).eval()
    with torch.no_grad():
        for layer in target.model.layers[PREFIX_LAYERS:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    target.save_pretrained(folder)
    assistant = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**(RANDOM_COMMON | overrides | {"num_hidden_layers": PREFIX_LAYERS}))).eval()
    missing = assistant.load_state_dict(target.state_dict(), strict=False).missing_keys
    assert not missing, missing  # every assistant tensor is the target's
    assistant.save_pretrained(folder + "-assistant")
    del target, assistant
    gc.collect()
    return folder, folder + "-assistant"


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
    if strategy.endswith(INT8):
        plan = plan_for(strategy[: -len(INT8)], source, s)
        if isinstance(plan, str):
            return plan
        return dataclasses.replace(plan, strategy=strategy, settings=f"{plan.settings} int8",
                                   drafter=plan.drafter + INT8)
    draft = dict(num_assistant_tokens=s.num_assistant_tokens, num_assistant_tokens_schedule=s.schedule,
                 assistant_confidence_threshold=s.confidence_threshold)
    hf_draft = draft | {"num_assistant_tokens_schedule": "constant" if s.schedule == "adaptive" else s.schedule}
    draft_text = f"K={s.num_assistant_tokens} {s.schedule} conf={s.confidence_threshold:g}"
    if strategy == "greedy":
        return Plan(strategy, "", None, {}, {})
    if strategy == "speculative":
        if source.assistant_path is None:
            return "no smaller checkpoint with the same tokenizer is installed"
        return Plan(strategy, f"{os.path.basename(source.assistant_path)} {draft_text}", "assistant", {}, {}, draft,
                    hf_draft)
    if strategy == "universal":
        if source.universal_path is None:
            return "no assistant with another tokenizer (--universal-assistant) is installed"
        return Plan(strategy, f"{os.path.basename(source.universal_path)} {draft_text}", "universal", {}, {}, draft,
                    hf_draft)
    if strategy == "speculative-self":
        return Plan(strategy, f"target drafts {draft_text}", "target", {}, {}, draft, hf_draft)
    if strategy == "prompt_lookup":
        n = s.prompt_lookup_num_tokens
        schedule = {"num_assistant_tokens_schedule": "adaptive" if s.schedule == "adaptive" else "constant"}
        return Plan(strategy, f"num_tokens={n} ngram=2 {schedule['num_assistant_tokens_schedule']}", None,
                    {"prompt_lookup_num_tokens": n} | schedule, {"prompt_lookup_num_tokens": n})
    if strategy == "early_exit":
        if not 1 <= s.early_exit < source.num_layers:
            return f"early exit {s.early_exit} is not inside 1..{source.num_layers - 1}"
        early_exit = {"assistant_early_exit": s.early_exit}
        return Plan(strategy, f"E={s.early_exit}/{source.num_layers} {draft_text}", "target", early_exit, early_exit,
                    draft, hf_draft)
    raise ValueError(f"unknown strategy {strategy!r}; choose from {', '.join(STRATEGIES)}")


# ------------------------------------------------------------------------------------------------------------------
# Running

CallFn = Callable[[str, np.ndarray], Call]


def measure_all(model: str, calls: dict[tuple[str, str], CallFn], prompts: dict[str, np.ndarray],
                repeats: int) -> dict[tuple[str, str], Measurement]:
    """One untimed pass of every (library, strategy) over the prompts (jaxspec compiles there), then `repeats`
    timed passes. A pass takes the prompts in turn and runs every (library, strategy) on a prompt back to back, so
    a strategy's call and its greedy baseline's on the same prompt are seconds apart: a load change on a shared
    machine lands on both (the paired ratios of `Measurement.speedups_over` cancel it) instead of on whichever
    strategy ran during it."""
    print(f"  untimed pass (jaxspec compiles) over {len(calls)} library x strategy pairs", file=sys.stderr)
    warmups = {key: [call(name, ids) for name, ids in prompts.items()] for key, call in calls.items()}
    passes: dict[tuple[str, str], list[list[Call]]] = {key: [] for key in calls}
    for repeat in range(repeats):
        print(f"  timed pass {repeat + 1}/{repeats}", file=sys.stderr)
        for key in calls:
            passes[key].append([])
        for name, ids in prompts.items():
            for key, call in calls.items():
                passes[key][-1].append(call(name, ids))
    results = {key: Measurement(key[0], model, key[1], warmups[key], passes[key]) for key in calls}
    for (library, strategy), m in results.items():
        print(f"  {library:12s} {strategy:16s} {m.tokens_per_second:8.2f} tok/s", file=sys.stderr)
    return results


def jaxspec_call(plan: Plan, target, assistants: dict, eos: list[int], pad: int, max_new_tokens: int) -> CallFn:
    """`assistants`: {"assistant": same-tokenizer drafter, "universal": drafter with another tokenizer, and their
    int8 copies as "assistant-int8", "universal-int8"}; a universal assistant brings its own tokenizer, which
    jaxspec maps onto the target's."""
    import jaxspec

    kwargs = plan.jaxspec_kwargs | plan.draft_config
    if plan.drafter in assistants:
        kwargs["assistant_model"] = assistants[plan.drafter]
    elif plan.strategy == "speculative-self":
        kwargs["assistant_model"] = target

    def call(name: str, ids: np.ndarray) -> Call:
        start = time.perf_counter()
        out = jaxspec.generate(target, ids[None], max_new_tokens=max_new_tokens, eos_token_id=eos,
                               pad_token_id=pad, **kwargs)
        seconds = time.perf_counter() - start - out.compile_seconds  # the whole call; compile only on the first
        n = int(out.num_new_tokens[0])
        return Call(name, out.sequences[0, len(ids): len(ids) + n].tolist(), seconds,
                    out.compile_seconds, out.target_forwards, out.rounds,
                    n - 1,  # the prefill commits the first token, the rounds the rest
                    int(out.drafted.sum()), int(out.accepted.sum()))

    return call


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


def hf_call(plan: Plan, target, assistants: dict, tally: HFTally, eos: list[int], pad: int,
            max_new_tokens: int, tokenizers: tuple | None = None) -> CallFn:
    """`tokenizers`: (target's, universal assistant's), for transformers' universal assisted decoding."""
    import torch

    kwargs = dict(plan.hf_kwargs)
    drafting_model = target if plan.drafter == "target" else assistants.get(plan.drafter)
    if plan.strategy in ("speculative", "speculative-self", "universal"):
        kwargs["assistant_model"] = drafting_model
    if plan.strategy == "universal":
        kwargs["tokenizer"], kwargs["assistant_tokenizer"] = tokenizers

    def call(name: str, ids: np.ndarray) -> Call:
        if drafting_model is not None:
            # HF reads draft length, schedule and threshold from the drafting model's generation_config (generate's
            # kwargs do not reach it), and a heuristic schedule writes back into it: set them before every call.
            for key, value in plan.hf_draft_config.items():
                setattr(drafting_model.generation_config, key, value)
        input_ids = torch.as_tensor(ids[None].astype(np.int64))
        tally.reset()
        with torch.inference_mode():
            start = time.perf_counter()
            out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                  do_sample=False, eos_token_id=eos, pad_token_id=pad, **kwargs)
            seconds = time.perf_counter() - start
        tokens = out[0, len(ids):].tolist()
        if plan.strategy == "greedy":
            # Plain decoding: one forward per token, which the hook counts.
            return Call(name, tokens, seconds, 0.0, tally.forwards, tally.forwards, len(tokens), 0, 0)
        # Assisted: one target forward per round, the first also holding the prompt. When the target drafts for
        # itself the hook cannot tell its drafting forwards apart, so the rounds are the count.
        return Call(name, tokens, seconds, 0.0, tally.rounds, tally.rounds, tally.round_tokens, tally.drafted,
                    tally.accepted)

    return call


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


@dataclasses.dataclass
class ModelRun:
    """Everything measured on one model."""

    plans: dict[str, Plan]
    jaxspec: dict[str, Measurement]
    hf: dict[str, Measurement]
    prompts: dict[str, np.ndarray]
    eos: list[int]
    pad: int
    parameters: int
    bytes_per_token: int


def bench_model(source: ModelSource, args, settings: DraftSettings, notes: list[str]) -> ModelRun:
    """Load the model (and assistant) in both libraries, then measure every applicable strategy."""
    import jaxspec

    plans = {}
    for strategy in args.strategies:
        plan = plan_for(strategy, source, settings)
        if isinstance(plan, str):
            notes.append(f"{source.name}: {strategy} skipped: {plan}")
        else:
            plans[strategy] = plan
    paths = {"assistant": source.assistant_path, "universal": source.universal_path}
    quantized = {p.drafter for p in plans.values() if p.drafter and p.drafter.endswith(INT8)}
    drafters = ({p.drafter for p in plans.values()} | {kind[: -len(INT8)] for kind in quantized}) & set(paths)

    target = jaxspec.load(source.path, dtype="float32")  # explicit: the default is bfloat16 on accelerators
    assistants = {kind: jaxspec.load(paths[kind], dtype="float32") for kind in drafters}
    assistants |= {kind: jaxspec.quantize(assistants[kind[: -len(INT8)]], "int8") for kind in quantized}
    prompts = encode_prompts(prompt_tokenizer(source, target), target.config.vocab_size, args.prompts)
    eos = list(target.eos_token_ids())
    pad = target.config.pad_token_id if target.config.pad_token_id is not None else (eos[0] if eos else 0)
    parameters, nbytes = weight_bytes_per_token(target.module)
    calls = {("jaxspec", s): jaxspec_call(p, target, assistants, eos, pad, args.max_new_tokens)
             for s, p in plans.items()}
    if not args.skip_hf:
        # Both libraries stay loaded so that the timed passes can alternate between them.
        hf_target = load_hf(source.path)
        hf_assistants = {kind: load_hf(paths[kind]) for kind in drafters}
        tally = HFTally(hf_target)
        # transformers' universal run gets the same tokenizers jaxspec built from the GGUF files.
        tokenizers = (target.tokenizer, assistants["universal"].tokenizer) if "universal" in drafters else None
        calls |= {("transformers", s): hf_call(p, hf_target, hf_assistants, tally, eos, pad, args.max_new_tokens,
                                               tokenizers)
                  for s, p in plans.items() if not s.endswith(INT8)}
    results = measure_all(source.name, calls, prompts, args.repeats)
    return ModelRun(
        plans=plans,
        jaxspec={s: m for (lib, s), m in results.items() if lib == "jaxspec"},
        hf={s: m for (lib, s), m in results.items() if lib == "transformers"},
        prompts=prompts, eos=eos, pad=pad, parameters=parameters, bytes_per_token=nbytes,
    )


# ------------------------------------------------------------------------------------------------------------------
# Rows, checks, reports


def ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b and not math.isnan(a) and not math.isnan(b) else math.nan


def paired_speedup(m: Measurement | None, greedy: Measurement | None, prompt: str | None = None) -> float:
    """The median over passes of the paired speedup over greedy (nan without either)."""
    return statistics.median(m.speedups_over(greedy, prompt)) if m and greedy else math.nan


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
            jaxspec_range=j.spread,
            hf_range=h.spread if h else (math.nan, math.nan),
            jaxspec_over_hf=ratio(j.tokens_per_second, h.tokens_per_second if h else None),
            jaxspec_compile_seconds=j.compile_seconds,
            jaxspec_target_forwards=j.total("target_forwards"),
            hf_target_forwards=h.total("target_forwards") if h else None,
            jaxspec_acceptance_rate=j.acceptance_rate,
            hf_acceptance_rate=h.acceptance_rate if h else math.nan,
            jaxspec_mean_accepted_length=j.mean_accepted_length,
            hf_mean_accepted_length=h.mean_accepted_length if h else math.nan,
            jaxspec_speedup_over_greedy=paired_speedup(j, jx_greedy),
            hf_speedup_over_greedy=paired_speedup(h, hf_greedy),
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


def spread(bounds: tuple[float, float]) -> str:
    return "" if math.isnan(bounds[0]) else f"({bounds[0]:.2f}-{bounds[1]:.2f})"


def times(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f}x"


def percent(part: float, whole: float) -> str:
    return "" if math.isnan(part) else f" ({100 * part / whole:.0f}%)"


def pair(a, b, spec: str = ".2f") -> str:
    return f"{fmt(a, spec)} / {fmt(b, spec)}"


def per_prompt_lines(model: str, jx: dict[str, Measurement], hf: dict[str, Measurement]) -> list[str]:
    """Table rows: each strategy's speedup over its own library's greedy, per prompt (jaxspec, with the range of its
    paired per-pass ratios, / transformers), and the acceptance per prompt."""
    if "greedy" not in jx:
        return []
    lines = []
    for strategy, m in jx.items():
        if strategy == "greedy":
            continue
        theirs = hf.get(strategy)
        accept, accept_hf = m.acceptance_by_prompt(), theirs.acceptance_by_prompt() if theirs else {}
        cells = []
        for p in accept:
            paired = m.speedups_over(jx["greedy"], p)
            cells.append(f"{statistics.median(paired):.2f} {spread((min(paired), max(paired)))} / "
                         f"{fmt(paired_speedup(theirs, hf.get('greedy'), p))} "
                         f"(acc. {fmt(accept[p])} / {fmt(accept_hf.get(p))})")
        lines.append(f"| {model} | {strategy} | " + " | ".join(cells) + " |")
    return lines


def markdown(rows: list[Row], rooflines: list[Roofline], header: list[str], notes: list[str],
             per_prompt: list[str] = (), prompts: list[str] = ()) -> str:
    lines = header + [""]
    lines += [
        "| model | strategy | settings | jaxspec tok/s (range) | HF tok/s (range) | jaxspec / HF | jaxspec compile s "
        "| target fwd jx / HF | acceptance jx / HF | mean accepted len jx / HF | speedup vs greedy jx / HF "
        "| jx = HF greedy |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        equal = "–" if r.jaxspec_equal_hf_greedy is None else f"{r.jaxspec_equal_hf_greedy}/{r.prompts}"
        lines.append(
            f"| {r.model} | {r.strategy} | {r.settings} | {fmt(r.jaxspec_tokens_per_second)} {spread(r.jaxspec_range)} "
            f"| {fmt(r.hf_tokens_per_second)} {spread(r.hf_range)} | {times(r.jaxspec_over_hf)} "
            f"| {fmt(r.jaxspec_compile_seconds, '.1f')} "
            f"| {pair(r.jaxspec_target_forwards, r.hf_target_forwards, 'd')} "
            f"| {pair(r.jaxspec_acceptance_rate, r.hf_acceptance_rate)} "
            f"| {pair(r.jaxspec_mean_accepted_length, r.hf_mean_accepted_length)} "
            f"| {pair(r.jaxspec_speedup_over_greedy, r.hf_speedup_over_greedy)} | {equal} |"
        )
    lines += [
        "",
        "Target forwards include the prefill, summed over the prompts. Mean accepted length is tokens committed per "
        "verification round: jaxspec's prefill commits the first token by itself, while transformers' first round is "
        "the prefill and already verifies drafts, so for assisted strategies transformers can need one target forward "
        "fewer per prompt for the same tokens. jx = HF greedy: prompts whose jaxspec tokens equal transformers' "
        "plain greedy tokens.",
    ]
    if per_prompt:
        lines += ["", "Speedup over the same library's plain greedy, per prompt, jaxspec (range over passes) / "
                  "transformers (acceptance jaxspec / transformers). Each is the median over passes of a paired "
                  "ratio: the strategy's call over greedy's call on the same prompt in the same pass, which ran "
                  "back to back:", "",
                  "| model | strategy | " + " | ".join(prompts) + " |", "|---|---|" + "---:|" * len(prompts)]
        lines += list(per_prompt)
    if rooflines:
        lines += [
            "",
            "Memory-bandwidth roofline of plain greedy (measured read bandwidth / weights read per token):",
            "",
            "| model | parameters | weights read / token | read bandwidth | roofline tok/s | jaxspec greedy "
            "| HF greedy |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for r in rooflines:
            lines.append(
                f"| {r.model} | {r.parameters / 1e6:.1f}M | {r.bytes_per_token / 1e6:.0f} MB "
                f"| {r.bandwidth_gb_s:.1f} GB/s | {r.tokens_per_second:.1f} "
                f"| {fmt(r.jaxspec_greedy)}{percent(r.jaxspec_greedy, r.tokens_per_second)} "
                f"| {fmt(r.hf_greedy)}{percent(r.hf_greedy, r.tokens_per_second)} |"
            )
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def chart(rows: list[Row], path: str) -> None:
    """Grouped bars of tokens/s per strategy, both libraries side by side, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

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
    plt.close(fig)


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
        "read_bandwidth_gb_s": bandwidth,
    }


def cpu_snapshot() -> tuple[float, float, float] | None:
    """(wall seconds, CPU seconds busy on the whole machine, CPU seconds of this process); None off Linux."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(x) for x in handle.readline().split()[1:9]]  # user .. steal, in clock ticks
    except OSError:
        return None
    idle = fields[3] + fields[4]  # idle + iowait
    own = os.times()
    return time.perf_counter(), (sum(fields) - idle) / os.sysconf("SC_CLK_TCK"), own.user + own.system


def other_processes_cores(start, end) -> float | None:
    """Cores that other processes kept busy on average between two snapshots: the noise in every timing here."""
    if start is None or end is None:
        return None
    wall, busy, own = (b - a for a, b in zip(start, end))
    return max(0.0, (busy - own) / wall)


def contention_note(cores_used_by_others: float | None) -> str | None:
    if cores_used_by_others is None or cores_used_by_others < 0.2:
        return None
    return (f"other processes kept {cores_used_by_others:.1f} of the machine's {os.cpu_count()} cores busy on average "
            "during this run: the timings are noisy; rerun on an idle machine")


# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="smollm2-135m,random-500m",
                        help=f"catalogue names and/or {', '.join(RANDOM_MODELS)} (add -prefix for an exact cheap assistant)")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help=", ".join(STRATEGIES))
    parser.add_argument("--prompts", default=",".join(PROMPTS), help=", ".join(PROMPTS))
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="timed passes (>= 3); median and range reported")
    parser.add_argument("--threads", type=int, default=None, help="CPU cores for both libraries (default: all)")
    parser.add_argument("--out", default="bench_out")
    parser.add_argument("--skip-hf", action="store_true", help="jaxspec only")
    parser.add_argument("--num-assistant-tokens", type=int, default=4)
    parser.add_argument("--schedule", default="adaptive",
                        choices=("adaptive", "constant", "heuristic", "heuristic_transient"),
                        help="jaxspec's draft schedule (transformers runs constant where this is adaptive)")
    parser.add_argument("--confidence-threshold", type=float, default=None,
                        help="assistant_confidence_threshold (default 0.4; 0 = off for random models)")
    parser.add_argument("--prompt-lookup-num-tokens", type=int, default=10)
    parser.add_argument("--universal-assistant", default=UNIVERSAL_ASSISTANT,
                        help="catalogue model with another tokenizer, the drafter of `universal`")
    parser.add_argument("--early-exit", type=int, default=None, help="draft layers (default: num_layers // 2)")
    parser.add_argument("--bandwidth-mb", type=int, default=1024, help="matrix size of the bandwidth measurement")
    args = parser.parse_args(argv)
    args.models = [m for m in args.models.split(",") if m]
    args.strategies = [s for s in args.strategies.split(",") if s]
    args.prompts = [p for p in args.prompts.split(",") if p]
    if args.repeats < 3:
        parser.error("--repeats must be at least 3: one pass says nothing about the noise")
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
    bandwidth = measure_read_bandwidth(args.bandwidth_mb)
    env = environment(cores, bandwidth)
    notes: list[str] = []
    if args.schedule == "adaptive":
        notes.append("jaxspec's adaptive schedule drafts fewer tokens after misses and stops drafting while a row "
                     "keeps missing; transformers has no such schedule and drafts K every round (constant)")
    elif args.schedule != "constant":
        notes.append(f"{args.schedule} schedule: jaxspec grows the draft length up to its static buffer "
                     "(max_assistant_tokens, by default 16); transformers grows it without a cap")
    if "speculative" in args.strategies and not args.skip_hf and importlib.util.find_spec("sklearn") is not None:
        # transformers' AssistedCandidateGenerator re-fits the threshold from a ROC curve when sklearn imports.
        notes.append("scikit-learn is installed: transformers re-tunes assistant_confidence_threshold during "
                     "speculative decoding with a separate assistant; jaxspec keeps the given value")
    start = cpu_snapshot()
    header = [
        f"# jaxspec vs transformers, CPU, float32, batch 1, greedy, max_new_tokens={args.max_new_tokens}, "
        f"median of {args.repeats}",
        "",
        f"{len(cores)} thread{'s' if len(cores) > 1 else ''} (cores {cores}); jax {env['jax']}, "
        f"transformers {env['transformers']}, "
        f"torch {env['torch']}; prompts: {', '.join(args.prompts)}. Read bandwidth {bandwidth:.1f} GB/s.",
    ]
    rows: list[Row] = []
    per_prompt: list[str] = []
    rooflines: list[Roofline] = []
    models: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="jaxspec-bench-") as workdir:
        for name in args.models:
            print(f"{name}:", file=sys.stderr)
            try:
                source = resolve_source(name, workdir, args.universal_assistant)
            except (FileNotFoundError, KeyError, ValueError) as error:
                notes.append(f"{name}: skipped: {error}")
                continue
            settings = draft_settings(args, source)
            run = bench_model(source, args, settings, notes)
            rows += build_rows(name, run.jaxspec, run.hf, run.plans)
            per_prompt += per_prompt_lines(name, run.jaxspec, run.hf)
            notes += losslessness_notes(name, run.jaxspec, run.hf)
            rooflines.append(roofline(name, run, bandwidth))
            models.append({
                "model": name, "path": source.path, "assistant_path": source.assistant_path,
                "random_config": RANDOM_COMMON | RANDOM_MODELS[name] if name in RANDOM_MODELS else None,
                "settings": dataclasses.asdict(settings), "eos_token_id": run.eos, "pad_token_id": run.pad,
                "prompt_lengths": {p: len(ids) for p, ids in run.prompts.items()},
                "measurements": [measurement_record(m) for m in [*run.jaxspec.values(), *run.hf.values()]],
            })
            gc.collect()  # free this model's weights (module graphs hold reference cycles) before the next loads

    env["other_processes_cores"] = other_processes_cores(start, cpu_snapshot())
    notes += [n for n in [contention_note(env["other_processes_cores"])] if n]
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if not has_matplotlib:
        notes.append("matplotlib is not installed: no chart written")
    report = markdown(rows, rooflines, header, notes, per_prompt, args.prompts)
    print(report)
    with open(os.path.join(args.out, "bench.md"), "w", encoding="utf-8") as handle:
        handle.write(report)
    with open(os.path.join(args.out, "bench.json"), "w", encoding="utf-8") as handle:
        json.dump(_plain({"environment": env, "arguments": vars(args), "rows": [dataclasses.asdict(r) for r in rows],
                          "rooflines": [dataclasses.asdict(r) for r in rooflines], "models": models,
                          "notes": notes}), handle, indent=1)
    if has_matplotlib:  # last, so that a plotting failure cannot cost the figures
        chart(rows, os.path.join(args.out, "bench.png"))


def measurement_record(m: Measurement) -> dict[str, Any]:
    """Every call as measured, plus the per-pass rates behind the median (their spread shows the noise)."""
    return dataclasses.asdict(m) | {"tokens_per_second": m.tokens_per_second, "tokens_per_second_per_pass": m.per_pass}


def roofline(name: str, run: ModelRun, bandwidth: float) -> Roofline:
    greedy = {lib: m["greedy"].tokens_per_second if "greedy" in m else math.nan
              for lib, m in (("jaxspec", run.jaxspec), ("hf", run.hf))}
    return Roofline(name, run.parameters, run.bytes_per_token, bandwidth, bandwidth * 1e9 / run.bytes_per_token,
                    greedy["jaxspec"], greedy["hf"])


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
