"""The built-in loop for the Dataset form (``data.dataset: package.module:function``): the
columns form's loop (any model on dict batches, losses as sums and counts) reading a torch
``Dataset`` the user already has through ``data.sample_loader.RankSamples`` instead of Parquet
rows through a transform. Resume, checkpoints, faults, early stopping, drains and metrics are
the loop's, unchanged: the cursor counts global samples, so a resume at any worker count
continues the same epoch from the same sample."""

from __future__ import annotations

from typing import Any

from trainer_core.data import arrays as data_mod
from trainer_core.train.columns_loop import ColumnsLoop
from trainer_core.train.group_start import rank_samples
from trainer_core.train.loop import BuiltinLoop


class DatasetLoop(ColumnsLoop):
    """One worker's side of a run of the built-in loop on the Dataset form."""

    def _build_data(self) -> data_mod.DatasetInfo:
        self.data: Any = rank_samples(
            self.config,
            self.data_spec,
            self.spec.run.seed,
            self.world_size,
            self.rank,
            pin_memory=self.device.type == "cuda",
        )
        return data_mod.DatasetInfo(num_rows=len(self.data.train), num_features=0, num_outputs=0)

    def _build_validation(self, info: data_mod.DatasetInfo) -> None:
        self._build_workload()  # no transform: the Dataset makes each sample

    def _epochs(self, first_epoch: int, first: int) -> Any:
        assert self.spec.schedule is not None
        return self.data.epochs(first_epoch, first, self.stop_epoch)

    def _validate(self) -> dict[str, float]:
        return self.batch_validation.run(self.model, self.data.validation(), dummy=self.last_batch)

    def close(self) -> None:
        BuiltinLoop.close(self)  # not the columns form's: no transform pool
        self.data.close()
