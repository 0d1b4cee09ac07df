"""The faults a spec injects (``faults``: a raise, a SIGKILL or a slowed step, on one rank of
one attempt, at a step), fired by the training loops as each step begins."""

from __future__ import annotations

import logging
import os
import signal
import time
from dataclasses import dataclass

from trainer_core.errors import InjectedFault
from trainer_core.spec.operations import FaultSection

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
