"""The data side of a session of relaytrain's own-loop API (``own_loop``): this rank's stream
of the run's global batches from a cursor, each batch's place in its optimizer step (with
``optimizer.grad_accumulation``, a step takes that many global batches, as in the built-in
loop's ``steps.optimizer_steps``), the validation rows, and the transform workers of the
columns form; for a torch Dataset (``data.dataset: package.module:function``) its samples
through torch's DataLoader (``data.sample_loader``)."""

from __future__ import annotations

from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from trainer_core.data import arrays as data_mod
from trainer_core.data.sample_loader import RankSamples
from trainer_core.data.transform import Batches, TransformPool
from trainer_core.errors import SpecError
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import Timings
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train.group_start import rank_data, rank_samples
from trainer_core.train.steps import batch_to_device, to_device


@dataclass(frozen=True)
class BatchPlace:
    """Where a global batch lies: its epoch, its index in the epoch, and its optimizer step."""

    epoch: int
    index: int
    #: The epoch's last batch (its last step ends here).
    end_of_epoch: bool
    #: The optimizer step it is part of ends with it: step the optimizer, then ``report``.
    ends_step: bool
    #: Global batches in its optimizer step: ``accumulation``, or what the epoch has left.
    step_batches: int
    #: Its step's place among the epoch's steps.
    step_in_epoch: int

    def cursor_after(self, batch_size: int) -> data_mod.Cursor:
        """Where the batch after this one is: a checkpoint's cursor after its step."""
        if self.end_of_epoch:
            return data_mod.Cursor(self.epoch + 1, 0)
        return data_mod.Cursor(self.epoch, (self.index + 1) * batch_size)


def place_of(epoch: int, index: int, batches_per_epoch: int, accumulation: int) -> BatchPlace:
    """Global batch ``index`` of ``epoch`` in the epoch's optimizer steps of ``accumulation``
    batches each (the last step takes what is left)."""
    first = index - index % accumulation  # the step's first batch
    step_batches = min(accumulation, batches_per_epoch - first)
    return BatchPlace(
        epoch=epoch,
        index=index,
        end_of_epoch=index + 1 == batches_per_epoch,
        ends_step=index + 1 == first + step_batches,
        step_batches=step_batches,
        step_in_epoch=index // accumulation,
    )


class SessionData:
    """One rank's data for a session: the training stream from a cursor, the validation rows,
    both on the worker's device."""

    def __init__(
        self,
        config: WorkerConfig,
        spec: RunSpec,
        rank: int,
        world_size: int,
        device: torch.device,
        timings: Timings,
    ):
        assert spec.data is not None and spec.schedule is not None
        data_spec = spec.data.resolved()
        self.device, self.timings = device, timings
        self.data_spec = data_spec
        self.batch_size = data_spec.batch_size
        self.accumulation = spec.optimizer.grad_accumulation
        self.epochs = spec.schedule.epochs
        #: The transform workers, started while the stream and the user's model are built.
        columns = data_spec.columns is not None
        self.pool = TransformPool(data_spec).warm() if columns else None
        seed = spec.run.seed
        self.stream: Any
        if data_spec.torch_dataset:  # a torch Dataset's samples, collated by the loader
            cuda = device.type == "cuda"
            self.stream = rank_samples(config, data_spec, seed, world_size, rank, cuda)
        else:
            self.stream, _ = rank_data(config, data_spec, seed, world_size, rank)
        self.train_batches = self.eval_batches = None
        if self.pool is not None:
            self.train_batches = Batches(data_spec, seed, pool=self.pool)
            self.eval_batches = Batches(data_spec, seed, training=False, pool=self.pool)
        self.batches_per_epoch = self.stream.batches_per_epoch
        self.steps_per_epoch = data_mod.steps_per_epoch(self.batches_per_epoch, self.accumulation)
        #: This rank's share of each global batch times the world size (``rank_weight``).
        self.rank_weight = self.stream.weight
        #: A torch Dataset's batches as its collate function made them (``dataloader()``, a
        #: script's ``DataLoader`` replaced: ``for inputs, labels in ...`` reads them as it
        #: did), not as the dict ``batches()`` hands out.
        self.collated = False

    def training(self, cursor: data_mod.Cursor) -> Generator[tuple[BatchPlace, Any], None, None]:
        """Each global batch from ``cursor`` to the end of the run's last epoch: its place and
        this rank's slice of it, its rows (not yet on the device: ``on_device``)."""
        first = cursor.batch(self.batch_size)
        start = self.train_batches.start if self.train_batches is not None else None
        if self.collated:
            epochs = self.stream.epochs(cursor.epoch, first, self.epochs, start, collated=True)
        else:
            epochs = self.stream.epochs(cursor.epoch, first, self.epochs, start)
        try:
            for epoch, ahead in self.timings.waited(iter(epochs)):
                for index, _, rows in self.timings.waited(iter(ahead)):
                    place = place_of(epoch, index, self.batches_per_epoch, self.accumulation)
                    yield place, rows
        finally:
            epochs.close()

    def validation(self) -> Iterator[dict[str, Any]]:
        """This rank's share of the validation rows, in batches on the device."""
        if self.eval_batches is None:  # the tabular form's rows, or a Dataset's batches
            for rows in self.stream.validation():
                yield self.on_device(rows)
            return
        parts = self.stream.validation_with_ids()
        for batch in self.eval_batches.each(0, parts, ahead=self.stream.data.prefetch):
            yield self.on_device(batch)

    def use(self, dataset: Any, loader_workers: int | None, collate: Any) -> None:
        """A loop's ``dataloader()`` options, before the stream opens: its own Dataset object
        in place of ``data.dataset``'s (of the length the run pinned), loader processes and
        collate function."""
        if isinstance(self.stream, RankSamples):
            self.collated = True
        if dataset is None and loader_workers is None and collate is None:
            return
        if not isinstance(self.stream, RankSamples):
            raise SpecError(
                "relaytrain's own-loop API: dataloader() with a dataset, num_workers or "
                f"collate_fn reads a torch Dataset, but data.dataset {self.data_spec.dataset!r} "
                "is not one: name the function returning it in data.dataset "
                "('package.module:function')",
                field="train_loop",
            )
        self.stream.use(dataset, loader_workers, collate)

    def on_device(self, rows: Any) -> Any:
        """A batch as the loop gets it, on the worker's device: the columns form's dict of
        tensors, the tabular form's ``{"features", "labels"}``, or a torch Dataset's batch (as
        its collate function made it for ``dataloader()``)."""
        if self.collated:
            return to_device(rows, self.device)
        if isinstance(rows, data_mod.Arrays):
            rows = {
                "features": torch.from_numpy(rows.features),
                "labels": torch.from_numpy(rows.labels),
            }
        return batch_to_device(rows, self.device)

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
        if isinstance(self.stream, RankSamples):  # its loader processes
            self.stream.close()
