"""One optimizer step of the built-in loop: gradient accumulation over micro-batches, clipping,
the run's precision (autocast, fp16's scaler, when a non-finite loss stops training), and an
epoch's batches grouped into steps."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer_core.data import arrays as data_mod
from trainer_core.errors import TrainingCodeError
from trainer_core.execution.worker_group import all_reduce
from trainer_core.tensors import is_dtensor, is_fsdp_module


def batch_to_device(batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """``batch``'s tensors on ``device``, copied without blocking; its other values as they are."""
    return {
        key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
        for key, value in batch.items()
    }


def to_device(value: Any, device: torch.device) -> Any:
    """``value``'s tensors (in dicts, lists and tuples too) on ``device``, as Ray's
    ``prepare_data_loader`` moves a batch: a batch as the loop's collate function made it."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if isinstance(value, Mapping):
        moved = {k: to_device(v, device) for k, v in value.items()}
        try:
            return type(value)(moved)  # type: ignore[call-arg]
        except TypeError:  # a mapping not made from a dict (a defaultdict): a dict
            return moved
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(to_device(v, device) for v in value))
    if isinstance(value, list | tuple):
        return type(value)(to_device(v, device) for v in value)
    return value


def accumulate_gradients(
    model: torch.nn.Module,
    micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    autocast: Callable[[], Any] = contextlib.nullcontext,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
    weight: float = 1.0,
) -> torch.Tensor:
    """Forward and backward over one optimizer step's micro-batches; returns the step's loss.

    Each micro-batch's mean loss is weighted by its share of the step's samples, so the
    gradients are those of one batch of all of them. DDP's all-reduce (FSDP's reduce-scatter)
    runs once, in the last backward: the others run under ``no_sync`` (FSDP: without gradient
    sync). ``scale`` is fp16's loss scaling; ``weight``
    the rank's (``sample_order.rank_weight``: 1 unless the workers do not divide the batch).
    """
    total = sum(len(labels) for _, labels in micro_batches)
    loss = torch.zeros((), device=micro_batches[0][1].device)
    no_sync = getattr(model, "no_sync", None)
    for position, (features, labels) in enumerate(micro_batches):
        last = position == len(micro_batches) - 1
        if is_fsdp_module(model):
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with autocast():
                part = loss_fn(model(features), labels) * (weight * len(labels) / total)
            (part if scale is None else scale(part)).backward()
        loss += part.detach().float()
    return loss


def accumulate_sums(
    model: torch.nn.Module,
    micro_batches: list[Any],
    forward_loss: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
    unit: float,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over one step's micro-batches of the columns form; returns this
    rank's summed loss and count of items.

    ``forward_loss(model, batch)`` is a micro-batch's ``(summed loss, count)``. Each sum is
    backpropagated times ``unit``, the same on every rank (world size / the step's samples),
    so the gradients are the global sum's times one factor, which ``rescale_gradients`` fixes
    once the global count is known. Synchronization as ``accumulate_gradients``'.
    """
    total = torch.zeros(())
    count = torch.zeros(())
    no_sync = getattr(model, "no_sync", None)
    for position, batch in enumerate(micro_batches):
        last = position == len(micro_batches) - 1
        if is_fsdp_module(model):
            model.set_requires_gradient_sync(last)  # type: ignore[operator]
        with contextlib.nullcontext() if last or no_sync is None else no_sync():
            with autocast():
                part, items = forward_loss(model, batch)
            scaled = part * unit
            (scaled if scale is None else scale(scaled)).backward()
        total += part.detach().float().cpu()
        count += items.detach().float().cpu()
    return total, count


def rescale_gradients(model: torch.nn.Module, factor: float) -> None:
    """Multiply every gradient by ``factor``."""
    for parameter in model.parameters():
        if parameter.grad is not None:
            parameter.grad.mul_(factor)


def summed_gradients(
    model: torch.nn.Module,
    micro_batches: list[Any],
    forward_loss: Callable[[torch.nn.Module, Any], tuple[torch.Tensor, torch.Tensor]],
    samples: int,
    world_size: int,
    autocast: Callable[[], Any] = contextlib.nullcontext,
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> float:
    """The columns form's step gradients: those of the summed loss of every micro-batch on every
    rank divided by their global count of items (one all-reduce of the sum and the count).
    ``samples``: the step's global samples (the batch size times the accumulation), which
    sets ``accumulate_sums``' unit. Returns the step's loss, the same on every rank."""
    unit = world_size / samples
    total, count = accumulate_sums(model, micro_batches, forward_loss, unit, autocast, scale)
    total_sum, total_count = all_reduce([float(total), float(count)])
    # DDP (FSDP's reduce-scatter) averaged the ranks' gradients of (sum x unit): make them the
    # global sum's over the global count.
    rescale_gradients(model, world_size / (max(total_count, 1.0) * unit))
    return total_sum / max(total_count, 1.0)


def optimizer_steps(
    batches: Iterable[tuple[int, np.ndarray, data_mod.Arrays]], accumulation: int
) -> Iterator[tuple[int, list[data_mod.Arrays]]]:
    """An epoch's (global batch index, row ids, rows) grouped into optimizer steps: (the
    index after the step's last batch, its micro-batches). A step ends where a multiple of
    ``accumulation`` batches of the epoch does, or at the epoch's end."""
    group: list[data_mod.Arrays] = []
    index = -1
    for index, _, rows in batches:
        group.append(rows)
        if (index + 1) % accumulation == 0:
            yield index + 1, group
            group = []
    if group:
        yield index + 1, group


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    model: torch.nn.Module,
    clip: float | None,
    scaler: torch.amp.GradScaler | None = None,
) -> float | None:
    """Clip the gradients' total norm to ``clip`` (after fp16's unscaling), then step (through
    the scaler, which skips a step whose gradients overflowed). Returns the norm before
    clipping, or None without ``clip``."""
    grad_norm = None
    if clip is not None:
        if scaler is not None:
            scaler.unscale_(optimizer)  # clip the true gradients
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        grad_norm = float(norm.full_tensor() if is_dtensor(norm) else norm)  # type: ignore[attr-defined]
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()
    return grad_norm


@dataclass
class NonFiniteLosses:
    """When a non-finite loss stops training.

    Without fp16's gradient scaler (fp32, bf16): at once. With it, a step whose loss overflowed
    fp16 is the scaler's to handle (its gradients are not finite either, so ``optimizer_step``
    skips it and lowers the scale) and training goes on; only ``limit`` such steps in a row stop
    it, an overflow that lowering the scale does not cure (fp16 cannot hold the model's values).
    """

    scaled: bool
    limit: int = 3
    #: Steps in a row, up to the last one, whose loss was not finite.
    in_a_row: int = 0

    def should_stop(self, loss: float) -> bool:
        """Take a step's loss; True when it stops training."""
        if math.isfinite(loss):
            self.in_a_row = 0
            return False
        self.in_a_row += 1
        return not self.scaled or self.in_a_row >= self.limit

    def error(
        self, loss: float, step: int, rank: int, scaler: torch.amp.GradScaler | None
    ) -> TrainingCodeError:
        """What stops training at ``step``, with the fix (fp16: the scaler's state too)."""
        where = f"loss became {loss} at step {step} on rank {rank}"
        fix = "lower optimizer.lr, check the data for NaN/inf, or add gradient clipping"
        if scaler is not None:  # an overflow that lowering the scale did not cure
            where += (
                f", {self.in_a_row} fp16 steps in a row (the gradient scaler "
                f"skipped them, its scale is down to {scaler.get_scale():g})"
            )
            fix = f"use precision bf16 or fp32, {fix}"
        return TrainingCodeError(
            f"{where}: {fix} in your model",
            error_type="NonFiniteLoss",
            step=step,
            rank=rank,
            deterministic=True,
        )


#: ``precision`` -> the dtype autocast computes in (fp32: no autocast).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """A run's ``precision`` on one device: autocast's dtype (None: fp32), fp16's gradient
    scaler, and the rule for non-finite losses."""

    def __init__(self, precision: str, device: torch.device):
        self.device_type = device.type
        self.dtype = AUTOCAST_DTYPES.get(precision)
        self.scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
        self.nonfinite = NonFiniteLosses(scaled=self.scaler is not None)

    def autocast(self) -> Any:
        """Autocast to the dtype on the device (a no-op for fp32)."""
        return torch.autocast(
            self.device_type, dtype=self.dtype or torch.float32, enabled=self.dtype is not None
        )

    def scale(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """fp16's loss scaling (None otherwise)."""
        return None if self.scaler is None else self.scaler.scale

    def check_loss(self, loss: float, step: int, rank: int) -> None:
        """Raise what stops training when ``loss`` does (``NonFiniteLosses``)."""
        if self.nonfinite.should_stop(loss):
            raise self.nonfinite.error(loss, step, rank, self.scaler)
