"""What one rank reads of a Dataset-form run (``samples``): its slice of every global batch of
each epoch, from the cursor, through torch's own ``DataLoader`` (loader processes,
``data.collate``, pinned memory, prefetch) fed by a batch sampler that starts at the cursor;
and its share of the validation samples.

The interface is ``rank_stream.RankStream``'s, so the built-in loop runs on it unchanged:
``epochs(...)`` gives ``(epoch, batches)`` with ``(global batch index, sample indices, batch)``
items, ``batches_per_epoch`` and ``weight``.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from trainer_core.data import sample_order
from trainer_core.data.samples import (
    VALIDATION,
    Batch,
    IndexOrder,
    SeededSamples,
    as_batch,
    collate_function,
    rank_part,
)
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection


def loader_context(forked: bool = False) -> Any:
    """How loader processes start. ``forked`` (a Ray worker's reader, where training reads):
    forked, as the DataLoaders of Ray Train's own examples are. Else (a driver, a flow's
    process, pytest): from a fork server, a fresh single-threaded process started once with
    torch loaded, since a process running Prefect's and a driver's Ray threads is not safe to
    fork (a forked loader process of a pytest process that had run a flow exited with code 1
    before its first sample). Not spawned, and not the fork server in a worker: bench.datasets
    measured a worker's data wait at 3.1 ms a step forked, 11.8 ms from a fork server and 12.2
    ms spawned (its samples/s 3,063, 2,599, 2,469; a plain forked DataLoader's 3,069). The
    Dataset (and ``data.collate``) must pickle either way, as under spawn anywhere."""
    if forked:
        return multiprocessing.get_context("fork")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch"])  # before the server starts; then a no-op
    return context


class EpochBatches(Sampler[list[tuple[int, int]]]):
    """The batch sampler: this rank's ``(epoch, index)`` keys of each global batch of the
    epoch ``start`` set, from its first batch on. The loader's processes outlive an epoch, so
    ``start`` is called before each epoch's iteration instead of a new loader made."""

    def __init__(self, order: IndexOrder, world_size: int, rank: int):
        self.order, self.world_size, self.rank = order, world_size, rank
        self.epoch, self.first = 0, 0

    def start(self, epoch: int, first: int) -> None:
        self.epoch, self.first = epoch, first

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        batches = self.order.rank_batches(self.epoch, self.first, self.world_size, self.rank)
        for _, ids in batches:
            yield [(self.epoch, int(i)) for i in ids]

    def __len__(self) -> int:
        return max(self.order.batches_per_epoch - self.first, 0)


class RankSamples:
    """Rank ``rank`` of ``world_size``'s side of a Dataset-form run: ``train`` is the training
    set, ``validation`` the validation set (None: ``data.validation_fraction`` of ``train``)."""

    def __init__(
        self,
        train: Any,
        validation: Any,
        data: DataSection,
        seed: int,
        world_size: int,
        rank: int,
        pin_memory: bool = False,
        forked: bool = False,
    ):
        self.data, self.seed, self.world_size, self.rank = data, seed, world_size, rank
        self.pin_memory = pin_memory
        #: A Ray worker's reader: its loader processes are forked (``loader_context``).
        self.forked = forked
        self.order = IndexOrder(len(train), data, seed, split=validation is None)
        self.train = SeededSamples(train, seed)
        #: The validation samples' Dataset and this rank's indices of it.
        self.validation_set = self.train if validation is None else SeededSamples(validation, seed)
        held = self.order.validation_ids if validation is None else np.arange(len(validation))
        self.validation_ids = rank_part(held, world_size, rank)
        self.batches_per_epoch = self.order.batches_per_epoch
        self.slice = sample_order.rank_slice(data.batch_size, world_size, rank)
        #: This rank's mean loss times this: DDP's average is then the global batch's mean.
        self.weight = sample_order.rank_weight(data.batch_size, world_size, rank)
        self.sampler = EpochBatches(self.order, world_size, rank)
        self.collate = collate_function(data)
        self.loader: DataLoader | None = None
        self.validation_loader: DataLoader | None = None

    def use(self, dataset: Any, loader_workers: int | None, collate: Any) -> None:
        """Read ``dataset`` (the loop's own object, of the training set's length: SpecError
        naming both otherwise) with ``loader_workers`` processes and ``collate`` (each None:
        as they were), from the next epoch's loader on."""
        if dataset is not None and dataset is not self.train.dataset:
            if len(dataset) != len(self.train):
                raise SpecError(
                    f"dataloader()'s dataset has {len(dataset)} samples, but data.dataset "
                    f"{self.data.dataset!r} has {len(self.train)}, the length this run's order "
                    "is made of: pass the same dataset (data.kwargs say how it is built)",
                    field="data.dataset",
                )
            self.train = SeededSamples(dataset, self.seed)
            self.close()
        if loader_workers is not None and loader_workers != self.data.loader_workers:
            self.data = self.data.model_copy(update={"loader_workers": loader_workers})
            self.close()
        if collate is not None and collate is not self.collate:
            self.collate = collate
            self.close()

    def _loader(self) -> DataLoader:
        if self.loader is None:
            self.loader = _loader(
                self.train,
                self.data.loader_workers,
                self.collate,
                self.pin_memory,
                self.seed,
                persistent=True,
                prefetch=self.data.prefetch,
                forked=self.forked,
                batch_sampler=self.sampler,
            )
        return self.loader

    def epoch(self, epoch: int, first: int = 0) -> Iterator[tuple[int, np.ndarray, Batch]]:
        """``(global batch index, sample indices, batch)`` of ``epoch`` from batch ``first``."""
        for index, ids, collated in self.collated(epoch, first):
            yield index, ids, as_batch(collated)

    def collated(self, epoch: int, first: int = 0) -> Iterator[tuple[int, np.ndarray, Any]]:
        """As ``epoch``, each batch as the collate function made it (a Ray loop's own
        ``DataLoader`` would hand it out so: ``train.ray_loop_data``)."""
        self.sampler.start(epoch, first)
        batches = self.order.rank_batches(epoch, first, self.world_size, self.rank)
        for (index, ids), collated in zip(batches, self._loader(), strict=True):
            yield index, ids, collated

    def epochs(
        self,
        first_epoch: int,
        first: int,
        stop_epoch: int,
        make_batch: Any = None,
        collated: bool = False,
    ) -> SampleEpochs:
        """Epochs ``first_epoch..stop_epoch - 1`` (from global batch ``first`` of the first):
        each batch as ``epoch`` gives it, or with ``collated`` as ``collated`` does."""
        return SampleEpochs(self, first_epoch, first, stop_epoch, collated)

    def validation(self) -> Iterator[Batch]:
        """This rank's validation samples in batches of ``data.batch_size``, every epoch the
        same draws (each sample is seeded by its index), through a loader whose processes are
        kept from one epoch's pass to the next (starting and ending them each pass took 70 ms
        against 13 ms: bench.datasets)."""
        if self.validation_loader is None:
            keys = [(VALIDATION, int(i)) for i in self.validation_ids]
            workers = self.data.loader_workers if len(keys) > self.data.batch_size else 0
            self.validation_loader = _loader(
                _Keyed(self.validation_set, keys),
                workers,
                self.collate,
                self.pin_memory,
                self.seed,
                persistent=True,
                prefetch=self.data.prefetch,
                forked=self.forked,
                batch_size=self.data.batch_size,
            )
        for collated in self.validation_loader:
            yield as_batch(collated, "data.validation")

    def close(self) -> None:
        """End the loaders' processes."""
        loaders = self.loader, self.validation_loader
        self.loader = self.validation_loader = None
        for loader in loaders:
            iterator = getattr(loader, "_iterator", None)
            if iterator is not None and hasattr(iterator, "_shutdown_workers"):
                iterator._shutdown_workers()


def held_batches(
    samples: SeededSamples,
    ids: np.ndarray,
    data: DataSection,
    collate: Any,
    pin_memory: bool = False,
    field: str = "data.validation",
) -> Iterator[Batch]:
    """Samples ``ids`` of a held-out set (validation, test) in order, in batches of
    ``data.batch_size``, each drawn as validation samples are (keyed by (run.seed, index)
    alone); loader processes for the pass only."""
    keys = [(VALIDATION, int(i)) for i in ids]
    size = data.batch_size
    workers = data.loader_workers if len(keys) > size else 0
    loader = _loader(
        _Keyed(samples, keys), workers, collate, pin_memory, samples.seed, batch_size=size
    )
    for collated in loader:
        yield as_batch(collated, field)


def _loader(
    dataset: Any,
    workers: int,
    collate: Any,
    pin_memory: bool,
    seed: int,
    persistent: bool = False,
    forked: bool = False,
    prefetch: int | None = None,
    **batching: Any,
) -> DataLoader:
    """torch's DataLoader as every loader of the Dataset form is made: ``workers`` processes
    (``loader_context()``) (kept across iterations with ``persistent``), a generator of its own, and
    ``batching`` (a ``batch_sampler``, or a ``batch_size``)."""
    return DataLoader(
        dataset,
        num_workers=workers,
        collate_fn=collate,
        pin_memory=pin_memory,
        prefetch_factor=prefetch if workers else None,
        persistent_workers=persistent and workers > 0,
        generator=_own_generator(seed),
        multiprocessing_context=loader_context(forked) if workers else None,
        **batching,
    )


def _own_generator(seed: int) -> torch.Generator:
    """A generator for a loader's own draws (each iteration draws its processes' base seed):
    without one it draws from torch's global generator, so a resumed epoch, which starts its
    loader at another point of the training's draws, would change the dropout after it."""
    return torch.Generator().manual_seed(seed)


class _Keyed(torch.utils.data.Dataset):
    """``keys`` of a ``SeededSamples`` as a plain sequence (the validation pass's loader)."""

    def __init__(self, samples: SeededSamples, keys: list[tuple[int, int]]):
        self.samples, self.keys = samples, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, position: int) -> Any:
        return self.samples[self.keys[position]]


class SampleEpochs:
    """Iterate for ``(epoch, its batches)``; ``close`` ends the loader's processes (also
    mid-epoch: a loop that stops early)."""

    def __init__(
        self,
        samples: RankSamples,
        first_epoch: int,
        first: int,
        stop_epoch: int,
        collated: bool = False,
    ):
        self.samples, self.first_epoch, self.first = samples, first_epoch, first
        self.stop_epoch = stop_epoch
        self.batches = samples.collated if collated else samples.epoch

    def __iter__(self) -> Iterator[tuple[int, Iterator[tuple[int, np.ndarray, Any]]]]:
        for epoch in range(self.first_epoch, self.stop_epoch):
            yield epoch, self.batches(epoch, self.first if epoch == self.first_epoch else 0)

    def close(self) -> None:
        self.samples.close()
