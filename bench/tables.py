"""The markdown tables of ``bench/README.md``: the newest full (not ``--quick``) result of each
benchmark, its variants by columns (or, for one run's figures, its rows), then its targets and
notes. ``python -m bench`` writes them between the README's table markers."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.common import README, RESULTS_DIR, SCHEMA_VERSION, format_figure

TABLES_START = "<!-- bench:tables:start -->"
TABLES_END = "<!-- bench:tables:end -->"
REPETITIONS_NOTE = " Median [min-max] of n repetitions."


def newest_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """The newest full (not quick) result of each benchmark in ``results_dir`` (not below it)."""
    newest: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("schema") != SCHEMA_VERSION or data.get("quick") or "benchmark" not in data:
            continue  # an older format, a quick run, or not a benchmark (the adversary's)
        name = data["benchmark"]
        if name not in newest or data["started_at"] > newest[name]["started_at"]:
            newest[name] = {**data, "_file": path.name}
    return newest


def render_tables(results: dict[str, dict[str, Any]], order: Iterable[str] = ()) -> str:
    """Markdown for every benchmark's newest result: variants x columns, then its targets."""
    if not results:
        return "_No full benchmark results yet: run `make bench`._\n"
    names = [n for n in order if n in results] + sorted(set(results) - set(order))
    return "\n".join(_render_one(results[name]) for name in names)


def update_readme(tables: str, readme: Path = README) -> None:
    """Replace the text between the README's table markers with ``tables``."""
    text = readme.read_text()
    start, end = text.find(TABLES_START), text.find(TABLES_END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} lacks the markers {TABLES_START} ... {TABLES_END}")
    head = text[: start + len(TABLES_START)]
    readme.write_text(f"{head}\n\n{tables.rstrip()}\n\n{text[end:]}")


def _render_one(data: dict[str, Any]) -> str:
    columns = data.get("columns") or []
    rows = (data.get("figures") or {}).get("rows")
    if rows and not data["variants"]:  # one run's figures by row (the chaos campaign's kinds)
        lines = _heading(data, repetitions=False)
        lines.append(f"| {data['figures'].get('row_name', 'row')} | " + " | ".join(columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for name, values in rows.items():
            cells = [format_figure(values.get(c)) for c in columns]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        return _render_targets(data, lines)
    lines = _heading(data, repetitions=True)
    lines.append("| variant | " + " | ".join(columns) + " | n |")
    lines.append("|---" * (len(columns) + 2) + "|")
    for name, variant in data["variants"].items():
        if not variant["available"]:
            lines.append(f"| {name} | not available yet: {variant['unavailable']} |")
            continue
        summary = variant["summary"]
        cells = [_cell(summary.get(c)) for c in columns]
        n = max((s["n"] for s in summary.values()), default=0)
        failed = f" ({len(variant['errors'])} failed)" if variant["errors"] else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {n}{failed} |")
    return _render_targets(data, lines)


def _heading(data: dict[str, Any], repetitions: bool) -> list[str]:
    """The benchmark's title and where and when its result was measured."""
    machine = data["machine"]
    commit = (data["git"].get("commit") or "unknown")[:10]
    dirty = " (with local changes)" if data["git"].get("dirty") else ""
    return [
        f"### {data['benchmark']}",
        "",
        f"{data['date']}, commit `{commit}`{dirty}, {machine['cpu_model']}, "
        f"{machine['logical_cores']} cores, {machine['ram_gb']} GB, load "
        f"{machine['load_average'][0]} -> {machine.get('load_average_at_end', ['?'])[0]}; "
        f"`{data['_file']}`." + (REPETITIONS_NOTE if repetitions else ""),
        "",
    ]


def _render_targets(data: dict[str, Any], lines: list[str]) -> str:
    """``lines`` with the result's targets and notes after them."""
    if data.get("targets"):
        lines += ["", "| target | value | threshold | result |", "|---|---|---|---|"]
        for t in data["targets"]:
            verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
            note = f" ({t['note']})" if t.get("note") else ""
            lines.append(
                f"| {t['name']}: {t['description']} | {format_figure(t['value'])} | {t['op']} "
                f"{t['threshold']:g} | {verdict}{note} |"
            )
    for note in data.get("notes") or []:
        lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def _cell(stats: dict[str, float] | None) -> str:
    if not stats:
        return "-"
    if stats["n"] == 1 or stats["min"] == stats["max"]:
        return format_figure(stats["median"])
    median, low, high = (format_figure(stats[k]) for k in ("median", "min", "max"))
    return f"{median} [{low}-{high}]"
