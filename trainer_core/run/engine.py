"""One attempt of a run: preflight on the driver, the plan, the attempt's record, and the
outcome. Ray is reached through ``trainer_core.execution`` only.

``run_attempt(spec)`` is one attempt: preflight checks on the driver (fail fast, no workers),
Ray Train's ``fit()`` with ``RunConfig(storage_path, name=<run name>)`` so every attempt
addresses the same run directory, metrics relayed to ``on_event`` while fit() runs, the attempt
recorded in ``attempts.jsonl``, any failure raised as a classified ``RelaytrainError`` (tagged
with its attempt). Called again on the same run, it resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import json
import logging
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import pyarrow
import torch

from trainer_core import __version__, storage
from trainer_core.checkpoint.exports import open_checkpoint
from trainer_core.checkpoint.files import Scan
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data import dataset_snapshot, footers, rank_stream, stream
from trainer_core.data.table_rows import TableRows
from trainer_core.errors import IncompatibleRunError, LeaseLostError, SpecError
from trainer_core.execution import classify, cluster, ray_head, trainer
from trainer_core.execution.trainer import EventHandler
from trainer_core.run import attempts
from trainer_core.run.live_state import LiveState
from trainer_core.spec.imports import import_object
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads
from trainer_core.train.batch_checks import check_batch_workload
from trainer_core.train.builtin import builtin_train_loop
from trainer_core.train.user_loop import user_train_loop

logger = logging.getLogger("relaytrain.engine")


# -- preflight ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What an attempt will do, decided on the driver before any worker starts."""

    run_name: str
    storage_uri: str
    run_uri: str
    attempt: int
    resume_step: int | None
    candidates: list[int]
    reason: str
    #: The snapshot the workers read (``PinnedDataset.for_workers``); None: made data, own loop.
    dataset: dict[str, Any] | None = None
    #: The lease owner the attempt's commits are fenced by (None: no lease, e.g. a test).
    lease_owner: str | None = None


def versions() -> dict[str, str]:
    return {
        "relaytrain": __version__,
        "ray": cluster.ray_version(),
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }


def canonical_storage_uri(uri: str) -> str:
    """The storage URI every process can resolve (local paths made absolute)."""
    location = storage.resolve(uri)
    return location.path if location.is_local else uri


@dataclass(frozen=True)
class PinnedDataset:
    """The dataset an attempt trains on: the run's snapshot (taken now on the first attempt,
    else read from the run directory and verified), what it holds, and the files added to
    the dataset since the snapshot (ignored)."""

    layout: footers.Layout
    info: data_mod.DatasetInfo
    record: dict[str, Any] | None
    added: list[str]

    def for_workers(self) -> dict[str, Any] | None:
        """What every rank builds its stream from, with no listing or footer read of its own."""
        if self.record is None:
            return None
        return {"snapshot": self.record, "info": asdict(self.info)}


def pin_dataset(
    spec: RunSpec, run_dir: RunDirectory | None = None, fresh: PinnedDataset | None = None
) -> PinnedDataset | None:
    """The built-in loop's dataset as this attempt must read it: the snapshot ``run_dir``
    records, checked against the files (SpecError naming a file that changed or vanished), or
    a new scan when the run has none (its first attempt). None for a user's own loop.

    ``fresh``: this attempt's own scan (``pin_dataset(spec)``), reused when it is the snapshot
    (the files as they were pinned) or there is none: the dataset is described once."""
    if spec.ray_loop:
        return None
    assert spec.data is not None
    data = spec.data.resolved()
    stored = run_dir.read_dataset_snapshot() if run_dir is not None else None
    location = None if data.dataset == "synthetic" else footers.dataset_location(data)
    added: list[str] = []
    if stored is not None and location is not None and stored["uri"] == location.uri:
        if fresh is not None and json.loads(json.dumps(fresh.record)) == stored:
            return fresh
        layout = dataset_snapshot.from_json(stored, data)
        added = dataset_snapshot.verify(layout, data).added
    elif fresh is not None:
        return fresh
    else:
        layout = footers.scan(data)  # footers only
    record = dataset_snapshot.to_json(layout) if layout.files else None
    return PinnedDataset(layout, stream.describe(layout, data), record, added)


def validate_workload(spec: RunSpec, pinned: PinnedDataset | None = None) -> int | None:
    """Import what the spec names, read the dataset (footers; ``pinned``: already read) and
    build the model: SpecError before any worker starts. Returns the run's total optimizer
    steps (None for a Ray Train loop of the user's own)."""
    if spec.train_loop is not None:
        workloads.resolve_train_loop(spec.train_loop)
    if spec.ray_loop:
        for name, uri in spec.datasets.items():  # footers only: the files are Parquet
            footers.scan_files(storage.resolve(uri), None, None, f"datasets.{name}")
        return None
    assert spec.data is not None and spec.schedule is not None
    data = spec.data.resolved()
    pinned = pinned or pin_dataset(spec)
    assert pinned is not None
    layout = pinned.layout
    _check_reader_memory(data, layout)
    one = rank_stream.RankStream(layout, data, spec.run.seed, 1, 0)  # row ids only: no rows read
    if one.batches_per_epoch == 0:
        raise SpecError(
            f"dataset {layout.uri} has {one.train_rows} training rows, fewer than one global batch "
            f"(data.batch_size={data.batch_size}): lower data.batch_size or "
            f"data.validation_fraction ({data.validation_fraction})",
            field="data.batch_size",
        )
    if spec.scaling.shard_fn is not None:
        import_object(spec.scaling.shard_fn, "scaling.shard_fn")
    if not spec.own_loop:  # a loop of the user's own builds its model and loss itself
        _check_model_on_rows(spec, pinned, one)
    return (
        data_mod.steps_per_epoch(one.batches_per_epoch, spec.optimizer.grad_accumulation)
        * spec.schedule.epochs
    )


def _check_model_on_rows(spec: RunSpec, pinned: PinnedDataset, one: rank_stream.RankStream) -> None:
    """The built-in loop's model, loss and metrics on a few real training rows."""
    assert spec.model is not None and spec.data is not None
    data = spec.data.resolved()
    layout, info = pinned.layout, pinned.info
    first = next(g for g, count in enumerate(one.train_counts) if count)  # one row group read
    sample = np.arange(min(one.train_counts[first], 4))
    ids, rows = one.reader.take(np.full(len(sample), first), sample)
    if isinstance(rows, TableRows):
        file = layout.row_groups[first].file
        where = layout.uri if layout.uri.endswith(file) else f"file {file!r} of {layout.uri}"
        check_batch_workload(spec, ids, rows, where)
    else:
        workloads.check_loss_and_metrics(
            workloads.build_model(spec.model, info.num_features, info.num_outputs),
            torch.from_numpy(rows.features),
            torch.from_numpy(rows.labels),
            spec.loss,
            spec.metrics,
            data.task or "classification",
        )


def _check_reader_memory(data: Any, layout: footers.Layout) -> None:
    """The live and next shuffle windows of every partition must fit in half of
    data.memory_mb (the row group slices around them take the rest): SpecError naming the
    settings otherwise."""
    windows_mb = 2 * data.partitions * data.shuffle_window * footers.row_bytes(layout) / 2**20
    if windows_mb > data.memory_mb / 2:
        raise SpecError(
            f"data.partitions ({data.partitions}) x 2 x data.shuffle_window "
            f"({data.shuffle_window}) rows (the live window and the next, read ahead) of "
            f"{footers.row_bytes(layout):.0f} bytes hold {windows_mb:.0f} MB, more than "
            f"half of data.memory_mb ({data.memory_mb}): lower data.shuffle_window or "
            "data.partitions, or raise data.memory_mb",
            field="data.shuffle_window",
        )


@dataclass(frozen=True)
class Preflight:
    """What the driver settled before an attempt: its plan, the run directory, the dataset it
    trains on (None for a user's own loop) and the run's total optimizer steps."""

    plan: Plan
    run_dir: RunDirectory
    pinned: PinnedDataset | None
    total_steps: int | None


def preflight(spec: RunSpec, attempt: int | None = None) -> Preflight:
    """Everything the driver checks before an attempt, in the order errors name themselves:
    the workload (what the spec imports, the dataset's footers, the model, the loss), then
    storage and the run directory, then the run's dataset snapshot. The dataset is read and
    described once (twice only when its files differ from the snapshot's)."""
    fresh = pin_dataset(spec)
    total_steps = validate_workload(spec, fresh)
    plan, run_dir = plan_attempt(spec, attempt)
    return Preflight(plan, run_dir, pin_dataset(spec, run_dir, fresh), total_steps)


def plan_attempt(spec: RunSpec, attempt: int | None = None) -> tuple[Plan, RunDirectory]:
    """Validate storage and the run directory, and decide fresh start vs. resume."""
    name = spec.run.name
    if name is None:
        raise SpecError("run.name is not set: give the run a name", field="run.name")
    storage_uri = canonical_storage_uri(spec.run.storage)
    root = storage.resolve(storage_uri)
    if root.uri.startswith("memory://"):
        raise SpecError(
            "run.storage memory:// lives in one process; Ray workers cannot see it. Use a "
            "path shared by every node, or object storage.",
            field="run.storage",
        )
    storage.probe_writable(storage.resolve(storage_uri, fail_fast=True))
    run_dir = RunDirectory.of(storage_uri, name)
    record = run_dir.read_run_record()
    if record is not None:
        stored_ray = record.get("versions", {}).get("ray")
        if stored_ray and stored_ray != cluster.ray_version():
            raise IncompatibleRunError(
                f"run {run_dir.uri} was written by Ray {stored_ray}; this is Ray "
                f"{cluster.ray_version()}, which cannot read its run snapshot. Resume it with Ray "
                f"{stored_ray}, or start a new run.name.",
                field="run.name",
            )
        run_dir.check_compatible(spec.identity(), spec.fingerprint())
    number = attempt if attempt is not None else attempts.next_number(attempts.read(run_dir))
    plan = resume_plan(name, storage_uri, run_dir.uri, number, run_dir.scan(), spec.run.init_from)
    if plan.resume_step is None and spec.run.init_from:
        open_checkpoint(spec.run.init_from)  # the workers would fail on it only after they start
    return plan, run_dir


def resume_plan(
    run_name: str,
    storage_uri: str,
    run_uri: str,
    attempt: int,
    scan: Scan,
    init_from: str | None = None,
) -> Plan:
    """Fresh start or resume, and why: from what a listing of the run directory found."""
    candidates = [c.step for c in reversed(scan.committed)]
    if candidates:
        reason = f"resume from the newest committed checkpoint (step {candidates[0]})"
        if scan.uncommitted:
            reason += f"; ignoring uncommitted {', '.join(scan.uncommitted)}"
        if scan.damaged:
            reason += f"; skipping damaged {', '.join(scan.damaged)}"
    else:
        reason = "fresh start: no committed checkpoint in the run directory"
        if init_from:
            reason += f"; warm start from {init_from}"
    resume_step = candidates[0] if candidates else None
    return Plan(run_name, storage_uri, run_uri, attempt, resume_step, candidates, reason)


# -- one attempt ----------------------------------------------------------------------------------


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
) -> AttemptResult:
    """Run one attempt of ``spec`` (resuming if the run has committed checkpoints).
    ``lease_owner``: the lease the workers' commits are fenced by; ``lost()``: an error once
    the lease is lost (the attempt is stopped and raises it)."""
    started = time.time()
    checked = preflight(spec, attempt)  # bad input names itself before the run directory
    run_dir, pinned = checked.run_dir, checked.pinned
    plan = replace(checked.plan, lease_owner=lease_owner)
    if pinned is not None:
        plan = replace(plan, dataset=pinned.for_workers())
        if pinned.added and on_event is not None:
            on_event({"kind": "dataset_added", "files": pinned.added, "uri": pinned.layout.uri})
    with cluster.ray_cluster():
        cluster.check_capacity(spec)
        reclaimed_before = cluster.preempted_nodes()
        _prepare_run_directory(spec, run_dir, plan)
        # From step 0 when nothing is committed; a user's loop from what only its workers know.
        start = plan.resume_step if plan.resume_step is not None or spec.ray_loop else 0
        record = attempts.AttemptRecord.opened(plan.attempt, plan.reason, start)
        attempts.write(run_dir, record)
        live = LiveState(step=plan.resume_step or 0, resumed_from=start)

        def handle(event: dict[str, Any]) -> None:
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
            failed = record.failed(classified, live.outcome(), live.step)
            if not isinstance(classified, LeaseLostError):  # the run is another flow's now
                attempts.write_quietly(run_dir, failed)
            if classified is error:
                raise
            raise classified from error
        result = _result(plan, run_dir, live, started)
        attempts.write(run_dir, record.completed(live.outcome(), result.steps_completed))
        return result


def _prepare_run_directory(spec: RunSpec, run_dir: RunDirectory, plan: Plan) -> None:
    """The dataset snapshot and the run record on the first attempt (in that order: the run
    record names the snapshot's fingerprint); earlier attempts that ended without a word
    closed; checkpoint directories no attempt committed removed (before any worker starts)."""
    snapshot = plan.dataset["snapshot"] if plan.dataset else None
    if snapshot is not None and run_dir.read_dataset_snapshot() is None:
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
