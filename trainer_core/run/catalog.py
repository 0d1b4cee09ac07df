"""What a storage holds, read from run directories alone: no cluster, no Prefect server.

The ``relaytrain`` command's ``runs``, ``show`` and ``export`` read through here, so they work
after the cluster is gone, on a local path or any ``run.storage`` URI (s3://, gs://, ...).
"""

from __future__ import annotations

import io
import socket
import time
from dataclasses import dataclass
from typing import Any, Literal

import pyarrow.fs as pafs
import torch

from trainer_core import storage
from trainer_core.checkpoint import verification
from trainer_core.checkpoint.exports import is_ray, model_weights
from trainer_core.checkpoint.files import CheckpointInfo
from trainer_core.checkpoint.ray_checkpoints import ray_checkpoints
from trainer_core.checkpoint.retention import rank_by_metric
from trainer_core.checkpoint.run_directory import RUN_FILE, RunDirectory, stored_spec
from trainer_core.errors import CheckpointCorruptError, SpecError
from trainer_core.run.lease import holder_is_gone
from trainer_core.run.summary import (
    TrainingResult,
    build_result,
    committed_checkpoints,
    read_stored_result,
)
from trainer_core.spec.run_spec import RunSpec

#: A run's state as its directory tells it. ``running``: a live flow holds its lease;
#: ``interrupted``: attempts ran, nothing finalized it and nobody holds it (run the same
#: run name again to resume); ``new``: set up, never trained.
Status = Literal["completed", "failed", "paused", "pruned", "running", "interrupted", "new"]


@dataclass(frozen=True)
class RunView:
    """One run as a listing shows it, and the full result behind it."""

    name: str
    uri: str
    status: Status
    result: TrainingResult
    spec: RunSpec | None
    #: Unix time of the newest record (the summary, else the last attempt's end or start).
    updated: float | None

    @property
    def best_metric(self) -> str:
        return self.spec.checkpoint.best_metric if self.spec else "val_loss"

    @property
    def best_value(self) -> Any:
        return self.result.best_metrics.get(self.best_metric)


def open_run(uri: str) -> RunDirectory:
    """The run directory at ``uri``; SpecError naming the fix when there is none."""
    location = storage.resolve(uri)
    if not location.child(RUN_FILE).exists():
        raise SpecError(
            f"{location.uri} is not a relaytrain run directory (no {RUN_FILE}): give a run's "
            "directory, e.g. runs/digits-cnn or s3://bucket/runs/NAME; `relaytrain runs "
            "STORAGE` lists them",
            field="run",
        )
    return RunDirectory(location)


def list_runs(storage_uri: str) -> tuple[list[RunView], list[str]]:
    """Every run directory directly under ``storage_uri``, oldest first; and why any run
    directory could not be read."""
    root = storage.resolve(storage_uri)
    if not root.is_dir():
        raise SpecError(
            f"storage {root.uri} does not exist or is not a directory: give the run.storage "
            "your runs were written to (default ./runs)",
            field="run.storage",
        )
    views, problems = [], []
    for info in root.list():
        if info.type != pafs.FileType.Directory:
            continue
        location = root.child(info.base_name)
        if location.child(RUN_FILE).exists():
            try:
                views.append(view(RunDirectory(location)))
            except SpecError as e:
                problems.append(str(e))
    return sorted(views, key=lambda v: (v.updated or 0, v.name)), problems


def view(run_dir: RunDirectory) -> RunView:
    """The run's status and result: its ``summary.json`` when finalized, else what its
    attempts, checkpoints and metrics say so far."""
    spec = stored_spec(run_dir)
    name = run_dir.location.path.rstrip("/").rsplit("/", 1)[-1]
    stored = read_stored_result(run_dir)
    if stored is not None:
        updated = _seconds(run_dir.summary_file.info().mtime)
        return RunView(name, run_dir.uri, stored.status, stored, spec, updated)
    if spec is None:
        raise SpecError(
            f"run {run_dir.uri}: its {RUN_FILE} holds a spec this release cannot read, and it "
            "has no summary.json",
            field="run",
        )
    records = run_dir.read_attempts()
    status: Status = "new"
    if _lease_held(run_dir):
        status = "running"
    elif records:
        status = "interrupted"
    # not finalized: the result as of now (its own status field means nothing yet)
    result = build_result(spec, run_dir, "", "failed").model_copy(update={"run_name": name})
    ends = [r.get("ended_at") or r.get("started_at") for r in records]
    updated = max((t for t in ends if t), default=None)
    return RunView(name, run_dir.uri, status, result, spec, updated)


def committed(run_dir: RunDirectory) -> list[CheckpointInfo]:
    """The run's committed checkpoints, oldest first: relaytrain's, or a user's own loop's Ray
    checkpoints (``summary.committed_checkpoints``; by what is there when its spec is
    unreadable)."""
    spec = stored_spec(run_dir)
    if spec is not None:
        return committed_checkpoints(spec, run_dir)
    return run_dir.scan().committed or ray_checkpoints(run_dir)


def choose_checkpoint(
    run_dir: RunDirectory, which: Literal["best", "latest"] | int = "best"
) -> CheckpointInfo:
    """The run's best (by its spec's ``checkpoint.best_metric``) or latest committed
    checkpoint, or the one at a step (a user loop's: its report's history key)."""
    found = committed(run_dir)
    if not found:
        raise SpecError(f"run {run_dir.uri} has no committed checkpoint yet", field="run")
    if isinstance(which, int):
        for checkpoint in found:
            if checkpoint.step == which:
                return _sound_one(run_dir, [checkpoint])
        run_dir.read_committed(which)  # a damaged one says so (CheckpointCorruptError)
        steps = ", ".join(str(c.step) for c in found)
        raise SpecError(
            f"run {run_dir.uri} has no committed checkpoint at step {which}: it has {steps}",
            field="step",
        )
    if which == "latest":
        return _sound_one(run_dir, found[::-1])
    spec = stored_spec(run_dir)
    metric, mode = (
        (spec.checkpoint.best_metric, spec.checkpoint.best_mode) if spec else ("val_loss", "min")
    )
    ranked = rank_by_metric(found, metric, mode) or found[::-1]  # none measured: the newest
    return _sound_one(run_dir, ranked)


def _sound_one(run_dir: RunDirectory, preferred: list[CheckpointInfo]) -> CheckpointInfo:
    """The first of ``preferred`` whose digests verify (each read whole unless its verdict is
    kept; nothing written: a reader of a run holds no lease)."""
    if is_ray(preferred[0]):  # a user loop's: its files are Ray's, with no digests
        return preferred[0]
    damaged = []
    for checkpoint in preferred:
        location = run_dir.checkpoint_location(checkpoint.step)
        found = verification.verify(location, checkpoint, keep=False)
        if found is None:
            return checkpoint
        damaged.append(f"{checkpoint.name}: {found}")
    raise CheckpointCorruptError(
        f"run {run_dir.uri}: no sound checkpoint to choose ({'; '.join(damaged)})"
    )


def export_model(
    run_dir: RunDirectory, checkpoint: CheckpointInfo, out_uri: str
) -> tuple[str, int]:
    """Write ``checkpoint``'s whole model as one plain ``state_dict`` file (``torch.load(path,
    weights_only=True)``) to a path or URI; returns where and how many bytes."""
    weights = model_weights(run_dir, checkpoint)
    buffer = io.BytesIO()
    torch.save(weights, buffer)
    target = storage.resolve(out_uri)
    if target.is_local:
        storage.resolve(target.path.rsplit("/", 1)[0] or "/").ensure_dir()
    target.write_bytes(buffer.getvalue())
    return target.uri, buffer.getbuffer().nbytes


def _lease_held(run_dir: RunDirectory) -> bool:
    if not run_dir.lease_file.exists():
        return False
    try:
        lease = run_dir.lease_file.read_json()
    except (ValueError, FileNotFoundError):
        return False
    return not holder_is_gone(lease, time.time(), socket.gethostname())


def _seconds(mtime: Any) -> float | None:
    if mtime is None:
        return None
    return mtime.timestamp() if hasattr(mtime, "timestamp") else float(mtime)
