"""train: one Ray Train attempt per Prefect task run; a failure becomes a retry that resumes."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from tasks.naming import artifact_key
from tasks.progress import ProgressArtifact
from tasks.setup import Prepared
from trainer_core import step_time
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import LeaseLostError, RelaytrainError
from trainer_core.run import attempts, engine, epochs, jobs, lease
from trainer_core.run.retry import RetryDecision, decide_retry
from trainer_core.spec.run_spec import RunSpec
from trainer_core.tracking import mlflow_log, tensorboard_log

#: The progress artifact is updated at most this often (and at the end of training).
PROGRESS_INTERVAL_S = 2.0
#: How long the end of an attempt waits for its last progress update to reach the API.
FINAL_PROGRESS_WAIT_S = 10.0


#: What the run should know of, by event kind: the log level, the message and its arguments.
NOTICES: dict[str, tuple[int, str, Callable[[dict[str, Any]], tuple[Any, ...]]]] = {
    "restarting": (
        logging.WARNING,
        "worker group restarting in place (restart %s; %s budget: %s) after %s: %s",
        lambda e: (
            e["restart"],
            e["error_budget"],
            "no limit" if e["limit"] is None else f"at most {e['limit']}",
            e["error_class"],
            e["error_message"],
        ),
    ),
    "waiting_for_resources": (
        logging.WARNING,
        "the Ray cluster is busy (%s): the worker group waits up to %g s "
        "(scaling.wait_for_resources_s) for other runs to free it",
        lambda e: (e["short"], e["wait_s"]),
    ),
    "waiting_for_nodes": (
        logging.WARNING,
        "waiting for nodes: %s; the worker group waits up to %g s "
        "(scaling.wait_for_resources_s) for the cluster to add them",
        lambda e: (e["short"], e["wait_s"]),
    ),
    "resizing": (
        logging.WARNING,
        "the cluster holds %s workers now: resizing the worker group from %s",
        lambda e: (e["to"], e["world_size"]),
    ),
    "preemption_notice": (
        logging.WARNING,
        "node(s) of rank(s) %s drain for preemption in %.1f s: checkpoint committed at step %s, "
        "just in time",
        lambda e: (e["ranks"], e["seconds_left"], e["step"]),
    ),
    "slow_checkpoint_writes": (
        logging.WARNING,
        "checkpoint writes outlast checkpoint.every=%s: at step %s training waited %.2f s for "
        "the previous write, which began %.2f s of training earlier. Raise checkpoint.every or "
        "use faster storage (said once per worker group)",
        lambda e: (e["every"], e["step"], e["wait_s"], e["since_s"]),
    ),
    "straggler": (
        logging.WARNING,
        "rank %s on node %s is a straggler: its steps take %.2fx its peers' median (over %sx "
        "for %s report windows in a row; the run's summary has the breakdown)",
        lambda e: (e["rank"], e["node"], e["ratio"], step_time.RATIO, step_time.WINDOWS),
    ),
    "dataset_added": (
        logging.INFO,
        "%s file(s) added to %s since this run took its dataset snapshot are ignored (a new "
        "run.name trains on them): %s",
        lambda e: (
            len(e["files"]),
            e["uri"],
            ", ".join(e["files"][:5]) + (" ..." if len(e["files"]) > 5 else ""),
        ),
    ),
}


def should_retry(task: Any, task_run: TaskRun, state: State) -> bool:
    """Prefect's retry_condition_fn: follow the decision the failed attempt recorded."""
    error = state.result(raise_on_failure=False)
    decision = getattr(error, "retry_decision", None)
    return isinstance(decision, RetryDecision) and decision.retry


class ProgressRelay:
    """Turns relayed training events into task logs and a live progress artifact."""

    def __init__(
        self, spec: RunSpec, prepared: Prepared, tracker: mlflow_log.Tracker | None = None
    ):
        self.logger = get_run_logger()
        self.tracker = tracker
        self.total_steps = prepared.total_steps
        self.epochs = spec.schedule.epochs if spec.schedule else None
        #: A loop on Ray's API's ``epoch`` values (``run.epochs``): in the numbering it reports,
        #: which its first report shows (the history's, for a resumed attempt).
        self.ray_loop = spec.ray_loop
        self.reported_epochs: set[Any] = set()
        if spec.ray_loop:
            run_dir = RunDirectory.of(prepared.storage_uri, prepared.run_name)
            self.reported_epochs = {row.get("epoch") for row in read_metrics_history(run_dir)}
        self.last_update = 0.0
        self.step = prepared.resume_step or 0
        self.artifact = ProgressArtifact(
            artifact_key(prepared.run_name, "progress"),
            f"Training progress of {prepared.run_name}",
            self._percent(),
            self.logger,
        )

    def _percent(self) -> float:
        if not self.total_steps:
            return 0.0
        return round(min(100.0, 100.0 * self.step / self.total_steps), 1)

    def __call__(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if self.tracker is not None:  # metric rows, logged once their checkpoint commits
            self.tracker.on_event(event)
        self._log_notice(kind, event)
        if kind in ("resumed", "fresh_start"):
            self.logger.log(*start_line(event))
        elif kind == "checkpoint":
            self.logger.info(
                "checkpoint committed at step %s: %s", event["step"], event.get("checkpoint_uri")
            )
        elif kind == "metrics":
            for row in event["rows"]:
                self.step = max(self.step, row["step"])
                self.reported_epochs.add(row.get("epoch"))
                if any(k.startswith("val_") for k in row):
                    self._log_epoch(row)
        elif kind == "output":  # what a rank's training code printed
            for line in event["lines"]:
                self.logger.info("[rank %s] %s", event["rank"], line)
        elif kind == "resume_rng" and not event["exact"]:
            self.logger.warning("resume not exact: %s", event.get("note"))
        elif kind == "finished":
            self.step = self.total_steps or self.step
            if event.get("stopped"):
                self.logger.info("training stopped at step %s: %s", event["step"], event["stopped"])
        if time.monotonic() - self.last_update >= PROGRESS_INTERVAL_S or kind == "finished":
            self.publish()

    def _log_notice(self, kind: str, event: dict[str, Any]) -> None:
        """Say what the run should know of: a restart or resize, a drain, slow writes, new files."""
        if kind in NOTICES:
            level, message, arguments = NOTICES[kind]
            self.logger.log(level, message, *arguments(event))

    def publish(self) -> None:
        """Post the progress known now, without waiting for the API."""
        self.artifact.post(self._percent())
        self.last_update = time.monotonic()

    def close(self) -> None:
        """The attempt's last progress (also when it ends early: where it got to), waited for
        a while: the task's own end needs the API too."""
        self.artifact.close(self._percent(), FINAL_PROGRESS_WAIT_S)

    def _log_epoch(self, row: dict[str, Any]) -> None:
        shown = " ".join(
            f"{k} {row[k]:.4f}" for k in sorted(row) if k == "loss" or k.startswith("val_")
        )
        of = f"/{self.epochs}" if self.epochs else ""
        first = epochs.first_reported(self.reported_epochs) if self.ray_loop else 0
        epoch = row.get("epoch")
        number = epochs.number(epoch, first) if isinstance(epoch, int) else epoch
        self.logger.info("epoch %s%s (step %s): %s", number, of, row["step"], shown)


def start_line(event: dict[str, Any]) -> tuple[int, str]:
    """The log line (level, text) of a worker group's start: resumed from a step, or from
    scratch; every committed checkpoint the workers could not use is named with why, as a
    warning (setup had named the newest as the resume point)."""
    skipped = event.get("skipped") or []
    if event["kind"] == "resumed":
        line = f"{event.get('world_size', '?')} workers resumed from step {event.get('step', '?')}"
    else:
        line = "workers started from scratch"
    if not skipped:
        return logging.INFO, line
    why = "; ".join(f"checkpoint {s['step']}: {s.get('reason', 'unusable')}" for s in skipped)
    return logging.WARNING, f"{line}, past committed checkpoints they could not use ({why})"


def _decide(
    spec: RunSpec,
    run_dir: RunDirectory,
    error: RelaytrainError,
    number: int,
    first_attempt: int = 1,
) -> RetryDecision:
    """Decide retry-or-stop from the attempt that ended in ``error``: ``error.attempt`` where
    the engine ran it (a re-attached Ray job's may be older than ``number``, the next one), and
    just recorded it (or could not record how it ended: it is closed here with ``error``); else
    ``number``, failed before its record (a preflight check). Record the verdict. Budgets count
    this flow run's attempts only (``first_attempt`` on), as Prefect counts ``retries``."""
    number = getattr(error, "attempt", number)
    records = attempts.close_unrecorded(run_dir, number, error)
    records = [r for r in records if r.attempt >= first_attempt]
    if not records or records[-1].attempt < number or records[-1].status != "failed":
        failure = attempts.AttemptRecord(
            attempt=attempts.next_number(records),
            status="failed",
            error_budget=error.budget,
            error_class=type(error).__name__,
            error_message=str(error),
        )
        return decide_retry(failure, records, spec.retries)
    decision = decide_retry(records[-1], records[:-1], spec.retries)
    attempts.write_quietly(run_dir, records[-1].decided(decision.reason))
    return decision


def worker_traceback(error: BaseException) -> str:
    """The whole traceback of the training code's failure, as its worker formatted it (the
    user's own frames; Ray's snippet of it is cut short), for the attempt's log line."""
    text = getattr(error, "traceback", None)
    if not text:
        return ""
    rank = getattr(error, "rank", None)
    where = "" if rank is None else f" on rank {rank}"
    return f"\nThe training code's traceback{where}:\n{text.rstrip()}"


@task(name="train", cache_policy=NO_CACHE, retry_condition_fn=should_retry)
def train(spec: RunSpec, prepared: Prepared) -> dict[str, Any]:
    """Run one attempt (resuming from the newest committed checkpoint); classify a failure."""
    logger = get_run_logger()
    run_dir = RunDirectory.of(prepared.storage_uri, prepared.run_name)
    held = lease.acquire(run_dir.location, owner=prepared.lease_owner)
    tracker = mlflow_log.for_run(spec, run_dir)
    if tracker is not None:
        tracker.attempt_started()
    progress = ProgressRelay(spec, prepared, tracker)
    number = attempts.next_number(attempts.read(run_dir))  # the attempt this one records
    with lease.LeaseKeeper(run_dir.location, held) as keeper:
        try:
            if jobs.job_address(spec):  # a remote cluster: the attempt runs as a Ray job
                result = jobs.run_attempt(
                    spec,
                    on_event=progress,
                    on_log=logger.info,
                    lease_owner=prepared.lease_owner,  # names the job: its commits are fenced
                    until_epoch=prepared.until_epoch,
                )
            else:
                result = engine.run_attempt(
                    spec,
                    on_event=progress,
                    lease_owner=prepared.lease_owner,
                    lost=lambda: keeper.lost,
                    until_epoch=prepared.until_epoch,
                )
        except LeaseLostError as error:  # the run is another flow's now: write nothing
            logger.error("attempt stopped: %s", error)
            raise
        except RelaytrainError as error:
            decision = _decide(spec, run_dir, error, number, prepared.first_attempt)
            tensorboard_log.write_quietly(run_dir)  # what the attempt committed, before a retry
            if tracker is not None:
                tracker.attempt_ended()
            error.retry_decision = decision  # type: ignore[attr-defined]
            logger.error(
                "attempt failed with %s: %s. %s%s",
                type(error).__name__,
                error,
                decision.reason,
                worker_traceback(error),
            )
            raise
        finally:  # however the attempt ended: where it got to (its thread ends too)
            progress.close()
    logger.info(
        "attempt %s completed at step %s in %.1f s",
        result.attempt,
        result.steps_completed,
        result.wall_time_s,
    )
    return result.to_dict()
