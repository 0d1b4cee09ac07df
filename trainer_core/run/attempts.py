"""The attempt record: one per attempt of a run, in the run directory's ``attempts.jsonl``.

A typed, versioned record with a few verbs: ``opened`` when an attempt starts, ``running`` once
its workers have said where they resumed (and at each restart in place), ``failed`` or
``completed`` when it ends, ``abandoned`` for one whose driver died without a word, and
``decided`` once the orchestrator chose to retry or stop. Readers get every field (a record
written by an older release gets the defaults), never a missing key.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer_core.checkpoint.history import last_recorded_step
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import StorageError

logger = logging.getLogger("relaytrain.attempts")

Status = Literal["running", "failed", "completed"]


#: The most of a failure's traceback an attempt record keeps.
TRACEBACK_CHARS = 20_000


@dataclass(frozen=True)
class AttemptRecord:
    attempt: int
    status: Status = "running"
    started_at: float | None = None
    ended_at: float | None = None
    #: The plan's words: fresh start, or resume from which checkpoint and why.
    plan: str = ""
    #: The committed step the workers resumed from (0: from the beginning; None: unknown).
    resumed_from_step: int | None = None
    #: When the workers had loaded it (worker clock): training resumed here.
    resumed_at: float | None = None
    #: What loading it cost: ``bytes_read`` from storage by the whole group, and the slowest
    #: rank's ``restore_s``; when the checkpoint it read was written (``checkpoint_created_at``).
    restore: dict[str, Any] | None = None
    #: A user's Ray loop: whether each resume restored every rank's RNG as its checkpoint saved
    #: it, so it trains on as the uninterrupted run would (None: no such resume), and why not.
    resume_exact: bool | None = None
    resume_note: str | None = None
    last_step: int | None = None
    #: The key its ranks marked their last completed steps by on their nodes (``step_marks``):
    #: the next attempt's ranks read the marks of a rank killed outright.
    marks: str | None = None
    #: When the workers last relayed progress (a metric row): a failure is noticed after it.
    last_progress_at: float | None = None
    #: In-place restarts of the worker group within the attempt (resizes of an elastic run):
    #: reason, world sizes, steps and seconds, as ``live_state.LiveState`` recorded them.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    world_size: int | None = None
    peak_worker_rss_mb: float | None = None
    error_class: str | None = None
    #: The retry budget the failure draws on: "none", "infrastructure", "preemption", "code".
    error_budget: str = "none"
    error_message: str | None = None
    error_step: int | None = None
    error_type: str | None = None
    #: The training code's whole traceback, as its worker formatted it (its end, at most
    #: ``TRACEBACK_CHARS``: the frame that raised is last).
    error_traceback: str | None = None
    #: True when the failure will repeat on retry (a NaN loss).
    deterministic: bool = False
    retry_decision: str | None = None

    # -- verbs ---------------------------------------------------------------------------------

    @classmethod
    def opened(cls, attempt: int, plan: str, resume_step: int | None) -> AttemptRecord:
        return cls(attempt, "running", time.time(), plan=plan, resumed_from_step=resume_step)

    def running(self, outcome: dict[str, Any]) -> AttemptRecord:
        """Still running, with what its workers said of themselves so far (where they resumed,
        their restarts): what the record keeps if its driver cannot close it."""
        return dataclasses.replace(self, **_known(outcome))

    def failed(
        self,
        error: BaseException,
        outcome: dict[str, Any],
        last_step: int,
        *,
        error_step_ran: bool = False,
    ) -> AttemptRecord:
        """Ended by ``error`` (classified); ``outcome`` is what the workers said of themselves;
        ``last_step`` the newest step they are known to have completed. The error's own step
        was completed only when ``error_step_ran`` (a user's Ray loop fails in a report, after
        its epoch trained); relaytrain's loops fail in the step they were running, so the step
        before it is the newest the error proves completed (a fault as step 17 begins: 16)."""
        error_step = getattr(error, "step", None) or 0
        reached = error_step if error_step_ran else error_step - 1
        return dataclasses.replace(
            self,
            **_known(outcome),
            status="failed",
            ended_at=time.time(),
            last_step=max(last_step, reached),
            error_class=type(error).__name__,
            error_budget=getattr(error, "budget", "none"),
            error_message=str(error)[:2000],
            error_step=getattr(error, "step", None),
            error_type=getattr(error, "error_type", None),
            error_traceback=(getattr(error, "traceback", None) or "")[-TRACEBACK_CHARS:] or None,
            deterministic=getattr(error, "deterministic", False),
        )

    def completed(self, outcome: dict[str, Any], last_step: int) -> AttemptRecord:
        return dataclasses.replace(
            self, **_known(outcome), status="completed", ended_at=time.time(), last_step=last_step
        )

    def abandoned(self, last_step: int | None = None) -> AttemptRecord:
        """A record still "running" that its driver can no longer end; ``last_step``: the
        newest step it is known to have trained (its metric segments), if any."""
        return dataclasses.replace(
            self,
            status="failed",
            last_step=last_step if self.last_step is None else self.last_step,
            error_class="DriverLost",
            error_budget="infrastructure",
            error_message="this attempt ended without recording how: its driver died (flow "
            "process killed, machine lost) or storage refused the record",
        )

    def reached(self, step: int) -> AttemptRecord:
        """A step its ranks completed, heard of later (the next attempt found their marks)."""
        return dataclasses.replace(self, last_step=max(self.last_step or 0, step))

    def decided(self, reason: str) -> AttemptRecord:
        return dataclasses.replace(self, retry_decision=reason)

    # -- JSON ----------------------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptRecord:
        """A stored record; fields this release does not know are left out."""
        return cls(**_known(data))


_FIELDS = {f.name for f in dataclasses.fields(AttemptRecord)}


def _known(data: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in data.items() if k in _FIELDS}


def read(run_dir: RunDirectory) -> list[AttemptRecord]:
    """The run's attempt records, oldest first."""
    return [AttemptRecord.from_json(r) for r in run_dir.read_attempts()]


def write(run_dir: RunDirectory, record: AttemptRecord) -> None:
    """Insert or replace the record of ``record.attempt``."""
    run_dir.record_attempt(record.to_json())


def write_quietly(run_dir: RunDirectory, record: AttemptRecord) -> bool:
    """``write`` for the record of a failure: when the store refuses it (full, or away), the
    failure being raised matters more than its record. Logged; False. The train task closes a
    record left running with the error it holds (``close_unrecorded``), or the next attempt
    does (``close_abandoned``)."""
    try:
        write(run_dir, record)
    except StorageError as e:
        logger.warning("could not record how attempt %s ended: %s", record.attempt, e)
        return False
    return True


def close_unrecorded(
    run_dir: RunDirectory, attempt: int, error: BaseException
) -> list[AttemptRecord]:
    """The records, ``attempt``'s closed as failed by ``error`` if it is still running (its
    engine could not record the end: the store refused the write). Stored if the store takes
    it now; the records as they are known either way."""
    records = read(run_dir)
    if records and records[-1].attempt == attempt and records[-1].status == "running":
        last_step = last_recorded_step(run_dir, attempt) or 0
        records[-1] = records[-1].failed(error, {}, last_step)
        write_quietly(run_dir, records[-1])
    return records


def next_number(records: list[AttemptRecord]) -> int:
    return max((r.attempt for r in records), default=0) + 1


def close_abandoned(run_dir: RunDirectory, attempt: int) -> None:
    """Mark earlier attempts still running as failed: they ended without a word.

    Only the lease holder starts attempts, so a running record of another attempt belongs to a
    driver whose flow process was killed or lost (its lease expired or was taken over).
    """
    for record in read(run_dir):
        if record.status == "running" and record.attempt != attempt:
            write(run_dir, record.abandoned(last_recorded_step(run_dir, record.attempt)))
