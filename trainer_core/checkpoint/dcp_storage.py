"""torch.distributed.checkpoint (DCP) through the run's own storage.

DCP writes and reads through a small file-system interface (``FileSystemBase``); its
``FileSystemWriter`` and ``FileSystemReader`` do the planning, the sharding and the resharding.
``RunStorage`` is that interface on one checkpoint directory of the run, in the run's filesystem
(pyarrow.fs: a local path, S3, GCS, fsspec), so a DCP checkpoint is committed like every other:

- every file DCP writes is hashed as it is written (no read-back) and becomes a manifest entry;
- each file is published atomically: on a local disk DCP writes straight into a temporary
  sibling, renamed when complete; on an object store it is one PUT
  (``storage.Location.write_stream``: spooled to memory, then to a local temporary file past
  ``SPOOL_BYTES``, so a retried upload starts again from the start);
- every file DCP reads is read whole once and checked against the manifest before DCP seeks in
  it, so a damaged shard is a ``CheckpointCorruptError`` and the older checkpoint is used;
- given the node's group (``load(node=...)``), a file that several ranks of a node need (the
  one holding what DCP saved once for all, rank 0's) is read once there, by one of them, and
  handed to the others;
- nothing read is unpickled beyond what DCP's metadata and plain tensor data hold
  (``dcp_metadata``): a planted ``.metadata`` or item is refused, never run.
"""

from __future__ import annotations

import contextlib
import io
import os
import posixpath
import shutil
import tempfile
import threading
import uuid
from collections.abc import Generator
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import (
    DefaultLoadPlanner,
    _EmptyStateDictLoadPlanner,
)
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from trainer_core.checkpoint import dcp_metadata
from trainer_core.checkpoint.files import FileEntry, HashingWriter, matches
from trainer_core.errors import CheckpointCorruptError
from trainer_core.storage.failures import storage_error
from trainer_core.storage.locations import Location

#: What a file being written to an object store is held in memory before it spills to disk.
SPOOL_BYTES = 64 * 1024 * 1024


class _OffsetWriter(HashingWriter):
    """A hashing stream that says how much it has written (DCP records each item's offset)."""

    def tell(self) -> int:
        return self.size


class RunStorage(FileSystemBase):
    """DCP's file system on checkpoint directory ``location``; ``expected`` is the manifest's
    ``files`` (for reading: every file is verified against it)."""

    def __init__(self, location: Location, expected: dict[str, dict[str, Any]] | None = None):
        self.location = location
        self.expected = expected
        #: The files written through this object, by name, as manifest entries.
        self.written: dict[str, FileEntry] = {}
        #: Bytes read from storage through this object.
        self.bytes_read = 0
        #: Files read for this rank by its node's first rank (or why they could not be).
        self.handed: dict[str, bytes | CheckpointCorruptError] = {}
        self._lock = threading.Lock()

    # -- paths: DCP joins names onto the directory it was given --------------------------------

    def init_path(self, path: str | os.PathLike) -> str:
        return ""

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return posix_join(os.fspath(path), suffix)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return False  # never chosen by DCP on its own: relaytrain passes it

    def mkdir(self, path: str | os.PathLike) -> None:
        pass  # object stores have no directories; a local one is made by the first write

    def exists(self, path: str | os.PathLike) -> bool:
        return self._child(path).exists()

    def rm_file(self, path: str | os.PathLike) -> None:
        self._child(path).delete_file()
        with self._lock:
            self.written.pop(os.fspath(path), None)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        """DCP writes ``.metadata`` under a temporary name, then renames it: the entry follows."""
        source, target = self._child(path), self._child(new_path)
        source.filesystem.move(source.path, target.path)
        with self._lock:
            entry = self.written.pop(os.fspath(path), None)
            if entry is not None:
                name = os.fspath(new_path)
                self.written[name] = FileEntry(name, entry.size, entry.xxh3_128)

    # -- streams -------------------------------------------------------------------------------

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Generator[io.IOBase, None, None]:
        name = os.fspath(path)
        if "r" in mode:
            handed = self.handed.pop(name, None)
            if isinstance(handed, CheckpointCorruptError):
                raise handed
            yield io.BytesIO(handed if handed is not None else self._read_verified(name))
            return
        if self.location.is_local:
            with self._local_stream(name) as writer:
                yield writer
            return
        with tempfile.SpooledTemporaryFile(SPOOL_BYTES) as spool:
            writer = _OffsetWriter(spool)
            yield writer  # type: ignore[misc]
            entry = writer.entry(name)

            def upload(stream: Any) -> None:
                spool.seek(0)
                shutil.copyfileobj(spool, stream, 8 * 1024 * 1024)

            self._child(name).write_stream(upload)
        with self._lock:
            self.written[name] = entry

    @contextlib.contextmanager
    def _local_stream(self, name: str) -> Generator[io.IOBase, None, None]:
        """A local file: written into a temporary sibling, renamed over ``name`` when whole."""
        target = self._child(name)
        parent, base = posixpath.split(target.path)
        temporary = posixpath.join(parent, f".{base}.{uuid.uuid4().hex}")
        fs = target.filesystem
        fs.create_dir(parent, recursive=True)
        try:
            with fs.open_output_stream(temporary) as f:
                writer = _OffsetWriter(f)
                yield writer  # type: ignore[misc]
            fs.move(temporary, target.path)
        except BaseException:
            with contextlib.suppress(Exception):
                fs.delete_file(temporary)
            raise
        with self._lock:
            self.written[name] = writer.entry(name)

    def share_on_node(self, names: list[str], node: tuple[Any, int]) -> None:
        """Every file that ``names`` (this rank's) and the node's other ranks' lists name is read
        once on the node, by one of the ranks that need it (the largest files first, each to
        the rank with the fewest bytes yet, so the ranks read in parallel), and handed to the
        others that need it. A collective on the node's group."""
        group, _ = node
        ranks = dist.get_process_group_ranks(group)
        wanted: list[Any] = [None] * len(ranks)
        dist.all_gather_object(wanted, sorted(names), group=group)
        needs = {name: [r for r, w in zip(ranks, wanted, strict=True) if name in w] for name in
                 {n for w in wanted for n in w}}  # fmt: skip
        size = {name: int((self.expected or {}).get(name, {}).get("size", 0)) for name in needs}
        load = dict.fromkeys(ranks, 0)
        reader = {}
        for name in sorted(needs, key=lambda n: (-size[n], n)):
            reader[name] = min(needs[name], key=lambda r: (load[r], r))
            load[reader[name]] += size[name]
        me = dist.get_rank()
        read: dict[str, bytes | str] = {}
        for name in sorted(n for n, r in reader.items() if r == me):
            try:
                read[name] = self._read_verified(name)
            except CheckpointCorruptError as e:
                read[name] = str(e)
        for name in sorted(needs):
            said: list[Any] = [read.get(name)]
            if len(needs[name]) > 1:
                dist.broadcast_object_list(said, src=reader[name], group=group)
            if me in needs[name]:
                value = said[0]
                self.handed[name] = (
                    value if isinstance(value, bytes) else CheckpointCorruptError(value)
                )

    def _read_verified(self, name: str) -> bytes:
        try:
            data = self._child(name).read_bytes()
        except FileNotFoundError as e:
            raise CheckpointCorruptError(f"{self.location.uri}: {name} is gone") from e
        with self._lock:
            self.bytes_read += len(data)
        if self.expected is not None:
            entry = self.expected.get(name)
            if entry is None or not matches(entry, data):
                raise CheckpointCorruptError(
                    f"{self.location.uri}: {name} does not match its manifest ({len(data)} bytes)"
                )
        return data

    def _child(self, path: str | os.PathLike) -> Location:
        return self.location.child(os.fspath(path))


# -- a DCP checkpoint in a checkpoint directory --------------------------------------------------


def save(state: dict[str, Any], location: Location, group: Any = None) -> list[FileEntry]:
    """Write ``state`` (DTensors: each rank its own shards) as a DCP checkpoint into checkpoint
    directory ``location``: a collective on ``group``. Returns this rank's files as manifest
    entries (DCP's coordinator, rank 0, writes ``.metadata`` too). A failure on any rank is
    raised on every rank, as the first failing rank's own error."""
    fs = RunStorage(location)
    writer = FileSystemWriter(location.uri, sync_files=False)
    writer.fs, writer.path = fs, ""  # type: ignore[assignment]  # DCP's file system, ours
    try:
        dcp.save(state, storage_writer=writer, process_group=group)
    except CheckpointException as e:  # a BaseException: raise what the rank raised
        cause = _cause(e)
        raise (storage_error(location.uri, "write", cause) or cause) from e
    return list(fs.written.values())


def load(
    state: dict[str, Any],
    location: Location,
    files: dict[str, dict[str, Any]],
    node: tuple[Any, int] | None = None,
) -> int:
    """Fill ``state`` in place from the DCP checkpoint in ``location``, resharded to the
    layout of ``state``'s tensors; every file is verified against the manifest's ``files``. A
    collective on the default group: a damaged or missing file is a ``CheckpointCorruptError``
    on every rank. ``node`` (this node's group, and its first rank): files are read once per
    node. Returns the bytes this rank read: each file it (or its node) needs a part of, whole
    (its digest covers the whole file)."""
    reader = _reader(location, files, node)
    try:
        dcp.load(state, storage_reader=reader, planner=_ItemsAsData(location))
    except CheckpointException as e:
        raise CheckpointCorruptError(f"DCP cannot load {location.uri}: {_cause(e)}") from e
    return reader.fs.bytes_read  # type: ignore[attr-defined]


def read_key(location: Location, files: dict[str, dict[str, Any]], key: str) -> Any:
    """Top-level entry ``key`` (``model``) of the DCP checkpoint in ``location``, whole, read by
    this process alone (DCP's ``dcp_to_torch_save``, in memory, for one key)."""
    state: dict[str, Any] = {}
    try:
        _load_state_dict(
            state,
            storage_reader=_reader(location, files),
            planner=_WholeItemsAsData(location, keys={key}),
            no_dist=True,
        )
    except CheckpointException as e:
        raise CheckpointCorruptError(f"DCP cannot read {location.uri}: {_cause(e)}") from e
    return state[key]


class _Reader(FileSystemReader):
    """DCP's reader on the run's storage; with ``node``, the files this rank's plan reads are
    read once per node (``RunStorage.share_on_node``) before DCP reads them."""

    def __init__(self, location: Location, files: dict[str, Any], node: Any = None):
        super().__init__(location.uri)
        self.fs, self.path = RunStorage(location, files), ""  # type: ignore[assignment]
        self.node = node

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP's metadata, verified against the manifest and read as data
        (``dcp_metadata.read_metadata``), never with ``pickle.load``."""
        name = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(name, "rb") as stream:
            data = stream.read()
        where = f"{self.fs.location.uri}/{os.fspath(name)}"  # type: ignore[attr-defined]
        metadata = dcp_metadata.read_metadata(data, where)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        if self.node is not None:
            names = {self.storage_data[item.storage_index].relative_path for item in plan.items}
            self.fs.share_on_node(sorted(names), self.node)  # type: ignore[attr-defined]
        return super().read_data(plan, planner)


class _ItemsAsData(DefaultLoadPlanner):
    """DCP's default load planner, but a non-tensor item (DCP reads those with
    ``torch.load(..., weights_only=False)``) is read as plain tensor data only."""

    def __init__(self, location: Location, **kwargs: Any):
        super().__init__(**kwargs)
        self.location = location

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        item = dcp_metadata.read_item(value, f"{self.location.uri}: item {fqn!r}")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], item)
        else:
            self.state_dict[fqn] = item


class _WholeItemsAsData(_ItemsAsData, _EmptyStateDictLoadPlanner):
    """The planner that rebuilds whole entries from the metadata (``read_key``), its
    non-tensor items read as data."""


def _reader(
    location: Location, files: dict[str, dict[str, Any]], node: Any = None
) -> FileSystemReader:
    return _Reader(location, files, node)


def _cause(error: CheckpointException) -> Exception:
    """The error a rank raised inside DCP (the first rank's), or the whole report."""
    for failure, _ in error.failures.values():
        if isinstance(failure, Exception):
            return failure
    return RuntimeError(str(error))


def posix_join(base: str, name: str) -> str:
    return f"{base}/{name}" if base else name
