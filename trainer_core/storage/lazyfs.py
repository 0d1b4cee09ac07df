"""A filesystem that Ray Train can carry to its controller and workers before relaytrain has set
the storage credentials there.

Ray Train unpickles ``RunConfig(storage_filesystem=...)`` in its controller and in every worker
as their arguments arrive, before any code of relaytrain's runs in that process (the controller
constructor and the train loop set the credentials first thing, ``controller.apply_credentials``).
Some clients read their credentials when they are built: google-cloud-cpp's (``gs://``) and
gcsfs's. Built at unpickling, they have none, and the controller's first storage call retries
for minutes. ``for_ray`` wraps such a filesystem in a ``PyFileSystem`` whose handler pickles as
the storage URI and builds the real filesystem (``storage.resolve``) at its first call.

Local paths and ``s3://`` pass through unwrapped: the local filesystem needs no credentials, and
the AWS SDK reads them at each request (Ray also special-cases ``S3FileSystem`` for uploads).

``for_tasks`` is for processes relaytrain's code never runs in first, such as Ray Data's read
tasks: its handler also carries a ``prepare`` step (setting the credentials) that runs before
the filesystem is built, for every store but the local one.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pyarrow.fs as pafs

from trainer_core import storage


def for_ray(uri: str, filesystem: pafs.FileSystem) -> pafs.FileSystem:
    """``filesystem`` (``uri``'s) as ``RunConfig(storage_filesystem=...)`` should carry it."""
    if isinstance(filesystem, pafs.LocalFileSystem | pafs.S3FileSystem):
        return filesystem
    return pafs.PyFileSystem(LazyHandler(uri))


def for_tasks(
    uri: str, filesystem: pafs.FileSystem, prepare: Callable[[], None]
) -> pafs.FileSystem:
    """``filesystem`` (``uri``'s) for any Ray process: built there at its first call, after
    ``prepare`` (which must pickle) has run; the local filesystem as it is."""
    if isinstance(filesystem, pafs.LocalFileSystem):
        return filesystem
    return pafs.PyFileSystem(LazyHandler(uri, prepare))


class LazyHandler(pafs.FileSystemHandler):
    """Every call goes to ``storage.resolve(uri).filesystem``, built at the first call in each
    process (after ``prepare``). Pickles as the URI and ``prepare``."""

    def __init__(self, uri: str, prepare: Callable[[], None] | None = None):
        self.uri = uri
        self.prepare = prepare
        self._filesystem: pafs.FileSystem | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri, "prepare": self.prepare}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["uri"], state.get("prepare"))  # type: ignore[misc]

    @property
    def filesystem(self) -> pafs.FileSystem:
        with self._lock:
            if self._filesystem is None:
                if self.prepare is not None:
                    self.prepare()
                self._filesystem = storage.resolve(self.uri).filesystem
            return self._filesystem

    def get_type_name(self) -> str:
        return "relaytrain-lazy"

    def equals(self, other: Any) -> bool:
        handler = other.handler if isinstance(other, pafs.PyFileSystem) else other
        return isinstance(handler, LazyHandler) and handler.uri == self.uri

    def normalize_path(self, path: str) -> str:
        return str(self.filesystem.normalize_path(path))

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return list(self.filesystem.get_file_info(paths))

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return list(self.filesystem.get_file_info(selector))

    def create_dir(self, path: str, recursive: bool) -> None:
        self.filesystem.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.filesystem.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.filesystem.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.filesystem.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.filesystem.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.filesystem.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.filesystem.copy_file(src, dest)

    def open_input_stream(self, path: str) -> Any:
        return self.filesystem.open_input_stream(path)

    def open_input_file(self, path: str) -> Any:
        return self.filesystem.open_input_file(path)

    def open_output_stream(self, path: str, metadata: Any) -> Any:
        return self.filesystem.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any) -> Any:
        return self.filesystem.open_append_stream(path, metadata=metadata)
