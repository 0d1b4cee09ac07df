"""The columns form's contract between a batch (a dict of tensors), the model, the loss and the
metrics, after Composer's ``forward(batch)``/``loss(outputs, batch)`` and HuggingFace's
``num_items_in_batch``.

- **Model call.** ``model.forward: fn(model, batch)`` when the spec names one; else
  ``model.inputs``: one key, passed positionally, or keys passed as keyword arguments; by
  default every key but ``labels``, as keyword arguments (a HuggingFace model takes
  ``input_ids`` and ``attention_mask`` so); a torch Dataset's ``(input, target)`` samples make
  ``{"input", "labels"}``, and the model is called as ``model(input)``.
- **Outputs.** A tensor, or an object with ``logits`` (HuggingFace's ``ModelOutput``), or a
  tuple whose first item is the logits.
- **Loss.** ``(summed loss, count of the items it covers)``: the loop adds both over the step's
  micro-batches and every rank, and divides once, so the gradients are those of one batch of
  all of them whatever the worker count, the accumulation or the padding. The spec's ``loss``
  is ``fn(outputs, batch)`` returning that pair, or a mean (weighted by the batch's samples);
  else data.task's: classification (cross-entropy over samples), regression (squared error),
  causal_lm (cross-entropy over the tokens that carry a label; position t predicts
  ``labels[t + 1]``, -100 carries none).
- **Metrics.** Sums with counts too, reduced over ranks before dividing: val_loss,
  val_accuracy (per sample, or per labelled token), val_perplexity (exp of val_loss), and the
  spec's ``metrics``, each ``fn(outputs, batch)`` returning ``(sum, count)`` or a mean.
- **Stateful metrics.** A ``metrics`` entry that names a class (F1, AUC: what no sum of batch
  figures gives): one instance per validation pass on each rank, ``update(outputs, batch)`` on
  each batch, then every rank's instance folded into one (``merge(other)``, in rank order) and
  ``compute()``d: the figure of every validation row. A torchmetrics ``Metric`` (its
  ``update`` taking ``(outputs, batch)``) syncs its own states in ``compute()``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any

import torch
from torch.nn import functional

from trainer_core.data.samples import INPUT
from trainer_core.spec.imports import import_object
from trainer_core.spec.run_spec import RunSpec
from trainer_core.spec.sections import metric_name

#: The batch key of the built-in losses' targets (HuggingFace's name).
LABELS = "labels"
#: A label that carries no loss (PyTorch's ``ignore_index``, HuggingFace's padding label).
IGNORE = -100

Batch = dict[str, torch.Tensor]
Sum = tuple[torch.Tensor, torch.Tensor]


def logits_of(outputs: Any) -> torch.Tensor:
    """The logits of a model's outputs: a tensor, ``outputs.logits``, or a tuple's first."""
    if isinstance(outputs, torch.Tensor):
        return outputs
    logits = getattr(outputs, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(outputs, tuple | list) and outputs and isinstance(outputs[0], torch.Tensor):
        return outputs[0]
    raise TypeError(
        f"the model returned {type(outputs).__name__}, which holds no logits: return a tensor, "
        "an object with .logits, or a tuple whose first item is the logits"
    )


def samples_in(batch: Batch) -> int:
    """Samples in a batch: the labels' first dimension, else any tensor's."""
    first = batch.get(LABELS)
    if first is None:
        first = next(iter(batch.values()))
    return int(first.shape[0])


def _classification(outputs: Any, batch: Batch) -> Sum:
    labels = batch[LABELS]
    loss = functional.cross_entropy(logits_of(outputs).float(), labels, reduction="sum")
    return loss, torch.tensor(float(labels.numel()))


def _regression(outputs: Any, batch: Batch) -> Sum:
    labels = batch[LABELS].float()
    prediction = logits_of(outputs).float().reshape(labels.shape)
    return functional.mse_loss(prediction, labels, reduction="sum"), torch.tensor(
        float(labels.numel())
    )


def _shifted(outputs: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """A causal LM's logits and labels aligned: position t predicts token t + 1."""
    logits = logits_of(outputs)[:, :-1, :]
    labels = batch[LABELS][:, 1:]
    return logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)


def _causal_lm(outputs: Any, batch: Batch) -> Sum:
    logits, labels = _shifted(outputs, batch)
    loss = functional.cross_entropy(logits, labels, ignore_index=IGNORE, reduction="sum")
    return loss, (labels != IGNORE).sum().float()


BUILTIN_LOSSES: dict[str, Callable[[Any, Batch], Sum]] = {
    "classification": _classification,
    "regression": _regression,
    "causal_lm": _causal_lm,
}


def as_sum(value: Any, batch: Batch, device: torch.device | None = None) -> Sum:
    """A loss's or metric's value as ``(sum, count)``: a pair as it is, a mean times the
    batch's samples."""
    if isinstance(value, tuple | list) and len(value) == 2:
        total, count = value
        total = torch.as_tensor(total, device=device)
        return total, torch.as_tensor(count, device=total.device).float()
    mean = torch.as_tensor(value, device=device)
    samples = samples_in(batch)
    return mean * samples, torch.tensor(float(samples), device=mean.device)


class BatchWorkload:
    """A spec's model call, loss and validation metrics for batches of the columns form."""

    def __init__(self, spec: RunSpec):
        assert spec.model is not None and spec.data is not None
        self.task = spec.data.task
        self.inputs = spec.model.inputs
        self.forward_hook = (
            import_object(spec.model.forward, "model.forward") if spec.model.forward else None
        )
        self.loss_path = spec.loss
        self.user_loss = import_object(spec.loss, "loss") if spec.loss else None
        #: The spec's metrics: functions of a batch, and classes of stateful metrics.
        self.metric_fns: dict[str, Callable[..., Any]] = {}
        self.stateful: dict[str, type] = {}
        for i, path in enumerate(spec.metrics):
            found = import_object(path, f"metrics.{i}")
            target = self.stateful if inspect.isclass(found) else self.metric_fns
            target[metric_name(path)] = found
        self.spec_metrics = [metric_name(path) for path in spec.metrics]

    def forward(self, model: torch.nn.Module, batch: Batch) -> Any:
        """The model's outputs for ``batch``."""
        if self.forward_hook is not None:
            return self.forward_hook(model, batch)
        if isinstance(self.inputs, str):
            return model(batch[self.inputs])
        if self.inputs is None and set(batch) == {INPUT, LABELS}:  # a Dataset's (input, target)
            return model(batch[INPUT])
        keys = self.inputs if self.inputs is not None else [k for k in batch if k != LABELS]
        return model(**{k: batch[k] for k in keys})

    def loss(self, outputs: Any, batch: Batch) -> Sum:
        """The batch's summed loss and the count of items it covers."""
        if self.user_loss is not None:
            return as_sum(self.user_loss(outputs, batch), batch)
        assert self.task is not None
        return BUILTIN_LOSSES[self.task](outputs, batch)

    def metric_names(self) -> list[str]:
        """The validation metrics recorded, in order."""
        names = ["val_loss"]
        if self.task == "causal_lm":
            names.append("val_perplexity")
        if self.task in ("classification", "causal_lm"):
            names.append("val_accuracy")
        return [*names, *self.spec_metrics]

    def metric_sums(self, outputs: Any, batch: Batch) -> dict[str, tuple[float, float]]:
        """Each metric's ``(sum, count)`` over a batch (val_perplexity: val_loss's)."""
        total, count = self.loss(outputs, batch)
        sums = {"val_loss": (float(total), float(count))}
        if self.task == "classification":
            labels = batch[LABELS]
            right = (logits_of(outputs).argmax(dim=-1) == labels).sum()
            sums["val_accuracy"] = (float(right), float(labels.numel()))
        elif self.task == "causal_lm":
            logits, labels = _shifted(outputs, batch)
            labelled = labels != IGNORE
            right = ((logits.argmax(dim=-1) == labels) & labelled).sum()
            sums["val_accuracy"] = (float(right), float(labelled.sum()))
        for name, fn in self.metric_fns.items():
            value, items = as_sum(fn(outputs, batch), batch)
            sums[name] = (float(value), float(items))
        return sums

    def new_states(self) -> dict[str, Any]:
        """A fresh instance of each stateful metric, for one validation pass."""
        return {name: cls() for name, cls in self.stateful.items()}

    @staticmethod
    def update_states(states: dict[str, Any], outputs: Any, batch: Batch) -> None:
        for metric in states.values():
            metric.update(outputs, batch)

    def finish(
        self, totals: dict[str, tuple[float, float]], computed: dict[str, float] | None = None
    ) -> dict[str, float]:
        """The metrics from their sums over every rank, with the stateful metrics' ``computed``
        figures (empty when nothing was counted)."""
        if not totals or totals["val_loss"][1] == 0:
            return {}
        found = {name: total / count for name, (total, count) in totals.items() if count}
        found.update(computed or {})
        if self.task == "causal_lm":
            found["val_perplexity"] = math.exp(min(found["val_loss"], 700.0))
        return {name: found[name] for name in self.metric_names() if name in found}
