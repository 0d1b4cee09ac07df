"""What an attempt will do, decided on the driver before any worker starts: the run directory
(its storage proven writable, its run record compatible with the spec) and fresh start or
resume, and why. ``resume_plan`` is a pure function of a listing of the run directory."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer_core import storage
from trainer_core.checkpoint.exports import open_checkpoint
from trainer_core.checkpoint.files import Scan
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import IncompatibleRunError, SpecError
from trainer_core.execution import cluster
from trainer_core.run import attempts
from trainer_core.spec.run_spec import RunSpec


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
    #: The files each of a Ray loop's ``datasets`` is read from: its snapshot's
    #: (``PinnedTables.files``).
    ray_datasets: dict[str, list[str]] | None = None
    #: The lease owner the attempt's commits are fenced by (None: no lease, e.g. a test).
    lease_owner: str | None = None
    #: The step marks' keys of this attempt and of the one before it (``WorkerConfig.marks``).
    marks: str | None = None
    earlier_marks: str | None = None
    #: Train to the end of this epoch (counted from 1) and stop there, its checkpoint
    #: committed: the run is paused, and a later attempt trains on. None: to the last epoch.
    until_epoch: int | None = None


def canonical_storage_uri(uri: str) -> str:
    """The storage URI every process can resolve (local paths made absolute)."""
    location = storage.resolve(uri)
    return location.path if location.is_local else uri


def run_directory(spec: RunSpec) -> RunDirectory:
    """The run's directory, its storage proven writable: SpecError naming run.name when it is
    unset, run.storage when no worker could reach it."""
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
    return RunDirectory.of(storage_uri, name)


def plan_attempt(
    spec: RunSpec, attempt: int | None = None, run_dir: RunDirectory | None = None
) -> tuple[Plan, RunDirectory]:
    """Check the run directory (``run_directory(spec)`` unless given) against the spec, and
    decide fresh start vs. resume."""
    if run_dir is None:
        run_dir = run_directory(spec)
    assert spec.run.name is not None  # run_directory refuses a spec without one
    name, storage_uri = spec.run.name, canonical_storage_uri(spec.run.storage)
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
