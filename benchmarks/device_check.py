"""One run that checks jaxspec on a freshly lent GPU or TPU: every strategy the installed models allow, one table.

It installs nothing. First bring the accelerator build of the jax that is installed (`pip list | grep jax`: 0.10.2
here; `--help` prints the command for the version it finds), then run the script from the repository root:

    pip install -U "jax[cuda12]==0.10.2"     # NVIDIA GPU (H200, H100, A100); Cloud TPU VM: "jax[tpu]==0.10.2"
    python benchmarks/device_check.py        # catalogue models, bfloat16, batch 1 and 8, 128 new tokens

    python benchmarks/device_check.py --tiny --max-new-tokens 16   # no catalogue package, no torch: CI on a CPU

Models (jaxspec/catalog.py, offline): SmolLM2-135M runs plain decoding, prompt lookup, early exit, and MTP, DFlash
and EAGLE-3 with the drafters jaxspec ships for it (jaxspec/assets); Qwen2.5-Coder-1.5B runs speculative decoding
with Qwen2.5-Coder-0.5B as its assistant; Qwen2.5-Coder-0.5B runs universal decoding with SmolLM2 as its assistant
(another tokenizer). A strategy whose model is not installed is listed as skipped with the pip command that brings
it, and so is every other row of `jaxspec.STRATEGIES`, with the reason no model here runs it. `--tiny` writes a
random 4-layer Llama (config.json and model.safetensors) to a temporary folder instead, prompts it with token ids,
and runs plain decoding, prompt lookup and early exit in float32: the same table, without a package, a tokenizer or
torch.

Workload: two fixed prompts, a code edit (its answer repeats most of the prompt: prompt lookup's home ground) and a
summary (free prose), greedy, `--max-new-tokens` per row. At batch B a call holds B rows that take the prompts in
turn (batch 8: four of each); batch 1 runs one call per prompt. A first run converts each catalogue model once into
jaxspec's cache (~/.cache/jaxspec/converted), which the "loading" time at the end includes.

Timing: per model and batch size, each strategy runs the workload once untimed: it compiles there, and its
`compile_seconds` (which include the adaptive schedule's one-time step-cost measurement) are the "compile s" column.
Then `--repeats` timed passes, each running every strategy back to back, so a change of load lands on a strategy
and its baseline alike. tok/s is the median over passes of new tokens over the calls' wall seconds; the speedup is
the median of per-pass ratios over plain decoding of the same batch. Compiled loops go to jaxspec's persistent
compilation cache (`JAXSPEC_COMPILATION_CACHE=off` disables it), so a second run shows loading them instead.

Counters (GenerateOutput's, over the calls of the first timed pass): acceptance is accepted / drafted tokens;
tokens/round is what a row commits per verification round (1 for plain decoding); modelled is the speedup the
adaptive schedule's cost model expected for the rounds it ran (`GenerateOutput.modelled_speedup`). A measured speedup
below the modelled one is a cost the model does not hold, and the "rounds" lines say where it is: each strategy's
milliseconds a round (median over the timed passes, prefill excluded) in plain decoding steps, beside what the model
priced those rounds at. Rounds dearer than priced: a cost inside the loop; rounds as priced: the rest of a call.

Prices: the adaptive schedule times each compiled loop on its first call (jaxspec/costs.py) and stores what a round
costs: a verify block of each width, a draft, a drafting round's fixed work. The "prices" lines print them in plain
decoding steps (a round of width 1), as the schedule uses them: on an accelerator a block of a few tokens should
cost about one step, where on a CPU a block of two costs about 1.4. A loop whose prices were stored by an earlier run
is not timed again, and its line says so.

Loop settings: the header names how the loops' run-time branches run (`JAXSPEC_BRANCHES`: jaxspec/inplace.py) and
which verify widths they compile (`JAXSPEC_VERIFY_WIDTHS`: jaxspec/schedule.py, `verify_widths`), both chosen on a
CPU. `--compare-settings` runs the whole check once per setting in SETTINGS (the defaults, XLA conditionals, blocks
of 1 and K + 1 only, both), each in its own process, and prints each strategy's tok/s and speedup side by side: the
A/B an accelerator needs before either default changes there (docs/design.md, 'On a GPU').

Identity: every pass of every strategy is compared, row by row and token for token, with the untimed pass of plain
greedy decoding of the same batch (plain decoding's own passes too: a run-to-run difference is a failure as well).
A difference is printed with its row and first differing token and makes the script exit 1 once everything is
printed. In bfloat16 a verify block can round differently from a one-token forward and flip a near-tied argmax
(README, "What is guaranteed"): a difference late in a row is likely that, one at token 0 a bug. `--dtype float32`
is the strict check (only a tie within float32 rounding could flip); on GPUs and TPUs set
`JAX_DEFAULT_MATMUL_PRECISION=highest` with it, since JAX's default float32 matmul there is TF32 or bfloat16.

Roofline: a plain decoding step must read every weight of the target once (an untied input embedding only one row
per token, MTP layers not at all) and each row's live KV cache (prompt and tokens so far, averaged over the steps;
bytes per cached position from the model's `init_cache`). Those bytes over the step time (the loop's own timing of
its rounds, prefill excluded) are the bandwidth reached, printed as a fraction of (a) the read bandwidth measured
here: a jitted float32 matrix-vector product over a `--bandwidth-mb` matrix, ten calls queued back to back per
timing so that dispatch overlaps the reads, best of five; and (b) the device's nominal peak, from a table keyed by
`jax.devices()[0].device_kind` (n/a for other kinds). jaxspec reads a cache shorter than 2048 positions whole at
batch 1, and one shorter than 1024 at batch 8 (models/layers.py, `key_extents`), so reading past the live context
counts against it here.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from _bench_prompts import CODE_EDITING, SUMMARY

# Nominal HBM bandwidth in TB/s by `jax.devices()[0].device_kind`. JAX calls TPU v5e "TPU v5 lite", v5p "TPU v5"
# and v6e "TPU v6 lite"; the marketing names are keys too.
NOMINAL_TB_S = {
    "NVIDIA H200": 4.8,
    "NVIDIA H100 80GB HBM3": 3.35,  # H100 SXM
    "NVIDIA A100-SXM4-80GB": 2.0, "NVIDIA A100 80GB PCIe": 2.0,
    "TPU v5 lite": 0.82, "TPU v5e": 0.82,
    "TPU v5": 2.76, "TPU v5p": 2.76,
    "TPU v6 lite": 1.64, "TPU v6e": 1.64,
    "TPU v4": 1.2,
}

# Both take about 180 tokens in the catalogue models' chat templates, so the two calls of batch 1 fall in one
# length bucket and share one compiled loop per strategy.
PROMPT_TEXTS = {"code_edit": CODE_EDITING, "summary": SUMMARY}
TINY_PROMPTS = {"code_edit": (12, 4), "summary": (40, 1)}  # (random ids, times repeated): the edit can be copied

# A random Llama with four layers, so that early exit has a layer to stop at; weights large enough (std 0.3) that
# the argmax of its logits is decided by the weights, not by float rounding; a vocabulary small enough that its
# output meets the prompt's ids and prompt lookup drafts. No EOS: every row decodes its whole budget.
TINY_CONFIG = dict(
    model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=128, hidden_size=64, intermediate_size=128,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
    rms_norm_eps=1e-5, rope_theta=10000.0, hidden_act="silu", tie_word_embeddings=False, bos_token_id=1,
    pad_token_id=0,
)
TINY_INIT_STD = 0.3
TINY = "tiny-llama"
TINY_STRATEGIES = ("greedy", "prompt_lookup", "early_exit")

SMOLLM2, CODER_SMALL, CODER = "smollm2-135m", "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"
# Why the rows of jaxspec.STRATEGIES that no model here runs are skipped (others: "no installed model runs it").
UNPLANNED = {
    "mtp_drafter": "needs a Gemma 4 target and its MTP drafter checkpoint; the catalogue has neither",
}
# The drafter checkpoints jaxspec ships for SmolLM2 (jaxspec/assets), run with `assistant_model=`.
SHIPPED_DRAFTER_STRATEGIES = ("dflash", "eagle3")


def accelerator_pip_commands() -> list[str]:
    """The pip commands that bring the accelerator builds of the installed jax version."""
    version = importlib.metadata.version("jax")
    return [f'pip install -U "jax[cuda12]=={version}"  (NVIDIA GPU)', f'pip install -U "jax[tpu]=={version}"  (TPU)']


# ------------------------------------------------------------------------------------------------------------------
# What runs: models, their strategies, and why the others are skipped


@dataclasses.dataclass(frozen=True)
class ModelPlan:
    name: str
    source: str  # what jaxspec.load reads
    strategies: tuple[str, ...]  # rows of jaxspec.STRATEGIES; plain decoding ("greedy") first: the reference
    drafters: tuple[tuple[str, str], ...] = ()  # (strategy, what jaxspec.load reads for its `assistant_model`)


@dataclasses.dataclass(frozen=True)
class Skip:
    model: str
    strategy: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Case:
    """One strategy on one loaded model: its `generate()` keyword arguments and a label for the table."""

    strategy: str
    settings: str
    kwargs: dict[str, Any]


def catalog_plans() -> tuple[list[ModelPlan], list[Skip]]:
    """The catalogue models this machine has, and a skip, with the pip command, for each strategy that lacks one."""
    from jaxspec import assets, catalog

    def missing(*names: str) -> str | None:
        for name in names:
            entry = catalog.get_entry(name)
            try:
                catalog.find_part_files(entry)  # finds the packages without importing or hashing anything
            except FileNotFoundError:
                return f"{name} is not installed: {catalog.install_command(entry.packages)}"
        return None

    plans, skips = [], []
    if reason := missing(SMOLLM2):
        skips += [Skip(SMOLLM2, s, reason)
                  for s in ("greedy", "prompt_lookup", "early_exit", "mtp", *SHIPPED_DRAFTER_STRATEGIES)]
    else:
        strategies, drafters = ["greedy", "prompt_lookup", "early_exit"], []
        asset = catalog.get_entry(SMOLLM2).mtp_asset
        if asset is not None and os.path.exists(os.path.join(assets.asset_folder(asset), assets.MTP_FILE)):
            strategies.append("mtp")
        else:
            skips.append(Skip(SMOLLM2, "mtp", f"its MTP layers (jaxspec/assets/{asset}) are missing from this install"))
        for strategy in SHIPPED_DRAFTER_STRATEGIES:
            name = catalog.shipped_drafter(SMOLLM2, strategy)
            if name is not None and os.path.exists(os.path.join(assets.asset_folder(name), "config.json")):
                strategies.append(strategy)
                drafters.append((strategy, name))
            else:
                reason = f"its drafter (jaxspec/assets/{name}) is missing from this install"
                skips.append(Skip(SMOLLM2, strategy, reason))
        plans.append(ModelPlan(SMOLLM2, SMOLLM2, tuple(strategies), tuple(drafters)))
    for target, strategy, assistant in ((CODER, "speculative", CODER_SMALL), (CODER_SMALL, "universal", SMOLLM2)):
        if reason := missing(target, assistant):
            skips.append(Skip(target, strategy, reason))
        else:
            plans.append(ModelPlan(target, target, ("greedy", strategy), ((strategy, assistant),)))
    return plans, skips


def tiny_plans(folder: str) -> tuple[list[ModelPlan], list[Skip]]:
    skips = [Skip(TINY, "mtp", "the random checkpoint has no MTP layers (catalogue mode runs SmolLM2's)"),
             Skip(TINY, "speculative", "tiny mode loads no assistant model (catalogue mode runs Qwen's)"),
             Skip(TINY, "universal", "tiny mode has no tokenizer (catalogue mode runs Qwen + SmolLM2)")]
    skips += [Skip(TINY, s, "tiny mode loads no drafter checkpoint (catalogue mode runs SmolLM2's shipped one)")
              for s in SHIPPED_DRAFTER_STRATEGIES]
    return [ModelPlan(TINY, folder, TINY_STRATEGIES)], skips


def select(plans: list[ModelPlan], skips: list[Skip], wanted: set[str]) -> tuple[list[ModelPlan], list[Skip]]:
    """The models that run a `wanted` strategy, each with plain decoding too (every speedup's baseline and the
    identity reference), and a skip for each wanted row of the strategy table that no plan runs or skips already."""
    import jaxspec

    plans = [dataclasses.replace(p, strategies=tuple(s for s in p.strategies if s == "greedy" or s in wanted))
             for p in plans if wanted & set(p.strategies)]
    skips = [s for s in skips if s.strategy in wanted]
    covered = {s for p in plans for s in p.strategies} | {s.strategy for s in skips}
    skips += [Skip("-", row.name, UNPLANNED.get(row.name, "no installed model runs it"))
              for row in jaxspec.STRATEGIES if row.name in wanted and row.name not in covered]
    return plans, skips


def case_for(strategy: str, model, plan: ModelPlan, tiny: bool) -> Case:
    """The `generate()` arguments of `strategy` on the loaded target: transformers' and jaxspec's defaults, except
    what selects the strategy."""
    # The tiny run is compile-bound: three drafts compile verify widths 1, 2 and 4 instead of up to 8 and 11.
    drafts = 3 if tiny else None
    if strategy == "greedy":
        return Case(strategy, "plain decoding", {})
    if strategy == "prompt_lookup":
        return Case(strategy, f"K={drafts or 10}", {"prompt_lookup_num_tokens": drafts or 10})
    if strategy == "early_exit":  # LayerSkip: the first half of the layers and the LM head draft
        layers = model.config.num_layers
        kwargs = {"assistant_early_exit": max(1, layers // 2)}
        if tiny:  # a random model's drafts are nearly flat: the default 0.4 confidence stop would withhold them all
            kwargs |= {"assistant_confidence_threshold": 0.0, "num_assistant_tokens": drafts}
        return Case(strategy, f"E={kwargs['assistant_early_exit']} of {layers}" + (f" K={drafts}" if tiny else ""),
                    kwargs)
    if strategy == "mtp":
        return Case(strategy, f"{model.config.num_mtp_layers} shipped layers", {"use_mtp": True})
    if strategy in ("speculative", "universal", *SHIPPED_DRAFTER_STRATEGIES):
        return Case(strategy, f"assistant {dict(plan.drafters)[strategy]}", {})  # run_case adds the loaded drafter
    raise ValueError(f"no case for strategy {strategy!r}")


# ------------------------------------------------------------------------------------------------------------------
# The tiny checkpoint and the prompts


def write_tiny_llama(folder: str, seed: int = 0) -> str:
    """A random Llama in Hugging Face's layout (config.json + model.safetensors), written with numpy alone."""
    from safetensors.numpy import save_file

    c = TINY_CONFIG
    d, f, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    head_dim = d // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * head_dim, c["num_key_value_heads"] * head_dim
    rng = np.random.default_rng(seed)

    def weight(*shape):
        return (TINY_INIT_STD * rng.standard_normal(shape)).astype(np.float32)

    def norm():
        return np.ones(d, np.float32)

    tensors = {"model.embed_tokens.weight": weight(v, d), "model.norm.weight": norm(), "lm_head.weight": weight(v, d)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": weight(q, d), p + "self_attn.k_proj.weight": weight(kv, d),
                    p + "self_attn.v_proj.weight": weight(kv, d), p + "self_attn.o_proj.weight": weight(d, q),
                    p + "mlp.gate_proj.weight": weight(f, d), p + "mlp.up_proj.weight": weight(f, d),
                    p + "mlp.down_proj.weight": weight(d, f), p + "input_layernorm.weight": norm(),
                    p + "post_attention_layernorm.weight": norm()}
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w", encoding="utf-8") as handle:
        json.dump(c, handle, indent=1)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    return folder


def tiny_prompts(vocab_size: int, seed: int = 1) -> dict[str, np.ndarray]:
    """Token-id prompts: the code edit repeats a run of ids (there is something to copy), the summary does not."""
    rng = np.random.default_rng(seed)
    return {name: np.tile(rng.integers(3, vocab_size, length), times).astype(np.int32)
            for name, (length, times) in TINY_PROMPTS.items()}


def text_prompts(tokenizer) -> dict[str, np.ndarray]:
    """The fixed prompts as user messages in the model's chat template."""
    return {name: np.asarray(tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                           add_generation_prompt=True, return_dict=False), np.int32)
            for name, text in PROMPT_TEXTS.items()}


def batch_calls(names: Sequence[str], batch: int) -> list[tuple[str, ...]]:
    """The rows of each call at batch size `batch`: the prompts in turn, in as few full calls as hold each once."""
    calls = -(-len(names) // batch)
    rows = [names[i % len(names)] for i in range(calls * batch)]
    return [tuple(rows[i * batch:(i + 1) * batch]) for i in range(calls)]


# ------------------------------------------------------------------------------------------------------------------
# Running and comparing


@dataclasses.dataclass
class Run:
    """One pass of one strategy over one batch size's calls."""

    calls: list[tuple[str, ...]]  # the prompt name of every row, per call
    outputs: list[Any]  # the calls' GenerateOutputs
    seconds: float  # wall seconds of the calls, compile excluded

    @property
    def names(self) -> list[str]:
        """Every row's prompt name, calls in order."""
        return [name for names in self.calls for name in names]

    @property
    def rows(self) -> list[np.ndarray]:
        """Every row's new tokens, calls in order."""
        return [out.new_tokens(row) for names, out in zip(self.calls, self.outputs) for row in range(len(names))]

    @property
    def compile_seconds(self) -> float:
        return sum(out.compile_seconds for out in self.outputs)

    @property
    def tokens_per_second(self) -> float:
        return sum(int(out.num_new_tokens.sum()) for out in self.outputs) / self.seconds

    @property
    def acceptance(self) -> float:
        drafted = sum(int(out.drafted.sum()) for out in self.outputs)
        return sum(int(out.accepted.sum()) for out in self.outputs) / drafted if drafted else math.nan

    @property
    def round_milliseconds(self) -> float:
        """Milliseconds a round of the calls' loops (plain decoding: a step), prefill excluded."""
        rounds = sum(out.rounds for out in self.outputs)
        seconds = sum(out.decode_seconds - out.prefill_seconds for out in self.outputs)
        return seconds / rounds * 1e3 if rounds else math.nan

    @property
    def priced_steps_per_round(self) -> float:
        """What the adaptive schedule's cost model says a round of these calls cost, in its unit (the loop's round
        of width 1); nan where nothing priced the rounds."""
        priced = sum(out.priced_steps for out in self.outputs)
        return priced / sum(out.rounds for out in self.outputs) if priced > 0 else math.nan

    @property
    def modelled_speedup(self) -> float:
        """The speedup the cost model expected for these rounds (`GenerateOutput.modelled_speedup`, over the calls):
        where it is above the measured one, decoding pays a cost the model does not hold."""
        priced = sum(out.priced_steps for out in self.outputs)
        steps = sum(int(out.num_new_tokens.max()) - 1 for out in self.outputs)
        return steps / priced if priced > 0 else math.nan

    @property
    def tokens_per_round(self) -> float:
        """Tokens a row commits per verification round (the prefill commits each row's first token)."""
        row_rounds = sum(int(out.accepted_hist.sum()) for out in self.outputs)
        committed = sum(int(out.num_new_tokens.sum()) - len(out.num_new_tokens) for out in self.outputs)
        return committed / row_rounds if row_rounds else math.nan


def run_case(model, assistant, case: Case, calls: list[tuple[str, ...]], prompts: dict[str, np.ndarray],
             max_new_tokens: int) -> Run:
    """Every call of the workload once; the wall time of each `generate` call, host work included, less its
    compile time (none after the warm-up)."""
    import jaxspec

    kwargs = case.kwargs | ({"assistant_model": assistant} if assistant is not None else {})
    outputs, seconds = [], 0.0
    for names in calls:
        start = time.perf_counter()
        out = jaxspec.generate(model, [prompts[name] for name in names], max_new_tokens=max_new_tokens,
                               do_sample=False, **kwargs)
        seconds += time.perf_counter() - start - out.compile_seconds
        outputs.append(out)
    return Run(calls, outputs, seconds)


@dataclasses.dataclass(frozen=True)
class Mismatch:
    row: int
    position: int  # the first differing new token (the shorter row's length when one row extends the other)
    expected: int | None  # None: that row ended there
    got: int | None
    lengths: tuple[int, int]

    def __str__(self) -> str:
        return (f"row {self.row} differs first at new token {self.position} (plain {self.expected}, this "
                f"{self.got}; {self.lengths[0]} and {self.lengths[1]} new tokens)")


def first_mismatch(expected: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> Mismatch | None:
    """The first row whose tokens differ from the reference row's, token for token (a row cut shorter or longer
    differs too), or None when every row is identical."""
    if len(expected) != len(got):
        raise ValueError(f"{len(got)} rows to compare with {len(expected)} reference rows")
    for row, (a, b) in enumerate(zip(expected, got)):
        a, b = np.asarray(a), np.asarray(b)
        common = min(len(a), len(b))
        differ = np.flatnonzero(a[:common] != b[:common])
        if differ.size or len(a) != len(b):
            at = int(differ[0]) if differ.size else common
            return Mismatch(row, at, int(a[at]) if at < len(a) else None, int(b[at]) if at < len(b) else None,
                            (len(a), len(b)))
    return None


# ------------------------------------------------------------------------------------------------------------------
# Bytes and bandwidth


def nbytes(x) -> int:
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


@dataclasses.dataclass(frozen=True)
class StepBytes:
    """What a plain decoding step of one model must read from memory."""

    weights: int
    kv_per_position: int  # one cached position of one row, every layer

    @classmethod
    def of(cls, model) -> StepBytes:
        """Weights: the target's params, less the MTP layers (they only draft) and an untied input embedding, of
        which a step reads one row per token. KV: the model's own cache, shaped without allocating it."""
        import jax

        from jaxspec.costs import weight_bytes

        weights = weight_bytes(model.module)  # each array once, less the MTP layers
        if not getattr(model.config, "tie_word_embeddings", True):
            weights -= nbytes(model.module.embed[...])
        cache = jax.eval_shape(lambda: model.module.init_cache(1, 1))
        return cls(weights, sum(nbytes(x) for x in jax.tree.leaves(cache)))

    def per_step(self, prompt_lengths: Sequence[int], new_tokens: Sequence[int]) -> float:
        """Bytes a step of one call reads, averaged over its steps: the weights, and each row's live cache (its
        prompt and, on average, half its new tokens)."""
        return self.weights + self.kv_per_position * sum(p + n / 2 for p, n in zip(prompt_lengths, new_tokens))


def reached_bandwidth(step_bytes: StepBytes, run: Run, prompts: dict[str, np.ndarray]) -> tuple[float, float]:
    """(bytes per step, bytes per second) of a plain decoding run, over its rounds: one target forward each, timed
    by the loop itself, the prefill excluded."""
    read = seconds = steps = 0.0
    for names, out in zip(run.calls, run.outputs):
        read += step_bytes.per_step([len(prompts[name]) for name in names], out.num_new_tokens.tolist()) * out.rounds
        seconds += out.decode_seconds - out.prefill_seconds
        steps += out.rounds
    return read / steps, read / seconds


def measure_bandwidth(megabytes: int, queued: int = 10, trials: int = 5) -> float:
    """Bytes per second at which the device reads a float32 matrix in a matrix-vector product, as decoding reads
    its weights (the vector and the result are tiny). `queued` calls are dispatched before waiting, so the host's
    dispatch overlaps the device's reads; the best of `trials` timings."""
    import jax
    import jax.numpy as jnp

    columns = 8192
    matrix = jnp.ones((max(1, megabytes * 2**20 // (4 * columns)), columns), jnp.float32)
    vector = jnp.ones((columns,), jnp.float32)
    matvec = jax.jit(jnp.dot)
    jax.block_until_ready(matvec(matrix, vector))
    best = math.inf
    for _ in range(trials):
        start = time.perf_counter()
        jax.block_until_ready([matvec(matrix, vector) for _ in range(queued)])
        best = min(best, (time.perf_counter() - start) / queued)
    return matrix.nbytes / best


def nominal_bandwidth(device_kind: str) -> float | None:
    """The device's nominal peak in bytes per second; None for a kind the table does not know."""
    return NOMINAL_TB_S[device_kind] * 1e12 if device_kind in NOMINAL_TB_S else None


# ------------------------------------------------------------------------------------------------------------------
# One model: warm-up, timed passes, the rows of the table


@dataclasses.dataclass
class Row:
    """A strategy on a model at a batch size."""

    model: str
    case: Case
    batch: int
    warmup: Run
    passes: list[Run]
    speedup: float
    mismatch: Mismatch | None  # the first, over the warm-up and every timed pass

    @property
    def tokens_per_second(self) -> float:
        return statistics.median(run.tokens_per_second for run in self.passes)


@dataclasses.dataclass
class ModelResult:
    rows: list[Row]
    notes: list[str]  # the roofline and batch-invariance lines
    load_seconds: float


def measure_model(plan: ModelPlan, args, bandwidth: dict[str, float | None]) -> ModelResult:
    """Load the target (and its drafters), then measure its strategies at every batch size."""
    import jaxspec

    started = time.perf_counter()
    model = jaxspec.load(plan.source, dtype=args.dtype)
    drafters = {strategy: jaxspec.load(source, dtype=args.dtype) for strategy, source in plan.drafters}
    load_seconds = time.perf_counter() - started
    cases = [case_for(strategy, model, plan, args.tiny) for strategy in plan.strategies]
    prompts = tiny_prompts(model.config.vocab_size) if args.tiny else text_prompts(model.tokenizer)
    log(f"{plan.name}: loaded in {load_seconds:.1f} s; prompts of {', '.join(str(len(p)) for p in prompts.values())} "
        "tokens")

    def run(case: Case, calls: list[tuple[str, ...]]) -> Run:
        return run_case(model, drafters.get(case.strategy), case, calls, prompts, args.max_new_tokens)

    step_bytes = StepBytes.of(model)
    rows, notes = [], []
    for batch in args.batch_sizes:
        batch_rows, price_notes = measure_batch(plan.name, cases, batch_calls(list(prompts), batch), run,
                                                args.repeats)
        plain = batch_rows[0]
        batch_notes = [*price_notes, roofline_line(plan.name, batch, step_bytes, plain.passes, prompts, bandwidth)]
        if rows:
            batch_notes.append(batch_invariance_line(plan.name, rows[0], plain))
        log("\n".join([table(batch_rows), *batch_notes]))  # what a run cut off by a time limit has measured so far
        notes += batch_notes
        rows += batch_rows
    return ModelResult(rows, notes, load_seconds)


def measure_batch(model: str, cases: list[Case], calls: list[tuple[str, ...]], run,
                  repeats: int) -> tuple[list[Row], list[str]]:
    """Every case (plain decoding first) over one batch size's calls: an untimed pass each, then `repeats` passes
    that run the cases back to back, so a change of the machine's load lands on a case and its baseline alike.
    Returns the rows and, per drafting case, the line of the step prices its first call timed."""
    from jaxspec import costs

    batch = len(calls[0])
    warmups, price_notes = {}, []
    for case in cases:
        before = costs.read_cache()
        warmups[case.strategy] = run(case, calls)
        log(f"  batch {batch} {case.strategy}: compiled in {warmups[case.strategy].compile_seconds:.1f} s")
        if case.strategy != "greedy":
            price_notes.append(prices_line(model, batch, case.strategy, before, costs.read_cache()))
    passes: dict[str, list[Run]] = {case.strategy: [] for case in cases}
    for _ in range(repeats):
        for case in cases:
            passes[case.strategy].append(run(case, calls))
    plain = warmups[cases[0].strategy]
    rows = []
    for case in cases:
        runs = [warmups[case.strategy], *passes[case.strategy]]
        mismatch = next((m for r in runs if (m := first_mismatch(plain.rows, r.rows)) is not None), None)
        speedup = statistics.median(mine.tokens_per_second / base.tokens_per_second
                                    for mine, base in zip(passes[case.strategy], passes[cases[0].strategy]))
        rows.append(Row(model, case, batch, runs[0], runs[1:], speedup, mismatch))
    plain_ms = statistics.median(run.round_milliseconds for run in passes[cases[0].strategy])
    price_notes += [rounds_line(model, row, plain_ms) for row in rows[1:]]
    return rows, price_notes


def rounds_line(model: str, row: Row, plain_ms: float) -> str:
    """A strategy's rounds as measured (median over the timed passes) against what the cost model priced them at:
    the figure that says which cost a speedup below the modelled one comes from, the rounds or the rest of a call
    (prefill, dispatch)."""
    ms = statistics.median(run.round_milliseconds for run in row.passes)
    priced = row.passes[0].priced_steps_per_round
    priced_text = "not priced" if math.isnan(priced) else f"{priced:.2f} priced (in the loop's rounds of width 1)"
    return (f"rounds {model} batch {row.batch} {row.case.strategy}: {ms:.2f} ms a round, {ms / plain_ms:.2f} plain "
            f"steps of {plain_ms:.2f} ms measured, {priced_text}; {row.passes[0].tokens_per_round:.2f} tokens a round")


def prices_line(model: str, batch: int, strategy: str, before: dict[str, float], after: dict[str, float]) -> str:
    """The prices a strategy's first call timed (the entries it added to the step-cost file), in plain steps. Keys
    end in `|verify|W`, `|draft` or `|round` after the loop's prefix (costs._loop_key_prefix)."""
    label = f"prices {model} batch {batch} {strategy}"
    added = {key: ms for key, ms in after.items() if key not in before}
    verify = {int(key.rsplit("|", 1)[1]): ms for key, ms in added.items() if key.rsplit("|", 2)[1] == "verify"}
    if 1 not in verify:
        return f"{label}: none timed in this run (stored by an earlier one, or this loop is not priced)"
    step = verify[1]
    widths = ", ".join(f"{w}: {ms / step:.2f}" for w, ms in sorted(verify.items()) if w > 1)
    line = f"{label}: a plain step {step:.2f} ms; verify width {widths} steps"
    parts = {key.rsplit("|", 1)[1]: ms for key, ms in added.items() if key.rsplit("|", 1)[1] in ("draft", "round")}
    if parts:
        line += (f"; a draft {parts.get('draft', 0.0) / step:.2f}, a drafting round's fixed work "
                 f"{parts.get('round', 0.0) / step:.2f} steps")
    return line


def batch_invariance_line(model: str, first: Row, other: Row) -> str:
    """Whether plain decoding's rows at another batch size equal those of the first, prompt by prompt: a row of a
    batch should decode as its prompt does alone (README). Informational: in bfloat16 a device's kernels may round
    differently at another batch size, which is not what the table's check is about."""
    reference = dict(zip(first.warmup.names, first.warmup.rows))
    same = first_mismatch([reference[name] for name in other.warmup.names], other.warmup.rows) is None
    return (f"batch invariance {model}: plain greedy rows at batch {other.batch} equal batch {first.batch}'s: {same} "
            "(informational)")


def roofline_line(model: str, batch: int, step_bytes: StepBytes, passes: list[Run], prompts: dict[str, np.ndarray],
                  bandwidth: dict[str, float | None]) -> str:
    """Plain decoding's bytes per step over its step time (median over passes), against both bandwidths."""
    figures = [reached_bandwidth(step_bytes, run, prompts) for run in passes]
    per_step = figures[0][0]
    reached = statistics.median(rate for _, rate in figures)

    def fraction(peak: float | None, label: str) -> str:
        return f"{label} n/a" if not peak else f"{reached / peak:.1%} of {label} {peak / 1e9:.0f} GB/s"

    return (f"roofline {model} batch {batch}: {per_step / 1e6:.1f} MB/step (weights {step_bytes.weights / 1e6:.1f} "
            f"MB + live KV) in {per_step / reached * 1e3:.2f} ms/step = {reached / 1e9:.1f} GB/s: "
            f"{fraction(bandwidth['measured'], 'measured')}, {fraction(bandwidth['nominal'], 'nominal')}")


# ------------------------------------------------------------------------------------------------------------------
# Report


COLUMNS = ("model", "strategy", "settings", "batch", "tok/s", "speedup", "modelled", "compile s", "acceptance",
           "tokens/round", "identical")
ALIGN = ("---", "---", "---", "---:", "---:", "---:", "---:", "---:", "---:", "---:", "---")


def table(rows: list[Row]) -> str:
    """The markdown table: one line per (model, strategy, batch size)."""
    def figure(value: float, spec: str, unit: str = "") -> str:
        return "-" if math.isnan(value) else format(value, spec) + unit

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join(ALIGN) + "|"]
    for r in rows:
        cells = (r.model, r.case.strategy, r.case.settings, str(r.batch), figure(r.tokens_per_second, ".1f"),
                 f"{r.speedup:.2f}x", figure(r.passes[0].modelled_speedup, ".2f", "x"),
                 f"{r.warmup.compile_seconds:.1f}", figure(r.passes[0].acceptance, ".3f"),
                 figure(r.passes[0].tokens_per_round, ".2f"), str(r.mismatch is None))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(args, bandwidth: dict[str, float | None]) -> list[str]:
    import jax

    from jaxspec import inplace, schedule

    count = jax.device_count()
    nominal = f"{bandwidth['nominal'] / 1e9:.0f} GB/s" if bandwidth["nominal"] else "n/a for this device kind"
    title = (f"# jaxspec device check: {jax.devices()[0].device_kind} ({jax.default_backend()}; {count} device"
             f"{'s, one used' if count > 1 else ''}), jax {jax.__version__}")
    settings = (f"{args.dtype}, greedy, {args.max_new_tokens} new tokens per row, "
                f"{'token-id' if args.tiny else 'chat'} prompts {' and '.join(PROMPT_TEXTS)} taken in turn by the "
                f"rows; median of {args.repeats} timed pass{'es' if args.repeats > 1 else ''} after a warm-up; "
                f"run-time branches: {inplace.MODE} (JAXSPEC_BRANCHES); verify widths: {schedule.WIDTH_RULE} "
                f"(JAXSPEC_VERIFY_WIDTHS). Read "
                f"bandwidth measured {bandwidth['measured'] / 1e9:.1f} GB/s ({args.bandwidth_mb} MB float32 "
                f"matrix-vector product), nominal {nominal}.")
    return [title, "", settings, ""]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    import jaxspec

    names = [row.name for row in jaxspec.STRATEGIES]
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="accelerator jax for the installed version: " + "; ".join(accelerator_pip_commands()))
    parser.add_argument("--tiny", action="store_true",
                        help="a random 4-layer Llama written to a temporary folder, token-id prompts: no catalogue "
                             "package, no tokenizer, no torch (how CI runs this script on CPU)")
    parser.add_argument("--dtype", default=None, help="parameter dtype (default: bfloat16; float32 with --tiny)")
    parser.add_argument("--batch-sizes", default="1,8", help="comma-separated batch sizes (default: 1,8)")
    parser.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per row (default: 128)")
    parser.add_argument("--repeats", type=int, default=3, help="timed passes after the warm-up (default: 3)")
    parser.add_argument("--strategies", default=",".join(names),
                        help="comma-separated rows of jaxspec.STRATEGIES (default: all); a model that runs one runs "
                             "plain decoding too")
    parser.add_argument("--bandwidth-mb", type=int, default=None,
                        help="matrix size of the bandwidth measurement (default: 2048 on accelerators, 256 on CPU)")
    parser.add_argument("--compare-settings", action="store_true",
                        help="run the check once per loop setting an accelerator may want (SETTINGS: run-time "
                             "branches, verify widths), each in its own process, and print their figures side by side")
    args = parser.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    try:
        args.batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b]
    except ValueError:
        parser.error(f"--batch-sizes takes comma-separated integers, got {args.batch_sizes!r}")
    if not args.batch_sizes or min(args.batch_sizes) < 1:
        parser.error("--batch-sizes needs at least one size, each at least 1")
    if args.repeats < 1 or args.max_new_tokens < 1:
        parser.error("--repeats and --max-new-tokens must be at least 1")
    args.strategies = {s for s in args.strategies.split(",") if s}
    if unknown := args.strategies - set(names):
        parser.error(f"unknown strategies {sorted(unknown)}; the rows are {', '.join(names)}")
    return args


# The loop settings a device may want other than a CPU's (docs/design.md, 'On a GPU'), as environment variables read
# when jaxspec is imported: `--compare-settings` runs the whole check once under each.
SETTINGS = (("default", {}), ("lax branches", {"JAXSPEC_BRANCHES": "lax"}),
            ("widths 1, K+1", {"JAXSPEC_VERIFY_WIDTHS": "ends"}),
            ("both", {"JAXSPEC_BRANCHES": "lax", "JAXSPEC_VERIFY_WIDTHS": "ends"}))


def table_cells(stdout: str) -> dict[tuple[str, str, str], dict[str, str]]:
    """The rows of a check's printed table, by (model, strategy, batch)."""
    rows = {}
    for line in stdout.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == len(COLUMNS) and cells[0] != COLUMNS[0]:
            row = dict(zip(COLUMNS, cells))
            rows[row["model"], row["strategy"], row["batch"]] = row
    return rows


def settings_table(runs: dict[str, dict[tuple[str, str, str], dict[str, str]]]) -> str:
    """One line per (model, strategy, batch) that any run measured: tok/s and speedup over plain decoding under each
    setting; `≠` marks a run whose tokens differed from plain greedy decoding's."""
    keys = list(dict.fromkeys(key for rows in runs.values() for key in rows))
    lines = ["| model | strategy | batch | " + " | ".join(runs) + " |", "|---|---|---:|" + "---:|" * len(runs)]
    for key in keys:
        cells = []
        for rows in runs.values():
            row = rows.get(key)
            differs = row is not None and row["identical"] != "True"
            cells.append("-" if row is None else f"{row['tok/s']} ({row['speedup']}){' ≠' if differs else ''}")
        lines.append(f"| {' | '.join(key)} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compare_settings(argv: list[str]) -> int:
    """This check once per entry of SETTINGS, each in its own process with the same arguments (their progress goes
    to stderr as it happens), then one table of tok/s and speedup under each; the worst exit status."""
    runs, status = {}, 0
    for name, environment in SETTINGS:
        log(f"== {name}: {' '.join(f'{k}={v}' for k, v in environment.items()) or 'no variable set'}")
        done = subprocess.run([sys.executable, os.path.abspath(__file__), *argv], env=os.environ | environment,
                              stdout=subprocess.PIPE, text=True, check=False)
        runs[name] = table_cells(done.stdout)
        status = max(status, done.returncode)
    print("# jaxspec device check: loop settings side by side (tok/s, speedup over plain decoding of the same run)\n")
    print(settings_table(runs))
    return status


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.compare_settings:
        return compare_settings([a for a in (sys.argv[1:] if argv is None else argv) if a != "--compare-settings"])
    import jax

    import jaxspec

    started = time.perf_counter()
    jaxspec.enable_compilation_cache()
    on_cpu = jax.default_backend() == "cpu"
    if on_cpu and not args.tiny:
        log("note: jax sees no accelerator; " + "; ".join(accelerator_pip_commands()))
    args.bandwidth_mb = args.bandwidth_mb or (256 if on_cpu else 2048)
    bandwidth = {"measured": measure_bandwidth(args.bandwidth_mb),
                 "nominal": nominal_bandwidth(jax.devices()[0].device_kind)}
    results = []
    with tempfile.TemporaryDirectory(prefix="jaxspec-device-check-") as folder:
        plans, skips = tiny_plans(write_tiny_llama(os.path.join(folder, TINY))) if args.tiny else catalog_plans()
        plans, skips = select(plans, skips, args.strategies)
        for plan in plans:
            results.append(measure_model(plan, args, bandwidth))
            gc.collect()  # this model's weights (module graphs hold reference cycles) go before the next loads
    rows = [row for result in results for row in result.rows]
    print("\n".join(header(args, bandwidth)))
    print(table(rows) if rows else "(nothing ran: no catalogue model is installed; see the skips below, or --tiny)")
    print("\nidentical: every pass's tokens equal plain greedy decoding's of the same batch, row by row (plain "
          "decoding: every pass equals its first)\n")
    for line in [note for result in results for note in result.notes]:
        print(line)
    for skip in skips:
        print(f"skipped {skip.strategy} ({skip.model}): {skip.reason}")
    mismatches = [row for row in rows if row.mismatch is not None]
    for row in mismatches:
        print(f"MISMATCH {row.model} {row.case.strategy} batch {row.batch}: {row.mismatch}")
    load = sum(result.load_seconds for result in results)
    compiled = sum(row.warmup.compile_seconds for row in rows)
    verdict = (f"{len(mismatches)} row(s) differ from plain greedy decoding" if mismatches
               else "every greedy output equals plain greedy decoding token for token")
    print(f"\nfinished in {time.perf_counter() - started:.0f} s (loading {load:.0f} s, compiling {compiled:.0f} s); "
          f"{verdict}")
    if not rows:
        return 2
    return 1 if mismatches else 0


if __name__ == "__main__":
    sys.exit(main())
