"""Answering a drain's notice: a node of the worker group is about to be preempted.

At every report boundary each rank asks Ray (``worker_api.preemption_notice``, a barrier of
Ray's). The first notice of a worker group is answered with a checkpoint at that step (the loop
saves it); then ``hold`` waits for it to commit, tells the driver, and waits for the drain's
deadline, when Ray Train restarts the group on the nodes that stay: steps trained meanwhile would
be lost with the node. The wait ends a few seconds past the deadline, and a deadline further
away than any cloud's preemption notice (or none) is not waited for: training goes on.
"""

from __future__ import annotations

import logging
import time

from trainer_core.checkpoint.manager import CheckpointManager
from trainer_core.execution import worker_api
from trainer_core.execution.worker_api import PreemptionNotice
from trainer_core.execution.worker_group import Relay, Timings

logger = logging.getLogger("relaytrain.worker")

#: After a just-in-time checkpoint the group waits for its node to go (every step trained then
#: would be lost with it), until this long past the drain's deadline: the deadline is when the
#: node is reclaimed, and the margin covers the clocks of the GCS and this node differing and the
#: reclaim taking a moment. A rank still waiting then trains on, and its next collective finds the
#: peer gone.
PREEMPTION_HOLD_MARGIN_S = 5.0
#: The longest wait: a drain due later than this after the checkpoint commits is not waited for
#: at all (waiting part of the way would save no step). Training goes on, and the loop's regular
#: checkpoints bound what the node takes with it. 150 s is the longest preemption notice of the
#: major clouds (AWS spot's two minutes; GCP's and Azure's are 30 s) plus the margin, rounded up:
#: a cloud's preemption is always waited for, a far deadline (a planned drain) never.
PREEMPTION_HOLD_MAX_S = 150.0


def hold_seconds(deadline: float | None, now: float) -> float:
    """How long to wait at ``now`` (Unix seconds) for a drain due at ``deadline``: until the
    deadline plus the margin, or not at all when that is past, more than
    ``PREEMPTION_HOLD_MAX_S`` away, or unknown (the drain gave no deadline)."""
    if deadline is None:
        return 0.0
    wait = deadline + PREEMPTION_HOLD_MARGIN_S - now
    return wait if 0.0 < wait <= PREEMPTION_HOLD_MAX_S else 0.0


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
        the driver, then wait for the drain's deadline (``hold_seconds``)."""
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
        wait = hold_seconds(notice.deadline, time.time())
        if wait:
            time.sleep(wait)
        self.timings.preemption_hold_s += time.perf_counter() - started
