"""What every benchmark shares: machine and version facts, alternating repetitions, targets, the
result JSON, and the markdown tables of ``bench/README.md``.

A benchmark module builds a list of ``Variant`` s, runs them with ``alternate`` (A, B, C, A, B,
C, ...) so slow drift of a shared machine hits every variant alike, checks its ``Target`` s
against ratios of medians from the same run, and writes a ``Result`` to
``<results dir>/<YYYY-MM-DD>-<name>.json``. ``python -m bench`` rebuilds the README's tables
from the newest full (not ``--quick``) result of each benchmark.
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "bench"
RESULTS_DIR = BENCH_DIR / "results"
#: Quick (smoke) runs land here unless told otherwise: git-ignored, never read by the README.
QUICK_RESULTS_DIR = RESULTS_DIR / "tmp"
README = BENCH_DIR / "README.md"
RESULTS_ENV = "RELAYTRAIN_BENCH_RESULTS"
SCHEMA_VERSION = 1
#: Every benchmark module, in the order ``make bench`` runs them and the README shows them.
BENCHMARKS = (
    "overhead",
    "recovery",
    "checkpoints",
    "fsdp_checkpoints",
    "restore",
    "reporting",
    "scaling",
    "memory",
    "precision",
    "data",
    "elastic",
    "chaos",
)
TABLES_START = "<!-- bench:tables:start -->"
TABLES_END = "<!-- bench:tables:end -->"

Sample = dict[str, float]


# -- facts about the run -------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, OS and load: enough to tell a quiet machine from a busy one."""
    import psutil

    return {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "hostname": platform.node(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    """Versions of everything a figure depends on."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("relaytrain", "torch", "ray", "prefect", "pyarrow", "numpy", "moto"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_state() -> dict[str, Any]:
    """The commit measured, and whether the tree had local changes (read-only git calls).
    Results written by earlier benchmarks of the same ``make bench`` are not changes to what is
    measured."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", *args],
                cwd=REPO,
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }


# -- variants and repetitions --------------------------------------------------------------------


class NotAvailable(Exception):
    """Raised by a variant that cannot be measured yet; the message says what is missing."""


@dataclass
class Variant:
    """One way of doing the thing a benchmark compares. ``run(rep)`` returns one sample."""

    name: str
    description: str
    run: Callable[[int], Sample]


@dataclass
class VariantRecord:
    """Everything measured for one variant: its samples, errors, or why it is unavailable."""

    description: str
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    unavailable: str | None = None

    def summary(self) -> dict[str, dict[str, float]]:
        return summarize(self.samples)

    def median(self, metric: str) -> float | None:
        values = [s[metric] for s in self.samples if _is_number(s.get(metric))]
        return statistics.median(values) if values else None

    def to_json(self) -> dict[str, Any]:
        return {
            "description": self.description,
            "available": self.unavailable is None,
            "unavailable": self.unavailable,
            "samples": self.samples,
            "summary": self.summary(),
            "errors": self.errors,
        }


def alternate(
    variants: list[Variant],
    repetitions: int,
    log: Callable[[str], None] = print,
    only: list[str] | None = None,
) -> dict[str, VariantRecord]:
    """Run the variants alternately (A, B, C, A, B, C, ...), ``repetitions`` rounds.

    ``only`` keeps the variants whose name matches one of its shell patterns (``--only``).
    A variant that raises ``NotAvailable`` is recorded as such and skipped afterwards; any other
    error is recorded with its traceback and the round goes on.
    """
    if only:
        skipped = [v.name for v in variants if not any(fnmatch.fnmatch(v.name, p) for p in only)]
        variants = [v for v in variants if v.name not in skipped]
        if skipped:
            log(f"[bench] --only skips {', '.join(skipped)}")
    records = {v.name: VariantRecord(v.description) for v in variants}
    for rep in range(repetitions):
        for variant in variants:
            record = records[variant.name]
            if record.unavailable is not None:
                continue
            log(f"[bench] {variant.name}: repetition {rep + 1}/{repetitions}")
            started = time.perf_counter()
            try:
                sample = variant.run(rep)
            except NotAvailable as e:
                record.unavailable = str(e)
                log(f"[bench] {variant.name}: not available yet: {e}")
                continue
            except Exception as e:
                record.errors.append("".join(traceback.format_exception(e))[-4000:])
                log(f"[bench] {variant.name}: FAILED: {type(e).__name__}: {e}")
                continue
            record.samples.append(sample)
            shown = ", ".join(f"{k}={_fmt(v)}" for k, v in sample.items())
            log(f"[bench] {variant.name}: {shown} ({time.perf_counter() - started:.1f} s)")
    return records


def summarize(samples: Iterable[Sample]) -> dict[str, dict[str, float]]:
    """Median, min, max and count of every numeric metric across samples."""
    values: dict[str, list[float]] = {}
    for sample in samples:
        for key, value in sample.items():
            if _is_number(value):
                values.setdefault(key, []).append(float(value))
    return {
        key: {
            "median": statistics.median(xs),
            "min": min(xs),
            "max": max(xs),
            "n": len(xs),
        }
        for key, xs in values.items()
    }


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


# -- targets --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A figure the issue asks for, compared with its threshold."""

    name: str
    description: str
    op: Literal["<=", ">="]
    threshold: float

    def check(self, value: float | None, note: str = "") -> dict[str, Any]:
        """The target's record: ``met`` is None when the value could not be measured."""
        met = None
        if value is not None:
            met = value <= self.threshold if self.op == "<=" else value >= self.threshold
        return {
            "name": self.name,
            "description": self.description,
            "value": value,
            "op": self.op,
            "threshold": self.threshold,
            "met": met,
            "note": note,
        }


def ratio(
    records: dict[str, VariantRecord], numerator: str, denominator: str, metric: str
) -> float | None:
    """median(numerator's metric) / median(denominator's metric), None if either is missing."""
    top = records[numerator].median(metric) if numerator in records else None
    bottom = records[denominator].median(metric) if denominator in records else None
    if top is None or bottom is None or bottom == 0:
        return None
    return top / bottom


# -- the result file ------------------------------------------------------------------------------


@dataclass
class Result:
    """One benchmark run, as written to ``<YYYY-MM-DD>-<name>.json``. Create it when the run
    starts (it notes the time and the machine's load then) and fill it in as it goes."""

    name: str
    quick: bool
    settings: dict[str, Any] = field(default_factory=dict)
    variants: dict[str, VariantRecord] = field(default_factory=dict)
    targets: list[dict[str, Any]] = field(default_factory=list)
    #: Metrics shown in the README table, in order (all of a variant's samples are in the JSON).
    columns: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    machine_at_start: dict[str, Any] = field(default_factory=machine_info)

    @property
    def failed(self) -> bool:
        return any(record.errors for record in self.variants.values())

    def to_json(self) -> dict[str, Any]:
        ended = time.time()
        return {
            "schema": SCHEMA_VERSION,
            "benchmark": self.name,
            "date": dt.date.fromtimestamp(self.started_at).isoformat(),
            "started_at": dt.datetime.fromtimestamp(self.started_at).isoformat(timespec="seconds"),
            "duration_s": round(ended - self.started_at, 1),
            "quick": self.quick,
            "command": " ".join(
                [Path(sys.executable).name, "-m", f"bench.{self.name}", *sys.argv[1:]]
            ),
            "machine": {
                **self.machine_at_start,
                "load_average_at_end": machine_info()["load_average"],
            },
            "versions": versions(),
            "git": git_state(),
            "settings": self.settings,
            "columns": self.columns,
            "variants": {name: record.to_json() for name, record in self.variants.items()},
            "targets": self.targets,
            "figures": self.figures,
            "notes": self.notes,
        }

    def write(self, results_dir: Path) -> Path:
        """Write ``<results_dir>/<YYYY-MM-DD>-<name>.json`` (a second run that day replaces it)."""
        results_dir.mkdir(parents=True, exist_ok=True)
        date = dt.date.fromtimestamp(self.started_at).isoformat()
        path = results_dir / f"{date}-{self.name}.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.to_json(), indent=2, sort_keys=False, default=str) + "\n")
        tmp.replace(path)
        return path


# -- command line ---------------------------------------------------------------------------------


def parser(name: str, description: str, repetitions: int) -> argparse.ArgumentParser:
    """The options every benchmark takes (a module adds its own)."""
    p = argparse.ArgumentParser(prog=f"python -m bench.{name}", description=description)
    p.add_argument("--quick", action="store_true", help="a few seconds: prove the harness works")
    p.add_argument(
        "--repetitions",
        type=int,
        default=None,
        help=f"rounds of alternating variants (default {repetitions}; 1 with --quick)",
    )
    p.add_argument(
        "--results-dir",
        type=Path,
        default=None,
        help=f"where the JSON goes (default ${RESULTS_ENV}, else bench/results, or "
        "bench/results/tmp with --quick)",
    )
    p.add_argument(
        "--only",
        type=lambda text: [name for name in text.split(",") if name],
        default=None,
        metavar="NAME[,NAME...]",
        help="run only the variants with these names (shell patterns allowed); the result goes "
        "to bench/results/tmp unless --results-dir is given, since it is not the whole table",
    )
    p.set_defaults(default_repetitions=repetitions)
    return p


def repetitions_of(args: argparse.Namespace) -> int:
    if args.repetitions is not None:
        return max(1, args.repetitions)
    return 1 if args.quick else args.default_repetitions


def results_dir_of(args: argparse.Namespace) -> Path:
    if args.results_dir is not None:
        return Path(args.results_dir)
    if os.environ.get(RESULTS_ENV):
        return Path(os.environ[RESULTS_ENV])
    return QUICK_RESULTS_DIR if args.quick or args.only else RESULTS_DIR


def unmatched(only: list[str] | None, names: list[str]) -> list[str]:
    """The ``--only`` patterns that match none of ``names``."""
    return [p for p in only or [] if not any(fnmatch.fnmatch(name, p) for name in names)]


def finish(result: Result, args: argparse.Namespace) -> int:
    """Write the result, print where and the targets; the process's exit code (2 when an
    ``--only`` pattern matched no variant: a typo must not pass for a measurement)."""
    missing = unmatched(args.only, list(result.variants))
    if missing:
        print(
            f"[bench] {result.name}: --only {','.join(missing)} matched no variant; it has: "
            f"{', '.join(result.variants) or 'no variant'} ('--only skips' lines above name "
            "the others)",
            file=sys.stderr,
        )
        return 2
    path = result.write(results_dir_of(args))
    print(f"\n[bench] {result.name}: wrote {path}")
    for target in result.targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[target["met"]]
        print(
            f"[bench]   {target['name']}: {_fmt(target['value'])} {target['op']} "
            f"{target['threshold']:g}: {verdict}"
        )
    if result.failed:
        print("[bench] some variants failed: see 'errors' in the JSON", file=sys.stderr)
    return 1 if result.failed else 0


# -- the README tables ----------------------------------------------------------------------------


def newest_results(results_dir: Path = RESULTS_DIR) -> dict[str, dict[str, Any]]:
    """The newest full (not quick) result of each benchmark in ``results_dir`` (not below it)."""
    newest: dict[str, dict[str, Any]] = {}
    for path in sorted(results_dir.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if data.get("schema") != SCHEMA_VERSION or data.get("quick"):
            continue
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


def _render_one(data: dict[str, Any]) -> str:
    machine = data["machine"]
    commit = (data["git"].get("commit") or "unknown")[:10]
    dirty = " (with local changes)" if data["git"].get("dirty") else ""
    lines = [
        f"### {data['benchmark']}",
        "",
        f"{data['date']}, commit `{commit}`{dirty}, {machine['cpu_model']}, "
        f"{machine['logical_cores']} cores, {machine['ram_gb']} GB, load "
        f"{machine['load_average'][0]} -> {machine.get('load_average_at_end', ['?'])[0]}; "
        f"`{data['_file']}`. Median [min-max] of n repetitions.",
        "",
    ]
    columns = data.get("columns") or []
    rows = (data.get("figures") or {}).get("rows")
    if rows and not data["variants"]:  # one run's figures by row (the chaos campaign's kinds)
        lines[-2] = lines[-2].replace(" Median [min-max] of n repetitions.", "")
        lines.append(f"| {data['figures'].get('row_name', 'row')} | " + " | ".join(columns) + " |")
        lines.append("|---" * (len(columns) + 1) + "|")
        for name, values in rows.items():
            lines.append(f"| {name} | " + " | ".join(_fmt(values.get(c)) for c in columns) + " |")
        return _render_targets(data, lines)
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


def _render_targets(data: dict[str, Any], lines: list[str]) -> str:
    """``lines`` with the result's targets and notes after them."""
    if data.get("targets"):
        lines += ["", "| target | value | threshold | result |", "|---|---|---|---|"]
        for t in data["targets"]:
            verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
            note = f" ({t['note']})" if t.get("note") else ""
            lines.append(
                f"| {t['name']}: {t['description']} | {_fmt(t['value'])} | {t['op']} "
                f"{t['threshold']:g} | {verdict}{note} |"
            )
    for note in data.get("notes") or []:
        lines += ["", f"- {note}"]
    return "\n".join(lines) + "\n"


def _cell(stats: dict[str, float] | None) -> str:
    if not stats:
        return "-"
    if stats["n"] == 1 or stats["min"] == stats["max"]:
        return _fmt(stats["median"])
    return f"{_fmt(stats['median'])} [{_fmt(stats['min'])}-{_fmt(stats['max'])}]"


def _fmt(value: Any) -> str:
    if not _is_number(value):
        return "-" if value is None else str(value)
    magnitude = abs(value)
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 10:
        return f"{value:.1f}"
    if magnitude >= 0.01 or magnitude == 0:
        return f"{value:.3g}" if magnitude < 1 else f"{value:.2f}"
    return f"{value:.2e}"


def update_readme(tables: str, readme: Path = README) -> None:
    """Replace the text between the README's table markers with ``tables``."""
    text = readme.read_text()
    start, end = text.find(TABLES_START), text.find(TABLES_END)
    if start < 0 or end < start:
        raise ValueError(f"{readme} lacks the markers {TABLES_START} ... {TABLES_END}")
    head = text[: start + len(TABLES_START)]
    readme.write_text(f"{head}\n\n{tables.rstrip()}\n\n{text[end:]}")


def recovery_phases(
    lost_at: float,
    detected_at: float | None,
    restarted_at: float | None,
    resumed_at: float | None,
    first_step_at: float,
) -> Sample:
    """Where a recovery's seconds went: until the failure was known (``detect_s``: the attempt
    ended, or Ray's controller restarted the group), until the next attempt began (``relaunch_s``:
    Prefect's retry; 0 in place), until its workers had loaded the checkpoint (``start_s``), and
    until their first step (``first_step_s``)."""
    if detected_at is None or restarted_at is None or resumed_at is None:
        return {}
    return {
        "detect_s": detected_at - lost_at,
        "relaunch_s": restarted_at - detected_at,
        "start_s": resumed_at - restarted_at,
        "first_step_s": first_step_at - resumed_at,
    }
