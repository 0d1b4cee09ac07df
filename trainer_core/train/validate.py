"""The validation metrics, one definition for the loop (each rank's validation rows, after
every epoch) and for the driver (a checkpoint evaluated on the holdout): val_loss (the spec's
loss), val_accuracy for classification, and the spec's own metrics, each a per-sample mean.

Both sum a part's per-sample values (``part_sums``) and divide by the rows seen, so a mean over
parts (and over ranks, after one all-reduce) is the mean over every row. ``RankValidation`` is
the loop's pass over one rank's rows, in step with the other ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer_core.data import arrays as data_mod
from trainer_core.execution.worker_group import all_reduce
from trainer_core.train.batch_workload import BatchWorkload


def metric_names(classification: bool, metric_fns: Mapping[str, Any]) -> list[str]:
    """The validation metrics recorded, in order."""
    return ["val_loss", *(["val_accuracy"] if classification else []), *metric_fns]


def part_sums(
    output: torch.Tensor,
    labels: torch.Tensor,
    loss: torch.Tensor,
    classification: bool,
    metric_fns: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]],
) -> dict[str, float]:
    """One part's sums of the per-sample metrics (``loss``: the loss function's mean over the
    part, computed where the caller's precision wants it)."""
    rows = len(labels)
    sums = {"val_loss": float(loss) * rows}
    if classification:
        sums["val_accuracy"] = float((output.argmax(dim=1) == labels).sum())
    for name, fn in metric_fns.items():
        sums[name] = float(fn(output, labels)) * rows
    return sums


@dataclass
class RankValidation:
    """The built-in loop's validation on one rank: its rows' metric sums, all-reduced once and
    divided by every rank's rows."""

    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    metric_fns: Mapping[str, Callable[[torch.Tensor, torch.Tensor], Any]]
    classification: bool
    #: Autocast to the run's precision, and a batch moved to the model's device.
    autocast: Callable[[], Any]
    to_device: Callable[[Any], torch.Tensor]
    #: Under FSDP every forward pass is a collective: a rank out of rows runs one on a dummy row
    #: of ``num_features`` while another still has rows.
    fsdp: bool
    num_features: int
    world_size: int

    @torch.no_grad()
    def run(self, model: torch.nn.Module, parts: Iterator[data_mod.Arrays]) -> dict[str, float]:
        """The metrics over every rank's ``parts`` (empty when no rank has validation rows)."""
        self._broadcast_buffers(model)
        model.eval()
        names = metric_names(self.classification, self.metric_fns)
        # Per-sample means, as sums over this rank's rows: all-reduced once, then divided.
        sums = dict.fromkeys(names, 0.0)
        seen = 0
        for part in self._in_step(parts):
            if part is None:  # FSDP: this rank's rows are done, the others' are not
                with self.autocast():
                    model(self.to_device(np.zeros((1, self.num_features), np.float32)))
                continue
            features = self.to_device(part.features)
            labels = self.to_device(part.labels)
            with self.autocast():
                output = model(features)
                loss = self.loss_fn(output, labels)
            found = part_sums(output, labels, loss, self.classification, self.metric_fns)
            for name, value in found.items():
                sums[name] += value
            seen += len(part)
        *totals, count = all_reduce([*sums.values(), float(seen)])
        if count == 0:
            return {}
        return {name: total / count for name, total in zip(names, totals, strict=True)}

    def _broadcast_buffers(self, model: torch.nn.Module) -> None:
        broadcast_buffers(model, self.world_size)

    def _in_step(self, parts: Iterator[data_mod.Arrays]) -> Iterator[data_mod.Arrays | None]:
        return in_step(parts, self.fsdp)


def broadcast_buffers(model: torch.nn.Module, world_size: int) -> None:
    """Every rank validates with rank 0's buffers (batch norm's running statistics), the ones a
    checkpoint saves. DDP broadcasts them from rank 0 before each training forward pass, which
    then updates each rank's from its own slice of the batch: after the last one they differ
    by rank (and FSDP never syncs them)."""
    if world_size > 1:
        for buffer in model.buffers():
            dist.broadcast(buffer, src=0)


def in_step(parts: Iterator[Any], fsdp: bool) -> Iterator[Any | None]:
    """``parts``; under FSDP (every forward pass a collective), as many as the rank with the
    most parts has (None once this rank's are done)."""
    if not fsdp:
        yield from parts
        return
    while True:
        part = next(parts, None)
        if all_reduce([float(part is not None)])[0] == 0:
            return
        yield part


@dataclass
class BatchValidation:
    """The columns form's validation on one rank: each metric's sum and count over its
    batches (``BatchWorkload.metric_sums``), all-reduced once, then divided."""

    workload: BatchWorkload
    autocast: Callable[[], Any]
    #: A batch on the model's device.
    to_device: Callable[[Any], Any]
    fsdp: bool
    world_size: int

    @torch.no_grad()
    def run(
        self, model: torch.nn.Module, batches: Iterator[Any], dummy: Any = None
    ) -> dict[str, float]:
        """The metrics over every rank's ``batches``; under FSDP a rank out of batches runs
        ``dummy`` (a batch it trained on) while another still has some."""
        broadcast_buffers(model, self.world_size)
        model.eval()
        names = [
            n
            for n in self.workload.metric_names()
            if n != "val_perplexity" and n not in self.workload.stateful
        ]
        sums = dict.fromkeys(names, (0.0, 0.0))
        states = self.workload.new_states()
        for batch in in_step(batches, self.fsdp):
            if batch is None:
                with self.autocast():
                    self.workload.forward(model, self.to_device(dummy))
                continue
            batch = self.to_device(batch)
            with self.autocast():
                outputs = self.workload.forward(model, batch)
            for name, (total, count) in self.workload.metric_sums(outputs, batch).items():
                sums[name] = (sums[name][0] + total, sums[name][1] + count)
            self.workload.update_states(states, outputs, batch)
        flat = all_reduce([value for pair in sums.values() for value in pair])
        totals = {name: (flat[2 * i], flat[2 * i + 1]) for i, name in enumerate(names)}
        return self.workload.finish(totals, compute_states(states, self.world_size))


def compute_states(states: dict[str, Any], world_size: int) -> dict[str, float]:
    """Each stateful metric's figure over every rank's batches: every rank's instance gathered
    and folded into rank 0's (``merge``, in rank order, the same on every rank), then
    ``compute()``d; a metric that syncs itself (torchmetrics') is computed as it is."""
    found: dict[str, float] = {}
    for name, metric in states.items():
        if world_size > 1 and not syncs_itself(metric):
            gathered: list[Any] = [None] * world_size
            dist.all_gather_object(gathered, metric)
            metric = gathered[0]
            for other in gathered[1:]:
                metric.merge(other)
        found[name] = float(metric.compute())
    return found


def syncs_itself(metric: Any) -> bool:
    """A torchmetrics ``Metric``, which gathers its states across ranks in ``compute()``."""
    return bool(getattr(metric, "sync_on_compute", False)) and hasattr(metric, "sync")
