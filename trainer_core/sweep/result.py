"""A sweep's result: every trial with its values, status, metric, steps and run directory,
and the best trial. Built from the trials' run directories and the sweep's standing alone, so
a sweep run again after it ended returns the same result; written as the sweep directory's
``result.json`` and returned by the ``sweep`` flow.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainer_core.sweep.schedule import Standing
from trainer_core.sweep.spec import Sweep
from trainer_core.sweep.trials import TrialRun

TrialStatus = Literal["completed", "pruned", "failed", "pending"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class TrialResult(_Frozen):
    """One trial: a relaytrain run (``relaytrain show <run_uri>``)."""

    number: int
    run_name: str
    run_uri: str
    #: The values the sweep set, by dotted key of the run spec.
    values: dict[str, Any]
    #: ``pruned``: stopped at the checkpoint of the validation that pruned it (its run says
    #: so too); ``pending``: not ended yet (a sweep still running).
    status: TrialStatus
    #: The sweep's metric at the trial's last committed epoch: measured on the weights of
    #: ``checkpoint_uri``.
    metric: float | None
    epochs: int
    steps: int
    pruned_at_epoch: int | None = None
    #: The newest committed checkpoint: the weights ``metric`` was measured on.
    checkpoint_uri: str | None = None
    #: The metric after each committed epoch (counted from 1).
    reports: dict[int, float] = {}


class SweepResult(_Frozen):
    name: str
    #: The sweep's own directory (``sweep.json``, ``result.json``, the study's journal).
    sweep_uri: str
    metric: str
    direction: Literal["minimize", "maximize"]
    sampler: str
    pruner: str
    seed: int
    status: Literal["completed", "running"]
    trials: list[TrialResult]
    #: The completed trial with the best metric (the lowest number among equals).
    best: TrialResult | None
    #: Optimizer steps the trials trained, and the steps of every trial trained to its end:
    #: what pruning saved is ``1 - steps_trained / steps_full``.
    steps_trained: int
    steps_full: int
    #: The sweep's parent run in MLflow (each trial's run its child); None without MLflow, or
    #: while its server was not reached.
    mlflow_run_id: str | None = None


def trial_result(run: TrialRun, values: Mapping[str, Any], pruned_at: int | None) -> TrialResult:
    result = run.result
    status: TrialStatus
    if pruned_at is not None:
        status = "pruned"
    elif run.status in ("completed", "failed"):
        status = run.status  # type: ignore[assignment]
    else:
        status = "pending"
    return TrialResult(
        number=run.number,
        run_name=run.run_name,
        run_uri=run.run_uri,
        values=dict(values),
        status=status,
        metric=run.last_value,
        epochs=run.epochs,
        steps=result.steps_completed if result else 0,
        pruned_at_epoch=pruned_at,
        checkpoint_uri=result.latest_checkpoint_uri if result else None,
        reports=dict(run.reports),
    )


def sweep_result(
    sweep: Sweep, sweep_uri: str, runs: Mapping[int, TrialRun], now: Standing
) -> SweepResult:
    """The sweep as ``runs`` and its standing ``now`` have it."""
    trials = [trial_result(runs[n], now.values.get(n, {}), now.pruned.get(n)) for n in sorted(runs)]
    completed = [t for t in trials if t.status == "completed" and t.metric is not None]
    sign = 1.0 if sweep.direction == "minimize" else -1.0
    best = min(completed, key=lambda t: (sign * (t.metric or 0.0), t.number), default=None)
    return SweepResult(
        name=sweep.name,
        sweep_uri=sweep_uri,
        metric=sweep.section.metric,
        direction=sweep.direction,
        sampler=sweep.section.sampler,
        pruner=sweep.pruner_name(),
        seed=sweep.section.seed,
        status="completed" if now.over else "running",
        trials=trials,
        best=best,
        steps_trained=sum(t.steps for t in trials),
        steps_full=sum(_full_steps(sweep, runs[t.number]) for t in trials),
    )


def _full_steps(sweep: Sweep, run: TrialRun) -> int:
    """The steps of ``run`` trained to its last epoch (0 while none is known)."""
    result = run.result
    if result is None or not result.epochs_completed:
        return 0
    per_epoch = result.steps_completed // result.epochs_completed
    return per_epoch * (result.target_epochs or sweep.epochs or result.epochs_completed)
