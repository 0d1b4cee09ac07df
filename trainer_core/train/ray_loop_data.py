"""A user's own Ray loop's torch Dataset, read as the Dataset form reads one, and resumed where
the checkpoint the loop reported left it.

``dataloader(dataset, batch_size=..., epoch=...)`` is the one-line replacement for a Ray loop's
``DataLoader(...)`` and ``ray.train.torch.prepare_data_loader``. Ray's shards an epoch with a
``DistributedSampler``: a resumed loop starts its epoch over, and which rank reads which sample
depends on the world size. This one reads through the Dataset form's reader
(``sample_loader.RankSamples``): the epoch's order is ``samples.IndexOrder``'s, a function of
(run.seed, epoch) alone; each sample is drawn with the global generators seeded by (run.seed,
epoch, index) (``samples.SeededSamples``); rank r of W gets its slice of each global batch.

Where the loader stands (its epoch, the global samples it handed out) goes into each checkpoint
the loop reports (``ray_checkpoints.POSITION_FILE``, written by the rank that writes the RNG
states ``loop_rng`` saves). When the resumed loop reads that checkpoint
(``ray.train.get_checkpoint()``), its first ``dataloader()`` of the same epoch starts there, at
any world size (the order and the count are global); a later epoch starts at its first sample.
So a loop that checkpoints at an epoch's end and resumes at the next runs unchanged, and one
that checkpoints mid-epoch and restarts its epoch loop at the checkpoint's epoch goes on from
the sample after the last it trained.

No Ray here: ``user_loop`` binds a rank's ``LoopData`` while the loop runs (``bound``).
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

from trainer_core.checkpoint.ray_checkpoints import POSITION_FILE, add_file, read_added_file
from trainer_core.checkpoint.run_directory import check_schema
from trainer_core.data.sample_loader import RankSamples
from trainer_core.data.samples import check_map_style
from trainer_core.errors import IncompatibleRunError, SpecError
from trainer_core.spec.sections import DataSection
from trainer_core.train.steps import to_device

logger = logging.getLogger("relaytrain.user_loop")

#: The version of what ``position_payload`` writes.
POSITION_SCHEMA = 1

FIELD = "train_loop"


@dataclass(frozen=True)
class Position:
    """Where a Ray loop's loader stands: ``samples`` of ``epoch``'s order handed out (global,
    a multiple of ``batch_size``), of a dataset of ``length`` samples."""

    epoch: int
    samples: int
    batch_size: int
    length: int


def position_payload(position: Position) -> bytes:
    """What ``POSITION_FILE`` holds."""
    return json.dumps({"schema": POSITION_SCHEMA, **asdict(position)}, sort_keys=True).encode()


def first_batch(saved: Position | None, epoch: int, batch_size: int, length: int) -> int:
    """The global batch of ``epoch`` a resumed loop's loader starts at: where ``saved`` left
    it when that was ``epoch``, else the first. SpecError naming both values when the batch
    or the dataset's length is not the one the position counts."""
    if saved is None or saved.epoch != epoch:
        return 0
    if batch_size != saved.batch_size:
        raise SpecError(
            f"dataloader(batch_size={batch_size}) resumes epoch {epoch}, which the checkpoint's "
            f"loader read in global batches of {saved.batch_size}: pass "
            f"batch_size={saved.batch_size} until the epoch ends",
            field=FIELD,
        )
    if length != saved.length:
        raise SpecError(
            f"dataloader()'s dataset has {length} samples, but the checkpoint's loader read "
            f"epoch {epoch} of one of {saved.length}: the epoch's order is made of the length. "
            "Pass the dataset the run began with, or start a new run.name",
            field=FIELD,
        )
    return saved.samples // batch_size


class LoopData:
    """One rank's side: the reader of the loop's Dataset (kept across epochs, with its loader
    processes), where it stands, and where a resumed group's checkpoint says it stood."""

    def __init__(self, seed: int, rank: int, world_size: int, device: torch.device | None = None):
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.device = device or torch.device("cpu")
        #: After the last batch handed out (None: none yet in this worker group).
        self.position: Position | None = None
        #: The position the resumed loop's checkpoint holds, until its first ``dataloader()``.
        self.resumed: Position | None = None
        #: A resumed group whose loop has not read its checkpoint yet, and whether the loop
        #: runs yet (relaytrain's own reads of the checkpoint restore nothing).
        self.pending = False
        self.armed = False
        self._reader: RankSamples | None = None
        self._reader_key: tuple[Any, ...] | None = None

    def batches(
        self,
        dataset: Any,
        *,
        batch_size: int,
        epoch: int,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
    ) -> Iterator[Any]:
        """This rank's part of each global batch of ``epoch`` (see ``dataloader``)."""
        check_map_style(
            dataset,
            "dataloader()'s dataset is",
            FIELD,
            "Pass one, or feed a stream to your loop through Ray Data (datasets: in the spec, "
            "ray.train.get_dataset_shard in the loop)",
        )
        self._check(dataset, batch_size, epoch, num_workers)
        length = len(dataset)
        first = first_batch(self.resumed, epoch, batch_size, length)
        self.resumed = None  # the resumed loader is this one
        reader = self._reader_for(dataset, batch_size, num_workers, collate_fn)
        self.position = Position(epoch, first * batch_size, batch_size, length)
        return self._hand_out(reader, epoch, first, batch_size, length)

    def _hand_out(
        self, reader: RankSamples, epoch: int, first: int, batch_size: int, length: int
    ) -> Iterator[Any]:
        for index, _, collated in reader.collated(epoch, first):
            self.position = Position(epoch, (index + 1) * batch_size, batch_size, length)
            yield to_device(collated, self.device)

    def _check(self, dataset: Any, batch_size: Any, epoch: Any, num_workers: Any) -> None:
        def whole(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        if not whole(batch_size) or batch_size < 1:
            raise SpecError(
                f"dataloader(batch_size={batch_size!r}): pass the global batch, a whole "
                "number of samples summed over every worker",
                field=FIELD,
            )
        if not whole(epoch) or epoch < 0:
            raise SpecError(
                f"dataloader(epoch={epoch!r}): pass the loop's epoch (0, 1, ...): the epoch's "
                "order, and where a resume goes on, are keyed by it",
                field=FIELD,
            )
        if not whole(num_workers) or num_workers < 0:
            raise SpecError(
                f"dataloader(num_workers={num_workers!r}): loader processes per worker, 0 "
                "or more (0: in the training process)",
                field=FIELD,
            )
        if batch_size % self.world_size:
            multiple = -(-batch_size // self.world_size) * self.world_size
            raise SpecError(
                f"dataloader(batch_size={batch_size}) is the global batch, split over "
                f"{self.world_size} workers: each rank's loss is the mean of its share and DDP "
                "averages the ranks' gradients, so the shares must be equal for that to be the "
                f"batch's mean. Pass a multiple of {self.world_size} (such as {multiple}), or "
                "run on a worker count that divides it",
                field=FIELD,
            )
        if len(dataset) < batch_size:
            raise SpecError(
                f"dataloader()'s dataset has {len(dataset)} samples, fewer than "
                f"batch_size={batch_size}: an epoch holds whole global batches (the last "
                "len % batch_size samples of each epoch's order are left out), so it would "
                "have none. Pass a smaller batch_size",
                field=FIELD,
            )

    def _reader_for(
        self, dataset: Any, batch_size: int, num_workers: int, collate_fn: Any
    ) -> RankSamples:
        """The reader of ``dataset``: the last one (its loader processes kept) when the loop
        asks with the same arguments."""
        key = (id(dataset), batch_size, num_workers, collate_fn)
        if self._reader is not None and key == self._reader_key:
            return self._reader
        self.close()
        data = DataSection.model_construct(
            dataset="dataloader()", batch_size=batch_size, loader_workers=num_workers
        )
        # No validation set of the reader's: every index is a training index (a Ray loop
        # validates in its own code).
        reader = RankSamples(
            dataset,
            (),
            data,
            self.seed,
            self.world_size,
            self.rank,
            pin_memory=self.device.type == "cuda",
            forked=True,  # a Ray worker's
        )
        reader.use(None, None, collate_fn)
        self._reader, self._reader_key = reader, key
        return reader

    def save(self, checkpoint: Any) -> None:
        """At a report: where the loader stands, into ``checkpoint`` (the one this rank hands
        Ray, which writes the RNG states into it)."""
        if self.position is None:
            return
        add_file(
            checkpoint,
            POSITION_FILE,
            position_payload(self.position),
            "a resume from it starts the epoch's samples over",
        )

    def restore(self, checkpoint: Any) -> None:
        """The loop read ``checkpoint`` (``ray.train.get_checkpoint()``): its first read of a
        resumed group's gives the next ``dataloader()`` the position the checkpoint holds."""
        if not self.armed or not self.pending or checkpoint is None:
            return
        self.pending = False
        try:
            data = read_added_file(checkpoint, POSITION_FILE)
        except OSError as e:  # a loop that reads no Dataset through dataloader()
            logger.debug("no loader position in %s: %s", checkpoint.path, e)
            return
        where = f"{checkpoint.path}/{POSITION_FILE}"
        try:
            record = json.loads(data)
            if isinstance(record, dict):  # a schema this release does not read is refused
                check_schema(record, where)
            self.resumed = Position(
                *(int(record[key]) for key in ("epoch", "samples", "batch_size", "length"))
            )
        except IncompatibleRunError:
            raise
        except (ValueError, KeyError, TypeError) as e:  # not as dataloader() writes it
            logger.warning(
                "%s is not a loader position (%s): a resume from it starts the epoch's samples "
                "over",
                where,
                e,
            )

    def close(self) -> None:
        """End the reader's loader processes."""
        if self._reader is not None:
            self._reader.close()
        self._reader = self._reader_key = None


_bound: LoopData | None = None


@contextlib.contextmanager
def bound(data: LoopData) -> Iterator[LoopData]:
    """``data`` is what ``dataloader`` reads for while the block (the user's loop) runs."""
    global _bound
    _bound = data
    try:
        yield data
    finally:
        _bound = None
        data.close()


def dataloader(
    dataset: Any,
    *,
    batch_size: int,
    epoch: int,
    num_workers: int = 0,
    collate_fn: Callable[[list[Any]], Any] | None = None,
) -> Iterator[Any]:
    """This rank's part of each global batch of ``epoch`` of ``dataset`` (a map-style torch
    Dataset), on the worker's device: the replacement, in a Ray loop relaytrain runs
    (``train_loop_api: ray``), for ``prepare_data_loader(DataLoader(dataset, ...))``.

    ``batch_size`` is the global batch, summed over every worker (a multiple of the worker
    count); ``num_workers`` and ``collate_fn`` are ``DataLoader``'s (the batch is what the
    collate function makes). The order is a function of (run.seed, epoch); a resumed loop
    asking for its checkpoint's epoch goes on from the checkpoint's sample (module docstring).
    Call it once an epoch, and iterate it to the epoch's end or to the loop's report."""
    if _bound is None:
        raise SpecError(
            "ray_loop_data.dataloader() reads for a Ray Train loop relaytrain runs "
            "(train_loop_api: ray, train_loop: package.module:function): call it in that "
            "loop, on its workers. A loop on relaytrain's own API (train_loop_api: relaytrain) "
            "calls session().dataloader(...) instead",
            field=FIELD,
        )
    return _bound.batches(
        dataset, batch_size=batch_size, epoch=epoch, num_workers=num_workers, collate_fn=collate_fn
    )
