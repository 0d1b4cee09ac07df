"""The built-in loop for the columns form (``data.columns``): any model on any batch.

It is ``BuiltinLoop`` with four parts of its own; resume, checkpoints, faults, early
stopping, drains and metrics are the loop's, unchanged:

- the model: ``model.name`` called with ``model.kwargs`` alone, any ``nn.Module``;
- the batches: each epoch's rows through ``data.transform`` in the read-ahead thread
  (``data.transform.Batches``: one generator per row, keyed by (run.seed, epoch, row id));
- a step: summed losses and counts (``batch_workload``), added over the micro-batches and the
  ranks, divided once by the global count: the gradients of one batch of all of them;
- validation: sums and counts of every metric, reduced over the ranks, then divided.
"""

from __future__ import annotations

from typing import Any

import torch

from trainer_core.data import arrays as data_mod
from trainer_core.data import rank_stream
from trainer_core.data.transform import Batches, TransformPool
from trainer_core.train import validate, workloads
from trainer_core.train.batch_workload import Batch, BatchWorkload
from trainer_core.train.loop import BuiltinLoop
from trainer_core.train.steps import batch_to_device, summed_gradients


class ColumnsLoop(BuiltinLoop):
    """One worker's side of a run of the built-in loop on the columns form."""

    def _new_model(self, info: data_mod.DatasetInfo) -> torch.nn.Module:
        assert self.spec.model
        return workloads.build_model(self.spec.model, 0, 0, columns_form=True)

    def _build_data(self) -> data_mod.DatasetInfo:
        #: The transform workers, started while the stream and the model are built.
        self.transform_pool = TransformPool(self.data_spec).warm()
        return super()._build_data()

    def _build_validation(self, info: data_mod.DatasetInfo) -> None:
        seed, pool = self.spec.run.seed, self.transform_pool
        self.batches = Batches(self.data_spec, seed, pool=pool)
        self.eval_batches = Batches(self.data_spec, seed, training=False, pool=pool)
        self._build_workload()

    def _build_workload(self) -> None:
        """The model call, loss and metrics on dict batches, and the validation pass on them."""
        self.workload = BatchWorkload(self.spec)
        self.batch_validation = validate.BatchValidation(
            self.workload,
            self.precision.autocast,
            self._batch_to_device,
            fsdp=self.fsdp,
            world_size=self.world_size,
        )
        self.last_batch: Batch | None = None

    def _epochs(self, first_epoch: int, first: int) -> rank_stream.Epochs:
        assert self.spec.schedule is not None
        return self.data.epochs(first_epoch, first, self.stop_epoch, self.batches.start)

    def _gradients(self, model: torch.nn.Module, micro_batches: list[Any]) -> float:
        self.last_batch = micro_batches[0]
        with self.clock.part("h2d"):
            batches = [self._batch_to_device(b) for b in micro_batches]
        with self.clock.part("forward_backward"):
            return summed_gradients(
                model,
                batches,
                self._forward_loss,
                self.data_spec.batch_size * self.accumulation,
                self.world_size,
                self.precision.autocast,
                self.precision.scale(),
            )

    def _forward_loss(self, model: torch.nn.Module, batch: Batch) -> tuple[torch.Tensor, Any]:
        return self.workload.loss(self.workload.forward(model, batch), batch)

    def _validate(self) -> dict[str, float]:
        parts = self.data.validation_with_ids()
        batches = self.eval_batches.each(0, parts, ahead=self.data_spec.prefetch)
        return self.batch_validation.run(self.model, batches, dummy=self.last_batch)

    def _batch_to_device(self, batch: Batch) -> Batch:
        return batch_to_device(batch, self.device)

    def close(self) -> None:
        super().close()
        self.transform_pool.close()
