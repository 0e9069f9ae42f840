"""Render the benchmark records into the docs: docs/benchmarks.md in full, and the README's summary tables.

    python benchmarks/render.py [--results benchmarks/results] [--docs docs/benchmarks.md] [--readme README.md]
    python benchmarks/render.py --check     # exit 1 if either file is not what the records render to

Reads every `{results}/*.json` (the records benchmarks/_record.py writes) and keeps the newest record per
(benchmark, model, mode) (mode: bench_mtp's timed, acceptance-only or random-deepseek runs). docs/benchmarks.md gets
one section per benchmark and model, each headed by the date, commit, machine, read bandwidth and command of the run
that produced it; bench.py's tables are rebuilt by its own report code (benchmarks/_bench_report.py), so they read
as the run printed them. In the README, the text between the lines `<!-- results:begin -->` and `<!-- results:end
-->` becomes a compact table of bench.py's newest record for the main job's model (speedup over plain greedy and
acceptance per strategy), the command under it; `--readme ''` leaves the README alone. Prose carries no figure that
no record holds: rerun a benchmark, then this, and commit the record with the rendered files.

The output depends on the records alone (no clock), so `--check` is stable. Run it as a script: it imports its
siblings in benchmarks/, which Python finds because it puts the script's folder on sys.path.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import shlex
import sys
from typing import Any

from _record import REPO, RESULTS

BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MAIN = "bench"  # the benchmark whose records feed the README
README_MODEL = "smollm2-135m"  # the model of the README's main job (scripts/generate.py's default); the rest: docs
DOCS = os.path.join(REPO, "docs", "benchmarks.md")
README = os.path.join(REPO, "README.md")


# ------------------------------------------------------------------------------------------------------------------
# Records


def load_records(folder: str) -> list[dict[str, Any]]:
    records = []
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        with open(path, encoding="utf-8") as handle:
            record = json.load(handle)
        record["_file"] = os.path.relpath(path, REPO)
        records.append(record)
    return records


def newest(records: list[dict[str, Any]]) -> dict[tuple[str, str, str | None], dict[str, Any]]:
    """The newest record per (benchmark, model, mode); a record of several models counts for each of them."""
    chosen: dict[tuple[str, str, str | None], dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: (r["date"], r["_file"])):
        for model in record["models"]:
            chosen[record["benchmark"], model, record.get("mode")] = record
    order = lambda key: (key[0] != MAIN, key[0], key[1], key[2] or "")  # noqa: E731 (bench.py first)
    return {key: chosen[key] for key in sorted(chosen, key=order)}


def rows_of(record: dict[str, Any], model: str) -> list[dict[str, Any]]:
    return [row for row in record["rows"] if row.get("model", model) == model]


# ------------------------------------------------------------------------------------------------------------------
# Formatting


def cell(value: Any) -> str:
    """A figure as a table shows it: 3 significant digits or so, '–' where it does not apply."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        magnitude = abs(value)
        return f"{value:.1f}" if magnitude >= 100 else f"{value:.2f}" if magnitude >= 1 else f"{value:.3f}"
    if isinstance(value, list):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|")


def command_line(record: dict[str, Any]) -> str:
    return shlex.join(record["command"])


def provenance(record: dict[str, Any]) -> list[str]:
    """The lines that say where a table's figures come from."""
    m = record["machine"]
    load = m.get("load_average") or {}
    load_text = ""
    if load:
        load_text = f"; load average {load['start'][0]:.2f} at the start, {load['end'][0]:.2f} at the end"
    devices = ", ".join(m.get("jax_devices") or [])
    machine = (f"{m.get('processor') or m['platform']}, {m['cpu_count']} CPUs ({len(m['cores'])} used), "
               f"jax {m['jax']} on {m['jax_backend']} ({devices}){load_text}")
    lines = [f"- date: {record['date']}; commit: `{record['commit']}`", f"- machine: {machine}"]
    if record.get("bandwidth_gb_s") is not None:
        lines.append(f"- read bandwidth: {record['bandwidth_gb_s']:.1f} GB/s")
    lines.append(f"- command: `{command_line(record)}`")
    lines.append(f"- record: `{record['_file']}`")
    return lines


def generic_tables(rows: list[dict[str, Any]]) -> list[str]:
    """Any benchmark's rows: one table per "table" label, a column per key, in the order the rows give them."""
    tables: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        tables.setdefault(row.get("table", ""), []).append(row)
    lines: list[str] = []
    for name, items in tables.items():
        columns = list(dict.fromkeys(k for row in items for k in row if k not in ("table", "model")))
        if len(tables) > 1 and name:
            lines += [f"### {name}", ""]
        lines.append("| " + " | ".join(c.replace("_", " ") for c in columns) + " |")
        lines.append("|" + "".join("---:|" if any(isinstance(r.get(c), (int, float)) and not isinstance(r.get(c), bool)
                                                  for r in items) else "---|" for c in columns))
        lines += ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in items]
        lines.append("")
    return lines


def bench_tables(record: dict[str, Any], model: str) -> list[str]:
    """bench.py's tables for one model, by bench.py's own report code."""
    from _bench_report import from_record_rows, markdown

    rows, per_prompt, rooflines = from_record_rows(rows_of(record, model))
    notes = [n for n in record.get("notes", []) if n.startswith(f"{model}:")
             or not any(n.startswith(f"{m}:") for m in record["models"])]
    text = markdown(rows, rooflines, [], notes, per_prompt, record.get("prompts", []))
    return text.strip("\n").split("\n") + [""]


# ------------------------------------------------------------------------------------------------------------------
# The two outputs


def render_docs(chosen: dict[tuple[str, str, str | None], dict[str, Any]]) -> str:
    lines = [
        "# Benchmarks",
        "",
        "<!-- Written by benchmarks/render.py from benchmarks/results/*.json; edit neither by hand: rerun the "
        "command of a section, then `python benchmarks/render.py`. -->",
        "",
        "Each section is the newest record of one benchmark on one model. Figures are measured side by side in one "
        "run, on the machine named under the section's title; ratios compare neighbouring calls, so they travel "
        "better between machines than tokens per second do.",
        "",
    ]
    if not chosen:
        lines += ["No records yet: run a benchmark (e.g. `python benchmarks/bench.py`), then this script.", ""]
    for (benchmark, model, mode), record in chosen.items():
        heading = f"{benchmark}: {model}" + (f" ({mode})" if mode else "")
        lines += [f"## {heading}", ""]
        if record.get("title"):
            lines += [record["title"], ""]
        lines += provenance(record) + [""]
        if benchmark == MAIN:
            lines += bench_tables(record, model)
        else:
            lines += generic_tables(rows_of(record, model))
            notes = record.get("notes") or []
            if notes:
                lines += ["Notes:", ""] + [f"- {n}" for n in notes] + [""]
    return "\n".join(lines).rstrip("\n") + "\n"


def readme_summary(chosen: dict[tuple[str, str, str | None], dict[str, Any]]) -> str:
    """A compact table of bench.py's newest record for the main job's model: speedup over plain greedy and
    acceptance. Every other model's tables are in docs/benchmarks.md."""
    lines: list[str] = []
    for (benchmark, model, _), record in chosen.items():
        if benchmark != MAIN or model != README_MODEL:
            continue
        strategies = [r for r in rows_of(record, model) if r.get("table") == "strategies"]
        if not strategies:
            continue
        has_hf = any(r.get("hf_tokens_per_second") is not None for r in strategies)
        lines += [f"**{model}** ({record.get('title', 'bench.py')}; {record['date'][:10]}, commit "
                  f"`{short_commit(record['commit'])}`):", ""]
        header = ["strategy", "jaxspec tok/s", "speedup over greedy", "acceptance"]
        if has_hf:
            header += ["transformers speedup over greedy", "transformers acceptance"]
        lines += ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
        for r in strategies:
            cells = [r["strategy"], cell(r["jaxspec_tokens_per_second"]),
                     _times(r["jaxspec_speedup_over_greedy"]), cell(r["jaxspec_acceptance_rate"])]
            if has_hf:
                cells += [_times(r["hf_speedup_over_greedy"]), cell(r["hf_acceptance_rate"])]
            lines.append("| " + " | ".join(cells) + " |")
        lines += ["", f"`{command_line(record)}`", ""]
    if lines:
        lines.append("All tables of these runs, and the machine each ran on: [docs/benchmarks.md](docs/benchmarks.md).")
    else:
        lines.append("No benchmark records yet: see [docs/benchmarks.md](docs/benchmarks.md).")
    return "\n".join(lines)


def short_commit(commit: str | None) -> str:
    if not commit:
        return "unknown"
    return commit[:12] + ("+dirty" if commit.endswith("+dirty") else "")


def _times(value) -> str:
    return "–" if value is None else f"{value:.2f}x"


def with_summary(readme: str, summary: str) -> str | None:
    """`readme` with the text between the marker lines replaced by `summary` (the marker lines stay); None without
    the markers."""
    lines = readme.split("\n")
    begin = next((i for i, line in enumerate(lines) if line.strip() == BEGIN), None)
    end = next((i for i, line in enumerate(lines) if line.strip() == END and begin is not None and i > begin), None)
    if end is None:
        return None
    return "\n".join(lines[: begin + 1] + [""] + summary.split("\n") + [""] + lines[end:])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=RESULTS, help="folder of the JSON records (default: benchmarks/results)")
    p.add_argument("--docs", default=DOCS, help="the full tables (default: docs/benchmarks.md)")
    p.add_argument("--readme", default=README, help="file with the summary markers (default: README.md; '' for none)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is not up to date")
    args = p.parse_args(argv)

    chosen = newest(load_records(args.results))
    outputs = {args.docs: render_docs(chosen)}
    failed = False
    if args.readme:
        with open(args.readme, encoding="utf-8") as handle:
            readme = with_summary(handle.read(), readme_summary(chosen))
        if readme is None:  # the docs are still written
            print(f"{args.readme} has no line {BEGIN} followed by a line {END}: add both where the summary goes, "
                  "or pass --readme ''", file=sys.stderr)
            failed = True
        else:
            outputs[args.readme] = readme
    stale = []
    for path, text in outputs.items():
        current = None
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                current = handle.read()
        if current == text:
            continue
        stale.append(path)
        if not args.check:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            with open(path, "w", encoding="utf-8") as handle:
                handle.write(text)
    for path in stale:
        print(f"{'out of date' if args.check else 'wrote'}: {os.path.relpath(path)}", file=sys.stderr)
    return 1 if failed or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
