"""A user's own loop's checkpoints: Ray Train's directories, which relaytrain reads (never
writes) through the report record it adds to each (``REPORT_FILE``) and Ray's snapshot of the
ones it keeps."""

from __future__ import annotations

import json
import logging
import posixpath
from typing import Any

from trainer_core import storage
from trainer_core.checkpoint.files import CheckpointInfo
from trainer_core.checkpoint.run_directory import SCHEMA_VERSION, RunDirectory, check_schema

logger = logging.getLogger("relaytrain.user_loop")

#: Ray Train's record of a run's registered checkpoints (a user's own loop's commit record).
RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
#: What relaytrain adds to each Ray checkpoint of a user's loop (``report_record``).
REPORT_FILE = "relaytrain.json"
#: ... and every rank's RNG states at that report (``train.loop_rng``): a resume restores
#: them, so dropout and shuffling go on as if the run had not stopped.
RNG_FILE = "relaytrain_rng.pt"
#: ... and where the loop's ``train.ray_loop_data.dataloader`` stood (its epoch and the global
#: samples it handed out): a resumed loop asking for that epoch goes on from there.
POSITION_FILE = "relaytrain_data.json"
#: The ``format`` of a user loop's Ray checkpoint as ``RunDirectory.ray_checkpoints`` describes
#: it: the loop's own files, whatever they are.
RAY_FORMAT = "ray.train/1"


def report_record(step: int, report: int, attempt: int, metrics: dict[str, Any]) -> bytes:
    """What a user loop's report adds to its Ray checkpoint (``REPORT_FILE``): the report's
    number in the run (counted across attempts: a resumed attempt goes on from it), its history
    key ``step`` and its metrics."""
    record = {
        "schema": SCHEMA_VERSION,
        "step": step,
        "report": report,
        "attempt": attempt,
        "metrics": metrics,
    }
    return json.dumps(record, sort_keys=True).encode()


def ray_checkpoints(run_dir: RunDirectory) -> list[CheckpointInfo]:
    """A user's own loop's checkpoints, oldest report first: the directories Ray Train's
    snapshot lists (it registers a checkpoint once uploaded, and drops one before deleting
    it) that hold relaytrain's report record. Each one's ``step`` is its report's history
    key, its ``metrics`` the report's."""
    try:
        snapshot = run_dir.location.child(RAY_SNAPSHOT_FILE).read_json()
    except (FileNotFoundError, ValueError):
        return []
    results = [
        *(snapshot.get("checkpoint_results") or []),
        snapshot.get("latest_checkpoint_result"),
    ]
    names = [r.get("checkpoint_dir_name") for r in results if isinstance(r, dict)]
    found = []
    for name in dict.fromkeys(n for n in names if isinstance(n, str) and _is_dir_name(n)):
        checkpoint = read_ray_checkpoint(run_dir, name)
        if checkpoint is not None:
            found.append(checkpoint)
    return sorted(found, key=lambda c: (c.manifest["report"], c.step))


def read_ray_checkpoint(run_dir: RunDirectory, name: str) -> CheckpointInfo | None:
    """The Ray checkpoint directory ``name`` as a ``CheckpointInfo`` (its files listed, no
    digests: Ray records none), or None when it has no report record."""
    location = run_dir.location.child(name)
    record = read_report_record(run_dir, name)
    if record is None:
        return None
    prefix = location.path.rstrip("/") + "/"
    files = {
        info.path[len(prefix) :]: {"size": info.size}
        for info in storage.walk_files(location)
        if info.path.startswith(prefix)
        and info.base_name not in (REPORT_FILE, RNG_FILE, POSITION_FILE)
    }
    metrics = dict(record.get("metrics") or {})
    manifest: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "format": RAY_FORMAT,
        "step": int(record["step"]),
        "report": int(record["report"]),
        "attempt": record.get("attempt"),
        "metrics": metrics,
        "files": files,
    }
    if isinstance(metrics.get("epoch"), int):  # the loop's own epoch index: epochs done
        manifest["epoch"] = metrics["epoch"] + 1
    return CheckpointInfo(int(record["step"]), name, location.uri, manifest)


def read_report_record(run_dir: RunDirectory, name: str) -> dict[str, Any] | None:
    """The report record of Ray checkpoint directory ``name`` (None when it has none)."""
    path = run_dir.location.child(name, REPORT_FILE)
    try:
        data = path.read_json()
    except (FileNotFoundError, ValueError):
        return None
    check_schema(data, path.uri)
    return data


def _is_dir_name(name: str) -> bool:
    """Whether ``name`` (from Ray's snapshot) names a directory directly in the run's."""
    return "/" not in name and name not in ("", ".", "..")


def add_file(checkpoint: Any, name: str, data: bytes, lost: str) -> bool:
    """Put ``name`` into the directory a loop hands Ray (``checkpoint``: a ``ray.train.
    Checkpoint``, on its own filesystem) before Ray takes it. A write that fails is logged with
    ``lost``, what a resume from it goes without: the checkpoint still goes to Ray. Whether it
    was written."""
    try:
        path = posixpath.join(str(checkpoint.path), name)
        with checkpoint.filesystem.open_output_stream(path) as stream:
            stream.write(data)
    except (OSError, AttributeError) as e:
        logger.warning("could not add %s to the checkpoint (%s): %s", name, e, lost)
        return False
    return True


def read_added_file(checkpoint: Any, name: str) -> bytes:
    """``name`` as ``add_file`` put it into a Ray checkpoint the loop read back (OSError: it
    has none)."""
    path = posixpath.join(str(checkpoint.path), name)
    with checkpoint.filesystem.open_input_stream(path) as stream:
        data: bytes = stream.read()
    return data
