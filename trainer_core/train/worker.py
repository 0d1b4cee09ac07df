"""What every training worker shares: the faults to inject, what an exception out of training
code means, and how to tell a lost peer from a bug (``is_peer_failure``, ``execution.classify``'s
rule). The collectives and the relay to the driver are ``execution.worker_group``'s."""

from __future__ import annotations

import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from trainer_core.checkpoint.manager import CheckpointManager
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data import dataset_snapshot, footers, rank_stream, stream
from trainer_core.errors import (
    InfrastructureError,
    InjectedFault,
    RelaytrainError,
    TrainingCodeError,
)
from trainer_core.execution.classify import is_peer_failure as is_peer_failure  # the driver's too
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import Relay, all_reduce
from trainer_core.spec.operations import FaultSection


def worker_error(
    error: BaseException, *, where: str, step: int | None, rank: int | None
) -> TrainingCodeError | InfrastructureError:
    """What an exception out of training code means: a collective that lost its peer is the
    infrastructure's (``where``: the step or report it was at, in words); anything else is the
    code's, with its type, step, rank and traceback."""
    if is_peer_failure(error):
        return InfrastructureError(
            f"rank {rank} lost a peer during a collective {where}: {type(error).__name__}: {error}",
            step=step,
        )
    return TrainingCodeError(
        f"{type(error).__name__}: {error}",
        error_type=type(error).__name__,
        step=step,
        rank=rank,
        traceback="".join(traceback.format_exception(error)),
    )


logger = logging.getLogger("relaytrain.worker")


@dataclass
class Faults:
    faults: list[FaultSection]
    attempt: int
    rank: int
    #: Faults fire in an attempt's first worker group, not again after an in-place restart.
    group: int = 0

    def check(self, step: int) -> None:
        if self.group:
            return
        for fault in self.faults:
            if fault.kind == "slow" and fault.seconds is not None:
                if (fault.attempt, fault.rank) == (
                    self.attempt,
                    self.rank,
                ) and step >= fault.at_step:
                    time.sleep(fault.seconds)
                continue
            if (fault.attempt, fault.rank, fault.at_step) != (self.attempt, self.rank, step):
                continue
            if fault.kind == "kill":
                logger.warning("fault: SIGKILL of rank %d at step %d", self.rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedFault(f"injected fault at step {step} on rank {self.rank}")


#: How long a failing worker lets its checkpoint in flight finish before it exits.
SETTLE_S = 60.0


def wind_down(
    error: RelaytrainError,
    checkpoints: CheckpointManager,
    relay: Relay,
    completed_step: int,
    group: int,
) -> RelaytrainError:
    """Before an error ends the worker: finish the checkpoint in flight (``checkpoints.settle``:
    what it commits is work not lost), then push the buffered metric rows. Returns the error to
    raise: the checkpoint's own, when it is the training code failing at an earlier step (the
    weights a checkpoint was refused for went bad before the loss did)."""
    earlier = checkpoints.settle(SETTLE_S)
    try:
        relay.flush()
        relay.tell_last_step(completed_step, group)  # rank 0's rows may lag it
    except Exception:  # the relay is best effort; the error being raised matters more
        logger.debug("relay flush failed", exc_info=True)
    if (
        isinstance(earlier, TrainingCodeError)
        and isinstance(error, TrainingCodeError)
        and (earlier.step or 0) < (error.step or 0)
    ):
        return earlier
    return error


def resume_candidates(
    config: WorkerConfig, relay: Relay, run_dir: RunDirectory
) -> tuple[int, list[int]]:
    """Which worker group of the attempt this is (0: the first; n after the n-th in-place
    restart), and the committed steps to try, newest first: the driver's scan for the first
    group; after an in-place restart (the same attempt, no new plan) rank 0 scans again, for
    what the lost group committed, and tells the others."""
    group = int(all_reduce([float(relay.begin_group())])[0])
    if group == 0:
        return group, list(config.candidates)
    found = [[c.step for c in reversed(run_dir.scan().committed)]]
    dist.broadcast_object_list(found, src=0)
    return group, list(found[0])


@dataclass
class Progress:
    """Where a worker's training stands: its step, the data cursor, the step resumed from."""

    step: int = 0
    cursor: data_mod.Cursor = field(default_factory=lambda: data_mod.Cursor(0, 0))
    resumed_from: int | None = None


def rank_data(
    config: WorkerConfig, data_spec: Any, seed: int, world_size: int, rank: int
) -> tuple[rank_stream.RankStream, data_mod.DatasetInfo]:
    """This rank's stream of the run's dataset snapshot (``seed``: the run's), as the driver
    pinned it (no rank lists the dataset), and the dataset's info."""
    if config.dataset is not None:
        layout = dataset_snapshot.from_json(config.dataset["snapshot"], data_spec)
        info = data_mod.DatasetInfo(**config.dataset["info"])
    else:  # generated data
        layout = footers.scan(data_spec)
        info = stream.describe(layout, data_spec)
    return rank_stream.RankStream(layout, data_spec, seed, world_size, rank), info
