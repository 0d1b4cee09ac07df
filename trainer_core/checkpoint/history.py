"""A run's metrics history: per-step rows written by each attempt in segments (with each commit),
merged into one row per step across attempts."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

from trainer_core.checkpoint.run_directory import METRICS_DIR, SCHEMA_VERSION, RunDirectory

SEGMENT_PATTERN = re.compile(r"^segment-a(\d{4})-(\d{9})-(\d{9})\.jsonl$")


def merge_metrics(
    segments: Sequence[tuple[int, Sequence[dict[str, Any]]]], attempts: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Merge per-attempt metric segments into one row per step.

    A row from attempt ``a`` at step ``s`` is dropped when a later attempt resumed from a step
    before ``s`` (that timeline was rewound); of the rows left for a step, the newest attempt's
    wins. The result is sorted by step with no duplicates.
    """
    # An attempt whose resume point is unknown (None: a user's loop resumed by Ray) rewinds
    # nothing; 0 is a fresh start and rewinds everything before it.
    rewinds = [
        (r["attempt"], r["resumed_from_step"])
        for r in attempts
        if r.get("resumed_from_step") is not None
    ]
    best: dict[int, tuple[int, dict[str, Any]]] = {}
    for attempt, rows in sorted(segments, key=lambda s: s[0]):
        for row in rows:
            step = row["step"]
            if any(later > attempt and step > resumed for later, resumed in rewinds):
                continue
            if step not in best or best[step][0] <= attempt:
                best[step] = (attempt, {k: v for k, v in row.items() if k != "schema"})
    return [best[step][1] for step in sorted(best)]


def write_metrics_segment(
    run_dir: RunDirectory, attempt: int, rows: Sequence[dict[str, Any]]
) -> None:
    if not rows:
        return
    first, last = rows[0]["step"], rows[-1]["step"]
    name = f"segment-a{attempt:04d}-{first:09d}-{last:09d}.jsonl"
    body = "".join(json.dumps({"schema": SCHEMA_VERSION, **r}) + "\n" for r in rows)
    run_dir.location.child(METRICS_DIR, name).write_bytes(body.encode())


def last_recorded_step(run_dir: RunDirectory, attempt: int) -> int | None:
    """The newest step of ``attempt``'s metric segments (written with each of its commits):
    how far it is known to have trained, from the segment names alone."""
    steps = [
        int(match.group(3))
        for info in run_dir.location.child(METRICS_DIR).list()
        if (match := SEGMENT_PATTERN.fullmatch(info.base_name)) and int(match.group(1)) == attempt
    ]
    return max(steps, default=None)


def read_metrics_history(run_dir: RunDirectory) -> list[dict[str, Any]]:
    """One row per step across every attempt: see ``merge_metrics``."""
    segments = []
    for info in run_dir.location.child(METRICS_DIR).list():
        match = SEGMENT_PATTERN.fullmatch(info.base_name)
        if not match:
            continue
        body = run_dir.location.child(METRICS_DIR, info.base_name).read_bytes().decode()
        rows = [json.loads(line) for line in body.splitlines() if line]
        segments.append((int(match.group(1)), rows))
    return merge_metrics(segments, run_dir.read_attempts())
