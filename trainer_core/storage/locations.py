"""Storage: URI -> pyarrow filesystem + path. The only place in relaytrain that parses URIs.

Supported:
- local paths and ``file://`` URIs (made absolute: Ray workers do not share the driver's cwd);
- ``s3://bucket/prefix`` (query options ``endpoint_override``, ``region``, ``scheme``,
  ``allow_bucket_creation``, ``allow_bucket_deletion``, ``tls_ca_file_path`` go to pyarrow's
  S3FileSystem; credentials come from the environment), ``gs://``, ``hdfs://``;
- ``fsspec+<protocol>://...`` to force the fsspec implementation of a protocol (e.g. s3fs),
  query options passed to ``fsspec.filesystem``; and any protocol pyarrow does not know natively
  (``memory://``, ``abfs://``, ...) through ``PyFileSystem(FSSpecHandler(...))``. ``gcs://`` is
  pyarrow's, like ``gs://``; ``fsspec+gcs://`` is gcsfs.

Credentials never travel in a URI: they come from the environment (``credential_env`` lists the
variables relaytrain hands on to Ray's controller and workers), filled from a Prefect block when
``run.credentials`` names one.

Errors: a refused credential or permission (and a read-only or full disk) is a ``StorageError``
that is not retried (a retry cannot fix it); a connection failure is a
``StorageUnavailableError`` (infrastructure, retried). Remote calls ride out an outage shorter
than ``RELAYTRAIN_STORAGE_PATIENCE_S`` (default 5 s) before they give up.

Remote locations stay ``str`` paths joined with ``posixpath`` (never ``pathlib``/``os.path``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import pyarrow.fs as pafs

from trainer_core.errors import (
    StorageError,
    StorageUnavailableError,
)
from trainer_core.storage.failures import storage_error

logger = logging.getLogger("relaytrain.storage")
T = TypeVar("T")

#: Environment variables that carry storage credentials or say where and how to reach storage.
#: ``credential_env`` hands those set in this process to Ray's controller and workers.
CREDENTIAL_ENV_VARS = (
    # AWS and S3-compatible stores (pyarrow's AWS SDK, botocore/s3fs)
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_DEFAULT_REGION",
    "AWS_REGION",
    "AWS_PROFILE",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CA_BUNDLE",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT_URL_S3",
    "AWS_EC2_METADATA_DISABLED",
    # Google Cloud Storage
    "GOOGLE_APPLICATION_CREDENTIALS",
    "GOOGLE_CLOUD_PROJECT",
    "STORAGE_EMULATOR_HOST",
    # Azure Blob / ADLS (adlfs)
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_CONNECTION_STRING",
    "AZURE_STORAGE_SAS_TOKEN",
    "AZURE_CLIENT_ID",
    "AZURE_CLIENT_SECRET",
    "AZURE_TENANT_ID",
    # HDFS
    "HADOOP_USER_NAME",
    "KRB5CCNAME",
)
#: Seconds a remote call keeps retrying a connection failure before it gives up (env override).
PATIENCE_ENV_VAR = "RELAYTRAIN_STORAGE_PATIENCE_S"
DEFAULT_PATIENCE_S = 5.0
#: Seconds setup waits for a remote store it cannot reach before it refuses the run (env
#: override): a flow launched during a short outage rides it out, a wrong endpoint is refused
#: after the wait with the same error. Setup is not retried, so no retry is spent either way.
SETUP_WAIT_ENV_VAR = "RELAYTRAIN_STORAGE_SETUP_WAIT_S"
DEFAULT_SETUP_WAIT_S = 30.0
#: Some stores answer a request without credentials with an error that looks like an outage.
NO_CREDENTIALS_HINT = (
    " No storage credentials are set in this process: if the store needs them, set "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the provider's variables) or name a Prefect "
    "block in run.credentials."
)


def credential_env() -> dict[str, str]:
    """The storage-credential environment variables set in this process (name -> value).

    Ray's controller and workers get these explicitly (a running Ray cluster does not see the
    driver's environment). Values are secrets: never log or persist what this returns.
    """
    return {name: os.environ[name] for name in CREDENTIAL_ENV_VARS if os.environ.get(name)}


def patience_s() -> float:
    """How long a remote call retries a connection failure (``RELAYTRAIN_STORAGE_PATIENCE_S``)."""
    return _seconds(PATIENCE_ENV_VAR, DEFAULT_PATIENCE_S)


def setup_wait_s() -> float:
    """How long setup waits for a remote store it cannot reach
    (``RELAYTRAIN_STORAGE_SETUP_WAIT_S``)."""
    return _seconds(SETUP_WAIT_ENV_VAR, DEFAULT_SETUP_WAIT_S)


def _seconds(name: str, default: float) -> float:
    try:
        return max(0.0, float(os.environ.get(name, default)))
    except ValueError:
        return default


#: fsspec protocols of S3: a key needs no parent directory.
S3_PROTOCOLS = frozenset({"s3", "s3a"})


def has_directories(filesystem: pafs.FileSystem) -> bool:
    """Whether a file's parent directories must exist before it is written. Not on S3, whose
    keys need no parents and whose listings find a key's prefixes without them: creating them
    there writes a marker object for each (pyarrow's S3 client heads the bucket and puts up to
    one marker a level first: four requests before each checkpoint file, a quarter of a run's
    requests). pyarrow's GCS client lists a directory by its marker, so GCS keeps them."""
    if isinstance(filesystem, pafs.S3FileSystem):
        return False
    if isinstance(filesystem, pafs.PyFileSystem):
        handler = filesystem.handler
        inner = getattr(handler, "filesystem", None)  # a lazily built filesystem (lazyfs)
        if isinstance(inner, pafs.FileSystem):
            return has_directories(inner)
        protocol = getattr(getattr(handler, "fs", None), "protocol", ())  # fsspec's
        protocols = {protocol} if isinstance(protocol, str) else set(protocol)
        return not protocols & S3_PROTOCOLS
    return True


@dataclass(frozen=True)
class Location:
    """A place in storage: a pyarrow filesystem and a path inside it, plus a display URI."""

    filesystem: pafs.FileSystem
    path: str
    uri: str
    #: Seconds to keep retrying a connection failure; None: ``patience_s()`` for remote stores.
    patience_s: float | None = field(default=None, compare=False)

    def child(self, *parts: str) -> Location:
        """The location ``parts`` below this one (posix join: safe for object stores). A part
        may hold ``/``-separated names (``metrics/part-1``), none of them empty, ``.`` or
        ``..``: a name read from storage (a manifest's, DCP's) never reaches outside."""
        for part in parts:
            if any(name in ("", ".", "..") for name in part.split("/")):
                raise ValueError(
                    f"unsafe path component {part!r} below {self.uri}: a name may not be "
                    "empty, absolute, or hold '.' or '..'"
                )
        return Location(
            self.filesystem,
            posixpath.join(self.path, *parts),
            posixpath.join(self.uri.split("?", 1)[0], *parts),
            self.patience_s,
        )

    @property
    def is_local(self) -> bool:
        return isinstance(self.filesystem, pafs.LocalFileSystem)

    # -- reads ------------------------------------------------------------------------------

    def info(self) -> pafs.FileInfo:
        return _call(self, "inspect", lambda: self.filesystem.get_file_info(self.path))

    def exists(self) -> bool:
        return self.info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        return self.info().type == pafs.FileType.Directory

    def read_bytes(self) -> bytes:
        def read() -> bytes:
            with self.filesystem.open_input_stream(self.path) as f:
                return f.read()

        return _call(self, "read", read)

    def read_json(self) -> Any:
        return json.loads(self.read_bytes())

    def list(self) -> list[pafs.FileInfo]:
        """Direct children, sorted by name; empty when the location does not exist."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=False)
        infos = _call(self, "list", lambda: self.filesystem.get_file_info(selector))
        return sorted(infos, key=lambda i: i.base_name)

    def files(self) -> dict[str, pafs.FileInfo]:
        """Every file under this location, at any depth, by its path relative to it: one
        listing (an object store's answers 1000 keys a request) instead of a request a file."""
        selector = pafs.FileSelector(self.path, allow_not_found=True, recursive=True)
        infos = _call(self, "list", lambda: self.filesystem.get_file_info(selector))
        prefix = self.path.rstrip("/") + "/"
        return {
            info.path[len(prefix) :]: info
            for info in infos
            if info.type == pafs.FileType.File and info.path.startswith(prefix)
        }

    # -- writes -----------------------------------------------------------------------------

    def ensure_dir(self) -> None:
        _call(self, "create", lambda: self.filesystem.create_dir(self.path, recursive=True))

    def write_bytes(self, data: bytes) -> None:
        """Write ``data`` so readers see either the old content or the new, never a part."""
        self.write_stream(lambda stream: stream.write(data))

    def write_stream(self, produce: Callable[[Any], T]) -> T:
        """Write what ``produce(stream)`` writes, atomically; return what it returns.

        Object stores publish a PUT atomically; on a local disk we write a temporary sibling
        and rename it over the target (and remove the sibling if the write fails, e.g. on a
        full disk). A retried write calls ``produce`` again from the start.
        """
        parent = posixpath.dirname(self.path)
        target = self.path
        if self.is_local:
            target = posixpath.join(parent, f".{posixpath.basename(self.path)}.{uuid.uuid4().hex}")

        def write() -> T:
            if has_directories(self.filesystem):
                self.filesystem.create_dir(parent, recursive=True)
            with self.filesystem.open_output_stream(target) as f:
                produced = produce(f)
            if target != self.path:
                self.filesystem.move(target, self.path)
            return produced

        try:
            return _call(self, "write", write)
        except BaseException:
            if target != self.path:
                with contextlib.suppress(Exception):
                    self.filesystem.delete_file(target)
            raise

    def write_json(self, value: Any) -> None:
        self.write_bytes(json.dumps(value, indent=2, sort_keys=True).encode() + b"\n")

    def delete_file(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            _call(self, "delete", lambda: self.filesystem.delete_file(self.path))

    def delete_dir(self) -> None:
        if self.exists():
            _call(self, "delete", lambda: self.filesystem.delete_dir(self.path))


# -- errors ---------------------------------------------------------------------------------------


def call(location: Location, verb: str, fn: Callable[[], T]) -> T:
    """``fn()``, a call to ``location``'s store made outside its filesystem (e.g. an SDK's):
    its failure classified and its connection failures retried, as the filesystem's are."""
    return _call(location, verb, fn)


def _call(location: Location, verb: str, fn: Callable[[], T]) -> T:
    """Run one filesystem call; classify its failure; retry connection failures of a remote
    store for up to the location's patience, with backoff."""
    patience = location.patience_s
    if patience is None:
        patience = 0.0 if location.is_local else patience_s()
    deadline: float | None = None
    delay = 0.2
    while True:
        try:
            return fn()
        except FileNotFoundError:
            raise
        except Exception as e:
            error = storage_error(location.uri, verb, e)
            if error is None:
                raise
            now = time.monotonic()
            deadline = now + patience if deadline is None else deadline
            if not isinstance(error, StorageUnavailableError) or now + delay > deadline:
                raise error from e
            logger.warning("%s; retrying for up to %.0f s more", error, deadline - now)
            time.sleep(delay)
            delay = min(2 * delay, 2.0)


# -- URIs -----------------------------------------------------------------------------------------


def probe_writable(location: Location) -> None:
    """Prove ``location`` is writable: create it, write, read back and delete a probe file.

    Keeps the failure's class (refused credentials and a full disk are not retried; a store
    that cannot be reached is a StorageUnavailableError) and says which knob fixes it.
    """
    probe = location.child(f".relaytrain-probe-{uuid.uuid4().hex}")
    payload = uuid.uuid4().bytes
    try:
        location.ensure_dir()
        probe.write_bytes(payload)
        if probe.read_bytes() != payload:
            raise StorageError(f"storage at {location.uri} returned other bytes than written")
        probe.delete_file()
    except StorageUnavailableError as e:
        if location.is_local:
            raise _reworded(e, f"run storage {location.uri} is not writable: {e}") from e
        hint = "" if credential_env() else NO_CREDENTIALS_HINT
        waited = ""
        if location.patience_s:  # setup's probe waited for the store
            waited = f" in {location.patience_s:.0f} s ({SETUP_WAIT_ENV_VAR})"
        raise StorageUnavailableError(
            f"run storage {location.uri} could not be reached{waited}: {str(e).rstrip('.')}. "
            "Check run.storage (its endpoint_override, scheme and region) and that the store is "
            f"up and reachable from here.{hint}"
        ) from e
    except StorageError as e:
        hint = (
            ""
            if "run.storage" in str(e)
            else " Fix run.storage, the credentials in the environment or run.credentials, or "
            "the permissions of that location."
        )
        message = f"run storage {location.uri} is not writable: {str(e).rstrip('.')}.{hint}"
        raise _reworded(e, message) from e
    except FileNotFoundError as e:
        raise StorageError(f"run storage {location.uri} could not be created: {e}") from e


def _reworded(error: StorageError, message: str) -> StorageError:
    """``error`` (same class and fields) with another message."""
    clone = copy.copy(error)
    clone.args = (message,)
    return clone


def walk_files(location: Location) -> Iterator[pafs.FileInfo]:
    """Every file below ``location`` (recursive)."""
    selector = pafs.FileSelector(location.path, allow_not_found=True, recursive=True)
    for info in _call(location, "list", lambda: location.filesystem.get_file_info(selector)):
        if info.type == pafs.FileType.File:
            yield info
