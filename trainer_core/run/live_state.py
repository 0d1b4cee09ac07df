"""What the driver knows of a running attempt, folded from the events its workers relay: the
step, metrics and checkpoint reached, its restarts in place and resizes, and what loading cost."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

#: What a resume's record keeps of its load: bytes the group read from storage, the slowest
#: rank's seconds, and when the checkpoint read was written (its manifest's ``created_at``: a
#: step's checkpoint is written again when a resume fell past it damaged and trained it anew).
RESTORE_KEYS = ("bytes_read", "restore_s", "checkpoint_created_at")


@dataclass
class LiveState:
    """What the driver knows of a running attempt, folded from the relayed events."""

    step: int = 0
    #: When the newest metric row was published (worker clock).
    progress_at: float | None = None
    resumed_from: int | None = None
    #: When the workers had loaded their start point (worker clock): training resumes here.
    resumed_at: float | None = None
    #: What loading it cost, and when its checkpoint was written (``RESTORE_KEYS``).
    restore: dict[str, Any] | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_uri: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    #: In-place restarts of the worker group: when, after what, and where each resumed.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    #: Workers in the group, and the largest peak resident memory any of them reported (MB).
    world_size: int | None = None
    peak_worker_rss_mb: float | None = None
    #: The just-in-time checkpoint of a drain's notice, until the preemption's restart.
    notice: dict[str, Any] | None = None
    #: Nodes whose preemption an in-place restart already answered: not the cause of a later
    #: failure.
    preempted_nodes: set[str] = field(default_factory=set)
    #: The newest worker group that said it began (its number, from the relay), and for each
    #: group a restart ended, that restart's index: a group Ray started that failed before it
    #: began (a fault during a recovery) took no number, so groups and restarts do not pair up
    #: by count.
    began: int | None = None
    ended_by: dict[int, int] = field(default_factory=dict)
    #: Whether a user Ray loop's resumes restored every rank's RNG as the checkpoint saved
    #: it (None: no resume of such a loop, or it did not say), and why not (the first why).
    resume_exact: bool | None = None
    resume_note: str | None = None

    def outcome(self) -> dict[str, Any]:
        """What an ended attempt's record says of its workers, failed or completed."""
        return {
            "resumed_from_step": self.resumed_from,
            "resumed_at": self.resumed_at,
            "last_progress_at": self.progress_at,
            "restore": self.restore,
            "restarts": self.restarts,
            "world_size": self.world_size,
            "peak_worker_rss_mb": self.peak_worker_rss_mb,
            "resume_exact": self.resume_exact,
            "resume_note": self.resume_note,
        }

    def apply(self, event: dict[str, Any]) -> bool:
        """Fold ``event`` in; True when it ended or began a worker group of the attempt (the
        record to update: where the workers resumed, a restart)."""
        kind = event["kind"]
        self._fold(event, kind)
        return kind in ("restarting", "resizing", "resumed", "fresh_start")

    def _fold(self, event: dict[str, Any], kind: str) -> None:
        if kind in ("resumed", "fresh_start"):  # a worker group began (0: the attempt's first)
            self.began = event.get("group", 0)
        if event.get("world_size"):
            self.world_size = event["world_size"]
        if kind == "memory":
            self.peak_worker_rss_mb = max(
                self.peak_worker_rss_mb or 0.0, event["peak_worker_rss_mb"]
            )
        if kind == "metrics" and event["rows"] and self._late(event):
            # rows rank 0 held back until its group ended: the live step is the later group's
            self._reached_before_restart(event["group"], event["rows"][-1]["step"])
        elif kind == "metrics" and event["rows"]:
            self.step = max(self.step, event["rows"][-1]["step"])
            self.progress_at = event["rows"][-1].get("time", event.get("time"))
            self.metrics = {**self.metrics, **event["rows"][-1]}
        elif kind == "preemption_notice":
            self.notice = {
                "just_in_time_step": event["step"],
                "seconds_to_deadline": event["seconds_left"],
            }
        elif kind == "restarting":
            self._restarting(event)
        elif kind == "resizing":  # the elastic policy found capacity for another size
            self._ends_the_group()
            self.restarts.append(
                {
                    "restart": len(self.restarts) + 1,
                    "reason": "capacity",
                    "failed_at": event["time"],
                    "last_step": self.step,
                    "world_size_before": event["world_size"],
                }
            )
        elif kind in ("resumed", "fresh_start") and event.get("group"):
            self._group_started(event)
        elif kind == "last_step":
            self._last_step(event)
        elif kind == "resumed":
            self.resumed_from = event.get("step")
            self.resumed_at = event.get("time")
            self.restore = {k: event[k] for k in RESTORE_KEYS if k in event}
        elif kind == "fresh_start":
            self.resumed_from = 0  # known: from the beginning (None means unknown)
            self.resumed_at = event.get("time")
        elif kind == "checkpoint":
            self.checkpoint_uri = event.get("checkpoint_uri")
        elif kind == "resume_rng":
            self._resume_rng(event)
        elif kind == "finished":
            self.timings = dict(event.get("timings") or {})

    def _resume_rng(self, event: dict[str, Any]) -> None:
        """A resumed worker group's word on its RNG (a user's Ray loop): exact or why not."""
        exact = bool(event["exact"])
        self.resume_exact = exact if self.resume_exact is None else self.resume_exact and exact
        self.resume_note = self.resume_note or event.get("note")
        if event.get("group") and self.restarts:
            self.restarts[-1]["resume_exact"] = exact

    def _restarting(self, event: dict[str, Any]) -> None:
        """The worker group ended and Ray Train restarts it in place: a restart to record."""
        reason = event["error_budget"]  # the budget the restart drew on
        self.preempted_nodes |= set(event.get("preempted_nodes") or ())
        notice = None
        if reason == "preemption":  # the just-in-time checkpoint answered this one
            notice, self.notice = self.notice, None
        self._ends_the_group()
        self.restarts.append(
            {
                **(notice or {}),
                "restart": len(self.restarts) + 1,
                "reason": reason,
                "failed_at": event["time"],
                "last_step": self.step,
                "last_progress_at": self.progress_at,
                "world_size_before": self.world_size,
                "error_class": event["error_class"],
                "error_message": event["error_message"],
            }
        )

    def _group_started(self, event: dict[str, Any]) -> None:
        """A later worker group of the attempt loaded its start point."""
        if not self.restarts or "resumed_at" in self.restarts[-1]:
            self.restarts.append({"restart": len(self.restarts) + 1, "reason": "unknown"})
        self.restarts[-1]["resumed_from_step"] = event.get("step", 0)
        self.restarts[-1]["resumed_at"] = event.get("time")
        self.restarts[-1]["world_size_after"] = event.get("world_size")
        for key in ("restore_s", "checkpoint_created_at"):  # the read began restore_s before
            if key in event:
                self.restarts[-1][key] = event[key]

    def _ends_the_group(self) -> None:
        """The restart about to be recorded ends the newest group that began, unless an earlier
        restart did (then the group it ends failed while starting)."""
        if self.began is not None and self.began not in self.ended_by:
            self.ended_by[self.began] = len(self.restarts)

    def _late(self, event: dict[str, Any]) -> bool:
        """Whether ``event`` comes from a worker group whose restart was heard of first."""
        return event.get("group") in self.ended_by

    def _reached_before_restart(self, group: int, step: int) -> None:
        """A step worker group ``group`` reached, heard of after the restart that ended it."""
        restart = self.restarts[self.ended_by[group]]
        restart["last_step"] = max(restart.get("last_step") or 0, step)

    def _last_step(self, event: dict[str, Any]) -> None:
        """A failing rank's last completed step (rank 0's rows lag it, or rank 0 died)."""
        if self._late(event):
            self._reached_before_restart(event["group"], event["last_step"])
        else:
            self.step = max(self.step, event["last_step"])
