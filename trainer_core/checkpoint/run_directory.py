"""The run directory: its layout, checkpoint commits, discovery, metrics history and retention.

Nobody else builds these paths. Layout::

    {storage}/{run}/
      run.json                          spec, fingerprint, versions, schema
      attempts.jsonl                    one record per attempt
      metrics/segment-a{A}-{first}-{last}.jsonl   per-step rows, merged by step
      checkpoint-{step:09d}/            files, manifest.json, then COMMITTED (last)
      summary.json, loss_curve.png, step_time.png    written by finalize
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

import json
import time
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import pyarrow.fs as pafs
from pydantic import ValidationError

from trainer_core import storage
from trainer_core.checkpoint import verification
from trainer_core.checkpoint.files import (
    CHECKPOINT_PATTERN,
    FILE_DIGEST,
    MARKER_FILE,
    CheckpointInfo,
    FileEntry,
    HashingWriter,
    Scan,
    checkpoint_dir_name,
    file_digest,
    matches,
    sha256_hex,
    size_mismatches,
)
from trainer_core.checkpoint.retention import RetentionPlan, plan_retention
from trainer_core.errors import (
    CheckpointCorruptError,
    IncompatibleRunError,
    LeaseLostError,
    SpecError,
)
from trainer_core.spec.operations import CheckpointSection
from trainer_core.spec.run_spec import RunSpec, identity_changes
from trainer_core.storage.locations import Location
from trainer_core.storage.torn_reads import read_whole, read_whole_json

SCHEMA_VERSION = 1
RUN_FILE = "run.json"
#: The run's pinned dataset snapshot (trainer_core.data.dataset_snapshot).
DATASET_FILE = "dataset.json"
ATTEMPTS_FILE = "attempts.jsonl"
SUMMARY_FILE = "summary.json"
CURVE_FILE = "loss_curve.png"
STEP_TIME_FILE = "step_time.png"
LEASE_FILE = "lock.json"
METRICS_DIR = "metrics"
MANIFEST_FILE = "manifest.json"


class RunDirectory:
    """One run's directory on any pyarrow filesystem. With ``lease_owner``, every checkpoint
    commit first checks that this owner still holds the run's lease (a fence: a flow that lost
    it commits nothing more)."""

    def __init__(self, location: Location, lease_owner: str | None = None):
        self.location = location
        self.lease_owner = lease_owner
        #: Manifests read and verified here, by step, with their marker's (size, mtime): a
        #: later scan (one after every commit) lists a checkpoint, not reads them again.
        self._manifests: dict[int, tuple[tuple[int, Any], dict[str, Any]]] = {}
        #: Kept verdicts read here (``verification``), by step: the marker's and the verdict's
        #: (size, mtime) they were read at, and the damage found (None: sound or stale).
        self._verdicts: dict[int, tuple[tuple[Any, ...], str | None]] = {}

    @classmethod
    def of(cls, storage_uri: str, run_name: str, lease_owner: str | None = None) -> RunDirectory:
        """The directory of run ``run_name`` under ``run.storage`` (the one place it is built)."""
        return cls(storage.resolve(storage_uri).child(run_name), lease_owner)

    def check_lease(self, owner: str) -> None:
        """LeaseLostError unless ``owner`` holds the run's lease now: the flow holding it, or
        the Ray job that flow drives (named in the lease: ``lease.name_job``)."""
        current = self.read_lease()
        if current is None or owner not in (current.get("owner"), current.get("job")):
            holder = "nobody" if current is None else current.get("owner")
            raise LeaseLostError(
                f"run {self.uri} is no longer held by {owner} (held by {holder}): it writes "
                "nothing more. Let the flow holding it finish, or run it again.",
                field="run.name",
            )

    def read_lease(self) -> dict[str, Any] | None:  # None: no lease; a torn read is read again
        return read_whole_json(self.lease_file)

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
    def step_time_file(self) -> Location:
        return self.location.child(STEP_TIME_FILE)

    @property
    def lease_file(self) -> Location:
        return self.location.child(LEASE_FILE)

    # -- run.json ---------------------------------------------------------------------------

    def _read_record(self, name: str) -> dict[str, Any] | None:
        """A JSON record of the run directory, its schema checked (None when absent)."""
        record = self.location.child(name)
        try:
            data = record.read_json()
        except FileNotFoundError:
            return None
        check_schema(data, record.uri)
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
        records = read_whole(path, lambda b: [json.loads(x) for x in b.splitlines() if x]) or []
        for record in records:
            check_schema(record, path.uri)
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
        self._manifests.pop(step, None)
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
        """List checkpoint directories and classify each: a listing each (``read_committed``)."""
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
        """The checkpoint of ``step`` if committed (its marker holds its manifest's hash), else
        None; CheckpointCorruptError if a file it lists is missing or of another size: a listing
        (its marker and manifest read when first seen)."""
        location = self.checkpoint_location(step)
        files = location.files()
        marker = files.get(MARKER_FILE)
        if marker is None:
            return None
        sizes = {name: info.size for name, info in files.items()}
        seen = (marker.size, marker.mtime)
        cached = self._manifests.pop(step, None)
        manifest = cached[1] if cached is not None and cached[0] == seen else None
        if manifest is None or size_mismatches(manifest, sizes):  # read (again)
            manifest = self._read_manifest(location)
            if manifest is None:
                return None
        if mismatched := size_mismatches(manifest, sizes):
            name, size = next(iter(mismatched.items()))
            raise CheckpointCorruptError(
                f"checkpoint {location.uri}: file {name} is missing or has "
                f"{size} bytes instead of {manifest['files'][name]['size']}"
            )
        self._manifests[step] = (seen, manifest)  # (fsspec's stores may give no mtime)
        verdict = files.get(verification.VERDICT_FILE)
        if verdict is not None:  # read whole before: damaged is no longer committed
            key = (*seen, verdict.size, verdict.mtime)
            cached_verdict = self._verdicts.get(step)
            if cached_verdict is None or cached_verdict[0] != key:
                cached_verdict = self._verdicts[step] = (key, verification.damage_found(location))
            if cached_verdict[1] is not None:
                raise CheckpointCorruptError(
                    f"checkpoint {location.uri} was found damaged when read whole: "
                    f"{cached_verdict[1]}"
                )
        return CheckpointInfo(step, checkpoint_dir_name(step), location.uri, manifest)

    def _read_manifest(self, location: Location) -> dict[str, Any] | None:
        try:  # the manifest, if the marker holds its hash
            marker = location.child(MARKER_FILE).read_json()
            manifest_bytes = location.child(MANIFEST_FILE).read_bytes()
        except (ValueError, FileNotFoundError):
            return None
        if marker.get("manifest_sha256") != sha256_hex(manifest_bytes):
            return None
        manifest = json.loads(manifest_bytes)
        check_schema(manifest, location.uri)
        return dict(manifest)

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
            self._manifests.pop(int(match.group(1)), None)
            location.child(MARKER_FILE).delete_file()
            location.delete_dir()


def check_schema(data: dict[str, Any], where: str) -> None:
    schema = data.get("schema")
    if not isinstance(schema, int) or not 1 <= schema <= SCHEMA_VERSION:
        readable = "1" if SCHEMA_VERSION == 1 else f"1 to {SCHEMA_VERSION}"
        raise IncompatibleRunError(
            f"{where} has schema {schema!r}, this relaytrain reads schema {readable}: upgrade "
            "relaytrain (a newer release wrote it), or start a new run.name",
            field="run.name",
        )


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
