"""A user's own code, as a team installs its package on the cluster's nodes: the columns form's
model and transform, and a training loop of its own on relaytrain's API, for the adversary's
scenarios that draw them (``scenario.FORMS``).

It is importable as ``adversary_user``: the world puts this directory on the path of the
cluster's nodes and of every command (``world.USER_CODE``), so it is the same module whichever
checkout the adversary drives. The network is the built-in MLP's layers under the same names
(``net.<i>``), which the scoring oracle reads.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn


class Net(nn.Module):
    """Linear layers with ReLU and dropout between them, one output."""

    def __init__(self, inputs: int, hidden: list[int], dropout: float = 0.1):
        super().__init__()
        layers: list[nn.Module] = []
        width = inputs
        for size in hidden:
            layers += [nn.Linear(width, size), nn.ReLU(), nn.Dropout(dropout)]
            width = size
        layers.append(nn.Linear(width, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


# -- the columns form ---------------------------------------------------------------------------


def mlp(inputs: int, hidden: list[int], dropout: float = 0.1) -> nn.Module:
    """``model.name`` of the columns form: ``fn(**kwargs)``."""
    return Net(inputs, hidden, dropout)


def row(sample: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    """``data.transform``: the row's features as the model's ``x``, its target as ``labels``
    (no randomness: the same for training and validation)."""
    return {
        "x": np.asarray(sample["x"], dtype=np.float32),
        "labels": np.float32(sample["y"]),
    }


# -- a loop of one's own ------------------------------------------------------------------------


def train(config: dict[str, Any]) -> None:
    """The regression the built-in loop trains, written as a user writes it on relaytrain's API:
    its own optimizer (``config["optimizer"]``: adam or sgd), an optional warmup-and-cosine
    schedule of its own, one batch a step, and the validation loss on every validation row at
    each epoch's end. (Accumulation through ``ends_step`` is the API's since dc43134, a checkout
    the adversary must still drive: the scenarios that draw this loop draw no accumulation.)"""
    from trainer_core.train import own_loop

    run = own_loop.session()
    model = Net(int(config["inputs"]), list(config["hidden"]), float(config["dropout"]))
    if config["optimizer"] == "sgd":
        optimizer: torch.optim.Optimizer = torch.optim.SGD(
            model.parameters(), lr=0.05, momentum=0.9
        )
    else:
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = None
    if config.get("cosine"):
        total, warmup = run.total_steps, 3

        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, total - warmup)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    model = run.setup(model, optimizer, scheduler)
    for batch in run.batches():
        model.train()
        prediction = model(batch["features"]).squeeze(-1)
        loss = nn.functional.mse_loss(prediction, batch["labels"].float())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        metrics = {"loss": loss.item()}
        if run.end_of_epoch and config.get("validation"):
            metrics["val_loss"] = validation_loss(run, model)
        run.report(metrics)


def validation_loss(run: Any, model: nn.Module) -> float:
    """The mean squared error over every validation row of every rank: sums, one division."""
    model.eval()
    total = count = 0.0
    with torch.no_grad():
        for batch in run.validation():
            prediction = model(batch["features"]).squeeze(-1)
            labels = batch["labels"].float()
            total += nn.functional.mse_loss(prediction, labels, reduction="sum").item()
            count += labels.numel()
    total, count = run.sum_over_ranks([total, count])
    return total / count
