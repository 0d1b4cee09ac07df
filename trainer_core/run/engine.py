"""One attempt of a run: Ray Train's ``fit()`` after the driver's preflight, the attempt's
record, and its result. Ray is reached through ``trainer_core.execution`` only.

``run_attempt(spec)`` is one attempt: preflight on the driver (``trainer_core.run.preflight``:
fail fast, no workers), Ray Train's ``fit()`` with ``RunConfig(storage_path, name=<run name>)``
so every attempt addresses the same run directory, metrics relayed to ``on_event`` while fit()
runs, the attempt recorded in ``attempts.jsonl``, any failure raised as a classified
``RelaytrainError`` (tagged with its attempt). Called again on the same run, it resumes from the
newest committed checkpoint.
"""

from __future__ import annotations

import logging
import platform
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import pyarrow
import torch

from trainer_core import __version__
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import LeaseLostError
from trainer_core.execution import classify, cluster, ray_head, trainer
from trainer_core.execution.trainer import EventHandler
from trainer_core.run import attempts
from trainer_core.run.live_state import LiveState
from trainer_core.run.plan import Plan
from trainer_core.run.preflight import preflight
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train.builtin import builtin_train_loop
from trainer_core.train.user_loop import user_train_loop

logger = logging.getLogger("relaytrain.engine")


def versions() -> dict[str, str]:
    return {
        "relaytrain": __version__,
        "ray": cluster.ray_version(),
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }


@dataclass
class AttemptResult:
    run_name: str
    run_uri: str
    attempt: int
    status: str
    resumed_from_step: int | None
    steps_completed: int
    final_metrics: dict[str, Any]
    latest_checkpoint_uri: str | None
    wall_time_s: float
    plan_reason: str
    #: Seconds rank 0 spent stepping, aggregating metrics and writing checkpoints.
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_attempt(
    spec: RunSpec,
    *,
    attempt: int | None = None,
    on_event: EventHandler | None = None,
    poll_interval_s: float = 0.5,
    lease_owner: str | None = None,
    lost: Callable[[], BaseException | None] | None = None,
    until_epoch: int | None = None,
) -> AttemptResult:
    """Run one attempt of ``spec`` (resuming if the run has committed checkpoints).
    ``lease_owner``: the lease the workers' commits are fenced by; ``lost()``: an error once
    the lease is lost (the attempt is stopped and raises it); ``until_epoch``: pause the run
    after that epoch (``Plan.until_epoch``)."""
    started = time.time()
    checked = preflight(spec, attempt)  # bad input names itself before any worker starts
    run_dir, pinned, tables = checked.run_dir, checked.pinned, checked.tables
    plan = replace(checked.plan, lease_owner=lease_owner, until_epoch=until_epoch)
    if pinned is not None:
        plan = replace(plan, dataset=pinned.for_workers())
    if tables is not None:
        plan = replace(plan, ray_datasets=tables.files())
    if on_event is not None:
        for uri, added in checked.added():
            on_event({"kind": "dataset_added", "files": added, "uri": uri})
    with cluster.ray_cluster():
        cluster.check_capacity(spec, first_attempt=plan.attempt == 1)  # retries wait
        reclaimed_before = cluster.preempted_nodes()
        _prepare_run_directory(spec, run_dir, plan, checked.snapshot)
        # From step 0 when nothing is committed; a user's loop from what only its workers know.
        start = plan.resume_step if plan.resume_step is not None or spec.ray_loop else 0
        record = attempts.AttemptRecord.opened(plan.attempt, plan.reason, start)
        record = replace(record, marks=uuid.uuid4().hex[:16])
        earlier = _ended_before(run_dir, plan.attempt)
        plan = replace(plan, marks=record.marks, earlier_marks=earlier.marks if earlier else None)
        attempts.write(run_dir, record)
        live = LiveState(step=plan.resume_step or 0, resumed_from=start)

        def handle(event: dict[str, Any]) -> None:
            nonlocal earlier
            if event["kind"] == "earlier_last_step" and earlier is not None:
                # how far a rank killed outright got in the attempt before: its own record
                earlier = earlier.reached(event["last_step"])
                attempts.write_quietly(run_dir, earlier)
            if live.apply(event):  # a worker group began or ended: the record says so now
                attempts.write(run_dir, record.running(live.outcome()))
            if on_event is not None:
                on_event(event)

        loop = user_train_loop if spec.ray_loop else builtin_train_loop
        try:
            trainer.fit(spec, plan, loop, handle, poll_interval_s, reclaimed_before, lost)
        except BaseException as error:
            named = ray_head.name_loss(classify.classify(error))  # a lost head, not Ray's exit
            classified = classify.name_preemption(named, reclaimed_before | live.preempted_nodes)
            classified.attempt = plan.attempt  # type: ignore[attr-defined]  # for the train task
            failed = record.failed(
                classified, live.outcome(), live.step, error_step_ran=spec.ray_loop
            )
            if not isinstance(classified, LeaseLostError):  # the run is another flow's now
                attempts.write_quietly(run_dir, failed)
            if classified is error:
                raise
            raise classified from error
        result = _result(plan, run_dir, live, started)
        attempts.write(run_dir, record.completed(live.outcome(), result.steps_completed))
        return result


def _ended_before(run_dir: RunDirectory, attempt: int) -> attempts.AttemptRecord | None:
    """The record of the attempt before ``attempt`` if it failed: its ranks may have left
    step marks that this attempt's ranks find."""
    earlier = [r for r in attempts.read(run_dir) if r.attempt == attempt - 1]
    return earlier[0] if earlier and earlier[0].status == "failed" else None


def _prepare_run_directory(
    spec: RunSpec, run_dir: RunDirectory, plan: Plan, pinned: dict[str, Any] | None
) -> None:
    """The dataset snapshot (``pinned``: what preflight pinned) and the run record on the
    first attempt (in that order: the run record names the snapshot's fingerprint, the stored
    one's where an attempt stored it already); earlier attempts that ended without a word
    closed; checkpoint directories no attempt committed removed (before any worker starts)."""
    snapshot = run_dir.read_dataset_snapshot()
    if snapshot is None and pinned is not None:
        snapshot = pinned
        run_dir.write_dataset_snapshot(snapshot)
    if run_dir.read_run_record() is None:
        run_dir.write_run_record(
            spec.model_dump(mode="json"),
            spec.identity(),
            spec.fingerprint(),
            versions(),
            dataset=snapshot["fingerprint"] if snapshot else None,
        )
    attempts.close_abandoned(run_dir, plan.attempt)
    _clean_orphans(run_dir)


def _result(plan: Plan, run_dir: RunDirectory, live: LiveState, started: float) -> AttemptResult:
    """A completed attempt's result: where the newest commit (else the workers' word) got."""
    newest = run_dir.scan().newest
    return AttemptResult(
        run_name=plan.run_name,
        run_uri=plan.run_uri,
        attempt=plan.attempt,
        status="completed",
        resumed_from_step=live.resumed_from or None,
        steps_completed=newest.step if newest else live.step,
        final_metrics=newest.metrics if newest else dict(live.metrics),
        latest_checkpoint_uri=newest.uri if newest else live.checkpoint_uri,
        wall_time_s=time.time() - started,
        plan_reason=plan.reason,
        timings=live.timings,
    )


def _clean_orphans(run_dir: RunDirectory) -> None:
    """Before workers start nothing is in flight: drop uncommitted checkpoint directories."""
    uncommitted = run_dir.scan().uncommitted
    if uncommitted:
        logger.info("removing uncommitted checkpoint directories: %s", uncommitted)
        run_dir.delete_checkpoints(uncommitted)
