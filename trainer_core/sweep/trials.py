"""Where each trial of a sweep stands, read from its run directory alone: the run's own
summary and metrics history are the sweep's record of it, so a sweep stopped at any moment and
run again finds what it had done.

A trial's report at an epoch counts once its run has committed that epoch (its summary says it
paused or completed at that epoch or later): a value in the history of a leg that was cut short
is not one a decision may rest on, because the checkpoint it was measured on may not exist.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, TypeGuard

from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.numbers import is_finite_number
from trainer_core.run.plan import canonical_storage_uri
from trainer_core.run.summary import TrainingResult, mark_pruned, read_stored_result
from trainer_core.sweep.spec import Sweep


@dataclass(frozen=True)
class TrialRun:
    """Trial ``number``'s run as its directory holds it."""

    number: int
    run_name: str
    run_uri: str
    #: The sweep's metric.
    metric: str
    #: Its summary's status (``paused``, ``pruned``, ``completed``, ``failed``); None before a
    #: first leg ended.
    status: str | None = None
    #: Epochs committed, by its summary.
    epochs: int = 0
    #: The sweep's metric after each committed epoch (counted from 1).
    reports: Mapping[int, float] = field(default_factory=dict)
    result: TrainingResult | None = None

    @property
    def ended(self) -> bool:
        """Trained to its end (its last epoch, or early-stopped), or failed every retry."""
        return self.status in ("completed", "failed")

    @property
    def last_value(self) -> float | None:
        """The metric at its last committed epoch; for a run that reported none by epoch (an
        own loop), its final metrics'."""
        if self.reports:
            return self.reports[max(self.reports)]
        if self.result is not None and self.status == "completed":
            value = self.result.final_metrics.get(self.metric)
            return float(value) if _number(value) else None
        return None


def storage_uri(sweep: Sweep) -> str:
    """Where the sweep's trials and its own directory live: its run spec's ``run.storage``, as
    every process resolves it."""
    return canonical_storage_uri(sweep.trial_spec(0, {}).run.storage)


def trial_directory(sweep: Sweep, number: int) -> RunDirectory:
    return RunDirectory.of(storage_uri(sweep), sweep.trial_name(number))


def read_trial(sweep: Sweep, number: int) -> TrialRun:
    """Trial ``number`` as its run directory stands (a trial not begun: status None)."""
    run_dir = trial_directory(sweep, number)
    name, metric = sweep.trial_name(number), sweep.section.metric
    result = read_stored_result(run_dir) if run_dir.location.exists() else None
    if result is None:
        return TrialRun(number, name, run_dir.uri, metric)
    reports = by_epoch(read_metrics_history(run_dir), metric, result.epochs_completed)
    return TrialRun(
        number, name, run_dir.uri, metric, result.status, result.epochs_completed, reports, result
    )


def record_pruned(sweep: Sweep, runs: Mapping[int, TrialRun], pruned: Mapping[int, int]) -> None:
    """Say in each trial the sweep pruned (number -> epoch) that it was: its own run's summary
    then reads ``pruned``, not ``paused``, for ``relaytrain show`` and the run catalog. Only
    between waves (no leg holds a trial), and the same however often it is done."""
    for number, epoch in pruned.items():
        if runs[number].status == "paused":  # marked already: nothing to read again
            mark_pruned(trial_directory(sweep, number), epoch)


def by_epoch(history: list[dict[str, Any]], metric: str, committed: int) -> dict[int, float]:
    """``metric`` after each epoch (counted from 1) up to ``committed``: the last row of the
    epoch that has it (a validation's row, at the epoch's end)."""
    found: dict[int, float] = {}
    for row in sorted(history, key=lambda r: r.get("step", 0)):
        epoch, value = row.get("epoch"), row.get(metric)
        if isinstance(epoch, int) and _number(value) and epoch + 1 <= committed:
            found[epoch + 1] = float(value)
    return found


def _number(value: Any) -> TypeGuard[float]:
    return isinstance(value, int | float) and is_finite_number(value)
