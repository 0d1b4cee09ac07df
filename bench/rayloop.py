"""A stock Ray Train loop on the same workload: Ray's own checkpoints and reports, no relaytrain.

Written as Ray's checkpointing guide writes it: resume from ``ray.train.get_checkpoint()``,
``prepare_model``, and every ``checkpoint_every`` steps rank 0 ``torch.save`` s its state into a
temporary directory that every rank's ``ray.train.report(metrics, checkpoint=...)`` hands to
Ray. ``report_every`` adds metrics-only reports. ``kill_at_step`` SIGKILLs rank 0 once (a marker
file remembers it across Ray's in-place restarts). No validation pass, metrics history or
RNG restore: this is the reference for recovery and reporting cost, not for the result.

Config keys: ``spec`` (a RunSpec as JSON), ``checkpoint_every``, ``report_every``,
``kill_at_step``, ``kill_marker``.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import ray.train
import ray.train.torch
import torch

from bench.probe import StepProbe
from bench.workload import Workload
from trainer_core.spec.run_spec import RunSpec


def ray_native_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker``."""
    entered = time.time()
    spec = RunSpec.model_validate(config["spec"])
    assert spec.run.name is not None
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    probe = StepProbe(spec.run.name, rank)
    probe.mark("loop_entered", at=entered)
    work = Workload(spec, rank, world_size)
    probe.mark("set_up")
    step = _resume(work)
    model = ray.train.torch.prepare_model(work.model)
    probe.mark("restored")
    clock = {"step_s": 0.0, "report_s": 0.0, "checkpoint_s": 0.0, "reports": 0, "checkpoints": 0}
    every_checkpoint = config.get("checkpoint_every")
    every_report = config.get("report_every")
    batches, batches_epoch = [], -1
    while step < work.total_steps:
        epoch, index = divmod(step, work.num_batches)
        if epoch != batches_epoch:
            batches, batches_epoch = work.batches(epoch), epoch
        step += 1
        _maybe_kill(config, rank, step, probe)
        started = time.perf_counter()
        loss = work.step(model, batches[index])
        clock["step_s"] += time.perf_counter() - started
        probe.stepped(step)
        if every_report and step % every_report == 0:
            started = time.perf_counter()
            ray.train.report({"step": step, "loss": loss})
            clock["report_s"] += time.perf_counter() - started
            clock["reports"] += 1
        if every_checkpoint and (step % every_checkpoint == 0 or step == work.total_steps):
            started = time.perf_counter()
            _report_checkpoint(work, step, loss)
            clock["checkpoint_s"] += time.perf_counter() - started
            clock["checkpoints"] += 1
    probe.done(timings=clock)


def _resume(work: Workload) -> int:
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return 0
    with checkpoint.as_directory() as directory:
        state = torch.load(Path(directory) / "state.pt", weights_only=True, map_location="cpu")
    return work.load(state)


def _report_checkpoint(work: Workload, step: int, loss: float) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = None
        if work.rank == 0:
            torch.save(work.state(step), Path(tmp) / "state.pt")
            checkpoint = ray.train.Checkpoint.from_directory(tmp)
        ray.train.report({"step": step, "loss": loss}, checkpoint=checkpoint)


def _maybe_kill(config: dict[str, Any], rank: int, step: int, probe: StepProbe) -> None:
    if rank != 0 or config.get("kill_at_step") != step:
        return
    try:  # once per run: Ray's restart replays this step
        os.close(os.open(config["kill_marker"], os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return
    probe.failure(step)
    os.kill(os.getpid(), signal.SIGKILL)
