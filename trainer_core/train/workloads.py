"""Built-in models, and the import-path contract for users' models and training loops.

A user model is ``package.module:function`` called as ``function(num_inputs, num_outputs,
**model.kwargs)`` and returning a ``torch.nn.Module`` that maps ``[batch, num_inputs]`` float
features to ``[batch, num_outputs]``. A user training loop is ``package.module:function`` with
Ray Train's ``train_loop_per_worker`` signature (``fn()`` or ``fn(config)``).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from trainer_core.errors import SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.sections import ModelSection, metric_name


def resolve_train_loop(path: str) -> Callable[..., Any]:
    fn = import_object(path, "train_loop")
    params = [
        p
        for p in inspect.signature(fn).parameters.values()
        if p.default is inspect.Parameter.empty
        and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    if len(params) > 1:
        raise SpecError(
            f"train_loop {path!r} takes {len(params)} required arguments; a Ray Train loop "
            "takes none or one (config)",
            field="train_loop",
        )
    return fn


def call_train_loop(fn: Callable[..., Any], config: dict[str, Any]) -> None:
    """A user's loop called as Ray Train calls it: with ``train_loop_config`` when it takes an
    argument."""
    if len(inspect.signature(fn).parameters) >= 1:
        fn(dict(config))
    else:
        fn()


class MLP(nn.Module):
    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        hidden: tuple[int, ...] = (128, 64),
        dropout: float = 0.0,
    ):
        super().__init__()
        layers: list[nn.Module] = []
        width = num_inputs
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU()]
            if dropout:
                layers.append(nn.Dropout(dropout))
            width = size
        layers.append(nn.Linear(width, num_outputs))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class SmallCNN(nn.Module):
    """Two conv blocks and a linear head, for small single-channel images (digits: 1x8x8)."""

    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        channels: tuple[int, int] = (16, 32),
        image_shape: tuple[int, int, int] | None = None,
        dropout: float = 0.0,
    ):
        super().__init__()
        if image_shape is None:
            side = math.isqrt(num_inputs)
            if side * side != num_inputs:
                raise SpecError(
                    f"model 'cnn' needs square single-channel images, but there are {num_inputs} "
                    "features: set model.kwargs.image_shape: [channels, height, width]",
                    field="model.kwargs.image_shape",
                )
            image_shape = (1, side, side)
        c, h, w = image_shape
        if c * h * w != num_inputs:
            raise SpecError(
                f"model.kwargs.image_shape {list(image_shape)} holds {c * h * w} values, but "
                f"the data has {num_inputs} features",
                field="model.kwargs.image_shape",
            )
        self.image_shape = (c, h, w)
        self.features = nn.Sequential(
            nn.Conv2d(c, channels[0], 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(channels[0], channels[1], 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Dropout(dropout),
            nn.Linear(channels[1] * (h // 2) * (w // 2), num_outputs),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x.view(-1, *self.image_shape)))


BUILDERS: dict[str, Callable[..., nn.Module]] = {"mlp": MLP, "cnn": SmallCNN}


def build_model(
    model: ModelSection, num_inputs: int, num_outputs: int, columns_form: bool = False
) -> nn.Module:
    """Build the model a spec names: ``fn(num_inputs, num_outputs, **kwargs)``, or for the
    columns form ``fn(**kwargs)``; SpecError for a bad name, kwargs or return value."""
    if columns_form and model.name in BUILDERS:
        raise SpecError(
            f"model.name {model.name!r} is built from a feature count, which data.columns does "
            "not have: name a builder 'package.module:function' called as fn(**model.kwargs) "
            "and returning any torch.nn.Module, or use data.features and data.label",
            field="model.name",
        )
    builder = BUILDERS.get(model.name) or import_object(model.name, "model.name")
    kwargs = {k: tuple(v) if isinstance(v, list) else v for k, v in model.kwargs.items()}
    try:
        if columns_form:
            module = builder(**model.kwargs)
        else:
            module = builder(num_inputs, num_outputs, **kwargs)
    except (SpecError, OSError):  # an OSError (a download, a file) may be transient
        raise
    except TypeError as e:
        raise SpecError(
            f"model {model.name!r} rejected model.kwargs {model.kwargs}: {e}. Fix model.kwargs "
            f"to fit the builder's parameters {_parameters(builder, 0 if columns_form else 2)}",
            field="model.kwargs",
        ) from e
    except Exception as e:
        raise SpecError(
            f"model.name {model.name!r} raised {type(e).__name__} while building with "
            f"{'' if columns_form else f'num_inputs={num_inputs}, num_outputs={num_outputs}, '}"
            f"model.kwargs={model.kwargs}: {e}. Fix the builder, or model.kwargs.",
            field="model.name",
        ) from e
    if not isinstance(module, nn.Module):
        raise SpecError(
            f"model.name {model.name!r} returned {type(module).__name__}, not a torch.nn.Module: "
            "make the builder return the model",
            field="model.name",
        )
    return module


def _parameters(builder: Callable[..., Any], skip: int = 2) -> list[str]:
    try:
        return list(inspect.signature(builder).parameters)[skip:]
    except (TypeError, ValueError):
        return []


Metric = Callable[[torch.Tensor, torch.Tensor], Any]


def loss_function(
    task: str, path: str | None = None
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The spec's ``loss`` by import path, else the task's: cross-entropy or mean squared error."""
    if path is not None:
        return import_object(path, "loss")
    if task == "classification":
        return nn.functional.cross_entropy
    return lambda output, target: nn.functional.mse_loss(output.squeeze(-1), target)


def metric_functions(paths: list[str]) -> dict[str, Metric]:
    """The spec's ``metrics`` by the name each is recorded under (``val_<function>``)."""
    found = {}
    for i, path in enumerate(paths):
        fn = import_object(path, f"metrics.{i}")
        if inspect.isclass(fn):
            raise SpecError(
                f"metrics.{i} {path!r} is a class, a stateful metric: those need the columns "
                "form (data.columns; update(outputs, batch)). In the tabular form a metric is "
                "fn(output, target) returning the batch's mean",
                field=f"metrics.{i}",
            )
        found[metric_name(path)] = fn
    return found


def check_loss_and_metrics(
    model: nn.Module,
    features: torch.Tensor,
    labels: torch.Tensor,
    loss: str | None,
    metrics: list[str],
    task: str,
) -> None:
    """Call the spec's own loss and metrics on the model's output for a few training rows, as
    the loop will: SpecError, naming the function, for one that raises or returns what the
    loop cannot use (before any worker starts)."""
    output = model(features)
    if loss is not None:
        value = _call(loss_function(task, loss), output, labels, "loss", loss)
        if not isinstance(value, torch.Tensor) or value.numel() != 1:
            raise SpecError(
                f"loss {loss!r} returned {_describe(value)}: return the batch's mean loss as a "
                "scalar tensor (e.g. torch.nn.functional.l1_loss(output, target))",
                field="loss",
            )
        if not value.requires_grad:
            raise SpecError(
                f"loss {loss!r} returned a tensor that does not depend on the model's output "
                "(no gradient flows back): compute it from `output` with torch operations, "
                "without .item(), .detach() or numpy",
                field="loss",
            )
    with torch.no_grad():
        for i, (name, fn) in enumerate(metric_functions(metrics).items()):
            value = _call(fn, output.detach(), labels, f"metrics.{i}", metrics[i])
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                value = value.item()
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise SpecError(
                    f"metrics.{i} {metrics[i]!r} (recorded as {name}) returned "
                    f"{_describe(value)}: return the batch's mean as a number or a scalar tensor",
                    field=f"metrics.{i}",
                )


def _call(fn: Callable[..., Any], output: Any, labels: Any, field: str, path: str) -> Any:
    try:
        return fn(output, labels)
    except Exception as e:
        raise SpecError(
            f"{field} {path!r} raised {type(e).__name__} on the model's output (shape "
            f"{list(output.shape)}) and target (shape {list(labels.shape)}, {labels.dtype}) of "
            f"the first training rows: {e}. Fix the function: it is called as fn(output, target)",
            field=field,
        ) from e


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]
