"""The run directory: its layout, checkpoint commits, discovery, metrics history and retention.

Nobody else builds these paths. Layout::

    {storage}/{run}/
      run.json                          spec, fingerprint, versions, schema
      attempts.jsonl                    one record per attempt
      metrics/segment-a{A}-{first}-{last}.jsonl   per-step rows, merged by step
      checkpoint-{step:09d}/            files, manifest.json, then COMMITTED (last)
      summary.json, loss_curve.png      written by finalize
      lock.json                         the lease of the flow driving the run
      (Ray's own snapshot and marker files sit beside these)

A user's own Ray Train loop checkpoints through Ray instead: Ray names each directory, and its
snapshot lists the ones it registered (its commit record); relaytrain adds one file to each::

      checkpoint_{Ray's timestamp}/     the loop's files, and relaytrain.json: the report it
                                        came with, numbered across attempts, and its metrics
      checkpoint_manager_snapshot.json  Ray Train's: the registered checkpoints, by name

Durable order: checkpoint files, metrics segment, manifest, commit marker; deletion last and
marker first (a directory without its marker does not exist). Every JSON carries "schema".
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow.fs as pafs
import xxhash
from pydantic import ValidationError

from trainer_core import storage
from trainer_core.errors import (
    CheckpointCorruptError,
    IncompatibleRunError,
    LeaseLostError,
    SpecError,
)
from trainer_core.spec.operations import CheckpointSection
from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage.locations import Location

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
#: The run's pinned dataset snapshot (trainer_core.data.dataset_snapshot).
DATASET_FILE = "dataset.json"
ATTEMPTS_FILE = "attempts.jsonl"
SUMMARY_FILE = "summary.json"
CURVE_FILE = "loss_curve.png"
LEASE_FILE = "lock.json"
METRICS_DIR = "metrics"
MANIFEST_FILE = "manifest.json"
MARKER_FILE = "COMMITTED"
CHECKPOINT_PATTERN = re.compile(r"^checkpoint-(\d{9})$")
SEGMENT_PATTERN = re.compile(r"^segment-a(\d{4})-(\d{9})-(\d{9})\.jsonl$")
#: Ray Train's record of a run's registered checkpoints (a user's own loop's commit record).
RAY_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"
#: What relaytrain adds to each Ray checkpoint of a user's loop (``report_record``).
REPORT_FILE = "relaytrain.json"
#: The ``format`` of a user loop's Ray checkpoint as ``RunDirectory.ray_checkpoints`` describes
#: it: the loop's own files, whatever they are.
RAY_FORMAT = "ray.train/1"


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint-{step:09d}"


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


#: The digest a manifest records for each file: xxHash's XXH3-128, about 20 GB/s here, so
#: hashing costs a checkpoint write almost nothing (sha256 runs at about 1.5 GB/s, slower than
#: the write itself). It detects corruption; the commit marker still names the manifest's sha256.
#: Manifests written before it carry "sha256", which is still verified.
FILE_DIGEST = "xxh3_128"


def file_digest(data: Any) -> str:
    return xxhash.xxh3_128_hexdigest(data)


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    xxh3_128: str

    def manifest_entry(self) -> dict[str, Any]:
        return {"size": self.size, FILE_DIGEST: self.xxh3_128}


def matches(entry: dict[str, Any], data: bytes) -> bool:
    """Whether ``data`` is what a manifest entry describes (size and digest)."""
    if len(data) != entry.get("size"):
        return False
    if FILE_DIGEST in entry:
        return file_digest(data) == entry[FILE_DIGEST]
    return sha256_hex(data) == entry.get("sha256")


class HashingWriter(io.RawIOBase):
    """A write-only stream that forwards to ``stream`` and digests what passes through, so the
    bytes are never held whole in memory, nor read twice."""

    def __init__(self, stream: Any):
        super().__init__()
        self.stream = stream
        self.digest = xxhash.xxh3_128()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, chunk: Any) -> int:
        view = memoryview(chunk).cast("B")
        self.digest.update(view)
        self.stream.write(view)
        self.size += len(view)
        return len(view)

    def entry(self, name: str) -> FileEntry:
        return FileEntry(name=name, size=self.size, xxh3_128=self.digest.hexdigest())


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint as its manifest describes it."""

    step: int
    name: str
    uri: str
    manifest: dict[str, Any] = field(repr=False)

    @property
    def metrics(self) -> dict[str, Any]:
        return dict(self.manifest.get("metrics") or {})

    @property
    def files(self) -> dict[str, dict[str, Any]]:
        return dict(self.manifest["files"])


@dataclass(frozen=True)
class Scan:
    """What a listing of the run directory found, oldest first."""

    committed: list[CheckpointInfo]
    #: Checkpoint directories without a valid marker (partial, or a marker that does not match).
    uncommitted: list[str]
    #: Committed by marker, but a file is missing or has the wrong size.
    damaged: list[str]

    @property
    def newest(self) -> CheckpointInfo | None:
        return self.committed[-1] if self.committed else None


@dataclass(frozen=True)
class RetentionPlan:
    keep: list[str]
    delete: list[str]
    reasons: dict[str, str]


class RunDirectory:
    """One run's directory on any pyarrow filesystem. With ``lease_owner``, every checkpoint
    commit first checks that this owner still holds the run's lease (a fence: a flow that lost
    it commits nothing more)."""

    def __init__(self, location: Location, lease_owner: str | None = None):
        self.location = location
        self.lease_owner = lease_owner

    @classmethod
    def of(cls, storage_uri: str, run_name: str, lease_owner: str | None = None) -> RunDirectory:
        """The directory of run ``run_name`` under ``run.storage`` (the one place it is built)."""
        return cls(storage.resolve(storage_uri).child(run_name), lease_owner)

    def check_lease(self, owner: str) -> None:
        """LeaseLostError unless ``owner`` holds the run's lease now."""
        current = self.lease_file.read_json() if self.lease_file.exists() else None
        if current is None or current.get("owner") != owner:
            holder = "nobody" if current is None else current.get("owner")
            raise LeaseLostError(
                f"run {self.uri} is no longer held by {owner} (held by {holder}): it writes "
                "nothing more. Let the flow holding it finish, or run it again.",
                field="run.name",
            )

    @property
    def uri(self) -> str:
        return self.location.uri

    @property
    def summary_file(self) -> Location:
        return self.location.child(SUMMARY_FILE)

    @property
    def curve_file(self) -> Location:
        return self.location.child(CURVE_FILE)

    @property
    def lease_file(self) -> Location:
        return self.location.child(LEASE_FILE)

    # -- run.json ---------------------------------------------------------------------------

    def _read_record(self, name: str) -> dict[str, Any] | None:
        """A JSON record of the run directory, its schema checked (None when absent)."""
        record = self.location.child(name)
        if not record.exists():
            return None
        data = record.read_json()
        _check_schema(data, record.uri)
        return data

    def read_run_record(self) -> dict[str, Any] | None:
        return self._read_record(RUN_FILE)

    def write_run_record(
        self,
        spec_json: dict[str, Any],
        identity: dict[str, Any],
        fingerprint: str,
        versions: dict[str, str],
        dataset: str | None = None,
    ) -> None:
        """``dataset``: the fingerprint of the dataset snapshot the run trains on."""
        self.location.child(RUN_FILE).write_json(
            {
                "schema": SCHEMA_VERSION,
                "spec": spec_json,
                "fingerprint": fingerprint,
                "identity": identity,
                "dataset": dataset,
                "versions": versions,
                "created_at": time.time(),
            }
        )

    # -- dataset.json --------------------------------------------------------------------------

    def read_dataset_snapshot(self) -> dict[str, Any] | None:
        return self._read_record(DATASET_FILE)

    def write_dataset_snapshot(self, snapshot: dict[str, Any]) -> None:
        self.location.child(DATASET_FILE).write_json(snapshot)

    def check_compatible(self, identity: dict[str, Any], fingerprint: str) -> None:
        """Refuse to continue a run whose checkpoints were written by an incompatible spec."""
        record = self.read_run_record()
        if record is None or record.get("fingerprint") == fingerprint:
            return
        stored = record.get("identity") or {}
        changed = identity_changes(stored, identity)
        shown = "; ".join(f"{path}: {old!r} -> {new!r}" for path, old, new in changed[:5])
        raise IncompatibleRunError(
            f"run {self.uri} was started with another model/data/scaling identity "
            f"(changed: {shown or 'fingerprint'}); its checkpoints cannot be resumed with this "
            "spec. Choose a new run.name, or restore the original values.",
            field=changed[0][0] if changed else "run.name",
        )

    # -- attempts.jsonl -----------------------------------------------------------------------

    def read_attempts(self) -> list[dict[str, Any]]:
        path = self.location.child(ATTEMPTS_FILE)
        if not path.exists():
            return []
        records = [json.loads(line) for line in path.read_bytes().decode().splitlines() if line]
        for record in records:
            _check_schema(record, path.uri)
        return records

    def record_attempt(self, record: dict[str, Any]) -> None:
        """Insert or replace the record for ``record["attempt"]`` (single writer: the lease)."""
        records = [r for r in self.read_attempts() if r["attempt"] != record["attempt"]]
        records.append({"schema": SCHEMA_VERSION, **record})
        records.sort(key=lambda r: r["attempt"])
        body = "".join(json.dumps(r, sort_keys=True) + "\n" for r in records)
        self.location.child(ATTEMPTS_FILE).write_bytes(body.encode())

    # -- checkpoints: writing -------------------------------------------------------------------

    def checkpoint_location(self, step: int) -> Location:
        return self.location.child(checkpoint_dir_name(step))

    def prepare_checkpoint_dir(self, step: int) -> None:
        """Remove a stale directory for ``step`` (left by an attempt that did not commit it).

        Re-uploading into a reused directory keeps stale files; start from empty instead.
        Marker first, so the directory never looks committed while it is half deleted. Fenced
        like the commit: a flow that lost the lease neither deletes nor writes here.
        """
        if self.lease_owner is not None:
            self.check_lease(self.lease_owner)
        target = self.checkpoint_location(step)
        if target.exists():
            target.child(MARKER_FILE).delete_file()
            target.delete_dir()

    def write_checkpoint_file(self, step: int, name: str, data: bytes) -> FileEntry:
        self.checkpoint_location(step).child(name).write_bytes(data)
        return FileEntry(name=name, size=len(data), xxh3_128=file_digest(data))

    def stream_checkpoint_file(
        self, step: int, name: str, produce: Callable[[HashingWriter], object]
    ) -> FileEntry:
        """Write a checkpoint file by streaming: ``produce`` writes into a hashing stream
        (``torch.save`` straight to storage, without a serialized copy in memory)."""

        def write(stream: Any) -> FileEntry:
            writer = HashingWriter(stream)
            produce(writer)
            return writer.entry(name)

        return self.checkpoint_location(step).child(name).write_stream(write)

    def commit_checkpoint(
        self, step: int, entries: Sequence[FileEntry], meta: dict[str, Any]
    ) -> CheckpointInfo:
        """Write the manifest, then the commit marker naming the manifest's hash. Last step."""
        names = [e.name for e in entries]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate checkpoint file names: {sorted(names)}")
        manifest = {
            "schema": SCHEMA_VERSION,
            "step": step,
            "created_at": time.time(),
            "files": {e.name: e.manifest_entry() for e in entries},
            **meta,
        }
        manifest_bytes = json.dumps(manifest, indent=2, sort_keys=True).encode()
        location = self.checkpoint_location(step)
        location.child(MANIFEST_FILE).write_bytes(manifest_bytes)
        if self.lease_owner is not None:
            self.check_lease(self.lease_owner)  # the fence: no commit without the lease
        location.child(MARKER_FILE).write_json(
            {"schema": SCHEMA_VERSION, "step": step, "manifest_sha256": sha256_hex(manifest_bytes)}
        )
        return CheckpointInfo(step, checkpoint_dir_name(step), location.uri, manifest)

    # -- checkpoints: discovery -----------------------------------------------------------------

    def scan(self) -> Scan:
        """List checkpoint directories and classify each (cheap: no file contents are read)."""
        committed, uncommitted, damaged = [], [], []
        for info in self.location.list():
            match = CHECKPOINT_PATTERN.fullmatch(info.base_name)
            if info.type != pafs.FileType.Directory or not match:
                continue
            step = int(match.group(1))
            try:
                checkpoint = self.read_committed(step)
            except CheckpointCorruptError:
                damaged.append(info.base_name)
                continue
            if checkpoint is None:
                uncommitted.append(info.base_name)
            else:
                committed.append(checkpoint)
        committed.sort(key=lambda c: c.step)
        return Scan(committed, sorted(uncommitted), sorted(damaged))

    def read_committed(self, step: int) -> CheckpointInfo | None:
        location = self.checkpoint_location(step)
        marker_path = location.child(MARKER_FILE)
        if not marker_path.exists():
            return None
        try:
            marker = marker_path.read_json()
            manifest_bytes = location.child(MANIFEST_FILE).read_bytes()
        except (ValueError, FileNotFoundError):
            return None
        if marker.get("manifest_sha256") != sha256_hex(manifest_bytes):
            return None
        manifest = json.loads(manifest_bytes)
        _check_schema(manifest, location.uri)
        for name, entry in manifest["files"].items():
            file_info = location.child(name).info()
            if file_info.type != pafs.FileType.File or file_info.size != entry["size"]:
                raise CheckpointCorruptError(
                    f"checkpoint {location.uri}: file {name} is missing or has "
                    f"{file_info.size} bytes instead of {entry['size']}"
                )
        return CheckpointInfo(step, checkpoint_dir_name(step), location.uri, manifest)

    def read_verified(self, checkpoint: CheckpointInfo, name: str) -> bytes:
        """Read one file of a committed checkpoint and prove it matches the manifest."""
        entry = checkpoint.files.get(name)
        if entry is None:
            raise CheckpointCorruptError(f"checkpoint {checkpoint.uri} has no file {name}")
        try:
            data = self.checkpoint_location(checkpoint.step).child(name).read_bytes()
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"checkpoint {checkpoint.uri}: {name} is gone") from e
        if not matches(entry, data):
            raise CheckpointCorruptError(
                f"checkpoint {checkpoint.uri}: {name} does not match its manifest "
                f"({len(data)} bytes, {FILE_DIGEST} {file_digest(data)[:12]}...)"
            )
        return data

    # -- a user's own loop's checkpoints (Ray's) -------------------------------------------------

    def ray_checkpoints(self) -> list[CheckpointInfo]:
        """A user's own loop's checkpoints, oldest report first: the directories Ray Train's
        snapshot lists (it registers a checkpoint once uploaded, and drops one before deleting
        it) that hold relaytrain's report record. Each one's ``step`` is its report's history
        key, its ``metrics`` the report's."""
        try:
            snapshot = self.location.child(RAY_SNAPSHOT_FILE).read_json()
        except (FileNotFoundError, ValueError):
            return []
        results = [
            *(snapshot.get("checkpoint_results") or []),
            snapshot.get("latest_checkpoint_result"),
        ]
        names = [r.get("checkpoint_dir_name") for r in results if isinstance(r, dict)]
        found = []
        for name in dict.fromkeys(n for n in names if isinstance(n, str) and _is_dir_name(n)):
            checkpoint = self.read_ray_checkpoint(name)
            if checkpoint is not None:
                found.append(checkpoint)
        return sorted(found, key=lambda c: (c.manifest["report"], c.step))

    def read_ray_checkpoint(self, name: str) -> CheckpointInfo | None:
        """The Ray checkpoint directory ``name`` as a ``CheckpointInfo`` (its files listed, no
        digests: Ray records none), or None when it has no report record."""
        location = self.location.child(name)
        record = self.read_report_record(name)
        if record is None:
            return None
        prefix = location.path.rstrip("/") + "/"
        files = {
            info.path[len(prefix) :]: {"size": info.size}
            for info in storage.walk_files(location)
            if info.path.startswith(prefix) and info.base_name != REPORT_FILE
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

    def read_report_record(self, name: str) -> dict[str, Any] | None:
        """The report record of Ray checkpoint directory ``name`` (None when it has none)."""
        path = self.location.child(name, REPORT_FILE)
        try:
            data = path.read_json()
        except (FileNotFoundError, ValueError):
            return None
        _check_schema(data, path.uri)
        return data

    # -- metrics history ----------------------------------------------------------------------

    def write_metrics_segment(self, attempt: int, rows: Sequence[dict[str, Any]]) -> None:
        if not rows:
            return
        first, last = rows[0]["step"], rows[-1]["step"]
        name = f"segment-a{attempt:04d}-{first:09d}-{last:09d}.jsonl"
        body = "".join(json.dumps({"schema": SCHEMA_VERSION, **r}) + "\n" for r in rows)
        self.location.child(METRICS_DIR, name).write_bytes(body.encode())

    def last_recorded_step(self, attempt: int) -> int | None:
        """The newest step of ``attempt``'s metric segments (written with each of its commits):
        how far it is known to have trained, from the segment names alone."""
        steps = [
            int(match.group(3))
            for info in self.location.child(METRICS_DIR).list()
            if (match := SEGMENT_PATTERN.fullmatch(info.base_name))
            and int(match.group(1)) == attempt
        ]
        return max(steps, default=None)

    def read_metrics_history(self) -> list[dict[str, Any]]:
        """One row per step across every attempt: see ``merge_metrics``."""
        segments = []
        for info in self.location.child(METRICS_DIR).list():
            match = SEGMENT_PATTERN.fullmatch(info.base_name)
            if not match:
                continue
            body = self.location.child(METRICS_DIR, info.base_name).read_bytes().decode()
            rows = [json.loads(line) for line in body.splitlines() if line]
            segments.append((int(match.group(1)), rows))
        return merge_metrics(segments, self.read_attempts())

    # -- retention ----------------------------------------------------------------------------

    def apply_retention(
        self,
        policy: CheckpointSection,
        *,
        protected_steps: Iterable[int] = (),
        in_flight_from_step: int | None = None,
    ) -> RetentionPlan:
        """Plan retention under ``policy`` (see ``plan_retention``) and delete what it drops."""
        scan = self.scan()
        plan = plan_retention(
            scan.committed,
            keep_last=policy.keep_last,
            keep_best=policy.keep_best,
            best_metric=policy.best_metric,
            best_mode=policy.best_mode,
            protected_steps=protected_steps,
            uncommitted=scan.uncommitted,
            in_flight_from_step=in_flight_from_step,
        )
        if plan.delete:
            self.delete_checkpoints(plan.delete)
        return plan

    def delete_checkpoints(self, names: Iterable[str]) -> None:
        """Delete checkpoint directories (retention, orphans): fenced by the lease."""
        names = list(names)
        if names and self.lease_owner is not None:
            self.check_lease(self.lease_owner)
        for name in names:
            match = CHECKPOINT_PATTERN.fullmatch(name)
            if not match:
                raise ValueError(f"refusing to delete {name!r}: not a checkpoint directory")
            location = self.location.child(name)
            location.child(MARKER_FILE).delete_file()
            location.delete_dir()


def open_checkpoint(uri: str) -> tuple[RunDirectory, CheckpointInfo]:
    """The committed checkpoint at ``uri`` (a ``.../checkpoint-NNNNNNNNN`` directory)."""
    run_location, name = storage.parent(storage.resolve(uri))
    match = CHECKPOINT_PATTERN.fullmatch(name)
    if not match:
        raise SpecError(
            f"run.init_from {uri!r} is not a checkpoint directory: point it at a committed "
            "{run}/checkpoint-NNNNNNNNN directory",
            field="run.init_from",
        )
    run_dir = RunDirectory(run_location)
    try:
        info = run_dir.read_committed(int(match.group(1)))
    except CheckpointCorruptError as e:
        raise SpecError(
            f"run.init_from checkpoint {uri} is damaged: {e}. Point it at another committed "
            "checkpoint.",
            field="run.init_from",
        ) from e
    if info is None:
        raise SpecError(
            f"run.init_from checkpoint {uri} does not exist or is not committed (no valid "
            "marker): point it at a committed {run}/checkpoint-NNNNNNNNN directory",
            field="run.init_from",
        )
    return run_dir, info


#: Where each part of a spec's identity lives in the spec (for messages that name the field).
_IDENTITY_FIELDS = {"num_workers": "scaling.num_workers", "seed": "run.seed"}


def identity_changes(
    stored: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[tuple[str, Any, Any]]:
    """The leaves where two spec identities differ: (dotted spec field, stored, current)."""
    changes: list[tuple[str, Any, Any]] = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        path = f"{prefix}{key}" if prefix else _IDENTITY_FIELDS.get(key, key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += identity_changes(old, new, f"{path}.")
        elif old != new:
            changes.append((path, old, new))
    return changes


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


def _is_dir_name(name: str) -> bool:
    """Whether ``name`` (from Ray's snapshot) names a directory directly in the run's."""
    return "/" not in name and name not in ("", ".", "..")


def _check_schema(data: dict[str, Any], where: str) -> None:
    schema = data.get("schema")
    if not isinstance(schema, int) or not 1 <= schema <= SCHEMA_VERSION:
        readable = "1" if SCHEMA_VERSION == 1 else f"1 to {SCHEMA_VERSION}"
        raise IncompatibleRunError(
            f"{where} has schema {schema!r}, this relaytrain reads schema {readable}: upgrade "
            "relaytrain (a newer release wrote it), or start a new run.name",
            field="run.name",
        )


def merge_metrics(
    segments: Sequence[tuple[int, Sequence[dict[str, Any]]]], attempts: Sequence[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Merge per-attempt metric segments into one row per step.

    A row from attempt ``a`` at step ``s`` is dropped when a later attempt resumed from a step
    before ``s`` (that timeline was rewound); of the rows left for a step, the newest attempt's
    wins. The result is sorted by step with no duplicates.
    """
    # An attempt whose resume point is unknown (None: a user's loop resumed by Ray) rewinds
    # nothing; 0 is a fresh start and rewinds everything before it.
    rewinds = [
        (r["attempt"], r["resumed_from_step"])
        for r in attempts
        if r.get("resumed_from_step") is not None
    ]
    best: dict[int, tuple[int, dict[str, Any]]] = {}
    for attempt, rows in sorted(segments, key=lambda s: s[0]):
        for row in rows:
            step = row["step"]
            if any(later > attempt and step > resumed for later, resumed in rewinds):
                continue
            if step not in best or best[step][0] <= attempt:
                best[step] = (attempt, {k: v for k, v in row.items() if k != "schema"})
    return [best[step][1] for step in sorted(best)]


def rank_by_metric(
    committed: Sequence[CheckpointInfo], metric: str, mode: Literal["min", "max"] | str
) -> list[CheckpointInfo]:
    """The checkpoints that recorded ``metric``, best first (the newer one on a tie). A
    checkpoint's manifest holds only what was measured on its own weights: one committed
    between two validations has no ``val_*`` metric and is not ranked by one."""
    scored = [c for c in committed if _finite(c.metrics.get(metric))]
    sign = 1.0 if mode == "min" else -1.0
    return sorted(scored, key=lambda c: (sign * float(c.metrics[metric]), -c.step))


def plan_retention(
    committed: Sequence[CheckpointInfo],
    *,
    keep_last: int | None,
    keep_best: int,
    best_metric: str,
    best_mode: Literal["min", "max"],
    protected_steps: Iterable[int] = (),
    uncommitted: Sequence[str] = (),
    in_flight_from_step: int | None = None,
) -> RetentionPlan:
    """Decide which checkpoint directories to delete. Pure: the caller executes the plan.

    Keeps the newest ``keep_last`` (all if None), the best ``keep_best`` by ``best_metric``,
    the newest committed one always, and every protected step (e.g. the one a run resumes
    from). Uncommitted directories are deleted unless they may still be in flight (step at or
    after ``in_flight_from_step``).
    """
    reasons: dict[str, str] = {}
    ordered = sorted(committed, key=lambda c: c.step)
    if ordered:
        reasons[ordered[-1].name] = "newest"
    if keep_last is not None:
        for c in ordered[-keep_last:]:
            reasons.setdefault(c.name, "last")
    else:
        for c in ordered:
            reasons.setdefault(c.name, "last")
    for c in rank_by_metric(ordered, best_metric, best_mode)[:keep_best]:
        reasons.setdefault(c.name, "best")
    protected = set(protected_steps)
    for c in ordered:
        if c.step in protected:
            reasons.setdefault(c.name, "protected")
    keep = [c.name for c in ordered if c.name in reasons]
    delete = [c.name for c in ordered if c.name not in reasons]
    for name in uncommitted:
        match = CHECKPOINT_PATTERN.fullmatch(name)
        step = int(match.group(1)) if match else None
        if step is not None and in_flight_from_step is not None and step >= in_flight_from_step:
            reasons[name] = "in flight"
            continue
        delete.append(name)
    return RetentionPlan(keep=keep, delete=delete, reasons=reasons)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and value == value and abs(value) != float("inf")


def checkpoint_step(name: str) -> int | None:
    match = CHECKPOINT_PATTERN.fullmatch(name)
    return int(match.group(1)) if match else None


def stored_spec(run_dir: RunDirectory) -> RunSpec | None:
    """The spec the run was set up with (``run.json``), or None if this release cannot read
    it."""
    record = run_dir.read_run_record() or {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return RunSpec.model_validate(record.get("spec") or {})
    except (ValidationError, SpecError, ValueError):
        return None
