"""URIs to locations: the one place relaytrain parses a storage URI (local paths, pyarrow's s3://,
gs://, hdfs://, and any fsspec protocol as fsspec+<protocol>://), refusing credentials in it."""

from __future__ import annotations

import os
import posixpath
import re
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pyarrow.fs as pafs

from trainer_core.errors import (
    SpecError,
)
from trainer_core.storage.failures import storage_error
from trainer_core.storage.locations import Location, setup_wait_s

PYARROW_SCHEMES = ("s3", "gs", "gcs", "hdfs", "viewfs")


#: The words credentials are named with in the options of the object stores a URI can reach:
#: pyarrow (access_key, secret_key, session_token, access_token), s3fs (key, secret, token,
#: aws_access_key_id, aws_secret_access_key, aws_session_token), gcsfs (token), adlfs
#: (account_key, sas_token, connection_string, client_secret, credential), and any password.
#: An option is refused by the words its name is made of (``is_credential_option``), so another
#: backend's spelling of the same thing (``AccountKey``, ``sasToken``) is refused too.
CREDENTIAL_WORDS = frozenset(
    {
        "key",
        "secret",
        "token",
        "password",
        "passwd",
        "pwd",
        "credential",
        "credentials",
        "sas",
        "sig",
        "signature",
        "connection",
        "auth",
        "authorization",
    }
)
#: Options whose names hold such a word but which name no secret (a KMS key's id).
NOT_CREDENTIALS = frozenset({"sse_kms_key_id", "kms_key_id", "ssekmskeyid"})


def is_credential_option(name: str) -> bool:
    """Whether a URI's option ``name`` looks like a credential to any fsspec or pyarrow
    backend: a word of it (split at ``_``, ``-``, ``.`` and camelCase) is a credential's."""
    snake = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    if snake in NOT_CREDENTIALS or snake.replace("_", "") in NOT_CREDENTIALS:
        return False
    words = {w for w in re.split(r"[^a-z0-9]+", snake) if w}
    return bool(words & CREDENTIAL_WORDS)


#: Query options of ``s3://`` URIs, passed to ``pyarrow.fs.S3FileSystem``.
S3_OPTIONS = (
    "region",
    "scheme",
    "endpoint_override",
    "allow_bucket_creation",
    "allow_bucket_deletion",
    "tls_ca_file_path",
)


def _parse_query(query: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if is_credential_option(key):
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

    ``fail_fast``: quick connection attempts (setup's probe), retried while the store cannot
    be reached for ``setup_wait_s()`` at most, so a flow launched during an outage waits it out
    and a wrong endpoint is reported after that wait.
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
    patience = setup_wait_s() if fail_fast else None
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
        # A file opened for writing is created at its first part, or at close as one PUT when
        # it is smaller than a part (most of a checkpoint's and run's files): a third of the
        # requests of a multipart upload (create, part, complete).
        allow_delayed_open=True,
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
        # No listings cache: other processes (the workers, the lease keeper's conditional
        # writes) rewrite the run directory's files, and s3fs opens a file with the ETag its
        # listing remembered: a replaced object then failed every read (FileExpired).
        options.setdefault("use_listings_cache", False)
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


#: S3 client settings: ordinary calls, and setup's probe (fail within seconds, not minutes).
S3_CONNECT_TIMEOUT_S = 5.0


S3_MAX_ATTEMPTS = 3


PROBE_CONNECT_TIMEOUT_S = 2.0


PROBE_MAX_ATTEMPTS = 2


PROBE_GCS_RETRY_LIMIT_S = 1
