"""What every training worker shares: the faults to inject, what an exception out of training
code means, and how to tell a lost peer from a bug (``is_peer_failure``, ``execution.classify``'s
rule). The collectives and the relay to the driver are ``execution.worker_group``'s."""

from __future__ import annotations

import logging
import os
import signal
import traceback
from dataclasses import dataclass

from trainer_core.errors import InfrastructureError, InjectedFault, TrainingCodeError
from trainer_core.execution.classify import is_peer_failure as is_peer_failure  # the driver's too
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
            if (fault.attempt, fault.rank, fault.at_step) != (self.attempt, self.rank, step):
                continue
            if fault.kind == "kill":
                logger.warning("fault: SIGKILL of rank %d at step %d", self.rank, step)
                os.kill(os.getpid(), signal.SIGKILL)
            raise InjectedFault(f"injected fault at step {step} on rank {self.rank}")
