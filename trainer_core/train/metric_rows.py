"""The built-in loop's metric rows: each optimizer step's loss averaged across ranks without
blocking the step, published to the driver, and kept for the next checkpoint's segment of the
metrics history.

A report window's last row also says where the window's time went (``step_clock``): the mean
over ranks of each part's seconds per step as ``time/<part>`` (with ``time/step``), every rank's
figures under ``step_time``, and the ranks straggling under ``stragglers``. The per-rank figures
travel in the window's one collective: each rank fills its own row of a zero matrix and the
sum gathers them."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from trainer_core.execution.worker_group import Relay, Timings, collective_device
from trainer_core.step_time import Stragglers, own_row, window_fields


class MetricRows:
    """One rank's rows: pending (not yet averaged), in flight (being averaged), unsaved (not yet
    in a metrics segment)."""

    def __init__(
        self, relay: Relay, timings: Timings, world_size: int, attempt: int, rank: int = 0
    ):
        self.relay = relay
        self.timings = timings
        self.world_size = world_size
        self.attempt = attempt
        self.rank = rank
        self.pending: list[dict[str, Any]] = []
        self.in_flight: list[tuple[Any, torch.Tensor, list[dict[str, Any]], dict]] = []
        #: Each rank's node (``watch_stragglers``); None: no straggler rule.
        self.stragglers: Stragglers | None = None
        self.unsaved: list[dict[str, Any]] = []
        #: The newest step's metrics alone: a checkpoint's manifest records these, so a
        #: validation's figures never outlive the weights they were measured on.
        self.latest: dict[str, float] = {}
        #: The default process group and where its collectives take their tensors (known at
        #: the first window: the group exists by then).
        self.group: dist.ProcessGroup | None = None
        self.device: torch.device | None = None

    def add(self, row: dict[str, Any]) -> None:
        """A step's row, its loss this rank's own."""
        self.pending.append(row)

    def watch_stragglers(self, nodes: list[str]) -> None:
        """Apply the straggler rule to the windows from now on (``nodes``: each rank's)."""
        self.stragglers = Stragglers(nodes)

    def aggregate(
        self, extra: dict[str, float], *, flush: bool = False, times: list[float] | None = None
    ) -> None:
        """Average the pending per-step losses across ranks: one collective per window, with
        ``extra`` (a validation's metrics) on the window's last row, and with ``times`` (this
        rank's ``StepClock.window()``) every rank's.

        The collective runs asynchronously (gloo's thread) and is completed at the next window,
        so training does not wait for it; ``flush`` completes everything (before a checkpoint
        records its metrics, and at the end).
        """
        if self.pending:
            values = [row["loss"] for row in self.pending]
            if times is not None:
                values += own_row(times, self.rank, self.world_size)
            if self.group is None:
                self.group, self.device = dist.group.WORLD, collective_device()
                assert self.group is not None, "the process group is not initialized"
            losses = torch.tensor(values, dtype=torch.float64, device=self.device)
            # The group's own call, not dist.all_reduce: its checks and loggers cost a tenth of
            # a window's aggregation, and a window's tensor needs none of them.
            work = self.group.allreduce([losses])
            self.in_flight.append((work, losses, self.pending, extra))
            self.pending = []
        while self.in_flight and (flush or len(self.in_flight) > 1):
            work, losses, rows, window_extra = self.in_flight.pop(0)
            work.wait()
            values = losses.tolist()
            means = [v / self.world_size for v in values[: len(rows)]]
            timing = self._window_times(values[len(rows) :], len(rows))
            self._publish(rows, means, window_extra, timing)

    def _window_times(self, matrix: list[float], steps: int) -> dict[str, Any]:
        if not matrix or self.rank != 0:  # rank 0 writes the history and relays
            return {}
        fields, new = window_fields(matrix, self.world_size, steps, self.stragglers)
        for found in new:
            self.relay.send("straggler", **found)
        return fields

    def take_unsaved(self) -> list[dict[str, Any]]:
        """The rows since the last checkpoint (for the next one's metrics segment)."""
        rows, self.unsaved = self.unsaved, []
        return rows

    def _publish(
        self,
        pending: list[dict[str, Any]],
        means: list[float],
        extra: dict,
        timing: dict[str, Any] | None = None,
    ) -> None:
        now = time.time()
        rows = [
            {**row, "loss": mean, "attempt": self.attempt, "time": now}
            for row, mean in zip(pending, means, strict=True)
        ]
        rows[-1].update(extra)
        rows[-1].update(timing or {})  # in the history, not in a checkpoint's metrics
        self.unsaved.extend(rows)
        self.latest = {
            "step": rows[-1]["step"],
            "epoch": rows[-1]["epoch"],
            "loss": rows[-1]["loss"],
            **extra,
        }
        started = time.perf_counter()
        self.relay.send("metrics", rows=rows)
        self.timings.relay_s += time.perf_counter() - started


def report_row(metrics: dict[str, Any]) -> dict[str, Any]:
    """A report's metrics as the history keeps them: numbers and strings (a tensor's item)."""
    row: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, bool | int | float | str):
            row[key] = value
        else:
            raise TypeError(
                f"report() metric {key!r} is a {type(value).__name__}: report numbers, strings "
                "or one-element tensors"
            )
    return row
