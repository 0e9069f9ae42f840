"""The report of benchmarks/bench.py: the rows of its tables, the markdown, the PNG chart and the JSON figures.

`markdown` prints the tables; `record_rows` gives every figure of them as labelled rows for the JSON record
(benchmarks/_record.py), and benchmarks/render.py rebuilds the same tables from those rows.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import statistics
from typing import Any

import numpy as np

from _bench_hf import versions
from _bench_plans import Plan
from _bench_timing import Measurement, paired_speedup, ratio


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
class PromptRow:
    """One cell of the per-prompt table: a strategy's paired speedup over its own library's greedy on one prompt."""

    model: str
    strategy: str
    prompt: str
    jaxspec_speedup_over_greedy: float  # median over passes
    jaxspec_range: tuple[float, float]  # min-max over passes
    hf_speedup_over_greedy: float
    jaxspec_acceptance_rate: float
    hf_acceptance_rate: float


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


def ranged(value: float, bounds: tuple[float, float]) -> str:
    """A median with its range beside it, or '–' alone where it does not apply."""
    return f"{fmt(value)} {spread(bounds)}".rstrip()


def times(value: float) -> str:
    return "–" if math.isnan(value) else f"{value:.2f}x"


def percent(part: float, whole: float) -> str:
    return "" if math.isnan(part) else f" ({100 * part / whole:.0f}%)"


def pair(a, b, spec: str = ".2f") -> str:
    return f"{fmt(a, spec)} / {fmt(b, spec)}"


def per_prompt_rows(model: str, jx: dict[str, Measurement], hf: dict[str, Measurement]) -> list[PromptRow]:
    """Each strategy's speedup over its own library's greedy, per prompt (jaxspec with the range of its paired
    per-pass ratios, and transformers), and the acceptance per prompt."""
    if "greedy" not in jx:
        return []
    rows = []
    for strategy, m in jx.items():
        if strategy == "greedy":
            continue
        theirs = hf.get(strategy)
        accept, accept_hf = m.acceptance_by_prompt(), theirs.acceptance_by_prompt() if theirs else {}
        for p in accept:
            paired = m.speedups_over(jx["greedy"], p)
            rows.append(PromptRow(model, strategy, p, statistics.median(paired), (min(paired), max(paired)),
                                  paired_speedup(theirs, hf.get("greedy"), p), accept[p],
                                  accept_hf.get(p, math.nan)))
    return rows


def per_prompt_lines(rows: list[PromptRow]) -> list[str]:
    """Table lines of `per_prompt_rows`: one per (model, strategy), a cell per prompt."""
    lines = []
    for (model, strategy), cells in _grouped(rows, lambda r: (r.model, r.strategy)).items():
        lines.append(f"| {model} | {strategy} | " + " | ".join(
            f"{r.jaxspec_speedup_over_greedy:.2f} {spread(r.jaxspec_range)} / {fmt(r.hf_speedup_over_greedy)} "
            f"(acc. {fmt(r.jaxspec_acceptance_rate)} / {fmt(r.hf_acceptance_rate)})" for r in cells) + " |")
    return lines


def _grouped(items, key) -> dict:
    groups: dict = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def markdown(rows: list[Row], rooflines: list[Roofline], header: list[str], notes: list[str],
             per_prompt: list[PromptRow] = (), prompts: list[str] = ()) -> str:
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
            f"| {r.model} | {r.strategy} | {r.settings} | {ranged(r.jaxspec_tokens_per_second, r.jaxspec_range)} "
            f"| {ranged(r.hf_tokens_per_second, r.hf_range)} | {times(r.jaxspec_over_hf)} "
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
        lines += per_prompt_lines(list(per_prompt))
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

    return {
        "python": platform.python_version(), "platform": platform.platform(), "cpu_count": os.cpu_count(),
        "pinned_cores": cores, "xla_flags": os.environ.get("XLA_FLAGS"),
        "jax": jax.__version__, "jax_backend": jax.default_backend(), "flax": flax.__version__,
        "dtype": "float32", "batch": 1, "read_bandwidth_gb_s": bandwidth,
    } | versions()  # transformers, torch, torch_threads


def measurement_record(m: Measurement) -> dict[str, Any]:
    """Every call as measured, plus the per-pass rates behind the median (their spread shows the noise)."""
    return dataclasses.asdict(m) | {"tokens_per_second": m.tokens_per_second, "tokens_per_second_per_pass": m.per_pass}


def roofline(name: str, parameters: int, bytes_per_token: int, jx: dict[str, Measurement],
             hf: dict[str, Measurement], bandwidth: float) -> Roofline:
    greedy = {lib: m["greedy"].tokens_per_second if "greedy" in m else math.nan
              for lib, m in (("jaxspec", jx), ("hf", hf))}
    return Roofline(name, parameters, bytes_per_token, bandwidth, bandwidth * 1e9 / bytes_per_token,
                    greedy["jaxspec"], greedy["hf"])


# ------------------------------------------------------------------------------------------------------------------
# The JSON record's rows, and the tables again from them (benchmarks/render.py)

TABLES = {"strategies": Row, "per prompt": PromptRow, "roofline": Roofline}


def record_rows(rows: list[Row], per_prompt: list[PromptRow], rooflines: list[Roofline]) -> list[dict[str, Any]]:
    """Every figure of the three tables, one dict per table row, labelled by its table ("strategies", "per prompt",
    "roofline") and model. NaN (a figure that does not apply) becomes null when the record is written."""
    return [{"table": table} | dataclasses.asdict(row)
            for table, items in (("strategies", rows), ("per prompt", per_prompt), ("roofline", rooflines))
            for row in items]


def from_record_rows(rows: list[dict[str, Any]]) -> tuple[list[Row], list[PromptRow], list[Roofline]]:
    """The inverse of `record_rows` (null back to NaN, ranges back to tuples)."""
    out: dict[str, list] = {table: [] for table in TABLES}
    for row in rows:
        cls = TABLES[row["table"]]
        values = {}
        for field in dataclasses.fields(cls):
            value = row.get(field.name)
            if field.name.endswith("_range"):
                value = tuple(math.nan if v is None else v for v in (value or (None, None)))
            elif value is None and "float" in str(field.type) and "None" not in str(field.type):
                value = math.nan
            values[field.name] = value
        out[row["table"]].append(cls(**values))
    return out["strategies"], out["per prompt"], out["roofline"]
