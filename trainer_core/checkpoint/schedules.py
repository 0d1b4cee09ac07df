"""The learning-rate schedule of the built-in loop: the spec's ``lr_schedule`` (``Schedule``:
warm-up, cosine or step decay over optimizer steps, and the segments a run continued to more
epochs goes on with), or any LR scheduler named by import path (``ImportedSchedule``:
``schedule.scheduler``, stepped after every optimizer step or at each epoch's end, on a
validation metric for ReduceLROnPlateau). Either is in every checkpoint, so a resume goes on
exactly; the loop calls ``after_optimizer_step`` and ``at_epoch_end``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any

import torch

from trainer_core.errors import SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.optimization import ScheduleSection


def lr_factor(
    step: int,
    schedule: ScheduleSection,
    total_steps: int,
    start: int = 0,
    start_factor: float | None = None,
) -> float:
    """Multiplier of the base learning rate after ``step`` optimizer steps. Pure.

    A cosine schedule decays from 1 (after the warm-up) to 0 at ``total_steps``. From a
    continuation on (``start_factor``: the factor the run had after ``start`` steps, when it went
    on to another ``total_steps``) it decays from that factor to 0 at the new total instead."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if schedule.lr_schedule == "cosine":
        begin, peak = schedule.warmup_steps, 1.0
        if start_factor is not None and start >= schedule.warmup_steps:
            begin, peak = start, start_factor
        span = max(total_steps - begin, 1)
        progress = min(max(step - begin, 0) / span, 1.0)
        return peak * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule.lr_schedule == "step":
        return schedule.gamma ** (step // schedule.step_size)
    return 1.0


class Schedule(torch.optim.lr_scheduler.LambdaLR):
    """The run's LR schedule: ``lr_factor`` to ``total_steps`` times the spec's base rate.

    Its state (in every checkpoint) records the segment it is on: ``segment_start`` and
    ``segment_factor`` (None: the schedule from step 0). Loading a checkpoint keeps the LR the
    run had at the checkpoint's step: when this spec's schedule gives another factor there (more
    epochs asked for, so another ``total_steps``), a new segment starts at that step and factor
    and decays to the schedule's end at the new total. A changed base rate (``optimizer.lr``)
    applies from the checkpoint's step on; the restored optimizer's rate does not override it.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, schedule: ScheduleSection, total_steps: int
    ):
        self.total_steps = total_steps
        self.segment_start = 0
        self.segment_factor: float | None = None
        #: What the last ``load_state_dict`` changed, to log (None: nothing).
        self.changed: str | None = None
        super().__init__(optimizer, self._factor_of(schedule))

    def _factor_of(self, schedule: ScheduleSection) -> Any:
        # A plain function: LambdaLR's state_dict would save a callable object's attributes.
        return lambda step: lr_factor(
            step, schedule, self.total_steps, self.segment_start, self.segment_factor
        )

    def after_optimizer_step(self) -> None:
        self.step()

    def at_epoch_end(self, measured: dict[str, float]) -> None:
        """The built-in schedule counts optimizer steps only."""

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state.pop("changed", None)
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        total_steps, base_lrs = self.total_steps, list(self.base_lrs)
        super().load_state_dict(state_dict)  # the checkpoint's step, rates and segment
        self.total_steps = total_steps
        step = self.last_epoch
        base = float(self.base_lrs[0])
        had = float(self._last_lr[0]) / base if base else 0.0
        changes = []
        if not math.isclose(self.lr_lambdas[0](step), had, rel_tol=1e-9, abs_tol=1e-15):
            self.segment_start, self.segment_factor = step, had
            changes.append(f"the schedule decays from factor {had:.6g} to {total_steps} steps")
        if base_lrs != self.base_lrs:
            changes.append(f"optimizer.lr {self.base_lrs[0]:g} -> {base_lrs[0]:g}")
            self.base_lrs = base_lrs
            for group, new in zip(self.optimizer.param_groups, base_lrs, strict=True):
                group["initial_lr"] = new
                group["lr"] = new * self.lr_lambdas[0](step)
            self._last_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.changed = f"from step {step}: {'; '.join(changes)}" if changes else None


class ImportedSchedule:
    """``schedule.scheduler``: a scheduler of the user's naming, stepped when
    ``schedule.scheduler_interval`` says. Its own ``state_dict`` is what a checkpoint holds."""

    def __init__(self, scheduler: Any, schedule: ScheduleSection):
        self.scheduler = scheduler
        self.stepped_per = schedule.stepped_per
        self.metric = schedule.scheduler_metric
        self.kwargs = dict(schedule.scheduler_kwargs)
        #: What the last ``load_state_dict`` kept of the checkpoint over the spec, to log.
        self.changed: str | None = None

    def after_optimizer_step(self) -> None:
        if self.stepped_per == "step":
            self.scheduler.step()

    def at_epoch_end(self, measured: dict[str, float]) -> None:
        """Step at the end of an epoch, after its validation (``measured``: its metrics, the
        same on every rank). A metric not measured (no validation rows) gives no step, as it
        gives early stopping no verdict."""
        if self.stepped_per != "epoch":
            return
        if self.metric is None:
            self.scheduler.step()
        elif measured.get(self.metric) is not None:
            self.scheduler.step(measured[self.metric])

    def state_dict(self) -> dict[str, Any]:
        return dict(self.scheduler.state_dict())

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's state, whole: the scheduler's settings too (a torch scheduler's
        state holds its arguments), so changed ``scheduler_kwargs`` or ``optimizer.lr`` apply
        to a new run; ``changed`` names those the checkpoint kept."""
        fresh = self.scheduler.state_dict()
        self.scheduler.load_state_dict(state)
        kept = [
            f"{key} {state[key]!r} (the spec's {fresh[key]!r})"
            for key in [*self.kwargs, "base_lrs"]
            if key in fresh and key in state and fresh[key] != state[key]
        ]
        self.changed = (
            f"the checkpoint's scheduler keeps {', '.join(kept)}: schedule.scheduler_kwargs and "
            "optimizer.lr apply to a new run"
            if kept
            else None
        )


def make_scheduler(
    optimizer: torch.optim.Optimizer, schedule: ScheduleSection, total_steps: int
) -> Schedule | ImportedSchedule:
    """The spec's schedule over ``optimizer``: ``schedule.scheduler`` when it names one (a
    SpecError for arguments it does not take, or a step that does not fit
    ``scheduler_metric``), else the built-in ``lr_schedule`` to ``total_steps``."""
    if schedule.scheduler is None:
        return Schedule(optimizer, schedule, total_steps)
    field = "schedule.scheduler"
    scheduler_class = import_object(schedule.scheduler, field)
    try:
        scheduler = scheduler_class(optimizer, **schedule.scheduler_kwargs)
    except (TypeError, ValueError) as e:
        raise SpecError(
            f"schedule.scheduler {schedule.scheduler!r} refused schedule.scheduler_kwargs "
            f"{schedule.scheduler_kwargs}: {e}. Fix schedule.scheduler_kwargs",
            field="schedule.scheduler_kwargs",
        ) from e
    missing = [m for m in ("step", "state_dict", "load_state_dict") if not hasattr(scheduler, m)]
    if missing:
        raise SpecError(
            f"schedule.scheduler {schedule.scheduler!r} made a {type(scheduler).__name__}, "
            f"which has no {missing}: name an LR scheduler (torch.optim.lr_scheduler's), or a "
            "function returning one",
            field=field,
        )
    _check_metric(scheduler, schedule)
    return ImportedSchedule(scheduler, schedule)


def _check_metric(scheduler: Any, schedule: ScheduleSection) -> None:
    """A scheduler whose ``step`` needs a value (ReduceLROnPlateau's metric) gets
    ``scheduler_metric``; one whose step takes none (or only an epoch number) gets none."""
    try:
        parameters = inspect.signature(scheduler.step).parameters.values()
    except (TypeError, ValueError):
        return
    needs = [
        p.name
        for p in parameters
        if p.default is inspect.Parameter.empty
        and p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]
    name = type(scheduler).__name__
    if needs and schedule.scheduler_metric is None:
        raise SpecError(
            f"schedule.scheduler {schedule.scheduler!r}: {name}.step() needs {needs[0]!r}, a "
            "value measured at each epoch's end: set schedule.scheduler_metric to a "
            "validation metric (e.g. val_loss)",
            field="schedule.scheduler_metric",
        )
    if not needs and schedule.scheduler_metric is not None:
        raise SpecError(
            f"schedule.scheduler_metric {schedule.scheduler_metric!r}: {name}.step() takes no "
            "metric (only ReduceLROnPlateau-like schedulers do): drop "
            "schedule.scheduler_metric",
            field="schedule.scheduler_metric",
        )
