"""Where a loop of the user's own spends its time (``own_loop``), window by window: the
session's ``StepClock`` times what it sees (the data wait, the host-to-device copy, the
gradients' all-reduce from DDP's hook, the optimizer from its hooks, checkpoints, validation);
what they leave of a report window is the loop's own forward and backward. At each window's end
every rank's breakdown travels in one collective, and rank 0 records it in the history and
tells the driver of a new straggler."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from trainer_core.execution.worker_group import Relay, Timings, all_reduce, gather_nodes
from trainer_core.step_time import Stragglers, own_row, window_fields
from trainer_core.train.step_clock import StepClock


class ReportWindows:
    """One rank's report windows of a session."""

    def __init__(self, device: torch.device, timings: Timings, relay: Relay, rank: int):
        self.device, self.timings, self.relay, self.rank = device, timings, relay, rank
        self.clock = StepClock(device, timings)
        self.stragglers: Stragglers | None = None
        #: Optimizer steps in the window so far.
        self.steps = 0

    def start(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        before_optimizer_step: Callable[[], Any],
        world_size: int,
        enabled: bool,
    ) -> None:
        """The first window starts now (``setup`` has restored ``model``, DDP-wrapped):
        watch its all-reduce and ``optimizer``'s steps, which first run
        ``before_optimizer_step`` (the checkpoint's copy of the parameters)."""
        self.stragglers = Stragglers(gather_nodes(world_size))
        self.clock = StepClock(self.device, self.timings, enabled)
        self.clock.watch_allreduce(model)
        self.clock.watch_optimizer(optimizer, before_optimizer_step)

    def count_step(self) -> None:
        """An optimizer step ended in this window."""
        self.steps += 1

    def end(self, world_size: int) -> dict[str, Any]:
        """The window ending at this step: every rank's breakdown (one collective), the
        history's fields for it on rank 0 (none on the others)."""
        times = self.clock.window(rest="forward_backward")
        if times is None:
            return {}
        matrix = all_reduce(own_row(times, self.rank, world_size))
        steps, self.steps = self.steps, 0
        if self.rank != 0:  # rank 0 writes the history and relays
            return {}
        fields, new = window_fields(matrix, world_size, steps, self.stragglers)
        for found in new:
            self.relay.send("straggler", **found)
        return fields
