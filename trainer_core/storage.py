"""Storage: URI -> pyarrow filesystem + path. The only place in relaytrain that parses URIs.

Supported:
- local paths and ``file://`` URIs (made absolute: Ray workers do not share the driver's cwd);
- ``s3://bucket/prefix`` (query options such as ``endpoint_override``, ``region``, ``scheme``
  go to pyarrow's S3FileSystem; credentials come from the environment), ``gs://``, ``hdfs://``;
- ``fsspec+<protocol>://...`` to force the fsspec implementation of a protocol (e.g. s3fs),
  query options passed to ``fsspec.filesystem``; and any protocol pyarrow does not know natively
  (``memory://``, ``gcs://``, ``abfs://``, ...) through ``PyFileSystem(FSSpecHandler(...))``.

Remote locations stay ``str`` paths joined with ``posixpath`` (never ``pathlib``/``os.path``).
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import pyarrow.fs as pafs

from trainer_core.errors import SpecError, StorageError, StorageUnavailableError

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


@dataclass(frozen=True)
class Location:
    """A place in storage: a pyarrow filesystem and a path inside it, plus a display URI."""

    filesystem: pafs.FileSystem
    path: str
    uri: str

    def child(self, *parts: str) -> Location:
        """The location ``parts`` below this one (posix join: safe for object stores)."""
        for part in parts:
            if part in ("", ".", "..") or part.startswith("/"):
                raise ValueError(f"unsafe path component {part!r}")
        return Location(
            self.filesystem,
            posixpath.join(self.path, *parts),
            posixpath.join(self.uri.split("?", 1)[0], *parts),
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
        """Write ``data`` so readers see either the old content or the new, never a part.

        Object stores publish a PUT atomically; on a local disk we write a temporary sibling
        and rename it over the target.
        """
        parent = posixpath.dirname(self.path)
        target = self.path
        if self.is_local:
            target = posixpath.join(parent, f".{posixpath.basename(self.path)}.{uuid.uuid4().hex}")

        def write() -> None:
            self.filesystem.create_dir(parent, recursive=True)
            with self.filesystem.open_output_stream(target) as f:
                f.write(data)
            if target != self.path:
                self.filesystem.move(target, self.path)

        _call(self, "write", write)

    def write_json(self, value: Any) -> None:
        self.write_bytes(json.dumps(value, indent=2, sort_keys=True).encode() + b"\n")

    def delete_file(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            _call(self, "delete", lambda: self.filesystem.delete_file(self.path))

    def delete_dir(self) -> None:
        if self.exists():
            _call(self, "delete", lambda: self.filesystem.delete_dir(self.path))


def _call(location: Location, verb: str, fn: Any) -> Any:
    try:
        return fn()
    except FileNotFoundError:
        raise
    except PermissionError as e:
        raise StorageError(
            f"permission denied to {verb} {location.uri}: grant write access or choose another "
            f"run.storage ({e})"
        ) from e
    except OSError as e:
        raise StorageUnavailableError(f"could not {verb} {location.uri}: {e}") from e


def _parse_query(query: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    for key, value in parse_qsl(query, keep_blank_values=True):
        if key.lower() in CREDENTIAL_KEYS:
            raise SpecError(
                f"the storage URI carries a credential ({key}=...): never put secrets in a URI; "
                "set AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (or the provider's variables) in "
                "the environment or use a Prefect credentials block",
                field="run.storage",
            )
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


def resolve(uri: str) -> Location:
    """Turn a path or URI into a Location. Raises SpecError for what cannot be a location."""
    if not uri or not uri.strip():
        raise SpecError("storage location is empty: give a path or URI", field="run.storage")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        local = parts.path if scheme == "file" else uri
        path = os.path.abspath(os.path.expanduser(local))
        return Location(pafs.LocalFileSystem(), path, path)
    display = f"{scheme}://{parts.netloc}{parts.path}".rstrip("/")
    options = _parse_query(parts.query)
    if scheme in PYARROW_SCHEMES:
        try:
            filesystem, path = pafs.FileSystem.from_uri(uri)
        except (ValueError, OSError) as e:
            raise SpecError(
                f"storage URI {display!r} could not be opened with pyarrow: {e}",
                field="run.storage",
            ) from e
        return Location(filesystem, path.rstrip("/"), display)
    protocol = scheme.removeprefix("fsspec+")
    return _fsspec_location(protocol, parts.netloc + parts.path, options, display)


def _fsspec_location(protocol: str, path: str, options: dict[str, Any], display: str) -> Location:
    import fsspec

    if protocol == "s3" and "endpoint_override" in options:
        endpoint = options.pop("endpoint_override")
        if "://" not in str(endpoint):
            endpoint = f"{options.pop('scheme', 'https')}://{endpoint}"
        options["endpoint_url"] = endpoint
    try:
        fs = fsspec.filesystem(protocol, **options)
    except (ValueError, ImportError) as e:
        raise SpecError(
            f"storage protocol {protocol!r} of {display!r} is not available: {e} "
            "(install the fsspec implementation for it, or use a local path, s3://, gs://)",
            field="run.storage",
        ) from e
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
        Location(location.filesystem, posixpath.dirname(path), posixpath.dirname(uri)),
        posixpath.basename(path),
    )


def probe_writable(location: Location) -> None:
    """Prove ``location`` is writable: create it, write, read back and delete a probe file."""
    probe = location.child(f".relaytrain-probe-{uuid.uuid4().hex}")
    payload = uuid.uuid4().bytes
    try:
        location.ensure_dir()
        probe.write_bytes(payload)
        if probe.read_bytes() != payload:
            raise StorageError(f"storage at {location.uri} returned other bytes than written")
        probe.delete_file()
    except StorageError as e:
        raise StorageError(
            f"run storage {location.uri} is not writable: {e}. Fix run.storage, the credentials "
            "in the environment, or the permissions of that location."
        ) from e
    except FileNotFoundError as e:
        raise StorageError(f"run storage {location.uri} could not be created: {e}") from e


def walk_files(location: Location) -> Iterator[pafs.FileInfo]:
    """Every file below ``location`` (recursive)."""
    selector = pafs.FileSelector(location.path, allow_not_found=True, recursive=True)
    for info in _call(location, "list", lambda: location.filesystem.get_file_info(selector)):
        if info.type == pafs.FileType.File:
            yield info
