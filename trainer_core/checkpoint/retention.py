"""Which checkpoints a run keeps: the ranking by a metric (the best checkpoint, here only) and the
retention plan (keep_last, keep_best), pure functions of the committed checkpoints."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from trainer_core.checkpoint.files import (
    CHECKPOINT_PATTERN,
    CheckpointInfo,
)
from trainer_core.numbers import is_finite_number


@dataclass(frozen=True)
class RetentionPlan:
    keep: list[str]
    delete: list[str]
    reasons: dict[str, str]


def rank_by_metric(
    committed: Sequence[CheckpointInfo], metric: str, mode: Literal["min", "max"] | str
) -> list[CheckpointInfo]:
    """The checkpoints that recorded ``metric``, best first (the newer one on a tie). A
    checkpoint's manifest holds only what was measured on its own weights: one committed
    between two validations has no ``val_*`` metric and is not ranked by one."""
    scored = [c for c in committed if is_finite_number(c.metrics.get(metric))]
    sign = 1.0 if mode == "min" else -1.0
    return sorted(scored, key=lambda c: (sign * float(c.metrics[metric]), -c.step))


def plan_retention(
    committed: Sequence[CheckpointInfo],
    *,
    keep_last: int | None,
    keep_best: int,
    best_metric: str,
    best_mode: Literal["min", "max"],
    protected_steps: Iterable[int] = (),
    uncommitted: Sequence[str] = (),
    in_flight_from_step: int | None = None,
) -> RetentionPlan:
    """Decide which checkpoint directories to delete. Pure: the caller executes the plan.

    Keeps the newest ``keep_last`` (all if None), the best ``keep_best`` by ``best_metric``,
    the newest committed one always, and every protected step (e.g. the one a run resumes
    from). Uncommitted directories are deleted unless they may still be in flight (step at or
    after ``in_flight_from_step``).
    """
    reasons: dict[str, str] = {}
    ordered = sorted(committed, key=lambda c: c.step)
    if ordered:
        reasons[ordered[-1].name] = "newest"
    if keep_last is not None:
        for c in ordered[-keep_last:]:
            reasons.setdefault(c.name, "last")
    else:
        for c in ordered:
            reasons.setdefault(c.name, "last")
    for c in rank_by_metric(ordered, best_metric, best_mode)[:keep_best]:
        reasons.setdefault(c.name, "best")
    protected = set(protected_steps)
    for c in ordered:
        if c.step in protected:
            reasons.setdefault(c.name, "protected")
    keep = [c.name for c in ordered if c.name in reasons]
    delete = [c.name for c in ordered if c.name not in reasons]
    for name in uncommitted:
        match = CHECKPOINT_PATTERN.fullmatch(name)
        step = int(match.group(1)) if match else None
        if step is not None and in_flight_from_step is not None and step >= in_flight_from_step:
            reasons[name] = "in flight"
            continue
        delete.append(name)
    return RetentionPlan(keep=keep, delete=delete, reasons=reasons)
