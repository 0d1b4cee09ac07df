"""Reading ahead: one rank's rows of an epoch gathered a shuffle window at a time
(``Windows``), and a thread that reads, and starts making, the next batches while the step
runs (``Prefetcher``)."""

from __future__ import annotations

import collections
import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from trainer_core.data import sample_order, transform
from trainer_core.data.stream import Reader

_END = object()


class Windows:
    """One rank's rows of an epoch, gathered a shuffle window at a time, by plan.

    When a batch first needs window ``w`` of a partition, the rank's rows of that whole window
    are gathered in the window's order by one ``Reader.take`` (a few copies of many rows each,
    not a few dozen rows per row group per batch); each batch is then a run of each of its
    partitions' gathered windows. The slices of each partition's current and next window are
    read ahead (``Reader.prefetch``), and the reader's cache drops first the slices no planned
    window still needs. Rows and order are ``EpochOrder.rank_positions``': only where they are
    gathered differs. Memory: a gathered window per partition, counted against the cache.
    """

    def __init__(self, reader: Reader, order: sample_order.EpochOrder, world_size: int, rank: int):
        self.reader, self.order = reader, order
        start, stop = sample_order.rank_slice(order.batch_size, world_size, rank)
        bounds = np.concatenate([[0], np.cumsum(order.shares)])
        #: (partition, first, stop): the rank's positions of each global batch's share of a
        #: partition.
        self.spans = [
            (p, int(max(start, bounds[p]) - bounds[p]), int(min(stop, bounds[p + 1]) - bounds[p]))
            for p in order.partitions_of(world_size, rank)
        ]
        Key = tuple[int, int]
        #: The slices of each window planned and not yet gathered (its rows are located
        #: again when it is: kept, they would take 24 bytes a row of every planned window).
        self._planned: dict[Key, list[Key]] = {}
        self._done: set[Key] = set()
        #: Each partition's gathered window: (window, items, row ids, rows).
        self._live: dict[int, tuple[int, np.ndarray, np.ndarray, Any]] = {}
        self.wanted: collections.Counter[Key] = collections.Counter()
        reader.wanted, reader.outside_rows = self.wanted, 0
        #: The windows of the batch read ahead last, by partition.
        self._ahead: list[int] = []

    def read_ahead(self, index: int) -> None:
        """Plan, and start reading, each partition's window of batch ``index``, then each
        one's next (every current window before any next: the batch needs them all)."""
        windows = [
            (index * int(self.order.shares[partition]) + first) // self.order.window
            for partition, first, _ in self.spans
        ]
        if windows == self._ahead:  # most batches: no window starts
            return
        self._ahead = windows
        for step_ahead in (0, 1):
            for (partition, _, _), window in zip(self.spans, windows, strict=True):
                self._plan(partition, window + step_ahead)

    def _plan(self, partition: int, window: int) -> None:
        if (partition, window) in self._planned or (partition, window) in self._done:
            return
        items, groups, rows = self._locate(partition, window)
        keys = self.reader.slice_keys(groups, rows) if len(items) else []
        self.wanted.update(keys)
        self.reader.prefetch(keys)
        self._planned[(partition, window)] = keys

    def _locate(self, partition: int, window: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The rank's items of a window, and the (row group, training row) of each."""
        items = self._items(partition, window)
        order = self.order
        offsets = order.window_order(partition, window)[items - window * order.window]
        positions = order.part_starts[partition] + window * order.window + offsets
        groups, rows = order.locate(positions)
        return items, groups, rows

    def _items(self, partition: int, window: int) -> np.ndarray:
        """The partition's items (its shuffled sequence's indices) of ``window`` this rank
        reads, ascending."""
        share = int(self.order.shares[partition])
        first, stop = next((f, s) for p, f, s in self.spans if p == partition)
        low = window * self.order.window
        high = min(low + self.order.window, self.order.part_length(partition))
        items = np.arange(low, max(low, high), dtype=np.int64)
        if stop - first < share:
            within = items % share
            items = items[(within >= first) & (within < stop)]
        return items

    def _window(self, partition: int, window: int) -> tuple[int, np.ndarray, np.ndarray, Any]:
        live = self._live.get(partition)
        if live is not None and live[0] == window:
            return live
        spent = None
        if live is not None:  # batches read on from it: no batch needs it again
            self.reader.outside_rows -= len(live[1])
            spent = self._live.pop(partition)[3]  # its arrays take the next window's rows
        self._plan(partition, window)
        keys = self._planned.pop((partition, window))
        self._done.add((partition, window))
        items, groups, rows = self._locate(partition, window)
        ids, taken = self.reader.take(groups, rows, into=spent)
        self.wanted.subtract(keys)
        self._live[partition] = live = (window, items, ids, taken)
        self.reader.outside_rows += len(items)
        return live

    def batch(self, index: int) -> tuple[np.ndarray, Any]:
        """The row ids and rows of global batch ``index`` this rank trains on."""
        ids: list[np.ndarray] = []
        parts: list[Any] = []
        size, rows_type = self.order.window, self.reader.rows_type
        for partition, first, stop in self.spans:
            share = int(self.order.shares[partition])
            low, high = index * share + first, index * share + stop
            while low < high:  # a batch's share can run over a window's end
                window = low // size
                live = self._live.get(partition)
                if live is None or live[0] != window:
                    live = self._window(partition, window)
                _, items, window_ids, rows = live
                end = min(high, (window + 1) * size)
                start_at, end_at = np.searchsorted(items, [low, end]).tolist()
                if end_at > start_at:
                    ids.append(window_ids[start_at:end_at])
                    part = rows.slice(start_at, end_at)
                    # Copied when the next window is gathered into this one's arrays.
                    parts.append(rows_type.join([part]) if end < high else part)
                low = end
        return np.concatenate(ids), rows_type.join(parts)

    def close(self) -> None:
        """Let the gathered windows go, and the reader's cache their room."""
        self._live.clear()
        self.reader.outside_rows, self.reader.wanted = 0, None


class Prefetcher:
    """One rank's rows for global batches ``first..order.steps-1`` of an epoch, read ahead by a
    background thread: at most ``depth`` batches wait in memory (with ``make_batch``, as many
    more are being made). Iterate for
    ``(batch index, row ids, rows)`` (rows made into a batch when ``make_batch(ids, rows)``
    is given: it starts the batch and returns a function that finishes it, called once
    ``depth`` more are started); a read or transform error is raised where the batch would
    have been. The reader is the thread's alone while it runs."""

    def __init__(
        self,
        reader: Reader,
        order: sample_order.EpochOrder,
        world_size: int,
        rank: int,
        first: int = 0,
        depth: int = 2,
        make_batch: Callable[[np.ndarray, Any], Callable[[], Any]] | None = None,
    ):
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        #: Called by the reading thread once it has read the last batch (``Epochs``: it
        #: starts the next epoch's read-ahead); what it returns is ``finish()``'s.
        self.then: Callable[[], Prefetcher] | None = None
        self._following: Prefetcher | None = None
        self._reader = reader
        self._make_batch = make_batch
        self._depth = depth
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
        windows = Windows(reader, order, world_size, rank)

        def batches() -> Iterator[tuple[int, np.ndarray, Any]]:
            for index in range(first, order.steps):
                windows.read_ahead(index)
                ids, taken = windows.batch(index)
                yield index, ids, taken

        made: Iterator[tuple[int, np.ndarray, Any]] = batches()
        if self._make_batch is not None:
            # Up to ``depth`` batches are started (transformed in make_batch's pool) behind the
            # one finished, beside the ``depth`` waiting in the queue.
            make = self._make_batch
            started = ((make(ids, rows), (index, ids)) for index, ids, rows in batches())
            made = (
                (index, ids, batch)
                for batch, (index, ids) in transform.finished_in_order(started, self._depth)
            )
        try:
            for item in made:
                if not self._put(item):
                    return
        except BaseException as error:  # handed to the consumer
            self._put(error)
            return
        finally:
            windows.close()
        if self.then is not None and not self._stop.is_set():
            self._following = self.then()
        self._put(_END)

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def __iter__(self) -> Iterator[tuple[int, np.ndarray, Any]]:
        while True:
            item = self._queue.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def finish(self, stop: bool = False) -> Prefetcher | None:
        """Wait for the reading thread to end (``stop``: stop it first); the next epoch's
        read-ahead it started, if any."""
        if stop:
            self._stop.set()
        self._thread.join(timeout=10)
        return self._following

    def close(self, reader: bool = True) -> None:
        """Stop reading ahead and let the thread end (also mid-epoch); ``reader``: stop the
        reader's own read-ahead too (not when the next epoch reads on)."""
        self._stop.set()
        self._thread.join(timeout=10)
        if reader:
            self._reader.close()
