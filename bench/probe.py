"""Step timestamps from inside the workers, the same way for every variant.

Rank 0 appends JSON lines to ``$RELAYTRAIN_BENCH_PROBE_DIR/<run name>.jsonl``: its first step
(``first_step``), an injected failure just before the process kills itself (``failure``, from
whichever rank fails), at the end the span of steps it ran (``done``), and the moments of each
worker group's start (``GROUP_START``). Times are
``time.time()`` on one machine, so the driver can subtract them from its own clock.

relaytrain's built-in loop is measured unchanged: ``probed_builtin_loop`` wraps
``BuiltinLoop._step`` and ``BuiltinLoop.run`` in the worker process (one extra Python call per
step) and then runs ``builtin_train_loop`` itself. The flow and the bare ``TorchTrainer.fit()``
both run this wrapper, so the instrumentation cost is the same on both sides.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

PROBE_DIR_ENV = "RELAYTRAIN_BENCH_PROBE_DIR"
#: A worker group's start, as rank 0 marks it: its worker fn entered (Ray has started the
#: group: placement, processes, the process group), its model and data built, its checkpoint
#: loaded; then its ``first_step``.
GROUP_START = ("loop_entered", "set_up", "restored")


def probe_file(run_name: str) -> Path | None:
    """Where the probe of ``run_name`` is written (None: probing is off in this process)."""
    directory = os.environ.get(PROBE_DIR_ENV)
    return Path(directory) / f"{run_name}.jsonl" if directory else None


def read_probe(run_name: str) -> list[dict[str, Any]]:
    """The events recorded for ``run_name``, in order."""
    path = probe_file(run_name)
    if path is None or not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]


def process_age_s() -> float:
    """Seconds since this process started, to the kernel's tick (Linux): its start and the
    clock read on one clock, time since boot. (``psutil``'s ``create_time`` adds the boot time
    in whole seconds to it, so an age from it is off by up to a second.)"""
    with open("/proc/self/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()  # after the name, which may hold spaces
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # starttime, field 22 of proc(5)
    return time.clock_gettime(time.CLOCK_BOOTTIME) - started


class StepProbe:
    """One worker's step timestamps; only rank 0 writes, except for failures."""

    def __init__(self, run_name: str, rank: int, attempt: int = 1):
        self.path = probe_file(run_name)
        self.rank = rank
        self.attempt = attempt
        self.first: tuple[int, float] | None = None
        self.last: tuple[int, float] | None = None
        self.num_steps = 0

    def _write(self, event: str, **payload: Any) -> None:
        if self.path is None:
            return
        line = json.dumps({"event": event, "rank": self.rank, "attempt": self.attempt, **payload})
        with open(self.path, "a") as f:  # one short append per event: whole lines
            f.write(line + "\n")

    def mark(self, event: str, at: float | None = None) -> None:
        """Rank 0's moment ``event`` of a worker group's start (``GROUP_START``): ``at`` or now.
        ``loop_entered`` carries its process's age (a process Ray had idle is older)."""
        if self.rank != 0:
            return
        now = time.time() if at is None else at
        extra: dict[str, float] = {}
        if event == "loop_entered":
            extra["process_age_s"] = process_age_s() - (time.time() - now)
        self._write(event, time=now, pid=os.getpid(), **extra)

    def failure(self, step: int) -> None:
        """Call right before this worker kills itself at ``step`` (any rank)."""
        self._write("failure", step=step, time=time.time(), pid=os.getpid())

    def stepped(self, step: int) -> None:
        """Call when optimizer step ``step`` is done."""
        now = time.time()
        if self.first is None:
            self.first = (step, now)
            if self.rank == 0:
                self._write("first_step", step=step, time=now, pid=os.getpid())
        self.last = (step, now)
        self.num_steps += 1

    def done(self, **extra: Any) -> None:
        """Call when the loop ends normally: the span of steps this process ran."""
        if self.rank != 0 or self.first is None or self.last is None:
            return
        self._write(
            "done",
            first_step=self.first[0],
            first_time=self.first[1],
            last_step=self.last[0],
            last_time=self.last[1],
            num_steps=self.num_steps,
            torch_threads=torch.get_num_threads(),
            **extra,
        )


def done_event(run_name: str) -> dict[str, Any]:
    """Rank 0's last ``done`` event for ``run_name``: the span of steps its loop ran, and the
    timings it reported."""
    done = [e for e in read_probe(run_name) if e["event"] == "done"]
    if not done:
        raise RuntimeError(f"{run_name}: no step span was recorded (the loop did not end)")
    return done[-1]


def span(events: list[dict[str, Any]]) -> dict[str, float]:
    """Steps/s over the last uninterrupted stretch of steps, from its ``done`` event."""
    done = [e for e in events if e["event"] == "done"]
    if not done:
        return {}
    last = done[-1]
    seconds = last["last_time"] - last["first_time"]
    steps = last["last_step"] - last["first_step"]
    return {
        "steps_per_s": steps / seconds if seconds > 0 else float("nan"),
        "train_s": seconds,
        "num_steps": float(last["num_steps"]),
        "torch_threads": float(last["torch_threads"]),
    }


def first_step_time(events: list[dict[str, Any]], attempt: int | None = None) -> float | None:
    """When rank 0 finished its first step (of ``attempt``, or of the first one recorded)."""
    for event in events:
        if event["event"] == "first_step" and attempt in (None, event["attempt"]):
            return float(event["time"])
    return None


# -- relaytrain's built-in loop, unchanged, with the probe around its step ------------------------


def probed_builtin_loop(config: dict[str, Any]) -> None:
    """``trainer_core.train.builtin.builtin_train_loop`` with step timestamps (a Ray Train
    worker fn)."""
    from trainer_core.train.builtin import builtin_train_loop

    _instrument_builtin_loop()
    builtin_train_loop(config)


def _instrument_builtin_loop() -> None:
    from trainer_core.train.loop import BuiltinLoop

    if getattr(BuiltinLoop, "_bench_probed", False):
        return
    original_step, original_run = BuiltinLoop._step, BuiltinLoop.run
    original_init, original_restore = BuiltinLoop.__init__, BuiltinLoop.restore

    def __init__(self: Any, config: Any) -> None:
        entered = time.time()
        original_init(self, config)
        _probe_of(self).mark("loop_entered", at=entered)
        _probe_of(self).mark("set_up")

    def restore(self: Any) -> None:
        original_restore(self)
        _probe_of(self).mark("restored")

    def _step(self: Any, model: Any, index: Any, step: int) -> float:
        probe = _probe_of(self)
        if _kill_due(self, step):
            probe.failure(step)
        loss = original_step(self, model, index, step)
        probe.stepped(step)
        return loss

    def run(self: Any) -> None:
        original_run(self)
        _probe_of(self).done(timings=self.timings.to_json())

    BuiltinLoop.__init__ = __init__  # type: ignore[method-assign]
    BuiltinLoop.restore = restore  # type: ignore[method-assign]
    BuiltinLoop._step = _step  # type: ignore[method-assign]
    BuiltinLoop.run = run  # type: ignore[method-assign]
    BuiltinLoop._bench_probed = True  # type: ignore[attr-defined]


def _probe_of(loop: Any) -> StepProbe:
    probe = getattr(loop, "_bench_probe", None)
    if probe is None:
        probe = StepProbe(loop.config.run_name, loop.rank, loop.config.attempt)
        loop._bench_probe = probe
    return probe


def _kill_due(loop: Any, step: int) -> bool:
    """Whether the spec's fault injection kills this worker before ``step``."""
    return any(
        (f.kind, f.attempt, f.rank, f.at_step) == ("kill", loop.config.attempt, loop.rank, step)
        for f in loop.faults.faults
    )
