"""relaytrain's API for a training loop of your own (``train_loop_api: relaytrain``).

Your loop keeps relaytrain's guarantees, as Lightning Fabric keeps Lightning's in a loop of
its own: ``session()`` hands it this worker's side of the run.

- ``setup(model, optimizer, scheduler)`` restores the newest committed checkpoint every rank
  can verify (model, optimizer, scheduler, every rank's RNG, the data cursor) and returns the
  model wrapped for DDP;
- ``batches()`` is the run's data stream from its cursor: this rank's slice of each global
  batch, the same rows in the same order for any worker count, through ``data.transform``;
- ``report(metrics)`` ends the step of the batch just handed out: the row goes to the run's
  history and the driver, and a checkpoint in relaytrain's committed format is taken when
  ``checkpoint.every`` or the epoch's end says (retention, keep-best, exports as the built-in
  loop's).

A fault, a retry or an in-place restart resumes the loop at the step after the checkpoint, with
the same batches and RNG it would have had: bit-identical to a run without the fault.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import torch

from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data.transform import Batches, TransformPool
from trainer_core.errors import RelaytrainError, SpecError
from trainer_core.execution import worker_api
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import (
    Relay,
    Timings,
    all_reduce,
    gather_nodes,
    share_peak_rss,
)
from trainer_core.spec.run_spec import RunSpec
from trainer_core.step_time import Stragglers, own_row, window_fields
from trainer_core.train import workloads
from trainer_core.train.failure import wind_down, worker_error
from trainer_core.train.faults import Faults
from trainer_core.train.group_start import rank_data, resume_candidates
from trainer_core.train.metric_rows import report_row
from trainer_core.train.preemption import DrainWatch
from trainer_core.train.step_clock import StepClock
from trainer_core.train.steps import batch_to_device

logger = logging.getLogger("relaytrain.own_loop")

#: The run of the loop this worker process runs now (``session()``).
_current: OwnLoop | None = None


def _misuse(message: str) -> SpecError:
    """The API used out of order: the loop's code, which a retry would run the same way, so
    no retry is spent on it."""
    return SpecError(f"relaytrain's own-loop API: {message}", field="train_loop")


def session() -> OwnLoop:
    """This worker's side of the run, inside a ``train_loop`` that relaytrain runs with
    ``train_loop_api: relaytrain``."""
    if _current is None:
        raise RuntimeError(
            "own_loop.session() is relaytrain's API inside a train_loop run with "
            "train_loop_api: relaytrain: set it in the spec (with data and schedule), or use "
            "ray.train's API with train_loop_api: ray"
        )
    return _current


class OwnLoop:
    """One worker's side of a run of a loop of the user's own: data, checkpoints, reports."""

    def __init__(self, config: WorkerConfig):
        self.rank, self.world_size = worker_api.rank_and_world_size()
        #: Where the model and every batch live (a GPU with scaling.use_gpu).
        self.device = worker_api.device()
        self.config = config
        self.spec = RunSpec.model_validate(config.spec)
        assert self.spec.data is not None and self.spec.schedule is not None
        self.run_dir = RunDirectory.of(config.storage_uri, config.run_name, config.lease_owner)
        self.relay = Relay(config.relay, self.rank)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.timings = Timings()
        #: Where each report window's time goes; the straggler rule over the windows.
        self.clock = StepClock(self.device, self.timings)
        self.stragglers: Stragglers | None = None
        self._window_steps = 0
        data_spec = self.spec.data.resolved()
        self.batch_size = data_spec.batch_size
        #: The transform workers, started while the stream and the user's model are built.
        self._pool = TransformPool(data_spec).warm() if data_spec.columns_form else None
        self.data, _ = rank_data(config, data_spec, self.spec.run.seed, self.world_size, self.rank)
        seed, pool = self.spec.run.seed, self._pool
        self._train_batches = Batches(data_spec, seed, pool=pool) if pool else None
        self._eval_batches = Batches(data_spec, seed, training=False, pool=pool) if pool else None
        #: Epochs of the run, global batches per epoch, optimizer steps in all.
        self.epochs = self.spec.schedule.epochs
        self.batches_per_epoch = self.data.batches_per_epoch
        self.total_steps = self.epochs * self.batches_per_epoch
        #: The factor for this rank's mean loss so that DDP's average of the ranks' gradients
        #: is the global batch's mean: its share of each global batch times the world size
        #: (1.0 when the workers divide data.batch_size; else the slices differ by one row).
        self.loss_weight = self.data.weight
        self.checkpoints: CheckpointManager | None = None
        self._batches_called = False
        self.group = 0
        #: The steps done (the last reported), where the next batch is, where this group began.
        self.step = 0
        #: Where this worker group's batches begin (the restored checkpoint's cursor).
        self.cursor = data_mod.Cursor(0, 0)
        self.resumed_from = 0
        #: The batch handed out: its epoch, the index after it in its epoch, whether it ends it.
        self.epoch = 0
        self._end = 0
        self.end_of_epoch = False
        self._open = False
        self._after = data_mod.Cursor(0, 0)
        self._metrics: dict[str, Any] = {}
        self.latest: dict[str, Any] = {}
        self.unsaved: list[dict[str, Any]] = []
        training_state.seed_everything(self.spec.run.seed)  # identical initial weights

    # -- setup ---------------------------------------------------------------------------------

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
    ) -> torch.nn.Module:
        """Move ``model`` to this worker's device, restore the newest committed checkpoint
        (model, optimizer, ``scheduler``, every rank's RNG, the cursor) and return the model
        wrapped for DDP. Build the optimizer on the unwrapped model's parameters first."""
        if self.checkpoints is not None:
            raise _misuse("setup() was called twice: call it once, before batches()")
        model.to(self.device)
        training_state.seed_everything(self.spec.run.seed * 1009 + self.rank + 1)  # per rank
        self.checkpoints = CheckpointManager(
            self.run_dir,
            self.spec.checkpoint,
            TrainingState(model, optimizer, scheduler or training_state.NoSchedule()),
            rank=self.rank,
            world_size=self.world_size,
            attempt=self.config.attempt,
            relay=self.relay,
            timings=self.timings,
            node_rank=worker_api.node_rank(),
        )
        checkpoints = self.checkpoints
        self.drains = DrainWatch(
            self.config.watch_preemption, self.rank, self.relay, checkpoints, self.timings
        )
        self._restore(checkpoints)
        wrapped = worker_api.prepare_model(model)
        self.stragglers = Stragglers(gather_nodes(self.world_size))
        # The first window starts here.
        self.clock = StepClock(self.device, self.timings, self.spec.report.step_time)
        self.clock.watch_allreduce(wrapped)
        # The checkpoint thread copies the parameters while the next forward and backward run:
        # the optimizer waits for it before it changes them.
        self.clock.watch_optimizer(optimizer, checkpoints.before_optimizer_step)
        return wrapped

    def _restore(self, checkpoints: CheckpointManager) -> None:
        self.group, candidates = resume_candidates(self.config, self.relay, self.run_dir)
        self.faults.group = self.group
        loaded = checkpoints.load(candidates)
        checkpoint = loaded.checkpoint
        if checkpoint is None:
            if self.spec.run.init_from:
                checkpoints.load_weights(self.spec.run.init_from)
            self.relay.send(
                "fresh_start",
                skipped=loaded.skipped,
                warm_start=self.spec.run.init_from,
                group=self.group,
                world_size=self.world_size,
            )
            return
        self.step = self.resumed_from = checkpoint.step
        self.cursor = data_mod.Cursor.from_json(checkpoint.manifest["cursor"])
        self.latest = dict(checkpoint.manifest.get("metrics") or {})
        self.relay.send(
            "resumed",
            step=checkpoint.step,
            checkpoint_uri=checkpoint.uri,
            skipped=loaded.skipped,
            bytes_read=int(all_reduce([float(loaded.bytes_read)])[0]),
            restore_s=round(loaded.seconds, 4),
            group=self.group,
            world_size=self.world_size,
        )

    # -- data ----------------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """This rank's slice of each global batch from the cursor to the end of the run's last
        epoch, on this worker's device: the columns form's dict of tensors (through
        ``data.transform`` and ``data.collate``), or ``{"features", "labels"}`` for the tabular
        form. ``epoch`` and ``end_of_epoch`` say where the batch lies; ``report`` ends its step
        (a batch not reported is ended, with no metrics, when the next is asked for; one not
        reported when the loop returns is not counted)."""
        if self.checkpoints is None:
            raise _misuse(
                "batches() before setup(): call setup(model, optimizer, scheduler) first: it "
                "restores the newest checkpoint and the cursor the batches start from"
            )
        if self._batches_called:
            raise _misuse(
                "batches() was called a second time: it already hands out every batch from the "
                "cursor to the end of the run's last epoch, so a second pass would train the "
                "run again. Iterate over one batches() for the whole run (epoch and "
                "end_of_epoch say where each batch lies)"
            )
        self._batches_called = True
        first = self.cursor.batch(self.batch_size)
        start = self._train_batches.start if self._train_batches is not None else None
        epochs = self.data.epochs(self.cursor.epoch, first, self.epochs, start)
        try:
            for epoch, ahead in self.timings.waited(iter(epochs)):
                for index, _, rows in self.timings.waited(iter(ahead)):
                    self._end_step()
                    self.epoch, self._end = epoch, index + 1
                    self.end_of_epoch = self._end == self.batches_per_epoch
                    self._open, self._metrics = True, {}
                    with self.clock.part("h2d"):
                        batch = self._on_device(rows)
                    yield batch
        finally:
            epochs.close()
        self._end_step()

    def validation(self) -> Iterator[Any]:
        """This rank's share of the validation rows, in batches on this worker's device
        (through ``data.eval_transform``). Sum what you measure and its count over the ranks
        with ``sum_over_ranks``: the figure is then that of every validation row."""
        started = self.clock.start()
        try:
            if self._eval_batches is None:
                for rows in self.data.validation():
                    yield self._on_device(rows)
                return
            parts = self.data.validation_with_ids()
            for batch in self._eval_batches.each(0, parts, ahead=self.data.data.prefetch):
                yield self._on_device(batch)
        finally:
            self.clock.stop("validation", started)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """``values`` summed over every rank (a collective: every rank calls it alike)."""
        return all_reduce([float(v) for v in values])

    def _on_device(self, rows: Any) -> dict[str, Any]:
        if isinstance(rows, data_mod.Arrays):
            rows = {
                "features": torch.from_numpy(rows.features),
                "labels": torch.from_numpy(rows.labels),
            }
        return batch_to_device(rows, self.device)

    # -- steps ---------------------------------------------------------------------------------

    def report(self, metrics: dict[str, Any] | None = None) -> None:
        """End the step of the batch ``batches()`` handed out, with rank 0's ``metrics`` (numbers
        or one-element tensors; give every rank's figure through ``sum_over_ranks``): its row in
        the history, and a checkpoint when ``checkpoint.every`` steps or the epoch's end (or a
        drain's notice) say so. Report validation metrics at the epoch's last batch
        (``end_of_epoch``): the checkpoint of the weights they measured records them."""
        if not self._open:
            raise _misuse(
                "report() ends the step of the batch batches() handed out: call it once per "
                "batch, after the optimizer step"
            )
        self._metrics = dict(metrics or {})
        self._end_step()

    def _end_step(self) -> None:
        if not self._open:
            return
        self._open = False
        assert self.checkpoints is not None
        self.step += 1
        self.relay.completed_step = self.step
        self.faults.check(self.step)
        if self.step == self.resumed_from + 1:  # the optimizer state exists now
            self.checkpoints.reserve()
        if self.checkpoints.failed():
            self.checkpoints.wait()  # raises the checkpoint's error
        self.timings.num_steps += 1
        #: Where the next batch after this step is: the cursor of its checkpoint.
        self._after = (
            data_mod.Cursor(self.epoch + 1, 0)
            if self.end_of_epoch
            else data_mod.Cursor(self.epoch, self._end * self.batch_size)
        )
        row = {"step": self.step, "epoch": self.epoch, "batch": self._end - 1}
        row.update(report_row(self._metrics))
        self.latest = dict(row)
        due = self.step % self.spec.checkpoint.every == 0 or self.end_of_epoch
        at_report = due or self.step % self.spec.report.every == 0
        self._window_steps += 1
        timing = self._window() if at_report else {}
        self.unsaved.append({**row, "attempt": self.config.attempt, "time": time.time(), **timing})
        self.relay.send("metrics", rows=[self.unsaved[-1]])
        notice = self.drains.new_notice() if at_report else None
        if due or notice is not None:
            with self.clock.part("checkpoint"):
                self._checkpoint()
        if notice is not None:
            self.drains.hold(self.step, notice)

    def _window(self) -> dict[str, Any]:
        """The report window ending at this step: every rank's breakdown (one collective),
        the history's fields for it; a new straggler is told to the driver."""
        times = self.clock.window(rest="forward_backward")
        if times is None:
            return {}
        matrix = all_reduce(own_row(times, self.rank, self.world_size))
        if self.rank != 0:  # rank 0 writes the history and relays
            self._window_steps = 0
            return {}
        fields, new = window_fields(matrix, self.world_size, self._window_steps, self.stragglers)
        self._window_steps = 0
        for found in new:
            self.relay.send("straggler", **found)
        return fields

    def _checkpoint(self) -> None:
        assert self.checkpoints is not None
        after = self._after  # not the batch handed out since, when it was not reported
        meta = {"epoch": after.epoch, "cursor": after.to_json(), "metrics": self.latest}
        rows, self.unsaved = self.unsaved, []
        self.checkpoints.save(self.step, meta, rows)
        share_peak_rss(self.relay)

    def finish(self) -> None:
        """After the loop returns: its last step checkpointed when it was not (a loop that
        returns early keeps its work; the run goes on from there next time). A batch handed
        out but not reported (the loop broke out of ``batches()`` first) is not counted: the
        next run trains it."""
        self._open = False
        assert self.checkpoints is not None
        if self.step > self.checkpoints.last_step:
            self._checkpoint()
        share_peak_rss(self.relay)
        self.checkpoints.wait()
        if self.step == self.resumed_from and self.step > 0:
            self.relay.send("already_complete", step=self.step)
        self.relay.send(
            "finished",
            step=self.step,
            metrics=self.latest,
            timings=self.timings.to_json(),
            stopped=False,
        )

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self._pool is not None:
            self._pool.close()


def own_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` that runs a loop of the user's own on this API."""
    global _current
    worker_config = WorkerConfig.from_dict(config)
    loop = OwnLoop(worker_config)
    _current = loop
    try:
        assert loop.spec.train_loop is not None
        fn = workloads.resolve_train_loop(loop.spec.train_loop)
        workloads.call_train_loop(fn, loop.spec.train_loop_config)
        if loop.checkpoints is None:
            raise _misuse(
                f"train_loop {loop.spec.train_loop} returned without calling setup(): "
                "nothing was trained or checkpointed"
            )
        loop.finish()
    except Exception as e:
        step = loop.step + 1 if loop._open else loop.step or None
        error = (
            e
            if isinstance(e, RelaytrainError)
            else worker_error(e, where=f"at step {step}", step=step, rank=loop.rank)
        )
        if loop.checkpoints is not None:
            error = wind_down(error, loop.checkpoints, loop.relay, loop.step, loop.group)
        if error is e:
            raise
        raise error from e
    finally:
        _current = None
        loop.close()
