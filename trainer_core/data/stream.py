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
import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core.data import arrays as data_mod
from trainer_core.data import damage, row_slices, sample_order, table_rows
from trainer_core.data.footers import Layout, columns_of, row_bytes
from trainer_core.data.table_rows import Rows
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection


class RowGroupFiles:
    """A layout's row groups read from its files (or its in-memory table) as the rows a form
    reads: what ``Reader`` and its ``row_slices.SliceStore`` both call. Apart from the reader,
    so the slice store holds no reference back to it, and a reader let go frees its decoded
    rows at once, not when the cycle collector runs."""

    def __init__(self, layout: Layout, data: DataSection):
        self.layout = layout
        self.data = data
        #: The tabular form's feature and label arrays, or the columns form's Arrow table.
        self.rows_type = table_rows.rows_type(data)
        #: Each file's footer, once read (the reading threads share it; a race reads it twice).
        self._footers: dict[str, pq.FileMetaData] = {}

    def open(self, group: int) -> pa.NativeFile:
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

    def decoding(self, group: int) -> contextlib.AbstractContextManager[None]:
        """Around decoding row group ``group``: damaged bytes found in it are named
        (``damage``: not retried), a storage failure goes on as it was."""
        g = self.layout.row_groups[group]
        return damage.named(self.layout.uri, g.file, g.index, g.first_row, g.rows)

    def to_rows(self, table: pa.Table) -> Rows:
        """A table of the dataset's columns as the rows this form reads."""
        if self.rows_type is table_rows.TableRows:
            return table_rows.TableRows.from_table(table, self.data)
        return data_mod.table_arrays(table, self.data)

    def read(self, group: int) -> Rows:
        """Row group ``group`` decoded whole (every row), bypassing the cache: for row groups
        no larger than a slice."""
        g = self.layout.row_groups[group]
        if self.layout.table is not None:
            table = self.layout.table.slice(g.first_row, g.rows)
        else:
            with self.open(group) as f, self.decoding(group):
                table = self.parquet(f, g.file).read_row_group(
                    g.index, columns=columns_of(self.data), use_threads=False
                )
            row_slices.release_freed()  # the column chunk and pages it was decoded from
        return self.to_rows(table)

    def parquet(self, f: pa.NativeFile, name: str) -> pq.ParquetFile:
        """``f`` as a Parquet file, its footer read once per file and kept (a row group read
        from object storage is then its column chunks' ranges alone, fetched coalesced)."""
        assert self.layout.location is not None
        remote = not self.layout.location.is_local
        parquet = pq.ParquetFile(
            f,
            metadata=self._footers.get(name),
            pre_buffer=remote,
            page_checksum_verification=True,
        )
        self._footers.setdefault(name, parquet.metadata)
        return parquet

    def stream(self, group: int) -> Iterator[pa.RecordBatch]:
        """Row group ``group``'s record batches, about ``STREAM_BATCH_BYTES`` each."""
        g = self.layout.row_groups[group]
        rows = max(64, int(row_slices.STREAM_BATCH_BYTES / row_bytes(self.layout)))
        if self.layout.table is not None:
            yield from self.layout.table.slice(g.first_row, g.rows).to_batches(rows)
            return
        with self.open(group) as f, self.decoding(group):
            yield from row_slices.stream_row_group(f, g.index, rows, columns_of(self.data))

    def read_labels(self, group: int) -> np.ndarray:
        """Row group ``group``'s label column alone (no feature read)."""
        g = self.layout.row_groups[group]
        assert self.data.label is not None
        if self.layout.table is not None:
            column = self.layout.table.slice(g.first_row, g.rows).column(self.data.label)
        else:
            with self.open(group) as f, self.decoding(group):
                table = pq.ParquetFile(f, page_checksum_verification=True).read_row_group(
                    g.index, columns=[self.data.label]
                )
            column = table.column(self.data.label)
        if column.null_count:
            raise SpecError(
                f"data.label column {self.data.label!r} has null values", field="data.label"
            )
        return column.to_numpy(zero_copy_only=False)


class Reader:
    """Rows of a layout by (row group, training row), for one rank.

    Row groups are decoded in slices of ``slice_rows`` rows (``row_slices``: a row group that
    small is one slice, a bigger one is streamed once and spilled slice by slice). Decoded
    slices are kept, most recently used last, while they and the rows a reader's user holds
    decoded beside them (``outside_rows``: ``read_ahead.Windows``' gathered windows) hold at
    most ``cache_rows`` rows (the newest always stays): size it to the slices the live shuffle
    windows span (``RankStream`` does), or a batch re-reads them. Slices no planned window
    still needs (``wanted``, when a plan keeps it) go first.
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
        self.fraction = self.data.split_fraction
        self.cache_rows = cache_rows
        largest = max((g.rows for g in layout.row_groups), default=1)
        self.files = RowGroupFiles(layout, self.data)
        self.rows_type = self.files.rows_type
        self.slices = row_slices.SliceStore(
            [g.rows for g in layout.row_groups],
            slice_rows or largest,
            self.files.read,
            self.files.stream,
            self.files.to_rows,
            self.rows_type,
        )
        Key = tuple[int, int]  # (row group, slice)
        self._decoded: collections.OrderedDict[Key, Rows] = collections.OrderedDict()
        self._train_rows: collections.OrderedDict[int, np.ndarray] = collections.OrderedDict()
        #: Slices being read ahead (``prefetch``), by two threads: decoding overlaps use.
        self._pending: dict[Key, concurrent.futures.Future[Rows]] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        #: Rows held decoded outside the cache, counted against ``cache_rows``.
        self.outside_rows = 0
        #: How many planned windows still need each slice (None: no plan, least recently used
        #: goes first).
        self.wanted: collections.Counter[Key] | None = None
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

    def read(self, group: int) -> Rows:
        """Row group ``group`` decoded whole, bypassing the cache (``RowGroupFiles.read``)."""
        return self.files.read(group)

    def validation_rows(self, group: int) -> np.ndarray:
        return np.flatnonzero(~self._is_train(group))

    def train_counts(self) -> list[int]:
        """Training rows per row group, from row ids alone (no data read)."""
        return [int(self._is_train(g).sum()) for g in range(len(self.layout.row_groups))]

    def slice_keys(self, groups: np.ndarray, train_index: np.ndarray) -> list[tuple[int, int]]:
        """The (row group, slice) pairs training rows ``train_index[i]`` of ``groups[i]`` lie
        in, in first-seen order."""
        keys: dict[tuple[int, int], None] = {}
        groups = np.asarray(groups)
        found, first = np.unique(groups, return_index=True)
        for group in found[np.argsort(first)].tolist():
            if not self.slices.is_sliced(group):  # the usual case: one slice, the row group
                keys[(group, 0)] = None
                continue
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

    def slice(self, group: int, index: int) -> Rows:
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
        self.evict()
        return arrays

    def evict(self) -> None:
        """Drop decoded slices until they and ``outside_rows`` fit ``cache_rows``: those no
        planned window wants first, then the least recently used; the newest stays."""
        held = self.outside_rows + sum(len(a) for a in self._decoded.values())
        if held <= self.cache_rows:
            return
        wanted, newest = self.wanted, next(reversed(self._decoded), None)
        unwanted = [] if wanted is None else [k for k in self._decoded if not wanted[k]]
        for key in [*unwanted, *self._decoded]:
            if held <= self.cache_rows:
                return
            dropped = self._decoded.pop(key, None) if key != newest else None
            if dropped is not None:
                held -= len(dropped)

    def take(
        self, groups: Sequence[int] | np.ndarray, train_index: np.ndarray, into: Any = None
    ) -> tuple[np.ndarray, Rows]:
        """The row ids and rows of training rows ``train_index[i]`` of row group ``groups[i]``,
        in that order (written over ``into``, rows no longer used, where their shape fits)."""
        groups = np.asarray(groups)
        ids = np.empty(len(groups), dtype=np.int64)
        parts: list[tuple[np.ndarray, Any, np.ndarray]] = []
        # The positions of each row group's rows, found in one sort (a batch's rows come from
        # a few row groups, each in many places); row groups in first-seen order.
        found, first, inverse = np.unique(groups, return_index=True, return_inverse=True)
        by_group = np.argsort(inverse, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(inverse, minlength=len(found)))])
        for k in np.argsort(first).tolist():
            group = int(found[k])
            in_group = by_group[bounds[k] : bounds[k + 1]]
            rows = self.train_rows(group)[train_index[in_group]]
            ids[in_group] = self.layout.row_groups[group].first_row + rows
            if not self.slices.is_sliced(group):  # the usual case: one slice, the row group
                parts.append((in_group, self.slice(group, 0), rows))
                continue
            slices = self.slices.slice_of(rows, group)
            for index in dict.fromkeys(slices.tolist()):
                chosen = slices == index
                within = rows[chosen] - self.slices.start(group, index)
                parts.append((in_group[chosen], self.slice(group, index), within))
        return ids, self.rows_type.take_parts(parts, len(groups), into)

    def validation_parts(
        self, group: int, start: int = 0, stop: int | None = None
    ) -> Iterator[tuple[np.ndarray, Rows]]:
        """Row group ``group``'s validation rows ``start..stop`` (of its validation rows, in
        order) with their row ids, a slice at a time (reading only the slices they lie in, and
        not caching them: the training windows keep theirs)."""
        rows = self.validation_rows(group)[start:stop]
        if not len(rows):
            return
        first_row = self.layout.row_groups[group].first_row
        slices = self.slices.slice_of(rows, group)
        for index in dict.fromkeys(slices.tolist()):
            within = rows[slices == index]
            part = self.slices.read(group, index).take(within - self.slices.start(group, index))
            yield first_row + within, part


def describe(layout: Layout, data: DataSection) -> data_mod.DatasetInfo:
    """Rows, features and outputs of a dataset: from its schema and footers, reading at most
    the first row group (for the width of a variable-length feature list) and, for a
    classification label without statistics, the label column."""
    data = data.resolved()
    if layout.num_rows == 0:
        raise SpecError(f"dataset {layout.uri} has no rows: fix data.dataset", field="data.dataset")
    if data.columns_form:  # the transform makes the inputs: the model is built from its kwargs
        return data_mod.DatasetInfo(layout.num_rows, 0, 0)
    assert data.features is not None and data.label is not None
    files = RowGroupFiles(layout, data)
    if isinstance(data.features, str):
        kind = layout.schema.field(data.features).type
        if pa.types.is_fixed_size_list(kind):
            width = kind.list_size
        elif pa.types.is_list(kind):
            first = next(i for i, g in enumerate(layout.row_groups) if g.rows)
            with files.open(first) as f, files.decoding(first):
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
            labels = [files.read_labels(i) for i, g in enumerate(layout.row_groups) if g.rows]
            low, high = min(int(x.min()) for x in labels), max(int(x.max()) for x in labels)
        if low < 0:
            raise SpecError(
                f"data.label column {data.label!r} of {layout.uri} has negative classes "
                f"(down to {int(low)}): classes must be 0..K-1. Fix data.label.",
                field="data.label",
            )
        outputs = int(high) + 1
    return data_mod.DatasetInfo(layout.num_rows, int(width), outputs)
