"""The run lease (``lock.json``): one live flow drives a run at a time.

A lease names its holder (an owner id, host and pid) and expires unless renewed. Acquire takes a
free, expired or stale lease (the holder's process is gone from this very host), or one the
same owner already holds (a retried flow run). Where the store has compare-and-swap writes
(S3's conditional PutObject, GCS's ifGenerationMatch, a lock on local disks:
``conditional_write``), acquire and renew
write only if ``lock.json`` is still what they read, so of two racing flows exactly one wins.
Elsewhere acquire writes, waits a moment, and reads back: the last writer wins and the loser
sees it.

The lease is fenced: the flow renews it from setup to finalize (across its retry delays), a
renewal that finds it taken over marks the holder lost (``LeaseKeeper.lost``: the attempt is
stopped), every checkpoint commit checks it first (``RunDirectory.commit_checkpoint``), and
finalize writes nothing without it.
"""

from __future__ import annotations

import hashlib
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from trainer_core.checkpoint.run_directory import SCHEMA_VERSION, RunDirectory
from trainer_core.errors import LeaseHeldError, LeaseLostError
from trainer_core.storage import conditional_write
from trainer_core.storage.locations import Location
from trainer_core.storage.torn_reads import read_whole_json

DEFAULT_TTL_S = 60.0


def lease_ttl_s() -> float:
    """Seconds a lease lasts unless renewed (renewed every third of it):
    ``RELAYTRAIN_LEASE_TTL_S``, else 60."""
    return float(os.environ.get("RELAYTRAIN_LEASE_TTL_S") or DEFAULT_TTL_S)


@dataclass(frozen=True)
class Lease:
    owner: str
    host: str
    pid: int
    acquired_at: float
    expires_at: float
    #: The Ray job the holder drives (``scaling.job_address``), whose commits this lease fences.
    job: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"schema": SCHEMA_VERSION, **self.__dict__}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def holder_is_gone(lease: dict[str, Any], now: float, host: str) -> bool:
    """True when ``lease`` no longer protects anything: expired, or its process is dead here."""
    if lease.get("expires_at", 0) <= now:
        return True
    return lease.get("host") == host and not _pid_alive(int(lease.get("pid", -1)))


def acquire(
    run_location: Location,
    owner: str | None = None,
    ttl_s: float | None = None,
    settle_s: float = 0.2,
) -> Lease:
    """Take the run's lease or raise LeaseHeldError naming the holder."""
    ttl_s = ttl_s or lease_ttl_s()
    path = RunDirectory(run_location).lease_file
    host = socket.gethostname()
    owner = owner or f"{host}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    now = time.time()
    conditional = conditional_write.supported(path)
    found = conditional_write.read(path) if conditional else None
    current = found.value if found else read_whole_json(path)
    if current and current.get("owner") != owner and not holder_is_gone(current, now, host):
        raise LeaseHeldError(
            f"run {run_location.uri} is held by {current.get('owner')} (pid {current.get('pid')} "
            f"on {current.get('host')}) until {time.ctime(current['expires_at'])}: another flow "
            "is driving it. Wait for it to finish or cancel it, or choose another run.name.",
            field="run.name",
        )
    lease = Lease(owner, host, os.getpid(), now, now + ttl_s)
    taken = LeaseHeldError(
        f"run {run_location.uri} was taken by another flow at the same moment: it is driving "
        "it. Wait for it to finish, or choose another run.name.",
        field="run.name",
    )
    if found is not None:  # compare-and-swap: only one of two racing flows wins
        try:
            conditional_write.write(path, lease.to_json(), found.version)
        except conditional_write.ConditionFailed as e:
            # Written since it was read: by this owner's own keeper renewing it (then it is
            # ours), or by another flow that won.
            if (conditional_write.read(path).value or {}).get("owner") != owner:
                raise taken from e
        return lease
    path.write_json(lease.to_json())
    time.sleep(settle_s)
    if (read_whole_json(path) or {}).get("owner") != owner:
        raise taken
    return lease


def renew(run_location: Location, lease: Lease, ttl_s: float | None = None) -> Lease:
    """Extend ``lease``; LeaseLostError when another owner holds the run now."""
    path = RunDirectory(run_location).lease_file
    found = conditional_write.read(path) if conditional_write.supported(path) else None
    current = found.value if found else read_whole_json(path)
    if current is None or current.get("owner") != lease.owner:
        holder = "nobody (it was released)" if current is None else current.get("owner")
        raise LeaseLostError(
            f"the lease of run {run_location.uri} was taken over: it is held by {holder}, not "
            f"this flow ({lease.owner}), which stops and commits nothing more. Let the other "
            "flow finish, or cancel it and run this one again.",
            field="run.name",
        )
    renewed = Lease(
        lease.owner,
        lease.host,
        lease.pid,
        lease.acquired_at,
        time.time() + (ttl_s or lease_ttl_s()),
        current.get("job"),  # the job it drives, named by the train task (``name_job``)
    )
    if found is None:
        path.write_json(renewed.to_json())
        return renewed
    try:  # unless another flow wrote it since it was read
        conditional_write.write(path, renewed.to_json(), found.version)
    except conditional_write.ConditionFailed:
        return renew(run_location, lease, ttl_s)  # read again: lost, or ours still
    return renewed


def name_job(run_location: Location, owner: str, job_id: str) -> None:
    """Name in the lease the Ray job ``owner`` drives now (submitted or re-attached to), before
    it commits: the job's commits are fenced by its id (``RunDirectory(lease_owner=job_id)``
    holds while the lease names it), so a flow that takes the run over fences out every job it
    does not drive, and a flow that re-attaches to its predecessor's job lets it go on.
    LeaseLostError unless ``owner`` holds the lease."""
    path = RunDirectory(run_location).lease_file
    while True:
        check_held(run_location, owner)
        if not conditional_write.supported(path):
            path.write_json({**(read_whole_json(path) or {}), "job": job_id})
            return
        found = conditional_write.read(path)
        if (found.value or {}).get("owner") != owner:
            continue  # taken over since: check_held says by whom
        try:
            conditional_write.write(path, {**(found.value or {}), "job": job_id}, found.version)
            return
        except conditional_write.ConditionFailed:  # renewed meanwhile (by a keeper): again
            continue


#: ``summary_version`` of a run with no summary.json.
NO_SUMMARY = "absent"


def summary_version(run_location: Location) -> str:
    """What the run's summary.json is now: its sha256, or ``NO_SUMMARY``."""
    path = RunDirectory(run_location).summary_file
    if not path.exists():
        return NO_SUMMARY
    return hashlib.sha256(path.read_bytes()).hexdigest()


def acquire_to_finalize(
    run_location: Location, owner: str, summary_seen: str | None = None
) -> Lease:
    """Take the lease again for finalize: still ``owner``'s, or free again. A lease that was
    not ``owner``'s any more had lapsed, and another flow may have driven the run meanwhile:
    when summary.json is not what setup saw (``summary_seen``, a ``summary_version``; None: not
    recorded), that flow wrote it, and LeaseHeldError says finalize writes nothing over it."""
    current = RunDirectory(run_location).read_lease()
    held = acquire(run_location, owner=owner)
    if (current or {}).get("owner") == owner or summary_seen is None:
        return held
    if summary_version(run_location) != summary_seen:
        release(run_location, owner)
        raise LeaseHeldError(
            f"the lease of run {run_location.uri} lapsed before this flow's finalize ({owner} "
            "no longer held it), and summary.json was written since this flow's setup read it: "
            "by another flow that drove the run meanwhile. Its summary stands. Run this flow "
            "again to get the run's result as it is now.",
            field="run.name",
        )
    return held


def check_held(run_location: Location, owner: str) -> None:
    """LeaseLostError unless ``owner`` holds the run's lease now (a fence before a write that
    only the holder may make)."""
    RunDirectory(run_location).check_lease(owner)


def release(run_location: Location, owner: str) -> None:
    """Give the run back, if ``owner`` still holds it. Every keeper renewing it in this process
    is stopped first (the flow's and a train attempt's, nested): a renewal that read the lease
    before the delete would write it back after (on a local disk the delete is outside the
    renewal's compare-and-swap), holding the run for another TTL after its flow ended."""
    with _keepers_guard:
        renewing = list(_keepers.get((run_location.uri, owner), ()))
    for keeper in renewing:
        keeper.stop()
    path = RunDirectory(run_location).lease_file
    if (read_whole_json(path) or {}).get("owner") == owner:
        path.delete_file()


#: The keepers renewing a lease in this process, by (run URI, owner), outermost first: the
#: flow's from setup to finalize and, inside it, each train attempt's. ``release`` stops all.
_keepers: dict[tuple[str, str], list[LeaseKeeper]] = {}
_keepers_guard = threading.Lock()


class LeaseKeeper:
    """Renews a lease in a background thread while the run is driven (from setup to finalize,
    across retry delays). A renewal that finds the lease taken over stops renewing and keeps
    the error in ``lost``: the attempt in progress checks it and stops. Keepers of one lease
    nest (the train task's inside the flow's): each leaving ends only its own renewals, and
    ``release`` ends them all."""

    def __init__(self, run_location: Location, lease: Lease, ttl_s: float | None = None):
        self.location, self.lease = run_location, lease
        self.ttl_s = ttl_s or lease_ttl_s()
        self.lost: LeaseLostError | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="relaytrain-lease", daemon=True)

    @classmethod
    def of(cls, run_location: Location, owner: str) -> LeaseKeeper:
        """A keeper of the lease ``owner`` holds (taken by ``acquire`` earlier)."""
        now = time.time()
        return cls(run_location, Lease(owner, socket.gethostname(), os.getpid(), now, now))

    def _run(self) -> None:
        while not self._stop.wait(self.ttl_s / 3):
            try:
                self.lease = renew(self.location, self.lease, self.ttl_s)
            except LeaseLostError as e:
                self.lost = e
                return
            except Exception:  # a missed renewal is retried; expiry is the backstop
                continue

    def __enter__(self) -> LeaseKeeper:
        with _keepers_guard:
            _keepers.setdefault(self._key, []).append(self)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
        with _keepers_guard:
            nested = _keepers.get(self._key, [])
            if self in nested:
                nested.remove(self)
            if not nested:
                _keepers.pop(self._key, None)

    @property
    def _key(self) -> tuple[str, str]:
        return (self.location.uri, self.lease.owner)

    def stop(self) -> None:
        """Renew no more (a renewal in progress finishes first)."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(5)
