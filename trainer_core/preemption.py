"""Answering a drain's notice: a node of the worker group is about to be preempted.

At every report boundary each rank asks Ray (``worker_api.preemption_notice``, a barrier of
Ray's). The first notice of a worker group is answered with a checkpoint at that step (the loop
saves it); then ``hold`` waits for it to commit, tells the driver, and waits for the drain's
deadline, when Ray Train restarts the group on the nodes that stay: steps trained meanwhile would
be lost with the node.
"""

from __future__ import annotations

import logging
import time

from trainer_core.checkpoint_manager import CheckpointManager
from trainer_core.execution import worker_api
from trainer_core.execution.worker_api import PreemptionNotice
from trainer_core.worker import Relay, Timings

logger = logging.getLogger("relaytrain.worker")

#: After a just-in-time checkpoint the group waits for its node to go (every step trained then
#: would be lost with it), at most this long past the drain's deadline; then it trains on.
PREEMPTION_HOLD_MARGIN_S = 30.0


class DrainWatch:
    """One rank's view of drain notices during a worker group."""

    def __init__(
        self,
        enabled: bool,
        rank: int,
        relay: Relay,
        checkpoints: CheckpointManager,
        timings: Timings,
    ):
        self.enabled = enabled
        self.rank = rank
        self.relay = relay
        self.checkpoints = checkpoints
        self.timings = timings
        #: The notice a just-in-time checkpoint answered (once per group).
        self.answered: PreemptionNotice | None = None

    def new_notice(self) -> PreemptionNotice | None:
        """A drain's notice not yet answered in this group (every rank asks at every report)."""
        if not self.enabled:
            return None
        notice = worker_api.preemption_notice()
        if notice is None or self.answered is not None:
            return None
        self.answered = notice
        return notice

    def hold(self, step: int, notice: PreemptionNotice) -> None:
        """``notice`` was answered with a checkpoint at ``step``: wait for it to commit, tell
        the driver, then wait for the drain's deadline."""
        started = time.perf_counter()
        self.checkpoints.wait()
        seconds_left = None if notice.deadline is None else notice.deadline - time.time()
        self.relay.send(
            "preemption_notice",
            step=step,
            ranks=notice.ranks,
            deadline=notice.deadline,
            seconds_left=seconds_left,
        )
        logger.warning(
            "rank %d: a node of ranks %s drains for preemption in %s s; committed step %d",
            self.rank,
            notice.ranks,
            "?" if seconds_left is None else f"{seconds_left:.1f}",
            step,
        )
        if notice.deadline is not None:
            time.sleep(max(notice.deadline + PREEMPTION_HOLD_MARGIN_S - time.time(), 0.0))
        self.timings.preemption_hold_s += time.perf_counter() - started
