"""What every recovery test checks: the run a fault interrupted ends exactly where an
uninterrupted one does, and the fault matrix row it adds (runs/fault-matrix.jsonl)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer_core import storage
from trainer_core.checkpoint import dcp_storage, training_state
from trainer_core.checkpoint.exports import is_dcp
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.attempts import read as read_attempts
from trainer_core.run.summary import attempt_summaries
from trainer_core.train import evaluate

REPO = Path(__file__).resolve().parents[1]
MATRIX_FILE = REPO / "runs" / "fault-matrix.jsonl"


def run_dir_of(spec: Any) -> RunDirectory:
    return RunDirectory(storage.resolve(spec.run.storage).child(spec.run.name))


def final_state(run_dir: RunDirectory, suffix: str = "") -> dict:
    """The newest checkpoint's step, model and optimizer state (``torch.optim``'s layout, by
    parameter position, whatever the format)."""
    newest = run_dir.scan().newest
    assert newest is not None
    if is_dcp(newest):
        location = run_dir.checkpoint_location(newest.step)
        optimizer = dcp_storage.read_key(location, newest.files, "optimizer")
        return {
            "step": newest.step,
            "model": dcp_storage.read_key(location, newest.files, "model"),
            "optimizer": by_position(optimizer),
        }
    return {
        "step": newest.step,
        "model": training_state.from_bytes(run_dir.read_verified(newest, f"model{suffix}.pt")),
        "optimizer": training_state.from_bytes(
            run_dir.read_verified(newest, f"optimizer{suffix}.pt")
        ),
    }


def by_position(optimizer: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict keyed by parameter name (DCP's) keyed by position instead."""
    names = [name for group in optimizer["param_groups"] for name in group["params"]]
    index = {name: i for i, name in enumerate(names)}
    return {
        "state": {index[name]: value for name, value in optimizer["state"].items()},
        "param_groups": [
            {**group, "params": [index[name] for name in group["params"]]}
            for group in optimizer["param_groups"]
        ],
    }


def assert_same_tensors(a: Any, b: Any) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same_tensors(a[key], b[key])
    elif isinstance(a, list | tuple):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same_tensors(x, y)
    else:
        assert a == b


def losses(run_dir: RunDirectory) -> list[tuple[int, float]]:
    return [(row["step"], row["loss"]) for row in read_metrics_history(run_dir)]


def assert_recovered(
    run_dir: RunDirectory,
    reference: dict[str, Any],
    *,
    interval: int,
    committed_before: int | None = None,
    write_lost: bool = False,
    fault_step: int | None = None,
) -> list[dict[str, Any]]:
    """The fault-matrix invariants; returns the attempt records.

    - the run completed, and its final parameters and optimizer state are bit-identical to the
      uninterrupted run's;
    - the metrics history is complete, one row per step, each loss identical (no duplicates);
    - no committed checkpoint was lost: the first resume (a new attempt's, or a worker group's
      restarted in place) came from ``committed_before`` (the newest commit seen before the
      fault) or later;
    - each failure lost at most one checkpoint interval of steps; when the fault can take the
      checkpoint being written with it (``write_lost``: the write itself failed, or the node
      writing it died), the steps run while that write was in flight are lost too (checkpoints
      are asynchronous): at most two intervals;
    - with ``fault_step`` (a fault that fires as the built-in loop begins that step, on any
      rank): the first failure's steps lost are exactly the steps completed after its resume
      point, ``fault_step - 1 - resumed_from``: the fault's own step is the oracle, not what
      the driver heard.
    """
    attempts = run_dir.read_attempts()
    assert attempts and attempts[-1]["status"] == "completed", attempts
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]
    resumed = []  # in the order they happened: each attempt's start, then its restarts
    for index, attempt in enumerate(attempts):
        if index:
            resumed.append(attempt.get("resumed_from_step"))
        resumed += [r.get("resumed_from_step") for r in attempt.get("restarts") or ()]
    if committed_before is not None and resumed:
        assert (resumed[0] or 0) >= committed_before, (resumed, committed_before)
    bound = 2 * interval if write_lost else interval
    failures = []  # (steps lost, resumed from) of each failure, in the order they happened
    summaries = attempt_summaries([AttemptRecord.from_json(a) for a in attempts])
    for index, summary in enumerate(summaries):
        failures += [(r.steps_lost, r.resumed_from_step) for r in summary.restarts]
        if summary.status == "failed" and index + 1 < len(summaries):
            failures.append((summary.steps_lost, summaries[index + 1].resumed_from_step))
        lost = [summary.steps_lost, *(r.steps_lost for r in summary.restarts)]
        assert all(n is None or n <= bound for n in lost), summary
    if fault_step is not None:
        steps_lost, resumed_from = failures[0]
        assert steps_lost == fault_step - 1 - (resumed_from or 0), (failures, summaries)
    return attempts


def recorded_batches(logs: Path, key: str) -> list[list[Any]]:
    """The global batches an attempt trained, in order, from what a recording model or loop
    wrote (``{"rank", "world_size", key}`` JSON lines, a file per process): every rank's slice
    of each micro-batch, joined in rank order (rank r's slice is positions r*B//W.. of the
    batch). The records are taken away, so the next attempt's start empty. A rank that outlived
    the failing one may have recorded the failed step's forward: the count is the shortest
    rank's."""
    by_rank: dict[int, list[list[Any]]] = {}
    world_size = 0
    for path in sorted(logs.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_rank.setdefault(record["rank"], []).append(record[key])
            world_size = record["world_size"]
        path.unlink()
    assert sorted(by_rank) == list(range(world_size))
    count = min(len(slices) for slices in by_rank.values())
    return [[i for rank in range(world_size) for i in by_rank[rank][n]] for n in range(count)]


def committed_step(run_dir: RunDirectory) -> int:
    """The newest committed step (0: none yet)."""
    newest = run_dir.scan().newest
    return newest.step if newest else 0


def committed_before(run_dir: RunDirectory, when: float) -> int:
    """The newest step whose commit marker a local run directory got before ``when`` (Unix
    seconds): what a failure at ``when`` must not lose. (A checkpoint whose write was still in
    flight then is written again after the resume, so its marker is newer.)"""
    import os

    found = [
        c.step
        for c in run_dir.scan().committed
        if os.path.getmtime(
            run_dir.location.child(f"checkpoint-{c.step:09d}").child("COMMITTED").path
        )
        < when
    ]
    return max(found, default=0)


def record_matrix_row(case: str, run_dir: RunDirectory, **extra: Any) -> dict[str, Any]:
    """Append this fault's row (attempts, recovery seconds, steps lost) to the matrix file."""
    summaries = attempt_summaries(read_attempts(run_dir))
    row = {
        "case": case,
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "attempts": len(summaries),
        "statuses": [s.status for s in summaries],
        "errors": [s.error_class for s in summaries if s.error_class],
        "recovery_s": [round(s.recovery_s, 1) for s in summaries if s.recovery_s is not None],
        "steps_lost": [s.steps_lost for s in summaries if s.steps_lost is not None],
        "in_place": [
            {
                "reason": r.reason,
                "workers": [r.world_size_before, r.world_size_after],
                "recovery_s": None if r.recovery_s is None else round(r.recovery_s, 1),
                "steps_lost": r.steps_lost,
            }
            for s in summaries
            for r in s.restarts
        ],
        **extra,
    }
    MATRIX_FILE.parent.mkdir(parents=True, exist_ok=True)
    with MATRIX_FILE.open("a") as f:
        f.write(json.dumps(row) + "\n")
    return row


def measure_checkpoints(spec: Any, run_dir: RunDirectory) -> dict[int, dict[str, Any]]:
    """Every committed checkpoint, by step: the metrics its manifest records and those its
    weights score when evaluated on the driver on the validation split (the oracle the "best"
    checkpoint is checked against: ``evaluate``, not the ranking rule)."""
    rows = evaluate.holdout(spec)
    return {
        c.step: {"recorded": c.metrics, "measured": evaluate.evaluate(spec, c.uri, rows)}
        for c in run_dir.scan().committed
    }


def assert_records_what_it_measures(measured: dict[int, dict[str, Any]]) -> None:
    """A checkpoint records only metrics measured on its own weights: each val_* value in its
    manifest equals what its weights score (rtol 1e-5)."""
    for step, m in measured.items():
        for name, value in m["recorded"].items():
            if name.startswith("val_"):
                assert value == pytest.approx(m["measured"][name], rel=1e-5), (step, name)


def measured_best(
    measured: dict[int, dict[str, Any]], metric: str = "val_loss", mode: str = "min"
) -> int:
    """The step whose weights score best on ``metric`` among the checkpoints that were
    validated (recorded a val_* metric), by evaluation."""
    validated = {s: m["measured"][metric] for s, m in measured.items() if metric in m["recorded"]}
    assert validated, "no checkpoint was validated"
    pick = min if mode == "min" else max
    return pick(validated, key=lambda s: validated[s])


def expected_retention(
    measured: dict[int, dict[str, Any]], keep_last: int, metric: str = "val_loss", mode: str = "min"
) -> tuple[set[int], int]:
    """What retention must leave of the checkpoints an uninterrupted run committed (all kept in
    ``measured``): the newest ``keep_last`` and the best by evaluation, and that best step."""
    best = measured_best(measured, metric, mode)
    return set(sorted(measured)[-keep_last:]) | {best}, best


def assert_retained(
    run_dir: RunDirectory, best_checkpoint_uri: str | None, kept: set[int], best: int
) -> None:
    """The run directory holds exactly the ``kept`` committed checkpoints and nothing
    uncommitted, and the best checkpoint named is the one at step ``best``."""
    scan = run_dir.scan()
    assert {c.step for c in scan.committed} == kept
    assert not scan.uncommitted and not scan.damaged
    assert best_checkpoint_uri == run_dir.checkpoint_location(best).uri


def fail_then_resume(spec: Any) -> list[dict[str, Any]]:
    """A user loop's first attempt fails at its fault; the second resumes from a Ray checkpoint
    and completes. Returns the second attempt's events."""
    from trainer_core.errors import TrainingCodeError
    from trainer_core.run.engine import run_attempt

    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    events: list[dict[str, Any]] = []
    assert run_attempt(spec, on_event=events.append).status == "completed"
    resumed = next(e for e in events if e["kind"] in ("resumed", "fresh_start"))
    assert resumed["kind"] == "resumed" and resumed["checkpoint_uri"]
    return events
