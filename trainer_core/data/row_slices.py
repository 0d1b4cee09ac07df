"""Row groups read in slices of bounded size, so a worker's memory does not follow the files'
row group size.

pyarrow writes row groups of up to a million rows, Spark about 128 MB: decoding one whole is
hundreds of MB. The reader instead asks for slices of ``slice_rows`` rows. A row group no
larger than that is one slice, read as it is. A larger one is read once, streaming, as record
batches (``ParquetFile.iter_batches`` with a small read buffer: its memory is about a slice),
and each slice is spilled decoded to a local file; a slice is then one small file read. The
sample order is untouched: slices only decide what is decoded at a time.

The spill lives in a temporary directory of the worker process (``RELAYTRAIN_SPILL_DIR``, else
the system's), removed when the reader is gone; one a killed worker left is removed by the next
reader on that machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core.data import arrays as data_mod
from trainer_core.data.table_rows import Rows, TableRows

SPILL_PREFIX = "relaytrain-spill-"
#: The read buffer of a streamed row group (pyarrow reads the column chunks through it).
READ_BUFFER = 1 << 20
#: Bytes of a record batch a row group is streamed in: pyarrow's reader holds several times
#: a batch while decoding (measured: about 10x for a list column), so batches stay small and
#: are joined into slices.
STREAM_BATCH_BYTES = 1 << 20
#: What streaming row groups holds whatever the slice size: pyarrow's Parquet reader and
#: allocator, the read-ahead threads' arenas (a worker reading 96 MB row groups in 2,000-row
#: slices peaked about 85 MB above its start, measured with pyarrow 25).
READER_OVERHEAD_MB = 48
#: Slices a reading thread's decoding of a row group read whole (one no larger than a
#: slice) holds at its peak: the column chunk read whole and the pages decoded beside it (a
#: dictionary page too, as pyarrow writes by default) and the values. Measured with pyarrow
#: 25: reading a 32-row group of 100 KB binary rows, 3.05 MB decoded, peaked Arrow's pool at
#: 12.2 MB.
DECODE_SLICES = 4
#: Threads decoding slices at once (``stream.Reader.prefetch``).
READING_THREADS = 2
#: Slices held in passing, whatever the partitions: twelve measured on streamed row groups (a
#: spill's batches, joined slice and arrays, a validation read's slice, and what the
#: allocator keeps of them: about seven slices above the fixed overhead at the peak of an
#: epoch, one partition), and each reading thread's decoding of a row group read whole,
#: which streamed ones (1 MB batches) never showed. Wide rows (20-100 KB) in row groups read
#: whole held, at the peak of an epoch, Arrow's pool (within the other terms) and 4 to 9
#: slices more that the allocator kept resident (five layouts, after ``release_freed``): a
#: decode's peak for each thread covers them. A streamed row group's slices hold less.
SLICES_IN_PASSING = 12 + READING_THREADS * DECODE_SLICES


def slice_rows_for(
    memory_mb: int, row_bytes: float, partitions: int, window: int, largest: int
) -> int:
    """Rows per slice so that what a rank holds stays under ``memory_mb``: for each of the
    ``partitions`` it reads, the live window and the next one read ahead (together at most
    half the budget: checked on the driver) and three slices at their ends; and
    ``SLICES_IN_PASSING`` more. At least 256 rows; a row group that small or smaller is read
    whole."""
    budget = (memory_mb - READER_OVERHEAD_MB) * 2**20 - 2 * partitions * window * row_bytes
    rows = int(budget / ((3 * partitions + SLICES_IN_PASSING) * max(row_bytes, 1.0)))
    return min(largest, max(MIN_SLICE_ROWS, rows))


#: The fewest rows a slice of a bigger row group holds (fewer would read it in tiny pieces).
MIN_SLICE_ROWS = 256


def held_bytes(row_bytes: float, partitions: int, window: int, slice_rows: int) -> float:
    """What a rank reading ``partitions`` holds at slices of ``slice_rows`` rows (the sum
    ``slice_rows_for`` keeps under the budget): wide rows can make even the smallest slices
    hold more than ``data.memory_mb``, which setup then refuses."""
    held_rows = partitions * (2 * window + 3 * slice_rows) + SLICES_IN_PASSING * slice_rows
    return READER_OVERHEAD_MB * 2**20 + held_rows * row_bytes


class SliceStore:
    """Slice ``k`` of row group ``g`` (rows ``[k*S, (k+1)*S)``) of a layout's files.

    ``read_group(g)`` reads a whole row group (the small ones, and the in-memory table's);
    ``stream_group(g)`` yields the record batches of a big one.
    """

    def __init__(
        self,
        row_counts: list[int],
        slice_rows: int,
        read_group: Callable[[int], Rows],
        stream_group: Callable[[int], Iterator[pa.RecordBatch]],
        to_rows: Callable[[pa.Table], Rows],
        rows_type: type[data_mod.Arrays] | type[TableRows] = data_mod.Arrays,
    ):
        self.row_counts = row_counts
        self.slice_rows = slice_rows
        self._read_group = read_group
        self._stream_group = stream_group
        self._to_rows = to_rows
        self._rows_type = rows_type
        self._lock = threading.Lock()
        #: One spill at a time (the reading threads would otherwise hold two).
        self._spilling = threading.Lock()
        self._spilled: set[int] = set()
        self._dir: Path | None = None

    def is_sliced(self, group: int) -> bool:
        return self.row_counts[group] > self.slice_rows

    def num_slices(self, group: int) -> int:
        return -(-self.row_counts[group] // self.slice_rows) if self.is_sliced(group) else 1

    def slice_of(self, rows: np.ndarray, group: int) -> np.ndarray:
        """The slice of each row index of ``group``."""
        if not self.is_sliced(group):
            return np.zeros(len(rows), dtype=np.int64)
        return rows // self.slice_rows

    def start(self, group: int, index: int) -> int:
        return index * self.slice_rows if self.is_sliced(group) else 0

    def read(self, group: int, index: int) -> Rows:
        """Slice ``index`` of row group ``group``, decoded."""
        if not self.is_sliced(group):
            return self._read_group(group)
        self._spill(group)
        assert self._dir is not None
        return self._rows_type.load(str(self._dir / f"g{group}-s{index}"))

    def _spill(self, group: int) -> None:
        """Decode row group ``group`` once, a slice at a time, into the spill directory."""
        with self._lock:
            if self._dir is None:
                self._dir = _new_spill_dir()
                weakref.finalize(self, shutil.rmtree, self._dir, True)
        with self._spilling:
            if group in self._spilled:
                return
            index = 0
            pending: list[pa.RecordBatch] = []
            held = 0
            for batch in self._stream_group(group):
                pending.append(batch)
                held += batch.num_rows
                while held >= self.slice_rows:
                    table = pa.Table.from_batches(pending)
                    self._write(group, index, table.slice(0, self.slice_rows))
                    rest = table.slice(self.slice_rows)
                    pending, held = rest.to_batches(), rest.num_rows
                    index += 1
            if held:
                self._write(group, index, pa.Table.from_batches(pending))
            self._spilled.add(group)
        release_freed()

    def _write(self, group: int, index: int, table: pa.Table) -> None:
        assert self._dir is not None
        rows: Any = self._to_rows(table)
        self._rows_type.save(rows, str(self._dir / f"g{group}-s{index}"))


def release_freed() -> None:
    """Hand what decoding freed back to the system now. Arrow's allocator (mimalloc 3, in
    pyarrow 25) keeps freed pages resident for a second (its purge delay) before it returns
    them, and a reader of wide rows frees a few slices' bytes per row group it decodes, many
    times a second: 100 KB rows in row groups of 32, 2 partitions and a window of 32, peaked
    126-158 MB above the reader's start without this and 118-133 MB with it, where Arrow's
    pool never held more than 59 MB."""
    pa.default_memory_pool().release_unused()


def stream_row_group(
    file: pa.NativeFile, index: int, rows: int, columns: list[str]
) -> Iterator[pa.RecordBatch]:
    """The record batches of row group ``index`` of an open Parquet file, ``rows`` at a time,
    read through a small buffer (not the whole column chunks at once)."""
    reader = pq.ParquetFile(
        file, buffer_size=READ_BUFFER, pre_buffer=False, page_checksum_verification=True
    )
    yield from reader.iter_batches(
        batch_size=rows, row_groups=[index], columns=columns, use_threads=False
    )


def _new_spill_dir() -> Path:
    """A spill directory of this process; those of processes gone are removed first."""
    root = Path(os.environ.get("RELAYTRAIN_SPILL_DIR") or tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{SPILL_PREFIX}*"):
        pid = stale.name[len(SPILL_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{SPILL_PREFIX}{os.getpid()}-", dir=root))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True
