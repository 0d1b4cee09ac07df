"""Where one rank's step time goes, window by window, and which ranks straggle.

``StepClock`` splits each report window of a rank into ``PARTS``: waiting for data, the
host-to-device copy, forward and backward, waiting for the gradients' all-reduce, the optimizer
step, time blocked on checkpoints, validation, and the rest (the step's own Python, metrics).
The loops time their parts with ``part(name)``; what ``Timings`` already counts (data wait,
checkpoints) is taken as its change over the window. On a GPU a part is a pair of CUDA events,
resolved once at the window's end (one wait for the window's last event, never one per step).

The all-reduce wait comes from DDP's communication hook (``watch_allreduce``): the gradients'
all-reduce runs while backward goes on, and the time from the last bucket's launch to the end
of backward is time spent waiting for it (on a slow peer, or the network). Under FSDP the
reduce-scatter cannot be told apart from backward: it counts as forward and backward.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from trainer_core.execution.worker_group import Timings
from trainer_core.step_time import PARTS


class StepClock:
    """One rank's clock of its report windows."""

    def __init__(self, device: torch.device, timings: Timings, enabled: bool = True):
        #: False (``report.step_time: false``): nothing is timed, windows are None.
        self.enabled = enabled
        self.cuda = device.type == "cuda"
        self.timings = timings
        self.seconds = dict.fromkeys(PARTS, 0.0)
        #: CUDA-timed parts of the window: (part, start, end, sign), resolved at its end.
        self.events: list[tuple[str, Any, Any, float]] = []
        #: The last all-reduce launch of the current backward (a time, or a CUDA event).
        self.launched: Any = None
        self.started = time.perf_counter()
        self.marks = self._marks()

    def _marks(self) -> dict[str, float]:
        t = self.timings
        # checkpoint_s holds the waits for the previous checkpoint and for the copy.
        return {"data_wait": t.data_wait_s, "checkpoint": t.checkpoint_s + t.preemption_hold_s}

    def _now(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _add(self, name: str, start: Any, end: Any, sign: float = 1.0) -> None:
        if self.cuda:
            self.events.append((name, start, end, sign))
        else:
            self.seconds[name] += sign * (end - start)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Time the block as part ``name``. For ``forward_backward``, the wait for an all-reduce
        the DDP hook launched within it moves to ``allreduce_wait``."""
        if not self.enabled:
            yield
            return
        if name == "checkpoint":  # host work, some of it counted by Timings already
            with self._host_checkpoint():
                yield
            return
        self.launched = None
        start = self._now()
        try:
            yield
        finally:
            end = self._now()
            self._add(name, start, end)
            if name == "forward_backward" and self.launched is not None:
                self._add("allreduce_wait", self.launched, end)
                self._add("forward_backward", self.launched, end, -1.0)
            self.launched = None

    @contextlib.contextmanager
    def _host_checkpoint(self) -> Iterator[None]:
        """A checkpoint's save on the host (its staging and the collectives around it): the
        part of it ``Timings.checkpoint_s`` counts is taken from there at the window's end."""
        started, counted = time.perf_counter(), self._marks()["checkpoint"]
        try:
            yield
        finally:
            counted = self._marks()["checkpoint"] - counted
            self.seconds["checkpoint"] += time.perf_counter() - started - counted

    def start(self) -> Any:
        """A part begins (a loop of the user's own, timed from hooks): ``stop`` ends it."""
        return self._now() if self.enabled else None

    def stop(self, name: str, start: Any) -> None:
        if start is not None:
            self._add(name, start, self._now())

    def allreduce_waited(self) -> None:
        """The gradients are needed now (a user's loop's optimizer step): the time since the
        last all-reduce launch was spent waiting for it (and finishing backward)."""
        if self.launched is not None:
            self._add("allreduce_wait", self.launched, self._now())
            self.launched = None

    def watch_optimizer(self, optimizer: torch.optim.Optimizer, before_step: Any) -> None:
        """Time a user's loop's optimizer steps from the optimizer's hooks, each wait in one
        part only: first the wait for the gradients' all-reduce (since its last launch), then
        ``before_step()`` (the checkpoint's copy of the parameters, which ``Timings`` counts as
        checkpoint), then the step itself as ``optimizer``. ``before_step`` runs even with the
        clock disabled."""
        started: list[Any] = [None]

        def begin(*_: Any) -> None:
            self.allreduce_waited()
            before_step()
            started[0] = self.start()

        def end(*_: Any) -> None:
            self.stop("optimizer", started[0])
            started[0] = None

        optimizer.register_step_pre_hook(begin)
        optimizer.register_step_post_hook(end)

    def watch_allreduce(self, model: torch.nn.Module) -> None:
        """Time the waits for DDP's gradient all-reduce (a no-op for a model DDP does not
        wrap): the default all-reduce, through a hook that notes each bucket's launch."""
        if not self.enabled or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # Unannotated: DDP checks the hook's annotations, which this module's are strings.
        def hook(state, bucket):  # type: ignore[no-untyped-def]
            self.launched = self._now()
            return allreduce_hook(state, bucket)

        model.register_comm_hook(None, hook)

    def window(self, rest: str = "other") -> list[float] | None:
        """The window ending now: ``[wall, *PARTS]`` in seconds (None when disabled); starts
        the next one. The part ``rest`` gets what no other part measured (a user's loop: its
        forward and backward)."""
        if not self.enabled:
            return None
        now = time.perf_counter()
        marks = self._marks()
        seconds = self.seconds
        if self.events:
            self.events[-1][2].synchronize()
            for name, start, end, sign in self.events:
                seconds[name] += sign * start.elapsed_time(end) / 1000.0
        seconds["data_wait"] += marks["data_wait"] - self.marks["data_wait"]
        seconds["checkpoint"] += marks["checkpoint"] - self.marks["checkpoint"]
        wall = now - self.started
        seconds[rest] = max(wall - sum(v for k, v in seconds.items() if k != rest), 0.0)
        values = [wall, *(max(seconds[name], 0.0) for name in PARTS)]
        self.seconds = dict.fromkeys(PARTS, 0.0)
        self.events = []
        self.started, self.marks = now, marks
        return values
