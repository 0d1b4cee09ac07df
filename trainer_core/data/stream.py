"""Parquet read a row group at a time: a dataset's layout from metadata, and the rows one rank
trains and validates on (the built-in loop's only data path: the built-in sets too).

``scan`` reads only footers: the files, their row groups and row counts, the label's range and
the schema, which it checks (an empty directory, files whose schemas differ, a missing column,
a file that is not Parquet) before any worker starts. ``Reader`` turns the positions of
``trainer_core.data.sample_order`` into feature and label arrays, reading each row group it needs
once and keeping decoded only the row groups the live shuffle windows span. ``RankStream`` is
one rank's view: its slice of every global batch, read ahead by a background thread, and its
share of the validation rows. A worker's memory follows ``data.partitions``,
``data.shuffle_window`` and the row group size, not the dataset's size.
"""

from __future__ import annotations

import collections
import concurrent.futures
import hashlib
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

from trainer_core import storage
from trainer_core.data import arrays as data_mod
from trainer_core.data import row_slices, sample_order
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DATASET_FORMATS, DataSection


@dataclass(frozen=True)
class RowGroup:
    """One row group: its file, its index in the file, its rows and the id of its first row
    (row ids count every row of the dataset, files in name order)."""

    file: str
    index: int
    rows: int
    first_row: int
    #: The label column's (min, max) from the footer's statistics, when it has them.
    label_range: tuple[float, float] | None = None
    #: Its uncompressed size in the file (the footer's): about its decoded size.
    bytes: int = 0


@dataclass(frozen=True)
class DataFile:
    """One Parquet file as a scan found it: its size, modification time (ns, when the
    filesystem gives one) and a digest of its footer, which names every row group, column
    chunk and their statistics: a file rewritten in place has another."""

    path: str
    size: int
    mtime_ns: int | None
    footer: str


@dataclass(frozen=True)
class Layout:
    """What a dataset holds, from its Parquet footers alone (or, for the generated
    ``synthetic`` set, the table itself, cut into row groups of ``MEMORY_ROW_GROUP`` rows)."""

    uri: str
    location: storage.Location | None
    row_groups: tuple[RowGroup, ...]
    schema: pa.Schema
    table: pa.Table | None = None
    #: The files, in name order (none for a generated set).
    files: tuple[DataFile, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(g.rows for g in self.row_groups)

    def file_size(self, path: str) -> int | None:
        return next((f.size for f in self.files if f.path == path), None)


def columns_of(data: DataSection) -> list[str]:
    features = [data.features] if isinstance(data.features, str) else list(data.features or [])
    return [*features, *([data.label] if data.label else [])]


def row_bytes(layout: Layout) -> float:
    """Decoded bytes of a row, the largest of any row group's (from the footers: Parquet's
    uncompressed size; the in-memory table's own)."""
    if layout.table is not None:
        return layout.table.nbytes / max(layout.table.num_rows, 1)
    return max((g.bytes / g.rows for g in layout.row_groups if g.rows), default=1.0)


def dataset_location(data: DataSection) -> storage.Location:
    """Where ``data.dataset``'s files are (the built-in digits: the file shipped with
    relaytrain)."""
    return storage.resolve(data_mod.digits_uri() if data.dataset == "digits" else data.dataset)


def scan(data: DataSection) -> Layout:
    """The layout of ``data.dataset`` (resolved), its columns checked: SpecError naming the
    file and the fix for an empty directory, differing schemas, a missing column or a file
    that is not Parquet. Reads footers only."""
    data = data.resolved()
    if data.dataset == "synthetic":
        return _synthetic_layout(data)
    location = dataset_location(data)
    row_groups, schema, files = scan_files(location, columns_of(data), data.label, "data.dataset")
    data_mod.check_column_types(schema, data, location.uri)
    return Layout(location.uri, location, tuple(row_groups), schema, files=tuple(files))


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
) -> tuple[list[RowGroup], pa.Schema, list[DataFile]]:
    """Every file's row groups and the schema of ``columns`` (None: all of them), the same in
    every file, and the files; SpecError naming ``field`` and the file otherwise."""
    row_groups: list[RowGroup] = []
    files: list[DataFile] = []
    schema: pa.Schema | None = None
    first_file = ""
    for info in parquet_files(location, field):
        path = info.path
        metadata = read_footer(location, path, field)
        files.append(DataFile(path, info.size, info.mtime_ns, footer_digest(metadata)))
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
            group = metadata.row_group(index)
            row_groups.append(
                RowGroup(
                    path,
                    index,
                    group.num_rows,
                    first_row,
                    _range(group, label),
                    group.total_byte_size,
                )
            )
            first_row += group.num_rows
    assert schema is not None
    return row_groups, schema, files


def read_footer(location: storage.Location, path: str, field: str) -> pq.FileMetaData:
    """A Parquet file's footer; SpecError naming ``field`` and the file when it is not one."""
    try:
        with location.filesystem.open_input_file(path) as f:
            return pq.read_metadata(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise SpecError(
            f"{field} {location.uri}: file {path!r} is not Parquet ({str(e).rstrip('.')}). "
            f"Remove it or convert it: relaytrain reads {DATASET_FORMATS}.",
            field=field,
        ) from e


def footer_digest(metadata: pq.FileMetaData) -> str:
    """sha256 of a footer as Parquet serializes it."""
    out = pa.BufferOutputStream()
    metadata.write_metadata_file(out)
    return hashlib.sha256(out.getvalue().to_pybytes()).hexdigest()


def _range(group: pq.RowGroupMetaData, column: str | None) -> tuple[float, float] | None:
    """(min, max) of ``column`` in a row group, from its statistics (None without them)."""
    for index in range(group.num_columns):
        chunk = group.column(index)
        if chunk.path_in_schema != column:
            continue
        stats = chunk.statistics
        numeric = isinstance(stats.min, int | float) if stats and stats.has_min_max else False
        if stats is None or not numeric or stats.null_count:
            return None  # the label column's type is checked from the schema
        return float(stats.min), float(stats.max)
    return None


def _types(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def parquet_files(location: storage.Location, field: str) -> list[pafs.FileInfo]:
    """The dataset's files, in name order: the file itself, or every file below a directory
    except hidden ones and markers (``_SUCCESS``, ``.crc``)."""
    info = location.info()
    if info.type == pafs.FileType.NotFound:
        raise SpecError(
            f"{field} {location.uri} does not exist: fix {field} ({DATASET_FORMATS})",
            field=field,
        )
    if info.type == pafs.FileType.File:
        return [info]
    selector = pafs.FileSelector(location.path, recursive=True)
    files = sorted(
        (
            f
            for f in location.filesystem.get_file_info(selector)
            if f.type == pafs.FileType.File
            and not posixpath.basename(f.path).startswith(("_", "."))
        ),
        key=lambda f: f.path,
    )
    if not files:
        raise SpecError(
            f"{field} {location.uri} is an empty directory: no Parquet files below it. Fix "
            f"{field} ({DATASET_FORMATS}).",
            field=field,
        )
    return files


class Reader:
    """Rows of a layout by (row group, training row), for one rank.

    Row groups are decoded in slices of ``slice_rows`` rows (``row_slices``: a row group that
    small is one slice, a bigger one is streamed once and spilled slice by slice). Decoded
    slices are kept, most recently used last, while they hold at most ``cache_rows`` rows (the
    newest always stays): size it to the slices the live shuffle windows span (``RankStream``
    does), or a batch re-reads them.
    """

    def __init__(
        self,
        layout: Layout,
        data: DataSection,
        seed: int,
        cache_rows: int = 0,
        slice_rows: int | None = None,
    ):
        self.layout = layout
        self.data = data.resolved()
        self.seed = seed
        self.fraction = self.data.validation_fraction
        self.cache_rows = cache_rows
        largest = max((g.rows for g in layout.row_groups), default=1)
        self.slices = row_slices.SliceStore(
            [g.rows for g in layout.row_groups],
            slice_rows or largest,
            self.read,
            self._stream,
            lambda table: data_mod.table_arrays(table, self.data),
        )
        Key = tuple[int, int]  # (row group, slice)
        self._decoded: collections.OrderedDict[Key, data_mod.Arrays] = collections.OrderedDict()
        self._train_rows: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        #: Slices being read ahead (``prefetch``), by two threads: decoding overlaps use.
        self._pending: dict[Key, concurrent.futures.Future[data_mod.Arrays]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.row_groups_read = 0  # slices decoded, whole row groups or parts

    def _row_ids(self, group: int) -> np.ndarray:
        g = self.layout.row_groups[group]
        return np.arange(g.first_row, g.first_row + g.rows, dtype=np.int64)

    def _is_train(self, group: int) -> np.ndarray:
        """Which rows of ``group`` are training rows (from their ids: no data read)."""
        return ~sample_order.is_validation(self._row_ids(group), self.seed, self.fraction)

    def train_rows(self, group: int) -> np.ndarray:
        """Indices within row group ``group`` of its training rows (kept for the row groups
        that are decoded, and a few more)."""
        found = self._train_rows.get(group)
        if found is None:
            found = np.flatnonzero(self._is_train(group))
            self._train_rows[group] = found
            while len(self._train_rows) > len(self._decoded) + 8:
                self._train_rows.popitem(last=False)
        else:
            self._train_rows.move_to_end(group)
        return found

    def validation_rows(self, group: int) -> np.ndarray:
        return np.flatnonzero(~self._is_train(group))

    def train_counts(self) -> list[int]:
        """Training rows per row group, from row ids alone (no data read)."""
        return [int(self._is_train(g).sum()) for g in range(len(self.layout.row_groups))]

    def _open(self, group: int) -> pa.NativeFile:
        """Row group ``group``'s file, refused when its size is not the snapshot's."""
        g = self.layout.row_groups[group]
        assert self.layout.location is not None
        f = self.layout.location.filesystem.open_input_file(g.file)
        expected = self.layout.file_size(g.file)
        if expected is not None and f.size() != expected:
            size = f.size()
            f.close()
            raise SpecError(
                f"data.dataset {self.layout.uri}: file {g.file!r} changed while the run "
                f"trained on it ({expected} bytes in the run's snapshot, {size} now). Restore "
                "the file, or start a new run.name to train on the dataset as it is now.",
                field="data.dataset",
            )
        return f

    def read(self, group: int) -> data_mod.Arrays:
        """Row group ``group`` decoded whole (every row), bypassing the cache: for row groups
        no larger than a slice."""
        g = self.layout.row_groups[group]
        if self.layout.table is not None:
            table = self.layout.table.slice(g.first_row, g.rows)
        else:
            with self._open(group) as f:
                table = pq.ParquetFile(f).read_row_group(
                    g.index, columns=columns_of(self.data), use_threads=False
                )
        return data_mod.table_arrays(table, self.data)

    def _stream(self, group: int) -> Iterator[pa.RecordBatch]:
        """Row group ``group``'s record batches, about ``STREAM_BATCH_BYTES`` each."""
        g = self.layout.row_groups[group]
        rows = max(64, int(row_slices.STREAM_BATCH_BYTES / row_bytes(self.layout)))
        if self.layout.table is not None:
            yield from self.layout.table.slice(g.first_row, g.rows).to_batches(rows)
            return
        with self._open(group) as f:
            yield from row_slices.stream_row_group(f, g.index, rows, columns_of(self.data))

    def read_labels(self, group: int) -> np.ndarray:
        """Row group ``group``'s label column alone (no feature read)."""
        g = self.layout.row_groups[group]
        assert self.data.label is not None
        if self.layout.table is not None:
            column = self.layout.table.slice(g.first_row, g.rows).column(self.data.label)
        else:
            with self._open(group) as f:
                table = pq.ParquetFile(f).read_row_group(g.index, columns=[self.data.label])
            column = table.column(self.data.label)
        if column.null_count:
            raise SpecError(
                f"data.label column {self.data.label!r} has null values", field="data.label"
            )
        return column.to_numpy(zero_copy_only=False)

    def slice_keys(self, groups: np.ndarray, train_index: np.ndarray) -> list[tuple[int, int]]:
        """The (row group, slice) pairs training rows ``train_index[i]`` of ``groups[i]`` lie
        in, in first-seen order."""
        keys: dict[tuple[int, int], None] = {}
        for group in dict.fromkeys(np.asarray(groups).tolist()):
            rows = self.train_rows(group)[train_index[groups == group]]
            for index in dict.fromkeys(self.slices.slice_of(rows, group).tolist()):
                keys[(group, index)] = None
        return list(keys)

    def prefetch(self, keys: Sequence[tuple[int, int]]) -> None:
        """Start reading the slices ``keys`` (those neither decoded nor on their way) in the
        background. Files only: a table in memory is sliced when asked."""
        if self.layout.table is not None:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(2, "relaytrain-read")
        for key in keys:
            if key not in self._decoded and key not in self._pending:
                self._pending[key] = self._pool.submit(self.slices.read, *key)

    def close(self) -> None:
        """Drop what is being read ahead and stop the reading threads."""
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def slice(self, group: int, index: int) -> data_mod.Arrays:
        """Slice ``index`` of row group ``group`` decoded (every row), through the cache."""
        key = (group, index)
        found = self._decoded.get(key)
        if found is not None:
            self._decoded.move_to_end(key)
            return found
        pending = self._pending.pop(key, None)
        arrays = pending.result() if pending is not None else self.slices.read(group, index)
        self.row_groups_read += 1
        self._decoded[key] = arrays
        held = sum(len(a) for a in self._decoded.values())
        while len(self._decoded) > 1 and held > self.cache_rows:
            held -= len(self._decoded.popitem(last=False)[1])
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
            in_group = np.flatnonzero(groups == group)
            rows = self.train_rows(group)[train_index[in_group]]
            ids[in_group] = self.layout.row_groups[group].first_row + rows
            slices = self.slices.slice_of(rows, group)
            for index in dict.fromkeys(slices.tolist()):
                where = in_group[slices == index]
                within = rows[slices == index] - self.slices.start(group, index)
                part = self.slice(group, index).take(within)
                if features is None or labels is None:
                    features = np.empty((len(groups), part.features.shape[1]), np.float32)
                    labels = np.empty(len(groups), part.labels.dtype)
                features[where], labels[where] = part.features, part.labels
        if features is None or labels is None:
            return ids, data_mod.Arrays(np.zeros((0, 0), np.float32), np.zeros(0, np.float32))
        return ids, data_mod.Arrays(features, labels)

    def validation_parts(self, group: int) -> Iterator[data_mod.Arrays]:
        """Row group ``group``'s validation rows, a slice at a time (not cached: the training
        windows keep theirs)."""
        rows = self.validation_rows(group)
        if not len(rows):
            return
        slices = self.slices.slice_of(rows, group)
        for index in dict.fromkeys(slices.tolist()):
            within = rows[slices == index] - self.slices.start(group, index)
            yield self.slices.read(group, index).take(within)


def describe(layout: Layout, data: DataSection) -> data_mod.DatasetInfo:
    """Rows, features and outputs of a dataset: from its schema and footers, reading at most
    the first row group (for the width of a variable-length feature list) and, for a
    classification label without statistics, the label column."""
    data = data.resolved()
    assert data.features is not None and data.label is not None
    if layout.num_rows == 0:
        raise SpecError(f"dataset {layout.uri} has no rows: fix data.dataset", field="data.dataset")
    reader = Reader(layout, data, seed=0)
    if isinstance(data.features, str):
        kind = layout.schema.field(data.features).type
        if pa.types.is_fixed_size_list(kind):
            width = kind.list_size
        elif pa.types.is_list(kind):
            first = next(i for i, g in enumerate(layout.row_groups) if g.rows)
            with reader._open(first) as f:
                batch = next(
                    row_slices.stream_row_group(
                        f, layout.row_groups[first].index, 1, columns_of(data)
                    )
                )
            width = data_mod.table_arrays(pa.Table.from_batches([batch]), data).features.shape[1]
        else:
            width = 1
    else:
        width = len(data.features)
    outputs = 1
    if data.task == "classification":
        ranges = [g.label_range for g in layout.row_groups if g.rows]
        if layout.table is None and all(r is not None for r in ranges):
            low = min(r[0] for r in ranges if r is not None)
            high = max(r[1] for r in ranges if r is not None)
        else:  # the label column alone, one row group at a time
            labels = [reader.read_labels(i) for i, g in enumerate(layout.row_groups) if g.rows]
            low, high = min(int(x.min()) for x in labels), max(int(x.max()) for x in labels)
        if low < 0:
            raise SpecError(
                f"data.label column {data.label!r} of {layout.uri} has negative classes "
                f"(down to {int(low)}): classes must be 0..K-1. Fix data.label.",
                field="data.label",
            )
        outputs = int(high) + 1
    return data_mod.DatasetInfo(layout.num_rows, int(width), outputs)


class RankStream:
    """What rank ``rank`` of ``world_size`` trains and validates on: its slice of each global
    batch of ``data.batch_size`` samples, in the order of ``trainer_core.data.sample_order``, and
    the validation rows of every ``world_size``-th row group from ``rank`` on."""

    def __init__(self, layout: Layout, data: DataSection, seed: int, world_size: int, rank: int):
        self.data = data.resolved()
        self.seed, self.world_size, self.rank = seed, world_size, rank
        self.reader = Reader(layout, self.data, seed)
        self.train_counts = self.reader.train_counts()
        # Every partition this rank reads has a window live, spanning its rows and, at most,
        # a slice beyond each end; slices are sized so that stays under data.memory_mb.
        largest = max(g.rows for g in layout.row_groups)
        partitions = len(self.order(0).partitions_of(world_size, rank))
        slice_rows = row_slices.slice_rows_for(
            self.data.memory_mb, row_bytes(layout), partitions, self.data.shuffle_window, largest
        )
        self.reader.slices.slice_rows = slice_rows
        self.reader.cache_rows = partitions * (self.data.shuffle_window + 2 * slice_rows)
        self.train_rows = sum(self.train_counts)
        #: Global batches in every epoch (the last ``train_rows % batch_size`` positions of an
        #: epoch's stream are left out; each epoch leaves out others).
        self.batches_per_epoch = self.train_rows // self.data.batch_size
        self.slice = sample_order.rank_slice(self.data.batch_size, world_size, rank)
        #: This rank's mean loss times this: DDP's average is then the global batch's mean.
        self.weight = sample_order.rank_weight(self.data.batch_size, world_size, rank)

    def order(self, epoch: int) -> sample_order.EpochOrder:
        return sample_order.epoch_order(
            self.train_counts,
            seed=self.seed,
            epoch=epoch,
            batch_size=self.data.batch_size,
            partitions=self.data.partitions,
            window=self.data.shuffle_window,
        )

    def epoch(self, epoch: int, first: int = 0) -> Prefetcher:
        """Global batches ``first..`` of ``epoch``, this rank's slice of each, read ahead."""
        return Prefetcher(
            self.reader,
            self.order(epoch),
            self.world_size,
            self.rank,
            first=first,
            depth=self.data.prefetch,
        )

    def validation(self, chunk: int = 256) -> Iterator[data_mod.Arrays]:
        """This rank's validation rows in chunks of at most ``chunk``, a row group at a time
        (not cached: the training windows keep theirs)."""
        groups = self.reader.layout.row_groups
        for group in range(self.rank, len(groups), self.world_size):
            for arrays in self.reader.validation_parts(group):
                for start in range(0, len(arrays), chunk):
                    yield arrays.take(np.arange(start, min(start + chunk, len(arrays))))


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
        self._reader = reader
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
        partitions = order.partitions_of(world_size, rank)
        asked: set[tuple[int, int]] = set()
        try:
            for index in range(first, order.steps):
                # The row groups of each partition's current and next window, read ahead.
                for partition in partitions:
                    window = index * int(order.shares[partition]) // order.window
                    for ahead in (window, window + 1):
                        if (partition, ahead) not in asked:
                            asked.add((partition, ahead))
                            reader.prefetch(reader.slice_keys(*order.window_rows(partition, ahead)))
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
        self._reader.close()
