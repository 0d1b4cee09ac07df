"""What the driver hands every training worker: the ``train_loop_config`` of an attempt.

Plain values only (no torch, no Ray): Ray Train's controller unpickles it too, and the seam that
builds it (``execution.trainer``) sits below the loops that read it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class WorkerConfig:
    spec: dict[str, Any]
    storage_uri: str
    run_name: str
    attempt: int
    #: Committed checkpoint steps, newest first, as the driver's scan found them.
    candidates: list[int]
    relay: Any = None
    #: Whether Ray Train watches the group's nodes for drains (a cluster of several nodes):
    #: then the loop asks for a preemption notice at every report.
    watch_preemption: bool = False
    #: The run's dataset snapshot and what it holds (``run.preflight.PinnedDataset.for_workers``):
    #: the files every rank reads, listed by the driver once. None: generated data.
    dataset: dict[str, Any] | None = None
    #: The flow's lease owner: every commit and deletion checks it still holds the run.
    lease_owner: str | None = None
    #: The key this attempt's ranks mark their last completed step by on their nodes
    #: (``step_marks``), and the key of the attempt before it: a rank that finds that attempt's
    #: marks on its node tells the driver how far a rank killed outright got. None: no marks.
    marks: str | None = None
    earlier_marks: str | None = None
    #: The epoch (counted from 1) the attempt stops after (``Plan.until_epoch``). None: the last.
    until_epoch: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """The ``train_loop_config``: plain values only, because Ray Train's controller
        unpickles it too, and a class from this module would make it import torch."""
        return {"relaytrain": {f.name: getattr(self, f.name) for f in fields(self)}}

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> WorkerConfig:
        """The worker's side of ``to_dict``."""
        return cls(**config["relaytrain"])
