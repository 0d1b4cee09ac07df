"""The optimizer a spec names, built: a short name (``sgd``, ``adam``, ``adamw``: torch's) or
the import path of any optimizer, called with the arguments the spec sets and nothing of
relaytrain's own (an unset ``lr``, ``weight_decay`` or ``momentum`` is the optimizer's
default). What it cannot take is a SpecError naming the key: setup builds it on the driver
(``check_optimizer_and_schedule``) before any worker starts.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from trainer_core.checkpoint import training_state
from trainer_core.errors import SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.optimization import OptimizerSection, ScheduleSection


def make_optimizer(params: Any, section: OptimizerSection) -> torch.optim.Optimizer:
    """``section``'s optimizer over ``params``; SpecError for an argument it does not take."""
    optimizer_class = import_object(section.import_path, "optimizer.name")
    _check_step(optimizer_class, section)
    arguments = section.arguments()
    _check_arguments(optimizer_class, arguments, section)
    try:
        optimizer = optimizer_class(params, **arguments)
    except (TypeError, ValueError) as e:
        raise SpecError(
            f"optimizer {section.name} refused its arguments {arguments}: {e}. Fix "
            "optimizer.kwargs (or optimizer.lr, .weight_decay, .momentum)",
            field="optimizer.kwargs",
        ) from e
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise SpecError(
            f"optimizer.name {section.name!r} made a {type(optimizer).__name__}, not a "
            "torch.optim.Optimizer: name an optimizer class, or a function returning one",
            field="optimizer.name",
        )
    return optimizer


def hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """Each parameter group's settings (all but its parameters), as built."""
    return [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]


def kept_by_checkpoint(built: list[dict[str, Any]], optimizer: torch.optim.Optimizer) -> str | None:
    """What a restored ``optimizer`` kept of its checkpoint over the settings it was ``built``
    with (torch's ``load_state_dict`` restores every group's settings): None when nothing
    differs. The rate is the schedule's (``Schedule`` applies a changed ``optimizer.lr``)."""
    kept = sorted(
        {
            f"{key} {group[key]!r} (the spec's {before[key]!r})"
            for before, group in zip(built, optimizer.param_groups, strict=False)
            for key in before
            if key not in ("lr", "initial_lr")
            and key in group
            and not isinstance(before[key], torch.Tensor)  # a tensor rate follows the schedule
            and group[key] != before[key]
        }
    )
    if not kept:
        return None
    return (
        f"the checkpoint's optimizer keeps {', '.join(kept)}: optimizer.momentum, "
        ".weight_decay and .kwargs apply to a new run"
    )


def _parameters(function: Any) -> dict[str, inspect.Parameter] | None:
    """``function``'s named parameters, or None when it takes any keyword (``**kwargs``) or
    its signature cannot be read."""
    try:
        parameters = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return None
    return dict(parameters)


def _check_step(optimizer_class: Any, section: OptimizerSection) -> None:
    """The loop calls ``optimizer.step()``: an optimizer whose step needs a closure (LBFGS)
    re-evaluates the loss itself, which the loop cannot give it."""
    step = getattr(optimizer_class, "step", None)
    parameters = _parameters(step) if inspect.isfunction(step) else None
    required = [
        name
        for name, p in (parameters or {}).items()
        if name != "self"
        and p.default is inspect.Parameter.empty
        and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    ]
    if required:
        raise SpecError(
            f"optimizer.name {section.name!r}: its step() needs {required} (a closure that "
            "re-evaluates the loss), which the built-in loop, calling optimizer.step() once "
            "per step, does not give: use another optimizer, or a loop of your own "
            "(train_loop_api: relaytrain)",
            field="optimizer.name",
        )


def _check_arguments(
    optimizer_class: Any, arguments: dict[str, Any], section: OptimizerSection
) -> None:
    parameters = _parameters(optimizer_class)
    if parameters is None:
        return
    takes = [name for name in parameters if name not in ("self", "params")]
    for key in arguments:
        if key in parameters:
            continue
        field = f"optimizer.{key}" if key not in section.kwargs else "optimizer.kwargs"
        raise SpecError(
            f"{field.replace('kwargs', f'kwargs.{key}')}: optimizer {section.name} takes no "
            f"{key!r} (its arguments: {takes}): drop it"
            + (" (its momentum, if any, is one of those)" if key == "momentum" else ""),
            field=field,
        )


def check_optimizer_and_schedule(
    section: OptimizerSection, schedule: ScheduleSection, total_steps: int
) -> None:
    """Build the spec's optimizer and LR schedule (over a stand-in parameter) and pass their
    state through a checkpoint's bytes: SpecError for one that cannot be built, or whose
    state a checkpoint could not load back (``weights_only``: tensors and plain values)."""
    from trainer_core.checkpoint import schedules

    optimizer = make_optimizer([torch.nn.Parameter(torch.zeros(1))], section)
    scheduler = schedules.make_scheduler(optimizer, schedule, total_steps)
    inner = getattr(scheduler, "scheduler", scheduler)
    for state, field in ((optimizer, "optimizer.name"), (inner, "schedule.scheduler")):
        try:
            training_state.from_bytes(training_state.to_bytes(state.state_dict()))
        except Exception as e:  # a pickling error of any kind, or the refusal to load it
            raise SpecError(
                f"{field}: the state_dict() of {type(state).__name__} holds more than tensors "
                f"and plain values ({type(e).__name__}: {str(e).splitlines()[0][:200]}), so "
                "its checkpoints could not be loaded back (relaytrain loads them with "
                "torch.load(weights_only=True)): make its state_dict plain",
                field=field,
            ) from e
