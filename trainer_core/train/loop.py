"""The per-worker training loop (runs inside Ray Train workers).

It reaches Ray through ``execution.worker_api`` only (its rank, device, DDP wrapper and a
drain's notice). The built-in loop never reports to Ray: metrics reach the driver through a
relay actor without blocking the step (``metric_rows``), and checkpoints are relaytrain's own
(committed with a manifest and marker). Registering them with Ray would add a second, lagging
source of truth whose snapshot refuses to load once retention deletes a checkpoint it lists.

Resume is exact: model, optimizer, LR schedule, every rank's RNG states and the data cursor are
restored from the newest checkpoint that every rank can verify against its manifest. The loop
says when to save and what the manifest carries; ``checkpoint.manager`` owns the rest (state
keys, file names, staging, the background write, the commit). One optimizer step and the run's
precision are ``steps``'; a validation pass is ``validate.RankValidation``.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer_core.checkpoint import optimizers, schedules, training_state
from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data import rank_stream
from trainer_core.execution import worker_api
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import (
    Relay,
    Timings,
    all_reduce,
    gather_nodes,
    share_peak_rss,
)
from trainer_core.spec.imports import import_object
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import validate, workloads
from trainer_core.train.faults import Faults
from trainer_core.train.group_start import Progress, rank_data, resume_candidates
from trainer_core.train.metric_rows import MetricRows
from trainer_core.train.preemption import DrainWatch
from trainer_core.train.step_clock import StepClock
from trainer_core.train.steps import (
    Precision,
    accumulate_gradients,
    optimizer_step,
    optimizer_steps,
)

logger = logging.getLogger("relaytrain.worker")


class BuiltinLoop:
    """One worker's side of a run of the built-in loop."""

    def __init__(self, config: WorkerConfig):
        self.rank, self.world_size = worker_api.rank_and_world_size()
        #: Where the model, every batch and the validation data live (a GPU with use_gpu).
        self.device = worker_api.device()
        self.config = config
        self.spec = RunSpec.model_validate(config.spec)
        assert self.spec.model and self.spec.data and self.spec.schedule
        self.run_dir = RunDirectory.of(config.storage_uri, config.run_name, config.lease_owner)
        self.relay = Relay(config.relay, self.rank, config.marks, config.earlier_marks)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.data_spec = self.spec.data.resolved()
        info = self._build_data()
        #: Micro-batches (global batches) per optimizer step; steps and checkpoints count
        #: optimizer steps, the cursor global batches.
        self.accumulation = self.spec.optimizer.grad_accumulation
        self.total_steps = self.spec.schedule.epochs * data_mod.steps_per_epoch(
            self.data.batches_per_epoch, self.accumulation
        )
        #: The epoch (counted from 1) this attempt stops after: the run's last, or the one it
        #: pauses after (``WorkerConfig.until_epoch``), its checkpoint committed.
        epochs = self.spec.schedule.epochs
        self.stop_epoch = min(config.until_epoch or epochs, epochs)
        self._build_model(info)
        training_state.seed_everything(self.spec.run.seed * 1009 + self.rank + 1)  # per-rank RNG
        self.progress = Progress()
        self.group = 0  # worker groups of this attempt before this one (in-place restarts)
        self.current_step = 0
        self.timings = Timings()
        self.rows = MetricRows(self.relay, self.timings, self.world_size, config.attempt, self.rank)
        #: Where each report window's time goes (restarted when training begins).
        self.clock = StepClock(self.device, self.timings)
        self.checkpoints = CheckpointManager(
            self.run_dir,
            self.spec.checkpoint,
            TrainingState(self.model, self.optimizer, self.scheduler, self.precision.scaler),
            rank=self.rank,
            world_size=self.world_size,
            attempt=config.attempt,
            relay=self.relay,
            timings=self.timings,
            dcp=self.fsdp,
            node_rank=worker_api.node_rank(),
        )
        self.drains = DrainWatch(
            config.watch_preemption, self.rank, self.relay, self.checkpoints, self.timings
        )

    def _build_data(self) -> data_mod.DatasetInfo:
        """This rank's stream (``self.data``); returns the dataset's info."""
        #: This rank's slice of every global batch, and its share of the validation rows.
        self.data, info = rank_data(
            self.config, self.data_spec, self.spec.run.seed, self.world_size, self.rank
        )
        return info

    def _build_model(self, info: data_mod.DatasetInfo) -> None:
        """The model (identical initial weights on every rank; sharded under FSDP before its
        optimizer holds its parameters), optimizer, schedule, loss, precision and validation."""
        spec = self.spec
        assert spec.model and spec.schedule
        training_state.seed_everything(spec.run.seed)  # identical initial weights
        self.model = self._new_model(info)
        self.fsdp = spec.scaling.strategy == "fsdp"
        if self.fsdp:
            shard_fn = spec.scaling.shard_fn
            self.model = worker_api.shard_model(
                self.model,
                import_object(shard_fn, "scaling.shard_fn") if shard_fn else None,
            )
        self.optimizer = optimizers.make_optimizer(self.model.parameters(), spec.optimizer)
        self.built_hyperparameters = optimizers.hyperparameters(self.optimizer)
        self.scheduler = schedules.make_scheduler(self.optimizer, spec.schedule, self.total_steps)
        self.stopping = training_state.EarlyStopping()
        self.precision = Precision(spec.precision, self.device)
        self._build_validation(info)

    def _new_model(self, info: data_mod.DatasetInfo) -> torch.nn.Module:
        """The spec's model for a dataset of ``info``'s features and outputs."""
        assert self.spec.model
        return workloads.build_model(self.spec.model, info.num_features, info.num_outputs)

    def _build_validation(self, info: data_mod.DatasetInfo) -> None:
        """The loss, and the validation pass that measures it with the metrics."""
        self.loss_fn = workloads.loss_function(
            self.data_spec.task or "classification", self.spec.loss
        )
        self.validation = validate.RankValidation(
            self.loss_fn,
            workloads.metric_functions(list(self.spec.metrics)),
            self.data_spec.task == "classification",
            self.precision.autocast,
            self._to_device,
            fsdp=self.fsdp,
            num_features=info.num_features,
            world_size=self.world_size,
        )

    # -- resume --------------------------------------------------------------------------------

    def restore(self) -> None:
        self.group, candidates = resume_candidates(self.config, self.relay, self.run_dir)
        self.faults.group = self.group
        loaded = self.checkpoints.load(candidates)
        checkpoint = loaded.checkpoint
        if checkpoint is not None:
            manifest = checkpoint.manifest
            self.stopping = training_state.EarlyStopping.from_json(manifest.get("early_stopping"))
            kept = optimizers.kept_by_checkpoint(self.built_hyperparameters, self.optimizer)
            for changed in (self.scheduler.changed, kept):
                if self.rank == 0 and changed:
                    logger.warning("resumed under another spec, %s", changed)
            self.progress = Progress(
                step=checkpoint.step,
                cursor=data_mod.Cursor.from_json(manifest["cursor"]),
                resumed_from=checkpoint.step,
            )
            self.rows.latest = dict(manifest.get("metrics") or {})
            # What the restore cost: bytes read from storage by the whole group, and the
            # slowest rank's seconds.
            read = all_reduce([float(loaded.bytes_read)])[0]
            seconds = all_reduce([loaded.seconds], dist.ReduceOp.MAX)[0]
            self.relay.send(
                "resumed",
                step=checkpoint.step,
                checkpoint_uri=checkpoint.uri,
                skipped=loaded.skipped,
                bytes_read=int(read),
                restore_s=round(seconds, 4),
                checkpoint_created_at=manifest.get("created_at"),
                group=self.group,
                world_size=self.world_size,
            )
            return
        warm_start = self.spec.run.init_from
        if warm_start:
            self.checkpoints.load_weights(warm_start)
        self.relay.send(
            "fresh_start",
            skipped=loaded.skipped,
            warm_start=warm_start,
            group=self.group,
            world_size=self.world_size,
        )

    # -- steps ---------------------------------------------------------------------------------

    def run(self) -> None:
        # On the device before restoring: the optimizer casts loaded state to its parameters'.
        self.model.to(self.device)
        self.restore()
        ddp_model = (
            self.model
            if self.fsdp
            else worker_api.prepare_model(self.model, self.spec.scaling.ddp.kwargs())
        )
        self.rows.watch_stragglers(gather_nodes(self.world_size))
        self.clock = StepClock(self.device, self.timings, self.spec.report.step_time)
        self.clock.watch_allreduce(ddp_model)
        schedule = self.spec.schedule
        assert schedule is not None
        cursor = self.progress.cursor
        step = self.progress.step
        # An early-stopped run's last checkpoint says so: nothing is left to train.
        first_epoch = schedule.epochs if self.stopping.stopped else cursor.epoch
        epochs = self._epochs(first_epoch, cursor.batch(self.data_spec.batch_size))
        try:
            for epoch, ahead in self.timings.waited(iter(epochs)):
                ddp_model.train()
                steps = self.timings.waited(optimizer_steps(ahead, self.accumulation))
                for end, micro_batches in steps:
                    step += 1
                    self._train_step(ddp_model, step, epoch, end, micro_batches)
                    if self.stopping.stopped:
                        break
                if self.stopping.stopped:
                    break
        finally:
            started = time.perf_counter()
            epochs.close()
            self.timings.data_wait_s += time.perf_counter() - started
        self.rows.aggregate({}, flush=True)
        share_peak_rss(self.relay)
        started = time.perf_counter()
        self.checkpoints.wait()
        self.timings.checkpoint_wait_s += time.perf_counter() - started
        if step == self.progress.step and step > 0 and self.checkpoints.last_step == step:
            self.relay.send("already_complete", step=step)
        self.relay.finished(
            step=step,
            metrics=self.rows.latest,
            timings=self.timings.to_json(),
            stopped=self.stopping.stopped,
        )

    def _train_step(
        self,
        ddp_model: torch.nn.Module,
        step: int,
        epoch: int,
        end: int,
        micro_batches: list[data_mod.Arrays],
    ) -> None:
        """Optimizer step ``step``, which ends with global batch ``end - 1`` of ``epoch``; then
        what is due after it: metrics, validation and early stopping at the end of the epoch,
        a checkpoint."""
        started = time.perf_counter()
        copy_wait = self.timings.checkpoint_copy_wait_s
        loss, grad_norm = self._step(ddp_model, micro_batches, step)
        self.relay.completed(step)
        copy_wait = self.timings.checkpoint_copy_wait_s - copy_wait
        self.timings.step_s += time.perf_counter() - started - copy_wait
        if step == self.progress.step + 1:  # the optimizer state exists now
            self.checkpoints.reserve()
        if self.checkpoints.failed():
            self.checkpoints.wait()  # raises the checkpoint's error
        self.timings.num_steps += 1
        lr = self.optimizer.param_groups[0]["lr"]
        index = (end - 1) // self.accumulation  # the step's place in its epoch
        row = {"step": step, "epoch": epoch, "batch": index, "loss": loss, "lr": lr}
        if grad_norm is not None:
            row["grad_norm"] = grad_norm
        self.rows.add(row)
        self._after_step(ddp_model, step, epoch, end)

    def _after_step(self, ddp_model: torch.nn.Module, step: int, epoch: int, end: int) -> None:
        """What is due after optimizer step ``step`` (ending at global batch ``end - 1`` of
        ``epoch``): validation and early stopping at the end of the epoch, the metrics window, a
        checkpoint, a drain's hold."""
        end_of_epoch = end == self.data.batches_per_epoch
        extra: dict[str, float] = {}
        stop = False
        if end_of_epoch:
            with self.clock.part("validation"):
                extra = self._validate()
                stop = self._should_stop(epoch, extra)
            self.scheduler.at_epoch_end(extra)  # before the epoch's checkpoint records it
            ddp_model.train()
        # A validation is followed by a checkpoint of the weights it measured: only those
        # checkpoints carry val_* metrics, so only they are ranked (keep_best, best exports).
        should_checkpoint = (
            step % self.spec.checkpoint.every == 0
            or (end_of_epoch and (epoch == self.stop_epoch - 1 or bool(extra)))
            or stop
        )
        at_report = step % self.spec.report.every == 0 or end_of_epoch or should_checkpoint
        notice = self.drains.new_notice() if at_report else None
        should_checkpoint = should_checkpoint or notice is not None
        if at_report:
            started = time.perf_counter()
            self.rows.aggregate(extra, flush=should_checkpoint, times=self.clock.window())
            self.timings.aggregate_s += time.perf_counter() - started
            self.timings.num_aggregates += 1
        if should_checkpoint:
            next_cursor = (
                data_mod.Cursor(epoch + 1, 0)
                if end_of_epoch
                else data_mod.Cursor(epoch, end * self.data_spec.batch_size)
            )
            with self.clock.part("checkpoint"):
                self._checkpoint(step, next_cursor)
        if notice is not None:
            self.drains.hold(step, notice)

    def _should_stop(self, epoch: int, measured: dict[str, float]) -> bool:
        """Early stopping's verdict after ``epoch`` (the same on every rank: the metrics are
        all-reduced); the state goes into every later checkpoint."""
        section = self.spec.schedule.early_stopping if self.spec.schedule else None
        if section is None:
            return False
        return self.stopping.update(section, epoch + 1, measured.get(section.metric))

    def _step(
        self, model: torch.nn.Module, micro_batches: list[data_mod.Arrays], step: int
    ) -> tuple[float, float | None]:
        """One optimizer step over ``micro_batches``: the loss (mean over the step's samples)
        and, with clipping, the gradients' norm before it."""
        self.current_step = step
        self.faults.check(step)
        self.optimizer.zero_grad(set_to_none=True)
        value = self._gradients(model, micro_batches)
        self.checkpoints.before_optimizer_step()
        with self.clock.part("optimizer"):
            grad_norm = optimizer_step(
                self.optimizer,
                self.model,
                self.spec.optimizer.clip_grad_norm,
                self.precision.scaler,
            )
            self.scheduler.after_optimizer_step()
        self.precision.check_loss(value, step, self.rank)
        return value, grad_norm

    def _gradients(self, model: torch.nn.Module, micro_batches: list[Any]) -> float:
        """The step's gradients over its micro-batches; returns the step's loss."""
        with self.clock.part("h2d"):
            batches = [
                (self._to_device(m.features), self._to_device(m.labels)) for m in micro_batches
            ]
        with self.clock.part("forward_backward"):
            loss = accumulate_gradients(
                model,
                batches,
                self.loss_fn,
                self.precision.autocast,
                self.precision.scale(),
                self.data.weight,
            )
            return loss.item()

    def _epochs(self, first_epoch: int, first: int) -> rank_stream.Epochs:
        """The run's epochs from global batch ``first`` of ``first_epoch`` on, this rank's
        slice of each batch, read ahead (the next epoch's first batches during this one's end:
        ``rank_stream.Epochs``)."""
        assert self.spec.schedule is not None
        return self.data.epochs(first_epoch, first, self.stop_epoch)

    def _validate(self) -> dict[str, float]:
        """The validation metrics over every rank's validation rows."""
        return self.validation.run(self.model, self.data.validation())

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A batch as a tensor on the model's device (the same tensor, no copy, on the CPU)."""
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    # -- checkpoints -----------------------------------------------------------------------------

    def _checkpoint(self, step: int, cursor: data_mod.Cursor) -> None:
        """A checkpoint at ``step``, resuming at ``cursor``; the metric rows since the last one
        go with it."""
        meta: dict[str, Any] = {
            "epoch": cursor.epoch,
            "cursor": cursor.to_json(),
            "metrics": dict(self.rows.latest),
        }
        if self.spec.schedule and self.spec.schedule.early_stopping:
            meta["early_stopping"] = self.stopping.to_json()
        self.checkpoints.save(step, meta, self.rows.take_unsaved())
        share_peak_rss(self.relay)

    def close(self) -> None:
        """Stop the background work: the checkpoint writer."""
        self.checkpoints.close()
