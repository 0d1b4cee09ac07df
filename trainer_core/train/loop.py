"""The per-worker training loop (runs inside Ray Train workers).

It reaches Ray through ``execution.worker_api`` only (its rank, device, DDP wrapper and a drain's
notice). The built-in loop never reports to Ray: metrics
reach the driver through a relay actor without blocking the step, and checkpoints are
relaytrain's own (committed with a manifest and marker). Registering them with Ray would add a
second, lagging source of truth whose snapshot refuses to load once retention deletes a
checkpoint it lists.

Resume is exact: model, optimizer, LR schedule, every rank's RNG states and the data cursor are
restored from the newest checkpoint that every rank can verify against its manifest. The loop
says when to save and what the manifest carries; ``checkpoint.manager`` owns the rest (state
keys, file names, staging, the background write, the commit).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data import dataset_snapshot, footers, rank_stream, stream
from trainer_core.errors import InfrastructureError, RelaytrainError, TrainingCodeError
from trainer_core.execution import worker_api
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import (
    Relay,
    Timings,
    all_reduce,
    collective_device,
    peak_rss_mb,
)
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import validate, workloads
from trainer_core.train.preemption import DrainWatch
from trainer_core.train.steps import (
    NonFiniteLosses,
    accumulate_gradients,
    optimizer_step,
    optimizer_steps,
)
from trainer_core.train.worker import Faults, worker_error

logger = logging.getLogger("relaytrain.worker")


# -- the built-in loop ---------------------------------------------------------------------------

#: ``precision`` -> the dtype autocast computes in (fp32: no autocast).
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Progress:
    step: int = 0
    cursor: data_mod.Cursor = field(default_factory=lambda: data_mod.Cursor(0, 0))
    metrics: dict[str, float] = field(default_factory=dict)
    resumed_from: int | None = None


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
        self.relay = Relay(config.relay, self.rank)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.data_spec = self.spec.data.resolved()
        # The run's dataset snapshot, as the driver pinned it: no rank lists the dataset.
        if config.dataset is not None:
            layout = dataset_snapshot.from_json(config.dataset["snapshot"], self.data_spec)
            info = data_mod.DatasetInfo(**config.dataset["info"])
        else:  # generated data
            layout = footers.scan(self.data_spec)
            info = stream.describe(layout, self.data_spec)
        #: This rank's slice of every global batch, and its share of the validation rows.
        self.data = rank_stream.RankStream(
            layout, self.data_spec, self.spec.run.seed, self.world_size, self.rank
        )
        #: Micro-batches (global batches) per optimizer step; steps and checkpoints count
        #: optimizer steps, the cursor global batches.
        self.accumulation = self.spec.optimizer.grad_accumulation
        self.total_steps = self.spec.schedule.epochs * data_mod.steps_per_epoch(
            self.data.batches_per_epoch, self.accumulation
        )
        training_state.seed_everything(self.spec.run.seed)  # identical initial weights
        self.num_features = info.num_features
        self.model = workloads.build_model(self.spec.model, info.num_features, info.num_outputs)
        #: FSDP: the model is sharded before its optimizer holds its parameters.
        self.fsdp = self.spec.scaling.strategy == "fsdp"
        if self.fsdp:
            shard_fn = self.spec.scaling.shard_fn
            self.model = worker_api.shard_model(
                self.model,
                workloads.import_object(shard_fn, "scaling.shard_fn") if shard_fn else None,
            )
        self.optimizer = training_state.make_optimizer(self.model.parameters(), self.spec.optimizer)
        self.scheduler = training_state.make_scheduler(
            self.optimizer, self.spec.schedule, self.total_steps
        )
        self.loss_fn = workloads.loss_function(
            self.data_spec.task or "classification", self.spec.loss
        )
        self.metric_fns = workloads.metric_functions(list(self.spec.metrics))
        self.stopping = training_state.EarlyStopping()
        #: Autocast's dtype (None: fp32), and fp16's gradient scaler.
        self.autocast_dtype = AUTOCAST_DTYPES.get(self.spec.precision)
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.spec.precision == "fp16" else None
        )
        self.nonfinite = NonFiniteLosses(scaled=self.scaler is not None)
        training_state.seed_everything(self.spec.run.seed * 1009 + self.rank + 1)  # per-rank RNG
        self.progress = Progress()
        self.group = 0  # worker groups of this attempt before this one (in-place restarts)
        self.pending: list[dict[str, Any]] = []  # rows not yet aggregated across ranks
        self.unsaved: list[dict[str, Any]] = []  # rows not yet in a metrics segment
        self.current_step = 0
        self.completed_step = 0
        self.timings = Timings()
        self.in_flight: list[tuple[Any, torch.Tensor, list[dict[str, Any]], dict]] = []
        self.checkpoints = CheckpointManager(
            self.run_dir,
            self.spec.checkpoint,
            TrainingState(self.model, self.optimizer, self.scheduler, self.scaler),
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

    # -- resume --------------------------------------------------------------------------------

    def _candidates(self) -> list[int]:
        """Committed steps to try, newest first. The driver's scan for an attempt's first worker
        group; after an in-place restart (the same attempt, no new plan) rank 0 scans again,
        for what the lost group committed, and tells the others."""
        group = int(all_reduce([float(self.relay.begin_group())])[0])
        self.faults.group = group
        self.group = group
        if group == 0:
            return list(self.config.candidates)
        found = [[c.step for c in reversed(self.run_dir.scan().committed)]]
        dist.broadcast_object_list(found, src=0)
        return list(found[0])

    def restore(self) -> None:
        loaded = self.checkpoints.load(self._candidates())
        checkpoint = loaded.checkpoint
        if checkpoint is not None:
            manifest = checkpoint.manifest
            self.stopping = training_state.EarlyStopping.from_json(manifest.get("early_stopping"))
            if self.rank == 0 and self.scheduler.changed:
                logger.warning("resumed under another spec, %s", self.scheduler.changed)
            self.progress = Progress(
                step=checkpoint.step,
                cursor=data_mod.Cursor.from_json(manifest["cursor"]),
                metrics=dict(manifest.get("metrics") or {}),
                resumed_from=checkpoint.step,
            )
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
        ddp_model = self.model if self.fsdp else worker_api.prepare_model(self.model)
        schedule = self.spec.schedule
        assert schedule is not None
        cursor = self.progress.cursor
        step = self.progress.step
        # An early-stopped run's last checkpoint says so: nothing is left to train.
        first_epoch = schedule.epochs if self.stopping.stopped else cursor.epoch
        for epoch in range(first_epoch, schedule.epochs):
            first = cursor.batch(self.data_spec.batch_size) if epoch == cursor.epoch else 0
            ddp_model.train()
            ahead = self.data.epoch(epoch, first)
            try:
                for end, micro_batches in optimizer_steps(ahead, self.accumulation):
                    step += 1
                    self._train_step(ddp_model, step, epoch, end, micro_batches)
                    if self.stopping.stopped:
                        break
            finally:
                ahead.close()
            if self.stopping.stopped:
                break
        self._aggregate({}, flush=True)
        self._share_peak_rss()
        started = time.perf_counter()
        self.checkpoints.wait()
        self.timings.checkpoint_wait_s += time.perf_counter() - started
        if step == self.progress.step and step > 0 and self.checkpoints.last_step == step:
            self.relay.send("already_complete", step=step)
        self.relay.send(
            "finished",
            step=step,
            metrics=self.progress.metrics,
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
        schedule = self.spec.schedule
        assert schedule is not None
        started = time.perf_counter()
        copy_wait = self.timings.checkpoint_copy_wait_s
        loss, grad_norm = self._step(ddp_model, micro_batches, step)
        self.completed_step = step
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
        self.pending.append(row)
        end_of_epoch = end == self.data.batches_per_epoch
        extra: dict[str, float] = {}
        stop = False
        if end_of_epoch:
            extra = self._evaluate()
            stop = self._should_stop(epoch, extra)
            ddp_model.train()
        # A validation is followed by a checkpoint of the weights it measured: only those
        # checkpoints carry val_* metrics, so only they are ranked (keep_best, best exports).
        should_checkpoint = (
            step % self.spec.checkpoint.every == 0
            or (end_of_epoch and (epoch == schedule.epochs - 1 or bool(extra)))
            or stop
        )
        at_report = step % self.spec.report.every == 0 or end_of_epoch or should_checkpoint
        notice = self.drains.new_notice() if at_report else None
        should_checkpoint = should_checkpoint or notice is not None
        if at_report:
            started = time.perf_counter()
            self._aggregate(extra, flush=should_checkpoint)
            self.timings.aggregate_s += time.perf_counter() - started
            self.timings.num_aggregates += 1
        if should_checkpoint:
            next_cursor = (
                data_mod.Cursor(epoch + 1, 0)
                if end_of_epoch
                else data_mod.Cursor(epoch, end * self.data_spec.batch_size)
            )
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
        loss = accumulate_gradients(
            model,
            [(self._to_device(m.features), self._to_device(m.labels)) for m in micro_batches],
            self.loss_fn,
            self._autocast,
            None if self.scaler is None else self.scaler.scale,
            self.data.weight,
        )
        self.checkpoints.before_optimizer_step()
        grad_norm = optimizer_step(
            self.optimizer, self.model, self.spec.optimizer.clip_grad_norm, self.scaler
        )
        self.scheduler.step()
        value = loss.item()
        if self.nonfinite.should_stop(value):
            where = f"loss became {value} at step {step} on rank {self.rank}"
            fix = "lower optimizer.lr, check the data for NaN/inf, or add gradient clipping"
            if self.scaler is not None:  # an overflow that lowering the scale did not cure
                where += (
                    f", {self.nonfinite.in_a_row} fp16 steps in a row (the gradient scaler "
                    f"skipped them, its scale is down to {self.scaler.get_scale():g})"
                )
                fix = f"use precision bf16 or fp32, {fix}"
            raise TrainingCodeError(
                f"{where}: {fix} in your model",
                error_type="NonFiniteLoss",
                step=step,
                rank=self.rank,
                deterministic=True,
            )
        return value, grad_norm

    def _autocast(self) -> Any:
        """Autocast to ``precision``'s dtype on the model's device (a no-op for fp32)."""
        return torch.autocast(
            self.device.type,
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        )

    def _to_device(self, array: np.ndarray) -> torch.Tensor:
        """A batch as a tensor on the model's device (the same tensor, no copy, on the CPU)."""
        return torch.from_numpy(array).to(self.device, non_blocking=True)

    @torch.no_grad()
    def _evaluate(self) -> dict[str, float]:
        self._broadcast_buffers()
        self.model.eval()
        classification = self.data_spec.task == "classification"
        names = validate.metric_names(classification, self.metric_fns)
        # Per-sample means, as sums over this rank's rows: all-reduced once, then divided.
        sums = dict.fromkeys(names, 0.0)
        seen = 0
        for part in self._validation_parts():
            if part is None:  # FSDP: this rank's rows are done, the others' are not
                with self._autocast():
                    self.model(torch.zeros(1, self.num_features, device=self.device))
                continue
            features = self._to_device(part.features)
            labels = self._to_device(part.labels)
            with self._autocast():
                output = self.model(features)
                loss = self.loss_fn(output, labels)
            part_sums = validate.part_sums(output, labels, loss, classification, self.metric_fns)
            for name, value in part_sums.items():
                sums[name] += value
            seen += len(part)
        *totals, count = all_reduce([*sums.values(), float(seen)])
        if count == 0:
            return {}
        return {name: total / count for name, total in zip(names, totals, strict=True)}

    def _broadcast_buffers(self) -> None:
        """Every rank validates with rank 0's buffers (batch norm's running statistics), the
        ones a checkpoint saves. DDP broadcasts them from rank 0 before each training forward
        pass, which then updates each rank's from its own slice of the batch: after the last
        one they differ by rank (and FSDP never syncs them)."""
        if self.world_size > 1:
            for buffer in self.model.buffers():
                dist.broadcast(buffer, src=0)

    def _validation_parts(self) -> Any:
        """This rank's validation rows, in parts. Under FSDP every forward pass is a collective
        (each layer's parameters are gathered), so every rank runs as many as the rank with the
        most parts: one with none left gets None (a forward pass on a dummy row)."""
        if not self.fsdp:
            yield from self.data.validation()
            return
        parts = self.data.validation()
        while True:
            part = next(parts, None)
            if all_reduce([float(part is not None)])[0] == 0:
                return
            yield part

    def _aggregate(self, extra: dict[str, float], *, flush: bool = False) -> None:
        """Average the pending per-step losses across ranks: one collective per window.

        The collective runs asynchronously (gloo's thread) and is completed at the next window,
        so training does not wait for it; ``flush`` completes everything (before a checkpoint
        records its metrics, and at the end).
        """
        if self.pending:
            losses = torch.tensor(
                [row["loss"] for row in self.pending],
                dtype=torch.float64,
                device=collective_device(),
            )
            work = dist.all_reduce(losses, async_op=True)
            self.in_flight.append((work, losses, self.pending, extra))
            self.pending = []
        while self.in_flight and (flush or len(self.in_flight) > 1):
            work, losses, rows, window_extra = self.in_flight.pop(0)
            work.wait()
            self._publish(rows, (losses / self.world_size).tolist(), window_extra)

    def _publish(self, pending: list[dict[str, Any]], means: list[float], extra: dict) -> None:
        now = time.time()
        rows = [
            {**row, "loss": mean, "attempt": self.config.attempt, "time": now}
            for row, mean in zip(pending, means, strict=True)
        ]
        rows[-1].update(extra)
        self.unsaved.extend(rows)
        # The newest step's metrics alone: a checkpoint's manifest records these, so a
        # validation's figures never outlive the weights they were measured on.
        self.progress.metrics = {
            "step": rows[-1]["step"],
            "epoch": rows[-1]["epoch"],
            "loss": rows[-1]["loss"],
            **extra,
        }
        started = time.perf_counter()
        self.relay.send("metrics", rows=rows)
        self.timings.relay_s += time.perf_counter() - started

    # -- checkpoints -----------------------------------------------------------------------------

    def _checkpoint(self, step: int, cursor: data_mod.Cursor) -> None:
        """A checkpoint at ``step``, resuming at ``cursor``; the metric rows since the last one
        go with it."""
        rows, self.unsaved = self.unsaved, []
        meta: dict[str, Any] = {
            "epoch": cursor.epoch,
            "cursor": cursor.to_json(),
            "metrics": dict(self.progress.metrics),
        }
        if self.spec.schedule and self.spec.schedule.early_stopping:
            meta["early_stopping"] = self.stopping.to_json()
        self.checkpoints.save(step, meta, rows)
        self._share_peak_rss()

    def _share_peak_rss(self) -> None:
        """The largest peak resident memory of any rank so far, to the driver (one small
        collective, at each checkpoint and at the end)."""
        peak = torch.tensor([peak_rss_mb()], dtype=torch.float64, device=collective_device())
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        self.relay.send("memory", peak_worker_rss_mb=round(float(peak), 1))


def builtin_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` of the built-in loop."""
    worker_config = WorkerConfig.from_dict(config)
    loop = None
    try:
        loop = BuiltinLoop(worker_config)
        loop.run()
    except RelaytrainError as e:
        final = _wind_down(loop, e)
        if final is e:
            raise
        raise final from e
    except Exception as e:
        raise _wind_down(loop, _as_code_error(e, loop)) from e
    finally:
        if loop is not None:
            loop.checkpoints.close()


#: How long a failing worker lets its checkpoint in flight finish before it exits.
SETTLE_S = 60.0


def _wind_down(loop: BuiltinLoop | None, error: RelaytrainError) -> RelaytrainError:
    """Before an error ends the worker: finish the checkpoint in flight (what it commits is
    work not lost), then push the buffered metric rows. Returns the error to raise: the
    checkpoint's own, when it is the training code failing at an earlier step (the weights a
    checkpoint was refused for went bad before the loss did)."""
    if loop is None:
        return error
    earlier = loop.checkpoints.settle(SETTLE_S)
    try:
        loop.relay.flush()
        if isinstance(error, InfrastructureError) and loop.completed_step:
            loop.relay.outlived_rank_0(loop.completed_step, loop.group)
    except Exception:  # the relay is best effort; the error being raised matters more
        logger.debug("relay flush failed", exc_info=True)
    if (
        isinstance(earlier, TrainingCodeError)
        and isinstance(error, TrainingCodeError)
        and (earlier.step or 0) < (error.step or 0)
    ):
        return earlier
    return error


def _as_code_error(
    error: BaseException, loop: BuiltinLoop | None
) -> TrainingCodeError | InfrastructureError:
    step = None
    rank = None
    if loop is not None:
        rank = loop.rank
        step = loop.current_step or None
    return worker_error(error, where=f"at step {step}", step=step, rank=rank)
