"""What one rank reads of a dataset: the batches of each epoch in the worker-count-independent
order, read ahead in a thread (``read_ahead.Prefetcher``), and the validation rows."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from trainer_core.data import row_slices, sample_order
from trainer_core.data.footers import Layout, row_bytes
from trainer_core.data.read_ahead import Prefetcher
from trainer_core.data.stream import Reader
from trainer_core.spec.sections import DataSection

#: ``make_batch(epoch, row ids, rows)``: starts a batch (``Batches.start``), returning a function
#: that finishes it.
StartBatch = Callable[[int, np.ndarray, Any], Callable[[], Any]]


class RankStream:
    """What rank ``rank`` of ``world_size`` trains and validates on: its slice of each global
    batch of ``data.batch_size`` samples, in the order of ``trainer_core.data.sample_order``, and
    its slice of the validation rows in file order (a row group may be split between ranks:
    one pyarrow or Spark wrote often holds them all)."""

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
        #: The stream of a validation set of its own (``data.validation``: every row of it
        #: held out), which ``validation`` reads instead of this one's held-out rows.
        self.held: RankStream | None = None

    def order(self, epoch: int) -> sample_order.EpochOrder:
        return sample_order.epoch_order(
            self.train_counts,
            seed=self.seed,
            epoch=epoch,
            batch_size=self.data.batch_size,
            partitions=self.data.partitions,
            window=self.data.shuffle_window,
        )

    def epoch(
        self,
        epoch: int,
        first: int = 0,
        make_batch: StartBatch | None = None,
    ) -> Prefetcher:
        """Global batches ``first..`` of ``epoch``, this rank's slice of each, read ahead;
        ``make_batch(epoch, row ids, rows)`` (the columns form's ``Batches.start``) starts
        each in the read-ahead thread, which finishes it (the function it returned) in order."""
        return Prefetcher(
            self.reader,
            self.order(epoch),
            self.world_size,
            self.rank,
            first=first,
            depth=self.data.prefetch,
            make_batch=None if make_batch is None else functools.partial(make_batch, epoch),
        )

    def epochs(
        self,
        first_epoch: int,
        first: int,
        stop_epoch: int,
        make_batch: StartBatch | None = None,
    ) -> Epochs:
        """Epochs ``first_epoch..stop_epoch - 1`` (from global batch ``first`` of the first),
        each ``epoch``'s stream; the next epoch's reading starts as soon as this one's ends
        (``Epochs``)."""
        return Epochs(self, first_epoch, first, stop_epoch, make_batch)

    def validation(self, chunk: int = 256) -> Iterator[Any]:
        """This rank's validation rows in chunks of at most ``chunk``, a row group at a time
        (not cached: the training windows keep theirs)."""
        for _, rows in self.validation_with_ids(chunk):
            yield rows

    def validation_with_ids(self, chunk: int = 256) -> Iterator[tuple[np.ndarray, Any]]:
        """``validation``'s chunks with their rows' ids."""
        if self.held is not None:
            yield from self.held.validation_with_ids(chunk)
            return
        groups = self.reader.layout.row_groups
        counts = [g.rows - kept for g, kept in zip(groups, self.train_counts, strict=True)]
        total, world = sum(counts), self.world_size
        first, stop = total * self.rank // world, total * (self.rank + 1) // world
        before = 0  # validation rows in the row groups before this one
        for group, count in enumerate(counts):
            a, b = max(first - before, 0), min(stop - before, count)
            before += count
            if a < b:
                yield from self._chunks(self.reader.validation_parts(group, a, b), chunk)

    @staticmethod
    def _chunks(
        parts: Iterator[tuple[np.ndarray, Any]], chunk: int
    ) -> Iterator[tuple[np.ndarray, Any]]:
        """``parts`` (row ids and rows) in chunks of at most ``chunk`` rows."""
        for ids, rows in parts:
            for start in range(0, len(rows), chunk):
                index = np.arange(start, min(start + chunk, len(rows)))
                yield ids[index], rows.take(index)


class Epochs:
    """Iterate for ``(epoch, its Prefetcher)``. An epoch's read-ahead thread, once it has read
    the epoch's last batch (which then waits in memory, ``data.prefetch`` at most), starts the
    next epoch's: the first batches of the next epoch are read and transformed while this one's
    last steps, validation and checkpoint run, not after. ``close`` stops what is reading
    (also mid-epoch: a loop that stops early)."""

    def __init__(
        self,
        stream: RankStream,
        first_epoch: int,
        first: int,
        stop_epoch: int,
        make_batch: StartBatch | None,
    ):
        self.stream, self.stop_epoch, self.make_batch = stream, stop_epoch, make_batch
        self.first_epoch, self.first = first_epoch, first
        self.current: Prefetcher | None = None

    def _start(self, epoch: int, first: int) -> Prefetcher:
        ahead = self.stream.epoch(epoch, first, self.make_batch)
        if epoch + 1 < self.stop_epoch:
            ahead.then = functools.partial(self._start, epoch + 1, 0)
        return ahead

    def __iter__(self) -> Iterator[tuple[int, Prefetcher]]:
        if self.first_epoch >= self.stop_epoch:
            return
        ahead = self.current = self._start(self.first_epoch, self.first)
        for epoch in range(self.first_epoch, self.stop_epoch):
            yield epoch, ahead
            following = ahead.finish()
            ahead.close(reader=False)
            self.current = following
            if following is None:
                return
            ahead = following

    def close(self) -> None:
        if self.current is not None:
            following = self.current.finish(stop=True)
            if following is not None:
                following.close(reader=False)
            self.current.close()
            self.current = None
        self.stream.reader.close()
        if self.stream.held is not None:
            self.stream.held.reader.close()
