"""What a finished run amounts to: the typed result, the per-epoch table, the markdown summary.

Pure functions of the run directory's records (no Prefect): finalize writes ``summary.json``
from them and publishes them as artifacts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from trainer_core.checkpoint import exports, verification
from trainer_core.checkpoint.files import CheckpointInfo
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.ray_checkpoints import ray_checkpoints
from trainer_core.checkpoint.retention import rank_by_metric
from trainer_core.checkpoint.run_directory import SCHEMA_VERSION, RunDirectory
from trainer_core.errors import CheckpointCorruptError, SpecError
from trainer_core.numbers import is_finite_number
from trainer_core.run import epochs
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.attempts import read as read_attempts
from trainer_core.run.time_account import TimeAccount, time_account
from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage.locations import walk_files
from trainer_core.tracking import mlflow_log, mlflow_state, tensorboard_log
from trainer_core.train import evaluate

logger = logging.getLogger("relaytrain.summary")


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True)


class InPlaceRestart(_Frozen):
    """One in-place restart of an attempt's worker group (a resize, for an elastic run), why,
    and what it cost."""

    #: "infrastructure" (a worker or node lost), "preemption", "startup" (a group sized to
    #: capacity that went away could not start) or "capacity" (the elastic policy grew or
    #: shrank a healthy group).
    reason: str | None = None
    world_size_before: int | None = None
    world_size_after: int | None = None
    error_class: str | None = None
    error_message: str | None = None
    last_step: int | None = None
    resumed_from_step: int | None = None
    steps_lost: int | None = None
    recovery_s: float | None = None
    #: Seconds from the workers' last relayed progress to the failure being reported.
    detection_s: float | None = None


class AttemptSummary(_Frozen):
    attempt: int
    status: str
    error_class: str | None = None
    #: The retry budget its failure drew on: "infrastructure", "preemption", "code", ...
    error_budget: str | None = None
    error_message: str | None = None
    error_step: int | None = None
    resumed_from_step: int | None = None
    last_step: int | None = None
    steps_lost: int | None = None
    #: Seconds from this attempt's failure to the next attempt's workers resuming.
    recovery_s: float | None = None
    #: Seconds from the workers' last relayed progress to the failure being recorded.
    detection_s: float | None = None
    duration_s: float | None = None
    retry_decision: str | None = None
    #: In-place restarts of the worker group within this attempt: resizes of an elastic run,
    #: preemptions, and ``retries.in_place`` restarts.
    restarts: list[InPlaceRestart] = []
    #: Workers the attempt trained on, and the largest peak resident memory of any of them
    #: (MB; the built-in loop measures every rank, a user's loop rank 0), as of its last
    #: checkpoint or its end.
    world_size: int | None = None
    peak_worker_rss_mb: float | None = None
    #: A user's Ray loop: whether its resume restored every rank's RNG as the checkpoint saved
    #: it (None: no such resume), and why not.
    resume_exact: bool | None = None
    resume_note: str | None = None


#: How a run ended: trained to its last epoch (or early-stopped), failed, or paused after the
#: epoch it was asked to stop at (``until_epoch``): the same run name trains on from there.
#: ``pruned``: paused where a sweep's pruner stopped it (``mark_pruned``); asked for more, it
#: trains on as a paused run does.
Status = Literal["completed", "failed", "paused", "pruned"]


class TrainingResult(_Frozen):
    """The flow's result: JSON-serializable, also written as the run's ``summary.json``."""

    run_name: str
    storage_uri: str
    run_uri: str
    status: Status
    attempts: list[AttemptSummary]
    steps_completed: int
    epochs_completed: int
    final_metrics: dict[str, Any]
    best_metrics: dict[str, Any]
    best_checkpoint_uri: str | None
    latest_checkpoint_uri: str | None
    wall_time_s: float
    storage_bytes: int
    target_epochs: int | None = None
    #: Why training ended before ``target_epochs`` (early stopping); None when it did not.
    stop_reason: str | None = None
    #: The best and latest checkpoints' whole model as one ``torch.load(weights_only=True)``
    #: file: the checkpoint's own ``model.pt``, or the export of a DCP (fsdp) checkpoint.
    best_model_uri: str | None = None
    latest_model_uri: str | None = None
    #: Optimizer steps the workers ran, counting again each step a failure made them redo
    #: (None when a resume point is unknown: a user's loop resumed by Ray), and the share of
    #: them the result keeps: ``steps_completed / steps_computed``.
    steps_computed: int | None = None
    goodput: float | None = None
    #: Where the time went (None when no step was measured: a user's loop on Ray's API).
    time: TimeAccount | None = None
    #: Where the run is in MLflow and whether everything reached it (None: no MLflow).
    mlflow: mlflow_state.MlflowState | None = None
    #: ``data.test``'s figures on the best checkpoint (``test_loss``, ...), measured once when
    #: the run completed; None without a test set.
    test_metrics: dict[str, float] | None = None
    #: A user's own loop's ``train_loop_config`` as the run had it: a finished run is finished
    #: for this config (``tasks.setup.is_finished``). None for the built-in loop.
    train_loop_config: dict[str, Any] | None = None


def attempt_summaries(records: Sequence[AttemptRecord]) -> list[AttemptSummary]:
    """Attempt records with the steps each failure lost (last step minus the next resume)."""
    summaries = []
    for index, record in enumerate(records):
        following = records[index + 1] if index + 1 < len(records) else None
        lost = recovery = detection = None
        if record.status == "failed" and following is not None:
            lost = _steps_lost(record.last_step, following.resumed_from_step)
            if following.resumed_at and record.ended_at:
                recovery = following.resumed_at - record.ended_at
            if record.last_progress_at and record.ended_at:
                detection = max(record.ended_at - record.last_progress_at, 0.0)
        started, ended = record.started_at, record.ended_at
        summaries.append(
            AttemptSummary(
                attempt=record.attempt,
                status=record.status,
                error_class=record.error_class,
                error_budget=record.error_budget if record.status == "failed" else None,
                error_message=record.error_message,
                error_step=record.error_step,
                resumed_from_step=record.resumed_from_step,
                last_step=record.last_step,
                steps_lost=lost,
                recovery_s=recovery,
                detection_s=detection,
                duration_s=(ended - started) if started and ended else None,
                retry_decision=record.retry_decision,
                restarts=[_restart(r) for r in record.restarts],
                world_size=record.world_size,
                peak_worker_rss_mb=record.peak_worker_rss_mb,
                resume_exact=record.resume_exact,
                resume_note=record.resume_note,
            )
        )
    return summaries


def steps_computed(attempts: Sequence[AttemptSummary]) -> int | None:
    """Steps the workers ran across every attempt and in-place restart: each attempt from its
    resume point to its last step, plus what each in-place restart rewound (ran twice).

    A restart whose group never resumed (it failed again while starting) rewound nothing: the
    next one that did counts from the same last step. An attempt whose driver died is counted
    to the newest step its metric segments hold (a lower bound). None when an attempt's resume
    point is unknown (a user's loop that Ray resumed)."""
    total = 0
    for a in attempts:
        if a.last_step is None:
            continue
        if a.resumed_from_step is None:
            return None
        total += max(a.last_step - a.resumed_from_step, 0)
        total += sum(r.steps_lost or 0 for r in a.restarts)
    return total


def _steps_lost(last_step: Any, resumed_from: Any) -> int | None:
    """Steps run before a failure that the resume point does not hold."""
    if last_step is None or resumed_from is None:
        return None
    return max(int(last_step) - int(resumed_from), 0)


def _restart(record: dict[str, Any]) -> InPlaceRestart:
    last, resumed = record.get("last_step"), record.get("resumed_from_step")
    failed, back = record.get("failed_at"), record.get("resumed_at")
    progress = record.get("last_progress_at")
    return InPlaceRestart(
        reason=record.get("reason"),
        world_size_before=record.get("world_size_before"),
        world_size_after=record.get("world_size_after"),
        error_class=record.get("error_class"),
        error_message=record.get("error_message"),
        last_step=last,
        resumed_from_step=resumed,
        steps_lost=_steps_lost(last, resumed),
        recovery_s=(back - failed) if failed and back else None,
        detection_s=max(failed - progress, 0.0) if failed and progress else None,
    )


def best_checkpoint(
    committed: Sequence[CheckpointInfo], metric: str, mode: str
) -> CheckpointInfo | None:
    """The best checkpoint by ``metric`` (``rank_by_metric``); the newest when none recorded
    it."""
    ranked = rank_by_metric(committed, metric, mode)
    if ranked:
        return ranked[0]
    return committed[-1] if committed else None


def storage_bytes(run_dir: RunDirectory) -> int:
    return sum(info.size or 0 for info in walk_files(run_dir.location))


def committed_checkpoints(spec: RunSpec, run_dir: RunDirectory) -> list[CheckpointInfo]:
    """The run's committed checkpoints, oldest first: relaytrain's own, or a user's own loop's
    Ray checkpoints that Ray Train registered (``RunDirectory.ray_checkpoints``)."""
    if spec.ray_loop:
        return ray_checkpoints(run_dir)
    return run_dir.scan().committed


def user_loop_progress(
    status: str, newest: CheckpointInfo | None, history: Sequence[dict[str, Any]]
) -> tuple[int, int, dict[str, Any]]:
    """Where a user's own loop got: steps (its reports, or its ``step`` metric), epochs and
    final metrics. A completed run counts to its last report, checkpointed or not; an unfinished
    one to its newest checkpoint (a resume runs again what came after). Epochs from the loop's
    own ``epoch`` metric, in the numbering it reports (``run.epochs``), 0 without one."""
    if status == "completed" and history:
        final = dict(history[-1])
    else:
        final = newest.metrics if newest else {}
    step = final.get("step")
    done = int(step) if isinstance(step, int | float) and is_finite_number(step) else 0
    return done, epochs.epochs_done(final, history), final


def build_result(
    spec: RunSpec,
    run_dir: RunDirectory,
    storage_uri: str,
    status: Status,
    model_uris: dict[int, str | None] | None = None,
    history: list[dict[str, Any]] | None = None,
) -> TrainingResult:
    """The result as the run directory records it; ``model_uris`` (by step) names the model
    files of the best and latest checkpoints; ``history``: the run's metrics history, if the
    caller read it already."""
    model_uris = model_uris or {}
    records = read_attempts(run_dir)
    attempts = attempt_summaries(records)
    committed = committed_checkpoints(spec, run_dir)
    newest = committed[-1] if committed else None
    best = best_checkpoint(committed, spec.checkpoint.best_metric, spec.checkpoint.best_mode)
    history = read_metrics_history(run_dir) if history is None else history
    started = min((r.started_at for r in records if r.started_at), default=time.time())
    ended = max((r.ended_at or 0 for r in records), default=0) or time.time()
    if spec.ray_loop:
        done, epochs_done, final = user_loop_progress(status, newest, history)
    else:
        final = newest.metrics if newest else (history[-1] if history else {})
        epochs_done = int(newest.manifest.get("epoch", 0)) if newest else 0
        done = newest.step if newest else 0
    computed = steps_computed(attempts)
    wall = round(ended - started, 3)
    stop_reason = (newest.manifest.get("early_stopping") or {}).get("stopped") if newest else None
    target = spec.schedule.epochs if spec.schedule else None
    if status == "paused" and (stop_reason or target is None or epochs_done >= target):
        status = "completed"  # early stopping, or the pause at the last epoch, ended the run
    return TrainingResult(
        run_name=spec.run.name or run_dir.location.path.rsplit("/", 1)[-1],
        storage_uri=storage_uri,
        run_uri=run_dir.uri,
        status=status,
        attempts=attempts,
        steps_completed=done,
        epochs_completed=epochs_done,
        final_metrics=_clean(final),
        best_metrics=_clean(best.metrics) if best else {},
        best_checkpoint_uri=best.uri if best else None,
        latest_checkpoint_uri=newest.uri if newest else None,
        best_model_uri=model_uris.get(best.step) if best else None,
        latest_model_uri=model_uris.get(newest.step) if newest else None,
        wall_time_s=wall,
        time=time_account(history, attempts, wall),
        steps_computed=computed,
        goodput=round(done / computed, 4) if computed else None,
        storage_bytes=storage_bytes(run_dir),
        target_epochs=target,
        stop_reason=stop_reason,
        train_loop_config=dict(spec.train_loop_config) if spec.train_loop is not None else None,
    )


def finalize_run(
    spec: RunSpec,
    run_dir: RunDirectory,
    storage_uri: str,
    status: Status,
    history: list[dict[str, Any]] | None = None,
) -> TrainingResult:
    """Apply retention one last time, give the best and latest checkpoints a model file (an
    export, for DCP ones and a user loop's Ray ones), write the TensorBoard event file, then
    ``summary.json``; return the result. ``history``: the run's metrics history (read here
    when None), read once for all of them: on object storage each segment is a request."""
    if not spec.ray_loop:  # read each checkpoint whole once: only sound ones count below
        verification.sound(run_dir.checkpoint_location, run_dir.scan().committed)
    run_dir.apply_retention(spec.checkpoint)  # relaytrain's own; Ray Train keeps a user loop's
    history = read_metrics_history(run_dir) if history is None else history
    tensorboard_log.write_quietly(run_dir, history)
    committed = committed_checkpoints(spec, run_dir)
    exports.prune(run_dir, committed)
    best = best_checkpoint(committed, spec.checkpoint.best_metric, spec.checkpoint.best_mode)
    chosen = {c.step: c for c in (best, committed[-1] if committed else None) if c is not None}
    model_uris = {step: _model_uri(run_dir, c) for step, c in chosen.items()}
    result = build_result(spec, run_dir, storage_uri, status, model_uris, history)
    if status == "completed" and best is not None and spec.data and spec.data.test:
        result = result.model_copy(update={"test_metrics": _tested(spec, best)})
    tracker = mlflow_log.for_run(spec, run_dir)
    if tracker is not None:
        tracker.finish(result, history)
        result = result.model_copy(update={"mlflow": tracker.state})
    write_summary(run_dir, result)
    return result


def _tested(spec: RunSpec, best: CheckpointInfo) -> dict[str, float] | None:
    """``data.test``'s figures on the best checkpoint; None (and a warning naming the error)
    when the test set cannot be evaluated: the run's training stands."""
    try:
        return evaluate.test_metrics(spec, best.uri)
    except Exception as e:
        logger.warning("data.test could not be evaluated on %s: %s", best.uri, e)
        return None


def write_summary(run_dir: RunDirectory, result: TrainingResult) -> None:
    if run_dir.lease_owner is not None:
        run_dir.check_lease(run_dir.lease_owner)  # only the run's holder writes its summary
    run_dir.summary_file.write_json({"schema": SCHEMA_VERSION, **result.model_dump(mode="json")})


def sync_tracking(
    spec: RunSpec | None, run_dir: RunDirectory, result: TrainingResult | None = None
) -> tuple[TrainingResult | None, mlflow_log.Tracker]:
    """Log to MLflow what its server missed (see ``mlflow_log.sync_run``: ``spec`` None, the
    stored spec as data only); a finalized run's summary then records the new state. Returns
    the summary as it now is, and the tracker (what it logged, and what not)."""
    stored = read_stored_result(run_dir)
    tracker = mlflow_log.sync_run(run_dir, stored, spec=spec)
    result = result or stored
    if result is None:
        return None, tracker
    result = result.model_copy(update={"mlflow": tracker.state})
    write_summary(run_dir, result)
    return result, tracker


def _model_uri(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> str | None:
    try:
        return exports.model_location(run_dir, checkpoint).uri
    except (CheckpointCorruptError, SpecError) as e:  # the result still names the checkpoint
        logger.warning("no model file for checkpoint %s: %s", checkpoint.uri, e)
        return None


def mark_pruned(run_dir: RunDirectory, epoch: int) -> TrainingResult | None:
    """Record in a run paused after ``epoch`` that a sweep pruned it there: its summary's
    status becomes ``pruned`` (the sweep decides between legs, when no attempt holds the run).
    A run not paused at that epoch is left as it is. Returns the summary as it now is."""
    stored = read_stored_result(run_dir)
    if stored is None or stored.status != "paused" or stored.epochs_completed != epoch:
        return stored
    pruned = stored.model_copy(update={"status": "pruned"})
    write_summary(run_dir, pruned)
    return pruned


def read_stored_result(run_dir: RunDirectory) -> TrainingResult | None:
    path = run_dir.summary_file
    if not path.exists():
        return None
    data = path.read_json()
    data.pop("schema", None)
    return TrainingResult.model_validate(data)


def damaged_since(spec: RunSpec, run_dir: RunDirectory, stored: TrainingResult | None) -> list[str]:
    """What rotted, since the run finished, in the checkpoints its stored result names (the
    best and the latest, read whole again: finalize verified them, and nothing protects bytes
    at rest), each found damaged condemned; a user's own loop's Ray checkpoints carry no
    digests of ours."""
    if stored is None or spec.ray_loop:
        return []
    named = [u for u in (stored.best_checkpoint_uri, stored.latest_checkpoint_uri) if u]
    return verification.read_again(run_dir.checkpoint_location, run_dir.scan().committed, named)


def _clean(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if isinstance(v, int | float | str) and k != "time"}
