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
"""

from __future__ import annotations

import threading
from typing import Any

import pyarrow.fs as pafs

from trainer_core import storage


def for_ray(uri: str, filesystem: pafs.FileSystem) -> pafs.FileSystem:
    """``filesystem`` (``uri``'s) as ``RunConfig(storage_filesystem=...)`` should carry it."""
    if isinstance(filesystem, pafs.LocalFileSystem | pafs.S3FileSystem):
        return filesystem
    return pafs.PyFileSystem(LazyHandler(uri))


class LazyHandler(pafs.FileSystemHandler):
    """Every call goes to ``storage.resolve(uri).filesystem``, built at the first call in each
    process. Pickles as the URI alone."""

    def __init__(self, uri: str):
        self.uri = uri
        self._filesystem: pafs.FileSystem | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"uri": self.uri}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["uri"])  # type: ignore[misc]

    @property
    def filesystem(self) -> pafs.FileSystem:
        with self._lock:
            if self._filesystem is None:
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
