"""What every benchmark shares: alternating repetitions of its variants, targets, the result
JSON and the command line.

A benchmark module builds a list of ``Variant`` s, runs them with ``alternate`` (A, B, C, A, B,
C, ...) so slow drift of a shared machine hits every variant alike, checks its ``Target`` s
against ratios of medians from the same run, and writes a ``Result`` to
``<results dir>/<YYYY-MM-DD>-<name>.json``, with the machine, versions and commit it measured
(``bench.provenance``). ``python -m bench`` rebuilds the README's tables from the newest full
(not ``--quick``) result of each benchmark (``bench.tables``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import fnmatch
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from bench.provenance import git_state, machine_info, versions

REPO = Path(__file__).resolve().parents[1]
BENCH_DIR = REPO / "bench"
RESULTS_DIR = BENCH_DIR / "results"
#: Quick (smoke) runs land here unless told otherwise: git-ignored, never read by the README.
QUICK_RESULTS_DIR = RESULTS_DIR / "tmp"
README = BENCH_DIR / "README.md"
RESULTS_ENV = "RELAYTRAIN_BENCH_RESULTS"
SCHEMA_VERSION = 1
MB = 2**20
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
    "workloads",
    "datasets",
    "queue",
    "chaos",
)

Sample = dict[str, float]


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


def portable(text: str) -> str:
    """``text`` (a traceback) without this machine's paths: the repository's files relative to
    it, the interpreter's and its packages' under ``<python>``."""
    text = text.replace(f"{REPO}/", "")
    for prefix in sorted({sys.prefix, sys.base_prefix}, key=len, reverse=True):
        text = text.replace(f"{prefix}/", "<python>/")
    return text


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
                record.errors.append(portable("".join(traceback.format_exception(e)))[-4000:])
                log(f"[bench] {variant.name}: FAILED: {type(e).__name__}: {e}")
                continue
            record.samples.append(sample)
            shown = ", ".join(f"{k}={format_figure(v)}" for k, v in sample.items())
            log(f"[bench] {variant.name}: {shown} ({time.perf_counter() - started:.1f} s)")
    return records


def measure(variants: list[Variant], args: argparse.Namespace) -> dict[str, VariantRecord]:
    """``alternate`` the variants as the command line asks: its repetitions and ``--only``."""
    return alternate(variants, repetitions_of(args), only=args.only)


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
            "git": git_state(REPO),
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


def floats(text: str) -> list[float]:
    """A comma-separated list of numbers, as options such as ``--sizes 10,100`` take it."""
    return [float(item) for item in text.split(",")]


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
            f"[bench]   {target['name']}: {format_figure(target['value'])} {target['op']} "
            f"{target['threshold']:g}: {verdict}"
        )
    if result.failed:
        print("[bench] some variants failed: see 'errors' in the JSON", file=sys.stderr)
    return 1 if result.failed else 0


# -- figures -------------------------------------------------------------------------------------


def recovery_phases(
    lost_at: float,
    detected_at: float | None,
    restarted_at: float | None,
    resumed_at: float | None,
    first_step_at: float | None = None,
) -> Sample:
    """Where a recovery's seconds went: until the failure was known (``detect_s``: the attempt
    ended, or Ray's controller restarted the group), until the next attempt began (``relaunch_s``:
    Prefect's retry; 0 in place), until its workers had loaded the checkpoint (``start_s``), and
    until their first step (``first_step_s``, where it is known)."""
    if detected_at is None or restarted_at is None or resumed_at is None:
        return {}
    phases = {
        "detect_s": detected_at - lost_at,
        "relaunch_s": restarted_at - detected_at,
        "start_s": resumed_at - restarted_at,
    }
    if first_step_at is not None:
        phases["first_step_s"] = first_step_at - resumed_at
    return phases


def format_figure(value: Any) -> str:
    """A figure as the logs and the README tables show it: about three significant digits."""
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
