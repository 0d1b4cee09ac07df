"""Compare-and-swap writes of a small record (the run lease), where the store has them.

``read`` gives a record with its version; ``write`` replaces it only if it is still at that
version (or creates it only if absent), else raises ``ConditionFailed``. Two flows racing for
one run then cannot both win, however their requests interleave.

- S3 (pyarrow's ``s3://`` and s3fs's ``fsspec+s3://``): PutObject with ``If-None-Match: *``
  (create) or ``If-Match: <ETag>`` (replace), through boto3 with the store's endpoint and the
  environment's credentials. AWS S3 has both since 2024; so do MinIO and moto.
- GCS (pyarrow's ``gs://`` and gcsfs's ``fsspec+gcs://``): the JSON API's multipart upload
  with ``ifGenerationMatch`` (0: create), the version being the object's generation, signed
  with Application Default Credentials (google-auth), as both clients sign theirs.
- Local disks (and NFS with working locks): an exclusive ``flock`` on a sibling guard file
  around read, compare and replace; the version is the content's sha256.
- Any other store: ``supported`` is False and the caller falls back to write, wait, read back
  (the last writer wins and the others see it, unless their reads come first).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import pyarrow.fs as pafs

from trainer_core import storage
from trainer_core.storage.locations import Location


class ConditionFailed(Exception):
    """The record changed (or appeared) since it was read."""


@dataclass(frozen=True)
class Versioned:
    """A record and its version (None, None: there is none)."""

    value: dict[str, Any] | None
    version: str | None


def supported(location: Location) -> bool:
    return location.is_local or _s3_client(location) is not None or _gcs(location) is not None


def read(location: Location) -> Versioned:
    """The record at ``location`` and its version (a record read mid-write is read again:
    ``storage.untorn``)."""
    return storage.untorn(location, lambda: _read_once(location))


def _read_once(location: Location) -> Versioned:
    if location.is_local:
        try:
            with open(location.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return Versioned(None, None)
        return Versioned(json.loads(data), _digest(data))
    gcs = _gcs(location)
    if gcs is not None:
        return storage.call(location, "read", gcs.read)
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
    gcs = _gcs(location)
    if gcs is not None:
        return storage.call(location, "write", lambda: gcs.write(data, version))
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


GCS_ENDPOINT = "https://storage.googleapis.com"


@dataclass(frozen=True)
class _GcsObject:
    """One object through GCS's JSON API: read with its generation, write on a generation."""

    endpoint: str
    bucket: str
    key: str

    def read(self) -> Versioned:
        found = _gcs_session().get(
            f"{self.endpoint}/storage/v1/b/{quote(self.bucket)}/o/{quote(self.key, safe='')}",
            params={"alt": "media"},
            timeout=30,
        )
        if found.status_code == 404 and "bucket" not in found.text.lower():
            return Versioned(None, None)
        _raise_for(found)
        return Versioned(json.loads(found.content), found.headers["x-goog-generation"])

    def write(self, data: bytes, version: str | None) -> str:
        # multipart: the upload that every GCS server honours ifGenerationMatch on
        boundary = "relaytrain-" + hashlib.sha256(data).hexdigest()[:16]
        body = b"".join(
            [
                f"--{boundary}\r\nContent-Type: application/json; charset=UTF-8\r\n\r\n".encode(),
                json.dumps({"name": self.key}).encode(),
                f"\r\n--{boundary}\r\nContent-Type: application/json\r\n\r\n".encode(),
                data,
                f"\r\n--{boundary}--".encode(),
            ]
        )
        written = _gcs_session().post(
            f"{self.endpoint}/upload/storage/v1/b/{quote(self.bucket)}/o",
            params={"uploadType": "multipart", "ifGenerationMatch": version or "0"},
            data=body,
            headers={"Content-Type": f'multipart/related; boundary="{boundary}"'},
            timeout=30,
        )
        if written.status_code == 412:
            raise ConditionFailed(f"gs://{self.bucket}/{self.key}")
        _raise_for(written)
        return str(written.json()["generation"])


def _raise_for(response: Any) -> None:
    """A failed response as requests' HTTPError, its status and the server's own words in the
    message (storage.storage_error classifies it: 401/403 credentials, a missing bucket)."""
    if response.ok:
        return
    import requests

    try:
        words = response.json()["error"]["message"]
    except Exception:
        words = response.text[:200]
    if response.status_code == 404 and "bucket" in str(words).lower():
        words = f"{words} (NoSuchBucket)"
    raise requests.HTTPError(
        f"HTTP status {response.status_code} {response.reason}: {words}", response=response
    )


def _gcs(location: Location) -> _GcsObject | None:
    """The GCS object ``location`` names, through the endpoint its filesystem uses (None: the
    location is not on GCS)."""
    fs = location.filesystem
    if isinstance(fs, pafs.GcsFileSystem):
        options = fs.__reduce__()[1][0]  # the filesystem's own constructor arguments
        endpoint = options.get("endpoint_override") or GCS_ENDPOINT
        if "://" not in endpoint:
            endpoint = f"{options.get('scheme') or 'https'}://{endpoint}"
    elif isinstance(fs, pafs.PyFileSystem) and type(fs.handler.fs).__name__ == "GCSFileSystem":
        endpoint = str(getattr(fs.handler.fs, "_location", "") or GCS_ENDPOINT)
    else:
        return None
    bucket, _, key = location.path.partition("/")
    return _GcsObject(endpoint.rstrip("/"), bucket, key)


def _gcs_session() -> Any:
    return _gcs_session_for(os.environ.get("GOOGLE_APPLICATION_CREDENTIALS"))


@functools.cache
def _gcs_session_for(credentials_file: str | None) -> Any:
    """A requests session signed with Application Default Credentials (the environment's
    GOOGLE_APPLICATION_CREDENTIALS, gcloud's login, or the VM's service account); anonymous
    when there are none, as gcsfs falls back to."""
    import google.auth
    import requests
    from google.auth.exceptions import DefaultCredentialsError
    from google.auth.transport.requests import AuthorizedSession

    try:
        credentials, _ = google.auth.default(
            scopes=["https://www.googleapis.com/auth/devstorage.read_write"]
        )
    except DefaultCredentialsError:
        return requests.Session()
    return AuthorizedSession(credentials)
