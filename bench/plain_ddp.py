"""The plain PyTorch reference: ``torch.multiprocessing`` + gloo DDP, no Ray, no Prefect.

Each process trains the same model on the same batches as relaytrain's loop (``Workload``),
with the same cadence of extra work: a synchronous all-reduce of the window's losses every
``report.every`` steps, a validation pass at the end of every epoch, and a checkpoint every
``checkpoint.every`` steps, after every validation (relaytrain checkpoints the weights each
validation measured, for ``keep_best``) and at the end: rank 0 ``torch.save`` s model,
optimizer and schedule, every rank its RNG states, to a local directory, then a barrier. No
manifest, hashes, commit marker, metrics history or retention beyond keeping the newest.

``ray_train_loop`` runs the same training function inside Ray Train's workers (a bare
``TorchTrainer``, Ray's own process group): plain PyTorch's loop in Ray's process environment,
which tells Ray's cost on a machine apart from relaytrain's.

``sync_gradients=False`` runs every backward under DDP's ``no_sync()``: the same processes and
collectives, minus the per-step gradient all-reduce (and the wait for the slower rank that comes
with it). It is not training anyone would run; it measures the machine's compute ceiling.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel

from bench.probe import StepProbe
from bench.workload import Workload
from tests.net import free_port
from trainer_core.spec.run_spec import RunSpec


def run_plain_ddp(spec: RunSpec, checkpoint_dir: Path, sync_gradients: bool = True) -> float:
    """Train ``spec`` with ``scaling.num_workers`` processes; returns the process-tree start
    time (``time.time()``), from which time to first step is counted."""
    assert spec.run.name is not None
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    return spawn(_worker, spec, str(checkpoint_dir), sync_gradients)


def spawn(worker: Callable[..., None], spec: RunSpec, *args: Any) -> float:
    """``worker(rank, spec as JSON, port, *args)`` in ``scaling.num_workers`` processes,
    joined; returns when they were started (``time.time()``)."""
    started = time.time()
    mp.spawn(
        worker,
        args=(spec.model_dump(mode="json"), free_port(), *args),
        nprocs=spec.scaling.num_workers,
        join=True,
    )
    return started


def join_group(rank: int, spec_json: dict[str, Any], port: int) -> RunSpec:
    """A spawned worker's spec, after it joined the gloo group of ``spawn``'s processes with
    one thread (as Ray gives a 1-CPU worker: OMP_NUM_THREADS=1)."""
    spec = RunSpec.model_validate(spec_json)
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=spec.scaling.num_workers,
    )
    return spec


def _worker(
    rank: int, spec_json: dict[str, Any], port: int, checkpoint_dir: str, sync_gradients: bool
) -> None:
    spec = join_group(rank, spec_json, port)
    world_size = spec.scaling.num_workers
    try:
        _train(spec, rank, world_size, Path(checkpoint_dir), sync_gradients)
    finally:
        dist.destroy_process_group()


def ray_train_loop(config: dict[str, Any]) -> None:
    """``_train`` as a Ray Train worker function: ``config`` holds ``spec`` and
    ``checkpoint_dir``; rank and world size come from Ray Train's context."""
    import ray.train

    spec = RunSpec.model_validate(config["spec"])
    context = ray.train.get_context()
    torch.set_num_threads(1)  # as in _worker (Ray's 1-CPU workers have one thread already)
    directory = Path(config["checkpoint_dir"])
    directory.mkdir(parents=True, exist_ok=True)
    _train(spec, context.get_world_rank(), context.get_world_size(), directory, True)


def _train(
    spec: RunSpec, rank: int, world_size: int, checkpoint_dir: Path, sync_gradients: bool
) -> None:
    assert spec.schedule is not None and spec.data is not None and spec.run.name is not None
    work = Workload(spec, rank, world_size)
    model: torch.nn.Module = work.model
    if world_size > 1:  # as Ray's prepare_model: DDP only with more than one worker
        model = DistributedDataParallel(work.model)
    no_sync: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
    if not sync_gradients and isinstance(model, DistributedDataParallel):
        no_sync = model.no_sync
    probe = StepProbe(spec.run.name, rank)
    pending: list[float] = []
    step, step_s = 0, 0.0
    for epoch in range(spec.schedule.epochs):
        batches = work.batches(epoch)
        model.train()
        for index, batch in enumerate(batches):
            step += 1
            started = time.perf_counter()
            with no_sync():
                pending.append(work.step(model, batch))
            step_s += time.perf_counter() - started
            probe.stepped(step)
            end_of_epoch = index == len(batches) - 1
            if end_of_epoch:
                work.evaluate()
            last = end_of_epoch and epoch == spec.schedule.epochs - 1
            if step % spec.report.every == 0 or end_of_epoch:
                losses = torch.tensor(pending, dtype=torch.float64)
                dist.all_reduce(losses)
                pending = []
            validated = end_of_epoch and spec.data.validation_fraction > 0
            if step % spec.checkpoint.every == 0 or validated or last:
                _checkpoint(work, step, rank, checkpoint_dir)
    probe.done(timings={"step_s": step_s})


def _checkpoint(work: Workload, step: int, rank: int, directory: Path) -> None:
    state = work.state(step)
    torch.save(state, directory / f"step-{step:09d}-rank{rank}.pt")
    dist.barrier()
    if rank == 0:  # keep the newest only
        for old in directory.glob("step-*.pt"):
            if not old.name.startswith(f"step-{step:09d}-"):
                old.unlink(missing_ok=True)
