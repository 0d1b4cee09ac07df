"""A training loop of your own on relaytrain's API (``train_loop_api: relaytrain``).

``own_loop.session()`` gives the loop the run's data stream from its cursor, checkpoints in
relaytrain's committed format and reports: a fault, a retry or an in-place restart resumes it
bit-identically, as the built-in loop is (examples/own_loop.yaml runs it).
"""

from typing import Any

import torch
from torch import nn

from trainer_core.train import own_loop


def train(config: dict[str, Any]) -> None:
    run = own_loop.session()
    model = build(int(config.get("hidden", 64)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 3e-3)))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=run.total_steps)
    # Restores model, optimizer, scheduler, RNG and cursor from the newest checkpoint.
    model = run.setup(model, optimizer, scheduler)
    for batch in run.batches():  # this rank's slice of each global batch, from the cursor
        model.train()
        loss = nn.functional.cross_entropy(model(batch["features"]), batch["labels"])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()
        metrics = {"loss": loss.item()}
        if run.end_of_epoch:  # measured on the weights this step's checkpoint holds
            metrics.update(evaluate(run, model))
        run.report(metrics)  # ends the step; checkpoints when checkpoint.every says


def build(hidden: int = 64) -> nn.Module:
    """The model: an MLP on the digits' 64 pixels, with dropout (each rank draws its own)."""
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, 10))


def evaluate(run: own_loop.OwnLoop, model: nn.Module) -> dict[str, float]:
    """Loss and accuracy over every validation row of every rank: sums, then one division."""
    model.eval()
    loss = correct = count = 0.0
    with torch.no_grad():
        for batch in run.validation():
            logits = model(batch["features"])
            labels = batch["labels"]
            loss += nn.functional.cross_entropy(logits, labels, reduction="sum").item()
            correct += (logits.argmax(dim=1) == labels).sum().item()
            count += len(labels)
    loss, correct, count = run.sum_over_ranks([loss, correct, count])
    return {"val_loss": loss / count, "val_accuracy": correct / count}
