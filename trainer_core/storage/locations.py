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
import errno
import json
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import parse_qsl, urlsplit

import pyarrow.fs as pafs

from trainer_core.errors import (
    SpecError,
    StorageAccessError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
)

logger = logging.getLogger("relaytrain.storage")
T = TypeVar("T")

PYARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs")
CREDENTIAL_KEYS = (
    "access_key",
    "secret_key",
    "session_token",
    "aws_secret_access_key",
    "key",
    "secret",
    "token",
    "password",
)
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
#: Query options of ``s3://`` URIs, passed to ``pyarrow.fs.S3FileSystem``.
S3_OPTIONS = (
    "region",
    "scheme",
    "endpoint_override",
    "allow_bucket_creation",
    "allow_bucket_deletion",
    "tls_ca_file_path",
)
#: Seconds a remote call keeps retrying a connection failure before it gives up (env override).
PATIENCE_ENV_VAR = "RELAYTRAIN_STORAGE_PATIENCE_S"
DEFAULT_PATIENCE_S = 5.0
#: S3 client settings: ordinary calls, and setup's probe (fail within seconds, not minutes).
S3_CONNECT_TIMEOUT_S = 5.0
S3_MAX_ATTEMPTS = 3
PROBE_CONNECT_TIMEOUT_S = 2.0
PROBE_MAX_ATTEMPTS = 2
PROBE_GCS_RETRY_LIMIT_S = 1
#: What access refusals look like in pyarrow's (AWS SDK) and s3fs's (botocore) messages.
ACCESS_SIGNS = (
    "ACCESS_DENIED",
    "AccessDenied",
    "INVALID_ACCESS_KEY_ID",
    "InvalidAccessKeyId",
    "SIGNATURE_DOES_NOT_MATCH",
    "SignatureDoesNotMatch",
    "EXPIRED_TOKEN",
    "ExpiredToken",
    "InvalidToken",
    "HTTP status 401",
    "HTTP status 403",
    "Forbidden",
    "Unauthorized",
    "Unable to locate credentials",
    "NoCredentialsError",
    "AllAccessDisabled",
)
MISSING_BUCKET_SIGNS = ("NO_SUCH_BUCKET", "NoSuchBucket", "specified bucket does not exist")
#: pyarrow's GCS client creates a missing bucket; with no project to create it in, it says so.
GCS_CREATE_BUCKET_SIGNS = ("CreateBucket", "missing project id")
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
#: A path that can never hold the run (a file where a directory should be, a name too long).
BAD_PATH_ERRNOS = (errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP)
FULL_SIGNS = ("No space left on device", "Disk quota exceeded")
#: Some stores answer a request without credentials with an error that looks like an outage.
NO_CREDENTIALS_HINT = (
    " No storage credentials are set in this process: if the store needs them, set "
    "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the provider's variables) or name a Prefect "
    "block in run.credentials."
)
#: Packages whose own exception types mean "the connection failed" (not OSError subclasses).
TRANSPORT_PACKAGES = ("botocore", "aiobotocore", "aiohttp", "urllib3", "requests")


def credential_env() -> dict[str, str]:
    """The storage-credential environment variables set in this process (name -> value).

    Ray's controller and workers get these explicitly (a running Ray cluster does not see the
    driver's environment). Values are secrets: never log or persist what this returns.
    """
    return {name: os.environ[name] for name in CREDENTIAL_ENV_VARS if os.environ.get(name)}


def patience_s() -> float:
    """How long a remote call retries a connection failure (``RELAYTRAIN_STORAGE_PATIENCE_S``)."""
    try:
        return max(0.0, float(os.environ.get(PATIENCE_ENV_VAR, DEFAULT_PATIENCE_S)))
    except ValueError:
        return DEFAULT_PATIENCE_S


@dataclass(frozen=True)
class Location:
    """A place in storage: a pyarrow filesystem and a path inside it, plus a display URI."""

    filesystem: pafs.FileSystem
    path: str
    uri: str
    #: Seconds to keep retrying a connection failure; None: ``patience_s()`` for remote stores.
    patience_s: float | None = field(default=None, compare=False)

    def child(self, *parts: str) -> Location:
        """The location ``parts`` below this one (posix join: safe for object stores)."""
        for part in parts:
            if part in ("", ".", "..") or part.startswith("/"):
                raise ValueError(f"unsafe path component {part!r}")
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


def storage_error(uri: str, verb: str, error: BaseException) -> StorageError | None:
    """What a filesystem failure means for the run (None: not a storage failure).

    Refused credentials or permissions, a read-only store and a missing bucket are not retried
    (a retry cannot fix them); a full disk neither; anything else, such as a connection that
    failed, is a transient StorageUnavailableError.
    """
    text = f"{type(error).__name__}: {error}"
    if all(sign in text for sign in GCS_CREATE_BUCKET_SIGNS):
        return StorageAccessError(
            f"could not {verb} {uri}: its bucket does not exist (pyarrow's GCS client tried to "
            f"create it: {error}). Create the bucket, or fix run.storage.",
            field="run.storage",
        )
    transport = type(error).__module__.split(".")[0] in TRANSPORT_PACKAGES
    if not isinstance(error, OSError) and not transport:
        return None
    code = getattr(error, "errno", None)
    if code in FULL_ERRNOS or any(sign in text for sign in FULL_SIGNS):
        return StorageFullError(
            f"storage is full: could not {verb} {uri} ({error}). Free space (or raise the quota) "
            "there and run again to resume, or choose another run.storage.",
            field="run.storage",
        )
    if code in BAD_PATH_ERRNOS:
        return StorageAccessError(
            f"could not {verb} {uri}: {error}. Fix run.storage: it must name a directory (or a "
            "place one can be created).",
            field="run.storage",
        )
    if code == errno.EROFS:
        return StorageAccessError(
            f"storage is read-only: could not {verb} {uri} ({error}). Choose a writable "
            "run.storage.",
            field="run.storage",
        )
    if any(sign in text for sign in MISSING_BUCKET_SIGNS):
        return StorageAccessError(
            f"could not {verb} {uri}: its bucket does not exist ({error}). Create the bucket, or "
            "fix run.storage.",
            field="run.storage",
        )
    if isinstance(error, PermissionError) or any(sign in text for sign in ACCESS_SIGNS):
        return StorageAccessError(
            f"access denied to {verb} {uri} ({error}). Fix the credentials (AWS_ACCESS_KEY_ID / "
            "AWS_SECRET_ACCESS_KEY or the provider's variables in the environment, or the Prefect "
            "block named by run.credentials), grant them read and write access to that location, "
            "or choose another run.storage.",
            field="run.credentials",
        )
    return StorageUnavailableError(f"could not {verb} {uri}: {error}")


# -- URIs -----------------------------------------------------------------------------------------


def _parse_query(query: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key.lower() in CREDENTIAL_KEYS:
            raise _credentials_in_uri(f"{key}=...")
        lowered = value.lower()
        if lowered in ("true", "false"):
            options[key] = lowered == "true"
        else:
            try:
                options[key] = int(value)
            except ValueError:
                try:
                    options[key] = float(value)
                except ValueError:
                    options[key] = value
    return options


def _credentials_in_uri(what: str) -> SpecError:
    return SpecError(
        f"run.storage carries a credential ({what}): never put secrets in a URI; "
        "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the provider's variables) in "
        "the environment or name a Prefect credentials block in run.credentials",
        field="run.storage",
    )


def resolve(uri: str, *, fail_fast: bool = False) -> Location:
    """Turn a path or URI into a Location. Raises SpecError for what cannot be a location.

    ``fail_fast``: one quick connection attempt and no patience (setup's probe: an unreachable
    store is reported within seconds).
    """
    if not uri or not uri.strip():
        raise SpecError("storage location is empty: give a path or URI", field="run.storage")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        local = parts.path if scheme == "file" else uri
        path = os.path.abspath(os.path.expanduser(local))
        return Location(pafs.LocalFileSystem(), path, path)
    if parts.username is not None or parts.password is not None:
        raise _credentials_in_uri("user:password@ before the bucket or host")
    display = f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")
    options = _parse_query(parts.query)
    patience = 0.0 if fail_fast else None
    if scheme == "s3":
        filesystem = _s3_filesystem(parts.netloc, options, display, fail_fast)
        path = f"{parts.netloc}{parts.path}".rstrip("/")
        return Location(filesystem, path, display, patience)
    if scheme in PYARROW_SCHEMES:
        if fail_fast and scheme in ("gs", "gcs") and "retry_limit_seconds" not in options:
            # google-cloud-cpp retries a dead endpoint for minutes by default
            uri += f"{'&' if parts.query else '?'}retry_limit_seconds={PROBE_GCS_RETRY_LIMIT_S}"
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:
            raise SpecError(
                f"storage URI {display!r} could not be opened with pyarrow: {e}",
                field="run.storage",
            ) from e
        return Location(filesystem, path.rstrip("/"), display, patience)
    protocol = scheme.removeprefix("fsspec+")
    location = _fsspec_location(protocol, parts.netloc + parts.path, options, display, fail_fast)
    return Location(location.filesystem, location.path, location.uri, patience)


def _s3_filesystem(
    bucket: str, options: dict[str, Any], display: str, fail_fast: bool
) -> pafs.S3FileSystem:
    """pyarrow's S3 client for ``bucket`` with bounded timeouts and retries.

    Credentials are never passed here: the AWS SDK reads them from the environment in whichever
    process uses the filesystem (so a pickled filesystem carries none).
    """
    unknown = sorted(set(options) - set(S3_OPTIONS))
    if unknown:
        raise SpecError(
            f"storage URI {display!r} has unknown option(s) {unknown}: s3:// accepts "
            f"{', '.join(S3_OPTIONS)}",
            field="run.storage",
        )
    kwargs = {
        k: str(v) if k in ("region", "scheme", "endpoint_override") else v
        for k, v in options.items()
    }
    if "region" not in kwargs and "endpoint_override" not in kwargs:
        try:
            kwargs["region"] = pafs.resolve_s3_region(bucket)
        except (ValueError, OSError) as e:
            error = storage_error(display, "find the region of", e)
            raise (error or SpecError(f"{display}: {e}", field="run.storage")) from e
    return pafs.S3FileSystem(
        connect_timeout=PROBE_CONNECT_TIMEOUT_S if fail_fast else S3_CONNECT_TIMEOUT_S,
        retry_strategy=pafs.AwsStandardS3RetryStrategy(
            max_attempts=PROBE_MAX_ATTEMPTS if fail_fast else S3_MAX_ATTEMPTS
        ),
        **kwargs,
    )


def _fsspec_location(
    protocol: str, path: str, options: dict[str, Any], display: str, fail_fast: bool = False
) -> Location:
    import fsspec

    if protocol == "s3":
        if "endpoint_override" in options:
            endpoint = options.pop("endpoint_override")
            if "://" not in str(endpoint):
                endpoint = f"{options.pop('scheme', 'https')}://{endpoint}"
            options["endpoint_url"] = endpoint
        if fail_fast:
            options["config_kwargs"] = {
                "connect_timeout": PROBE_CONNECT_TIMEOUT_S,
                "retries": {"max_attempts": PROBE_MAX_ATTEMPTS, "mode": "standard"},
            }
    if protocol != "memory":
        # An instance resolves its credentials once: a cached one would outlive a change of
        # credentials in the environment (another run, another block).
        options.setdefault("skip_instance_cache", True)
    try:
        fs = fsspec.filesystem(protocol, **options)
    except (ValueError, ImportError) as e:
        raise SpecError(
            f"storage protocol {protocol!r} of {display!r} is not available: {e} "
            "(install the fsspec implementation for it, or use a local path, s3://, gs://)",
            field="run.storage",
        ) from e
    if fail_fast and hasattr(fs, "retries"):
        fs.retries = 1  # s3fs's own retry loop, on top of botocore's
    stripped = fs._strip_protocol(path)
    display = (
        f"{protocol}://{stripped.lstrip('/')}" if protocol != "memory" else f"memory://{stripped}"
    )
    filesystem = pafs.PyFileSystem(pafs.FSSpecHandler(fs))
    return Location(filesystem, stripped.rstrip("/") or "/", display.rstrip("/"))


def join_uri(uri: str, *parts: str) -> str:
    """``uri`` with ``parts`` appended to its path, keeping any query (e.g. endpoint_override)."""
    base, sep, query = uri.partition("?")
    joined = posixpath.join(base.rstrip("/") or "/", *parts)
    return f"{joined}{sep}{query}"


def parent(location: Location) -> tuple[Location, str]:
    """The location one level up, and the last path component."""
    path = location.path.rstrip("/")
    uri = location.uri.split("?", 1)[0].rstrip("/")
    return (
        Location(
            location.filesystem,
            posixpath.dirname(path),
            posixpath.dirname(uri),
            location.patience_s,
        ),
        posixpath.basename(path),
    )


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
        raise StorageUnavailableError(
            f"run storage {location.uri} could not be reached: {str(e).rstrip('.')}. Check "
            "run.storage (its endpoint_override, scheme and region) and that the store is up and "
            f"reachable from here.{hint}"
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
