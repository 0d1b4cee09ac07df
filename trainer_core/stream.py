"""Parquet read a row group at a time: a dataset's layout from metadata, and the rows one rank
trains on at each step (issue 15's reader; the loop does not use it yet).

``scan`` reads only footers: the files, their row groups and row counts, and the schema, which
it checks (an empty directory, files whose schemas differ, a missing column, a file that is not
Parquet) before any worker starts. ``Reader`` turns the positions of
``trainer_core.sample_order`` into feature and label arrays, reading each row group it needs
once and keeping at most ``cache_row_groups`` of them decoded: a worker's memory follows those
settings, not the dataset's size.
"""

from __future__ import annotations

import collections
import posixpath
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trainer_core import data as data_mod
from trainer_core import sample_order, storage
from trainer_core.errors import SpecError
from trainer_core.spec import DATASET_FORMATS, DataSection


@dataclass(frozen=True)
class RowGroup:
    """One row group: its file, its index in the file, its rows and the id of its first row
    (row ids count every row of the dataset, files in name order)."""

    file: str
    index: int
    rows: int
    first_row: int


@dataclass(frozen=True)
class Layout:
    """What a dataset holds, from its Parquet footers alone (or, for the generated
    ``synthetic`` set, the table itself, cut into row groups of ``MEMORY_ROW_GROUP`` rows)."""

    uri: str
    location: storage.Location | None
    row_groups: tuple[RowGroup, ...]
    schema: pa.Schema
    table: pa.Table | None = None

    @property
    def num_rows(self) -> int:
        return sum(g.rows for g in self.row_groups)


def columns_of(data: DataSection) -> list[str]:
    features = [data.features] if isinstance(data.features, str) else list(data.features or [])
    return [*features, *([data.label] if data.label else [])]


def scan(data: DataSection) -> Layout:
    """The layout of ``data.dataset`` (resolved), its columns checked: SpecError naming the
    file and the fix for an empty directory, differing schemas, a missing column or a file
    that is not Parquet. Reads footers only."""
    data = data.resolved()
    if data.dataset == "synthetic":
        return _synthetic_layout(data)
    uri = data_mod.digits_uri() if data.dataset == "digits" else data.dataset
    location = storage.resolve(uri)
    row_groups, schema = scan_files(location, columns_of(data), data.label, "data.dataset")
    data_mod.check_column_types(schema, data, location.uri)
    return Layout(location.uri, location, tuple(row_groups), schema)


#: Rows per row group of a dataset relaytrain generates in memory.
MEMORY_ROW_GROUP = 1024


def _synthetic_layout(data: DataSection) -> Layout:
    """The synthetic set as a table (features ``x``, label ``y``), read like Parquet."""
    s = data.synthetic
    arrays = data_mod.synthetic_arrays(s.num_samples, s.num_features, s.noise)
    width = arrays.features.shape[1]
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(arrays.features.reshape(-1)), width),
            "y": pa.array(arrays.labels),
        }
    )
    row_groups = tuple(
        RowGroup("<memory>", i, min(MEMORY_ROW_GROUP, len(arrays) - start), start)
        for i, start in enumerate(range(0, len(arrays), MEMORY_ROW_GROUP))
    )
    return Layout("synthetic", None, row_groups, table.schema, table)


def scan_files(
    location: storage.Location,
    columns: list[str] | None,
    label: str | None,
    field: str,
) -> tuple[list[RowGroup], pa.Schema]:
    """Every file's row groups and the schema of ``columns`` (None: all of them), the same in
    every file; SpecError naming ``field`` and the file otherwise."""
    row_groups: list[RowGroup] = []
    schema: pa.Schema | None = None
    first_file = ""
    for path in _parquet_files(location, field):
        try:
            metadata = pq.read_metadata(location.filesystem.open_input_file(path))
        except (pa.ArrowInvalid, OSError) as e:
            raise SpecError(
                f"{field} {location.uri}: file {path!r} is not Parquet ({str(e).rstrip('.')}). "
                f"Remove it or convert it: relaytrain reads {DATASET_FORMATS}.",
                field=field,
            ) from e
        file_schema = metadata.schema.to_arrow_schema()
        wanted = file_schema.names if columns is None else columns
        missing = [c for c in wanted if c not in file_schema.names]
        if missing:
            named = "data.label" if label in missing else "data.features"
            raise SpecError(
                f"{field} {location.uri}: file {path!r} has no column(s) {missing}, named by "
                f"{named}; it has {file_schema.names}. Fix data.features / data.label.",
                field=named,
            )
        found = pa.schema([file_schema.field(c) for c in wanted])
        if schema is None:
            schema, first_file = found, path
        elif not found.equals(schema):
            raise SpecError(
                f"{field} {location.uri}: files {first_file!r} and {path!r} have different "
                f"schemas for the columns relaytrain reads ({_types(schema)} against "
                f"{_types(found)}). Rewrite them with one schema, or point {field} at files "
                "that share one.",
                field=field,
            )
        first_row = sum(g.rows for g in row_groups)
        for index in range(metadata.num_row_groups):
            rows = metadata.row_group(index).num_rows
            row_groups.append(RowGroup(path, index, rows, first_row))
            first_row += rows
    assert schema is not None
    return row_groups, schema


def _types(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def _parquet_files(location: storage.Location, field: str) -> list[str]:
    """The dataset's files, in name order: the file itself, or every file below a directory
    except hidden ones and markers (``_SUCCESS``, ``.crc``)."""
    info = location.info()
    if info.type == pafs.FileType.NotFound:
        raise SpecError(
            f"{field} {location.uri} does not exist: fix {field} ({DATASET_FORMATS})",
            field=field,
        )
    if info.type == pafs.FileType.File:
        return [location.path]
    selector = pafs.FileSelector(location.path, recursive=True)
    files = sorted(
        f.path
        for f in location.filesystem.get_file_info(selector)
        if f.type == pafs.FileType.File and not posixpath.basename(f.path).startswith(("_", "."))
    )
    if not files:
        raise SpecError(
            f"{field} {location.uri} is an empty directory: no Parquet files below it. Fix "
            f"{field} ({DATASET_FORMATS}).",
            field=field,
        )
    return files


class Reader:
    """Rows of a layout by (row group, training row), for one rank."""

    def __init__(
        self,
        layout: Layout,
        data: DataSection,
        seed: int,
        cache_row_groups: int = 4,
    ):
        self.layout = layout
        self.data = data.resolved()
        self.seed = seed
        self.fraction = self.data.validation_fraction
        self.cache_row_groups = cache_row_groups
        self._decoded: collections.OrderedDict[int, data_mod.Arrays] = collections.OrderedDict()
        self._train_rows: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        self.row_groups_read = 0

    def _row_ids(self, group: int) -> np.ndarray:
        g = self.layout.row_groups[group]
        return np.arange(g.first_row, g.first_row + g.rows, dtype=np.int64)

    def train_rows(self, group: int) -> np.ndarray:
        """Indices within row group ``group`` of its training rows (the last few row groups'
        kept: a batch asks again for the row groups of its window)."""
        found = self._train_rows.get(group)
        if found is None:
            ids = self._row_ids(group)
            found = np.flatnonzero(~sample_order.is_validation(ids, self.seed, self.fraction))
            self._train_rows[group] = found
            while len(self._train_rows) > self.cache_row_groups:
                self._train_rows.popitem(last=False)
        else:
            self._train_rows.move_to_end(group)
        return found

    def validation_rows(self, group: int) -> np.ndarray:
        ids = self._row_ids(group)
        return np.flatnonzero(sample_order.is_validation(ids, self.seed, self.fraction))

    def train_counts(self) -> list[int]:
        """Training rows per row group, from row ids alone (no data read)."""
        return [len(self.train_rows(g)) for g in range(len(self.layout.row_groups))]

    def row_group(self, group: int) -> data_mod.Arrays:
        """Row group ``group`` decoded (every row), from a small most-recently-used cache."""
        found = self._decoded.get(group)
        if found is not None:
            self._decoded.move_to_end(group)
            return found
        g = self.layout.row_groups[group]
        if self.layout.table is not None:
            table = self.layout.table.slice(g.first_row, g.rows)
        else:
            assert self.layout.location is not None
            with self.layout.location.filesystem.open_input_file(g.file) as f:
                table = pq.ParquetFile(f).read_row_group(g.index, columns=columns_of(self.data))
        arrays = data_mod.table_arrays(table, self.data)
        self.row_groups_read += 1
        self._decoded[group] = arrays
        while len(self._decoded) > self.cache_row_groups:
            self._decoded.popitem(last=False)
        return arrays

    def take(
        self, groups: Sequence[int] | np.ndarray, train_index: np.ndarray
    ) -> tuple[np.ndarray, data_mod.Arrays]:
        """The row ids and rows of training rows ``train_index[i]`` of row group ``groups[i]``,
        in that order."""
        groups = np.asarray(groups)
        ids = np.empty(len(groups), dtype=np.int64)
        features: np.ndarray | None = None
        labels: np.ndarray | None = None
        for group in dict.fromkeys(groups.tolist()):  # first-seen order: few row groups a batch
            where = np.flatnonzero(groups == group)
            rows = self.train_rows(group)[train_index[where]]
            part = self.row_group(group).take(rows)
            if features is None or labels is None:
                features = np.empty((len(groups), part.features.shape[1]), np.float32)
                labels = np.empty(len(groups), part.labels.dtype)
            features[where], labels[where] = part.features, part.labels
            ids[where] = self.layout.row_groups[group].first_row + rows
        if features is None or labels is None:
            return ids, data_mod.Arrays(np.zeros((0, 0), np.float32), np.zeros(0, np.float32))
        return ids, data_mod.Arrays(features, labels)


_END = object()


class Prefetcher:
    """One rank's rows for global batches ``first..order.steps-1`` of an epoch, read ahead by a
    background thread: at most ``depth`` batches wait in memory. Iterate for
    ``(batch index, row ids, rows)``; a read error is raised where the batch would have been.
    The reader is the thread's alone while it runs."""

    def __init__(
        self,
        reader: Reader,
        order: sample_order.EpochOrder,
        world_size: int,
        rank: int,
        first: int = 0,
        depth: int = 2,
    ):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._read,
            args=(reader, order, world_size, rank, first),
            name="relaytrain-prefetch",
            daemon=True,
        )
        self._thread.start()

    def _read(
        self,
        reader: Reader,
        order: sample_order.EpochOrder,
        world_size: int,
        rank: int,
        first: int,
    ) -> None:
        try:
            for index in range(first, order.steps):
                groups, rows = order.locate(order.rank_positions(index, world_size, rank))
                if not self._put((index, *reader.take(groups, rows))):
                    return
        except BaseException as error:  # handed to the consumer
            self._put(error)
            return
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, np.ndarray, data_mod.Arrays]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        """Stop reading ahead and let the thread end (also mid-epoch)."""
        self._stop.set()
        self._thread.join(timeout=10)
