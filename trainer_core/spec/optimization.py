"""How a run is optimized, as spec sections: the optimizer (a short name or any optimizer by
import path, with nothing of relaytrain's that changes the math), the learning-rate schedule
(the built-in one, or any scheduler by import path, stepped per step or per epoch) and early
stopping."""

from __future__ import annotations

import warnings
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from trainer_core.errors import SpecError
from trainer_core.spec.sections import (
    IMPORT_PATH_PATTERN,
    NonNegativeInt,
    PositiveInt,
    _Section,
    import_path,
)

#: ``optimizer.name``'s short names, and the torch optimizer each names.
BUILTIN_OPTIMIZERS = {
    "sgd": "torch.optim:SGD",
    "adam": "torch.optim:Adam",
    "adamw": "torch.optim:AdamW",
}


#: The optimizer's arguments that have keys of their own in the optimizer section.
OPTIMIZER_OWN_KEYS = ("lr", "weight_decay", "momentum")


class OptimizerSection(_Section):
    #: "sgd", "adam", "adamw" (torch's SGD, Adam, AdamW), or the import path of any optimizer
    #: ``package.module:Class`` (``torch.optim:Adadelta``, or a function returning one), called
    #: as ``Class(params, **kwargs)`` with the ``lr``, ``weight_decay`` and ``momentum`` the
    #: spec sets.
    name: str = "adam"
    #: None (unset): the optimizer's own default, for each of these three (sgd, adam, adamw:
    #: lr 1e-3, weight decay 0, AdamW's 0.01; SGD's momentum 0). ``momentum`` is refused for an
    #: optimizer without one (adam's and adamw's is ``kwargs.betas``).
    lr: Annotated[float, Field(gt=0)] | None = None
    weight_decay: Annotated[float, Field(ge=0)] | None = None
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = None
    #: The optimizer's other keyword arguments (adam's ``betas``, Adadelta's ``rho``).
    kwargs: dict[str, Any] = Field(default_factory=dict)
    #: Global batches per optimizer step: gradients add up over them, DDP synchronizing only
    #: on the last (a loop on relaytrain's API: its session says which batch ends a step).
    #: Steps and checkpoints count optimizer steps, so a checkpoint never holds a
    #: half-accumulated gradient.
    grad_accumulation: PositiveInt = 1
    #: Clip the gradients' total norm to this before each optimizer step (after fp16's
    #: unscaling); the norm before clipping is recorded as ``grad_norm``. None: no clipping.
    clip_grad_norm: Annotated[float, Field(gt=0)] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value not in BUILTIN_OPTIMIZERS and not IMPORT_PATH_PATTERN.fullmatch(value):
            raise ValueError(
                f"optimizer.name {value!r} is neither 'sgd', 'adam' or 'adamw' nor the import "
                "path of an optimizer 'package.module:Class' (e.g. 'torch.optim:Adadelta')"
            )
        return value

    @field_validator("kwargs")
    @classmethod
    def _kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        own = [key for key in OPTIMIZER_OWN_KEYS if key in value]
        if own:
            raise SpecError(
                f"optimizer.kwargs.{own[0]}: set optimizer.{own[0]} instead (kwargs holds the "
                "optimizer's other arguments)",
                field="optimizer.kwargs",
            )
        if "params" in value:
            raise SpecError(
                "optimizer.kwargs.params: the model's parameters are passed by relaytrain; drop it",
                field="optimizer.kwargs",
            )
        return value

    @property
    def import_path(self) -> str:
        """What ``name`` names as ``package.module:Class`` (a short name's torch class)."""
        return BUILTIN_OPTIMIZERS.get(self.name, self.name)

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments the optimizer is called with (besides the parameters): the
        keys of its own the spec sets, and ``kwargs``."""
        own = {key: getattr(self, key) for key in OPTIMIZER_OWN_KEYS}
        return {**{k: v for k, v in own.items() if v is not None}, **self.kwargs}

    def describe(self) -> str:
        """The optimizer in a few words: its name and the arguments the spec sets."""
        arguments = ", ".join(f"{k} {v}" for k, v in self.arguments().items())
        return f"{self.name} ({arguments or 'its defaults'})"


class EarlyStoppingSection(_Section):
    """Stop when ``metric`` (a validation metric, measured at the end of every epoch) has not
    improved by more than ``min_delta`` for ``patience`` epochs in a row."""

    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: PositiveInt = 3
    min_delta: Annotated[float, Field(ge=0)] = 0.0


def _default(section: type[_Section], key: str) -> Any:
    return section.model_fields[key].default


class ScheduleSection(_Section):
    epochs: PositiveInt
    lr_schedule: Literal["constant", "cosine", "step"] = "constant"
    #: Optimizer steps of linear warm-up.
    warmup_steps: NonNegativeInt = 0
    #: For lr_schedule "step": multiply the rate by ``gamma`` every ``step_size`` optimizer
    #: steps.
    step_size: PositiveInt = 100
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.5
    #: Stop before ``epochs`` when a validation metric stops improving (its state is
    #: checkpointed, so a retry does not reset the patience). None: train every epoch.
    early_stopping: EarlyStoppingSection | None = None
    #: Instead of lr_schedule: the import path of any LR scheduler
    #: (``torch.optim.lr_scheduler:StepLR``, or a function returning one), called as
    #: ``Class(optimizer, **scheduler_kwargs)``; its state is in every checkpoint.
    scheduler: str | None = None
    scheduler_kwargs: dict[str, Any] = Field(default_factory=dict)
    #: When ``scheduler.step()`` is called: after every optimizer step ("step"), or once at
    #: each epoch's end, after its validation ("epoch"). So the scheduler's own counts
    #: (StepLR's ``step_size``, CosineAnnealingLR's ``T_max``) are in these units. None:
    #: "epoch" with ``scheduler_metric``, else "step".
    scheduler_interval: Literal["step", "epoch"] | None = None
    #: A validation metric (``val_loss``) measured at each epoch's end and passed to
    #: ``scheduler.step(value)`` (ReduceLROnPlateau).
    scheduler_metric: str | None = None

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: str | None) -> str | None:
        return import_path(
            value,
            "schedule.scheduler",
            "e.g. 'torch.optim.lr_scheduler:StepLR', called as Class(optimizer, **kwargs)",
        )

    @model_validator(mode="after")
    def _one_schedule(self) -> ScheduleSection:
        if self.scheduler is None:
            self._say_if_step_keys_do_nothing()
            alone = [
                key
                for key in ("scheduler_kwargs", "scheduler_interval", "scheduler_metric")
                if getattr(self, key)
            ]
            if alone:
                raise SpecError(
                    f"schedule.{alone[0]} configures schedule.scheduler, which is not set: set "
                    f"schedule.scheduler (e.g. 'torch.optim.lr_scheduler:StepLR'), or drop "
                    f"schedule.{alone[0]}",
                    field=f"schedule.{alone[0]}",
                )
            return self
        lr_schedule = [
            (key, value)
            for key, value in (
                ("lr_schedule", self.lr_schedule != "constant"),
                ("warmup_steps", self.warmup_steps > 0),
                # not model_fields_set: a worker validates the spec's dump, every key set
                ("step_size", self.step_size != _default(ScheduleSection, "step_size")),
                ("gamma", self.gamma != _default(ScheduleSection, "gamma")),
            )
            if value
        ]
        if lr_schedule:
            key = lr_schedule[0][0]
            raise SpecError(
                f"schedule.{key}={getattr(self, key)!r} is the built-in lr_schedule's, and "
                f"schedule.scheduler {self.scheduler!r} sets the rate instead: drop schedule."
                f"{key} (lr_schedule constant, warmup_steps 0), or schedule.scheduler. To warm "
                "up before your scheduler, name a function returning torch's SequentialLR of "
                "LinearLR and it",
                field=f"schedule.{key}",
            )
        if self.scheduler_metric is not None and self.scheduler_interval == "step":
            raise SpecError(
                f"schedule.scheduler_metric {self.scheduler_metric!r} is measured at each "
                "epoch's end, so the scheduler steps then: set schedule.scheduler_interval "
                "epoch (or drop it)",
                field="schedule.scheduler_interval",
            )
        return self

    def _say_if_step_keys_do_nothing(self) -> None:
        """``step_size`` and ``gamma`` are lr_schedule step's: with another, a warning."""
        changed = [
            key
            for key in ("step_size", "gamma")
            if getattr(self, key) != _default(ScheduleSection, key)
        ]
        if changed and self.lr_schedule != "step":
            warnings.warn(
                f"schedule.{changed[0]} does nothing with lr_schedule {self.lr_schedule!r}: it "
                "is lr_schedule step's (the rate times gamma every step_size optimizer steps). "
                "Set lr_schedule step, or drop it",
                UserWarning,
                stacklevel=2,
            )

    @property
    def stepped_per(self) -> Literal["step", "epoch"]:
        """When ``scheduler`` steps: after every optimizer step, or at each epoch's end."""
        if self.scheduler_interval is not None:
            return self.scheduler_interval
        return "epoch" if self.scheduler_metric is not None else "step"

    def describe(self) -> str:
        """The schedule in a few words."""
        if self.scheduler is None:
            return self.lr_schedule
        metric = f" on {self.scheduler_metric}" if self.scheduler_metric else ""
        return f"{self.scheduler} per {self.stepped_per}{metric}"
