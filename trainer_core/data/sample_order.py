"""Which sample each rank trains on at each step, from the dataset's metadata alone.

The order of an epoch depends on (seed, epoch) and the spec's data settings, never on the
number of workers, so a run resumed on another number of workers continues the same global
batches from the same sample: none skipped, none repeated.

- **Validation split.** A row is validation when a hash of (seed, its row id) falls below
  ``validation_fraction``: decided per row, from its id alone, the same on every rank and
  attempt, without reading the data.
- **The epoch's stream.** The dataset's row groups in a per-epoch shuffled order, each giving
  its training rows in file order, read from a per-epoch offset and wrapping around to it:
  positions 0..N-1.
- **Canonical partitions.** The stream is cut into ``partitions`` contiguous parts. Partition p
  gives ``shares[p]`` samples to every global batch (the global batch split as evenly as it
  goes), so its part is ``steps * shares[p]`` long, and the epoch's last ``N % batch_size``
  positions are left out (other epochs' orders train them).
- **Shuffle windows.** Each part is shuffled window by window: ``window`` consecutive
  positions, permuted by (seed, epoch, partition, window index). A reader holds one window per
  partition it reads, not the dataset.
- **Global batch** ``b`` is partition 0's b-th share, then partition 1's, and so on; rank r of
  W takes positions ``[r*B//W, (r+1)*B//W)`` of it. When W does not divide B, ranks take
  slices whose sizes differ by one (``rank_weight`` says how to weigh their losses so the
  gradient is still the global batch's mean). A rank reads only the partitions its slice
  overlaps: about ``partitions / W`` of them.

Pure: numpy only; the reader turns positions into rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


def splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer over uint64 values (wrapping arithmetic): a fast, well-mixed hash."""
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) & _MASK64


def is_validation(row_ids: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Whether each row id is in the validation split (deterministic in (seed, id))."""
    if fraction <= 0:
        return np.zeros(len(row_ids), dtype=bool)
    keyed = row_ids.astype(np.uint64) ^ splitmix64(np.array([seed], dtype=np.uint64))[0]
    unit = (splitmix64(keyed) >> np.uint64(11)).astype(np.float64) / float(2**53)
    return unit < fraction


def batch_shares(batch_size: int, partitions: int) -> np.ndarray:
    """How many samples each partition gives every global batch: as even as it goes."""
    base, extra = divmod(batch_size, partitions)
    return np.array([base + (p < extra) for p in range(partitions)], dtype=np.int64)


def rank_slice(batch_size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Positions ``[start, stop)`` of the global batch that ``rank`` trains on."""
    return rank * batch_size // world_size, (rank + 1) * batch_size // world_size


def rank_weight(batch_size: int, world_size: int, rank: int) -> float:
    """Factor for a rank's mean loss so DDP's average of the ranks' gradients is the global
    batch's mean: its share of the batch times the world size (1.0 when W divides B)."""
    start, stop = rank_slice(batch_size, world_size, rank)
    return (stop - start) * world_size / batch_size


@dataclass(frozen=True)
class EpochOrder:
    """One epoch's order over the training rows of row groups with ``train_counts`` rows each
    (in dataset order). Build with ``epoch_order``."""

    seed: int
    epoch: int
    batch_size: int
    window: int
    #: Row groups in stream order, and the stream position each begins at (one more: the end).
    row_groups: np.ndarray
    starts: np.ndarray
    #: Where in the row groups' concatenation position 0 lies (the stream wraps around).
    offset: int
    shares: np.ndarray
    #: The stream position each partition's part begins at.
    part_starts: np.ndarray
    steps: int
    _cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def partitions(self) -> int:
        return len(self.shares)

    def part_length(self, partition: int) -> int:
        return self.steps * int(self.shares[partition])

    def window_order(self, partition: int, index: int) -> np.ndarray:
        """The permutation of window ``index`` of ``partition`` (offsets within the window)."""
        key = (partition, index)
        order = self._cache.get(key)
        if order is None:
            length = min(self.window, self.part_length(partition) - index * self.window)
            rng = np.random.default_rng([self.seed, self.epoch, partition, index, 11])
            order = rng.permutation(length)
            if len(self._cache) >= 4 * self.partitions:  # windows are read in order: keep few
                self._cache.clear()
            self._cache[key] = order
        return order

    def partition_positions(self, partition: int, start: int, stop: int) -> np.ndarray:
        """Stream positions of items ``[start, stop)`` of ``partition``'s shuffled sequence."""
        found = []
        index = start
        while index < stop:
            window, offset = divmod(index, self.window)
            take = min(stop - index, self.window - offset)
            order = self.window_order(partition, window)[offset : offset + take]
            found.append(self.part_starts[partition] + window * self.window + order)
            index += take
        if not found:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(found).astype(np.int64)

    def batch_positions(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Stream positions of global batch ``step`` (0-based in the epoch), or of its
        positions ``[start, stop)``: only the partitions that slice overlaps are computed."""
        stop = self.batch_size if stop is None else stop
        bounds = np.concatenate([[0], np.cumsum(self.shares)])
        found = []
        for partition in range(self.partitions):
            low, high = max(start, bounds[partition]), min(stop, bounds[partition + 1])
            if low >= high:
                continue
            share = int(self.shares[partition])
            first = step * share + int(low - bounds[partition])
            found.append(self.partition_positions(partition, first, first + int(high - low)))
        if not found:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate(found)

    def rank_positions(self, step: int, world_size: int, rank: int) -> np.ndarray:
        """Stream positions ``rank`` of ``world_size`` trains on at ``step``."""
        return self.batch_positions(step, *rank_slice(self.batch_size, world_size, rank))

    def partitions_of(self, world_size: int, rank: int) -> list[int]:
        """The partitions ``rank`` reads: those its slice of every global batch overlaps."""
        start, stop = rank_slice(self.batch_size, world_size, rank)
        bounds = np.concatenate([[0], np.cumsum(self.shares)])
        return [
            p for p in range(self.partitions) if max(start, bounds[p]) < min(stop, bounds[p + 1])
        ]

    def locate(self, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(row group in dataset order, index among that row group's training rows) of each
        stream position."""
        positions = (positions + self.offset) % self.starts[-1]
        slot = np.searchsorted(self.starts, positions, side="right") - 1
        return self.row_groups[slot], positions - self.starts[slot]


def epoch_order(
    train_counts: Sequence[int],
    *,
    seed: int,
    epoch: int,
    batch_size: int,
    partitions: int,
    window: int,
) -> EpochOrder:
    """The order of ``epoch`` (see the module docstring). ``train_counts``: training rows of
    each row group, in dataset order."""
    counts = np.asarray(train_counts, dtype=np.int64)
    row_groups = np.random.default_rng([seed, epoch, 3]).permutation(len(counts))
    starts = np.concatenate([[0], np.cumsum(counts[row_groups])]).astype(np.int64)
    total = int(starts[-1])
    offset = int(np.random.default_rng([seed, epoch, 5]).integers(total)) if total else 0
    steps = total // batch_size
    shares = batch_shares(batch_size, partitions)
    part_starts = np.concatenate([[0], np.cumsum(steps * shares)[:-1]]).astype(np.int64)
    return EpochOrder(
        seed=seed,
        epoch=epoch,
        batch_size=batch_size,
        window=window,
        row_groups=row_groups,
        starts=starts,
        offset=offset,
        shares=shares,
        part_starts=part_starts,
        steps=steps,
    )
