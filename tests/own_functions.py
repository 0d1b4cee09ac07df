"""A loss, validation metrics and an FSDP sharding of a user's own, for the built-in loop's tests
(importable by Ray workers), and ones that are wrong in the ways setup must refuse."""

from __future__ import annotations

from typing import Any

import torch
from torch.nn import functional


def huber(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return functional.smooth_l1_loss(output.squeeze(-1), target, beta=0.5)


def mean_abs_error(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (output.squeeze(-1).float() - target).abs().mean()


def within_half(output: torch.Tensor, target: torch.Tensor) -> float:
    """The share of predictions within 0.5 of the target (a plain float is fine too)."""
    return float(((output.squeeze(-1).float() - target).abs() < 0.5).float().mean())


def per_sample_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Wrong: a loss per sample, not the batch's mean."""
    return (output.squeeze(-1) - target) ** 2


def detached_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Wrong: computed through numpy, so no gradient reaches the model."""
    return torch.tensor(float(((output.detach().squeeze(-1) - target) ** 2).mean()))


def loss_for_labels(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Wrong for a regression target: cross-entropy wants class indices."""
    return functional.cross_entropy(output, target)


def metric_as_text(output: torch.Tensor, target: torch.Tensor) -> str:
    """Wrong: a metric must be a number."""
    return "fine"


def shard(model: Any, mesh: Any) -> None:
    """A user's FSDP sharding (``scaling.shard_fn``): the built-in MLP's linear layers as
    units, kept gathered between forward and backward."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh, reshard_after_forward=False)


def trains_twice(config: dict[str, Any]) -> None:
    """An own loop (``train_loop_api: relaytrain``) that goes over ``batches()`` a second time
    after training the run once: API misuse, which would silently train the run again."""
    from trainer_core.train import own_loop

    run = own_loop.session()
    model = torch.nn.Linear(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = run.setup(model, optimizer)
    for _ in range(2):
        for batch in run.batches():
            loss = torch.nn.functional.mse_loss(
                model(batch["features"]).squeeze(1), batch["labels"]
            )
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.report({"loss": loss.item(), "loss_weight": run.loss_weight})


def accumulates(config: dict[str, Any]) -> None:
    """An own loop that accumulates each optimizer step's gradients over the batches
    ``optimizer.grad_accumulation`` gives it: DDP all-reduces on a step's last batch only
    (``run.no_sync()``), the optimizer steps and the step is reported where ``run.ends_step``
    says, each batch's loss weighted by ``run.loss_weight`` (its share of the step). A step's
    row says whether, after its first batch's backward, the ranks' gradients still differed
    (``kept_apart``: no all-reduce ran; DDP's would have made them equal)."""
    from examples.own_loop import build
    from trainer_core.train import own_loop

    run = own_loop.session()
    model = build(int(config.get("hidden", 32)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=float(config.get("lr", 0.01)))
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=run.total_steps)
    model = run.setup(model, optimizer, scheduler)
    model.train()
    step_loss = 0.0
    kept_apart: dict[str, bool] = {}
    for batch in run.batches():
        with run.no_sync():
            loss = functional.cross_entropy(model(batch["features"]), batch["labels"])
            (loss * run.loss_weight).backward()
        step_loss += loss.item() * run.loss_weight
        if not run.ends_step and not kept_apart:
            grad = next(model.parameters()).grad
            assert grad is not None
            own = [float(grad.sum()) if r == run.rank else 0.0 for r in range(run.world_size)]
            kept_apart["kept_apart"] = len(set(run.sum_over_ranks(own))) > 1
        if run.ends_step:
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
            run.report({"loss": step_loss, **kept_apart})
            step_loss, kept_apart = 0.0, {}


class WithUnusedLayer(torch.nn.Module):
    """A model with a layer its forward never uses (a head kept for later): DDP's all-reduce
    waits for that layer's gradients unless told ``find_unused_parameters``."""

    def __init__(self, num_inputs: int, num_outputs: int):
        super().__init__()
        self.used = torch.nn.Linear(num_inputs, num_outputs)
        self.unused = torch.nn.Linear(num_inputs, num_outputs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def with_unused_layer(num_inputs: int, num_outputs: int) -> torch.nn.Module:
    """``model.name`` builder of ``WithUnusedLayer``."""
    return WithUnusedLayer(num_inputs, num_outputs)


def unused_layer_loop(config: dict[str, Any]) -> None:
    """An own loop training ``WithUnusedLayer``, whose ``setup`` is given ``config['ddp']``."""
    from trainer_core.train import own_loop

    run = own_loop.session()
    model = WithUnusedLayer(6, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model = run.setup(model, optimizer, ddp=config.get("ddp"))
    for batch in run.batches():
        loss = functional.mse_loss(model(batch["features"]).squeeze(1), batch["labels"])
        optimizer.zero_grad()
        (loss * run.loss_weight).backward()
        optimizer.step()
        run.report({"loss": loss.item()})
