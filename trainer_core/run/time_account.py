"""Where a run's time went, as its result says: the kept steps' report windows (the mean over
ranks of each part, ``trainer_core.step_time``), what restarts cost, stragglers and advice."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import BaseModel, ConfigDict

from trainer_core import step_time


class Cost(Protocol):
    """What a failure cost, as an in-place restart (``summary.InPlaceRestart``) records it."""

    @property
    def steps_lost(self) -> int | None: ...
    @property
    def detection_s(self) -> float | None: ...
    @property
    def recovery_s(self) -> float | None: ...


class Attempt(Cost, Protocol):
    """An attempt as ``summary.AttemptSummary`` records it: its cost when it failed, what
    failed it, and its in-place restarts'."""

    @property
    def status(self) -> str: ...
    @property
    def error_class(self) -> str | None: ...
    @property
    def error_budget(self) -> str | None: ...
    @property
    def restarts(self) -> Sequence[Cost]: ...


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class RestartCost(_Frozen):
    """Seconds restarts cost, every attempt's and in-place restart's together."""

    #: From the workers' last relayed progress to the failure being reported.
    detection_s: float = 0.0
    #: From the failure to a new worker group resuming (start, restore).
    new_group_s: float = 0.0
    #: Steps run again from the resume point, at the run's mean step time.
    recompute_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.detection_s + self.new_group_s + self.recompute_s


class TimeAccount(_Frozen):
    """Where a run's time went, from its kept steps' report windows (each part the mean over
    the ranks; ``step_time`` has the rules) and its attempts."""

    wall_s: float
    #: Steps the windows measured, and their seconds.
    steps_measured: int
    training_s: float
    #: Seconds the kept steps spent stepping (not waiting for data or checkpoints, not
    #: validating), and their share of the wall time.
    productive_s: float
    productive_share: float | None
    data_wait_s: float
    checkpoint_blocked_s: float
    validation_s: float
    restarts: RestartCost
    #: The rest of the wall time: starting the cluster and worker groups, restoring, finishing
    #: (and steps no window measured: a failed attempt's after its last checkpoint).
    overhead_s: float
    #: Mean seconds per step of each part, and each part's share of the step time.
    per_step_s: dict[str, float]
    shares: dict[str, float]
    #: Ranks the straggler rule named: attempt, rank, node, windows, from_step, ratio.
    stragglers: list[dict[str, Any]] = []
    advice: list[str] = []


def time_account(
    history: Sequence[dict[str, Any]], attempts: Sequence[Attempt], wall_s: float
) -> TimeAccount | None:
    """What the history's report windows and the attempts say of where the time went."""
    rows = list(history)
    steps, total = step_time.run_totals(rows)
    if not steps:
        return None
    seconds = dict(zip(step_time.PARTS, total[1:], strict=True))
    training = total[0]
    waits = seconds["data_wait"] + seconds["checkpoint"] + seconds["validation"]
    productive = max(training - waits, 0.0)
    step_s = training / steps
    restarts: list[Cost] = [r for a in attempts for r in a.restarts]
    failed = [a for a in attempts if a.status == "failed"]
    lost = sum(a.steps_lost or 0 for a in failed) + sum(r.steps_lost or 0 for r in restarts)
    new_groups = {
        "in_place": sum(r.recovery_s or 0.0 for r in restarts),
        **{source: 0.0 for source in ("retry", "code", "other")},
    }
    for a in failed:
        new_groups[_retried_after(a)] += a.recovery_s or 0.0
    cost = RestartCost(
        detection_s=round(
            sum(a.detection_s or 0.0 for a in failed) + sum(r.detection_s or 0.0 for r in restarts),
            3,
        ),
        new_group_s=round(
            sum(a.recovery_s or 0.0 for a in failed) + sum(r.recovery_s or 0.0 for r in restarts),
            3,
        ),
        recompute_s=round(lost * step_s, 3),
    )
    shares = {
        name: round(value / training, 4) if training else 0.0 for name, value in seconds.items()
    }
    stragglers = step_time.stragglers_seen(rows)
    return TimeAccount(
        wall_s=wall_s,
        steps_measured=steps,
        training_s=round(training, 3),
        productive_s=round(productive, 3),
        productive_share=round(productive / wall_s, 4) if wall_s > 0 else None,
        data_wait_s=round(seconds["data_wait"], 3),
        checkpoint_blocked_s=round(seconds["checkpoint"], 3),
        validation_s=round(seconds["validation"], 3),
        restarts=cost,
        overhead_s=round(max(wall_s - training - cost.total_s, 0.0), 3),
        per_step_s={name: round(value / steps, 6) for name, value in seconds.items()},
        shares=shares,
        stragglers=stragglers,
        advice=step_time.advice(
            shares,
            stragglers,
            cost.total_s / wall_s if wall_s > 0 else 0.0,
            {k: v for k, v in cost.model_dump().items() if k.endswith("_s")},
            new_groups,
        ),
    )


def _retried_after(attempt: Attempt) -> str:
    """What a failed attempt's retry answered, for the advice on its new worker group: "retry"
    a lost worker or node that Ray Train could have restarted in place, "code" an error in the
    training code (no restart mends it), "other" the rest (the driver or cluster lost)."""
    if attempt.error_budget == "code":
        return "code"
    if attempt.error_budget in ("infrastructure", "preemption") and (
        attempt.error_class != "DriverLost"
    ):
        return "retry"
    return "other"
