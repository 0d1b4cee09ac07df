"""The validation metrics, one definition for the loop (each rank's validation rows, after
every epoch) and for the driver (a checkpoint evaluated on the holdout): val_loss (the spec's
loss), val_accuracy for classification, and the spec's own metrics, each a per-sample mean.

Both sum a part's per-sample values (``part_sums``) and divide by the rows seen, so a mean over
parts (and over ranks, after one all-reduce) is the mean over every row.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch


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
