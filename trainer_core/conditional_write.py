"""Compare-and-swap writes of a small record (the run lease), where the store has them.

``read`` gives a record with its version; ``write`` replaces it only if it is still at that
version (or creates it only if absent), else raises ``ConditionFailed``. Two flows racing for
one run then cannot both win, however their requests interleave.

- S3 (pyarrow's ``s3://`` and s3fs's ``fsspec+s3://``): PutObject with ``If-None-Match: *``
  (create) or ``If-Match: <ETag>`` (replace), through boto3 with the store's endpoint and the
  environment's credentials. AWS S3 has both since 2024; so do MinIO and moto.
- Local disks (and NFS with working locks): an exclusive ``flock`` on a sibling guard file
  around read, compare and replace; the version is the content's sha256.
- Any other store: ``supported`` is False and the caller falls back to write, wait, read back
  (the last writer wins and the others see it, unless their reads come first).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pyarrow.fs as pafs

from trainer_core import storage
from trainer_core.storage import Location


class ConditionFailed(Exception):
    """The record changed (or appeared) since it was read."""


@dataclass(frozen=True)
class Versioned:
    """A record and its version (None, None: there is none)."""

    value: dict[str, Any] | None
    version: str | None


def supported(location: Location) -> bool:
    return location.is_local or _s3_client(location) is not None


def read(location: Location) -> Versioned:
    """The record at ``location`` and its version."""
    if location.is_local:
        try:
            with open(location.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return Versioned(None, None)
        return Versioned(json.loads(data), _digest(data))
    client, bucket, key = _s3(location)

    def get() -> Versioned:
        try:
            found = client.get_object(Bucket=bucket, Key=key)
        except client.exceptions.NoSuchKey:
            return Versioned(None, None)
        return Versioned(json.loads(found["Body"].read()), found["ETag"])

    return storage.call(location, "read", get)


def write(location: Location, value: dict[str, Any], version: str | None) -> str:
    """Write ``value`` if the record is still at ``version`` (None: only if there is none);
    returns the new version, or raises ConditionFailed."""
    data = json.dumps(value, indent=2, sort_keys=True).encode() + b"\n"
    if location.is_local:

        def replace() -> str:
            with _guard(location.path):
                if read(location).version != version:
                    raise ConditionFailed(location.uri)
                location.write_bytes(data)
            return _digest(data)

        return storage.call(location, "write", replace)  # a full disk: StorageFullError
    client, bucket, key = _s3(location)
    condition = {"IfMatch": version} if version is not None else {"IfNoneMatch": "*"}

    def put() -> str:
        try:
            written = client.put_object(Bucket=bucket, Key=key, Body=data, **condition)
        except client.exceptions.ClientError as e:
            code = e.response.get("Error", {}).get("Code")
            status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code in ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey") or (
                status in (409, 412)
            ):
                raise ConditionFailed(location.uri) from e
            raise
        return str(written["ETag"])

    return storage.call(location, "write", put)


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@contextlib.contextmanager
def _guard(path: str) -> Iterator[None]:
    """An exclusive lock on ``path``'s guard file (``.<name>.guard`` beside it)."""
    directory, name = os.path.split(path)
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, f".{name}.guard"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _s3(location: Location) -> tuple[Any, str, str]:
    client = _s3_client(location)
    assert client is not None, f"{location.uri}: no conditional writes"
    bucket, _, key = location.path.partition("/")
    return client, bucket, key


def _s3_client(location: Location) -> Any | None:
    """A boto3 S3 client for the store ``location`` is on (None: not S3)."""
    fs = location.filesystem
    endpoint = region = None
    if isinstance(fs, pafs.S3FileSystem):
        options = fs.__reduce__()[1][0]  # the filesystem's own constructor arguments
        if options.get("endpoint_override"):
            endpoint = options["endpoint_override"]
            if "://" not in endpoint:
                endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
        region = options.get("region") or None
    elif isinstance(fs, pafs.PyFileSystem) and type(fs.handler.fs).__name__ == "S3FileSystem":
        s3fs = fs.handler.fs
        endpoint = s3fs.client_kwargs.get("endpoint_url") or getattr(s3fs, "endpoint_url", None)
        region = s3fs.client_kwargs.get("region_name")
    else:
        return None
    import boto3

    return boto3.client("s3", endpoint_url=endpoint, region_name=region)
