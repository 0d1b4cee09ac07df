"""relaytrain's API for a training loop of your own (``train_loop_api: relaytrain``).

Your loop keeps relaytrain's guarantees, as Lightning Fabric keeps Lightning's in a loop of
its own: ``session()`` hands it this worker's side of the run.

- ``setup(model, optimizer, scheduler)`` restores the newest committed checkpoint every rank
  can verify (model, optimizer, scheduler, every rank's RNG, the data cursor) and returns the
  model wrapped for DDP (with ``scaling.ddp``'s options, and ``ddp=``'s over them);
- ``batches()`` is the run's data stream from its cursor: this rank's slice of each global
  batch, the same rows in the same order for any worker count, through ``data.transform``;
- ``report(metrics)`` ends the optimizer step of the batches just handed out: the row goes to
  the run's history and the driver, and a checkpoint in relaytrain's committed format is taken
  when ``checkpoint.every`` or the epoch's end says (retention, keep-best, exports as the
  built-in loop's). With ``optimizer.grad_accumulation: k`` a step takes k batches:
  ``ends_step`` says which batch ends one, and ``no_sync()`` skips DDP's all-reduce on the
  others.

A fault, a retry or an in-place restart resumes the loop at the step after the checkpoint, with
the same batches and RNG it would have had: bit-identical to a run without the fault.

The session's parts: ``own_loop_data`` (the stream and each batch's place in its step),
``own_loop_checkpoints`` (the restore, the steps counted, what a checkpoint records and when),
``own_loop_passes`` (the one pass over the data, and its order), ``own_loop_window`` (where
each report window's time went).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch

from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import RelaytrainError
from trainer_core.execution import worker_api
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import Relay, Timings, all_reduce, share_peak_rss
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads
from trainer_core.train.failure import wind_down, worker_error
from trainer_core.train.faults import Faults
from trainer_core.train.own_loop_checkpoints import StepLedger
from trainer_core.train.own_loop_data import BatchPlace, SessionData
from trainer_core.train.own_loop_passes import Passes, misuse
from trainer_core.train.own_loop_window import ReportWindows
from trainer_core.train.preemption import DrainWatch
from trainer_core.train.rank_output import rank_output

logger = logging.getLogger("relaytrain.own_loop")

#: The run of the loop this worker process runs now (``session()``).
_current: OwnLoop | None = None


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
        self.relay = Relay(config.relay, self.rank, config.marks, config.earlier_marks)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.timings = Timings()
        self.windows = ReportWindows(self.device, self.timings, self.relay, self.rank)
        self.data = SessionData(
            config, self.spec, self.rank, self.world_size, self.device, self.timings
        )
        self.batch_size = self.data.batch_size
        #: Global batches per optimizer step (``optimizer.grad_accumulation``).
        self.accumulation = self.data.accumulation
        #: Epochs of the run, global batches per epoch, optimizer steps per epoch and in all.
        self.num_epochs = self.data.epochs
        self.batches_per_epoch = self.data.batches_per_epoch
        self.steps_per_epoch = self.data.steps_per_epoch
        self.total_steps = self.num_epochs * self.steps_per_epoch
        self.ledger = StepLedger(self.spec, config.attempt, self.batch_size)
        self.checkpoints: CheckpointManager | None = None
        self._model: torch.nn.Module | None = None
        self.passes = Passes(self.batch_size)
        #: The run's stream, once a pass opened it.
        self._stream: Iterator[tuple[BatchPlace, Any]] | None = None
        self.group = 0
        #: The batch handed out last, and whether the step it is part of is still open.
        self.place = BatchPlace(
            epoch=0, index=0, end_of_epoch=False, ends_step=True, step_batches=1, step_in_epoch=0
        )
        self._open = False
        self._metrics: dict[str, Any] = {}
        training_state.seed_everything(self.spec.run.seed)  # identical initial weights

    # -- where the run is ------------------------------------------------------------------

    @property
    def step(self) -> int:
        """The optimizer steps done (the last one ended)."""
        return self.ledger.step

    @property
    def epoch(self) -> int:
        """The epoch of the batch handed out."""
        return self.place.epoch

    @property
    def end_of_epoch(self) -> bool:
        """The batch handed out is its epoch's last (its step ends the epoch)."""
        return self.place.end_of_epoch

    @property
    def ends_step(self) -> bool:
        """The batch handed out is its optimizer step's last: step the optimizer, then
        ``report``. Always true without ``optimizer.grad_accumulation``."""
        return self.place.ends_step

    @property
    def loss_weight(self) -> float:
        """The factor for this rank's mean loss of the batch handed out, so that the gradients
        summed over its step's batches and averaged by DDP over the ranks are those of the
        step's mean loss: this rank's share of each global batch times the world size (1.0 when
        the workers divide data.batch_size; else the slices differ by one row), over the
        step's global batches (1 without ``optimizer.grad_accumulation``)."""
        return self.data.rank_weight / self.place.step_batches

    # -- setup -----------------------------------------------------------------------------

    def setup(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any = None,
        ddp: dict[str, Any] | None = None,
    ) -> torch.nn.Module:
        """Move ``model`` to this worker's device, restore the newest committed checkpoint
        (model, optimizer, ``scheduler``, every rank's RNG, the cursor) and return the model
        wrapped for DDP. Build the optimizer on the unwrapped model's parameters first.
        ``ddp``: keyword arguments of ``DistributedDataParallel`` (``find_unused_parameters``,
        ``broadcast_buffers``, ``static_graph``, ...), over the spec's ``scaling.ddp``."""
        if self.checkpoints is not None:
            raise misuse("setup() was called twice: call it once, before batches()")
        ddp_kwargs = ddp_options(self.spec.scaling.ddp.kwargs(), ddp)
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
        self.group = self.ledger.restore(
            checkpoints, self.config, self.relay, self.run_dir, self.world_size
        )
        self.faults.group = self.group
        self._model = worker_api.prepare_model(model, ddp_kwargs)
        # The checkpoint thread copies the parameters while the next forward and backward run:
        # the optimizer waits for it before it changes them. The first window starts here.
        self.windows.start(
            self._model,
            optimizer,
            checkpoints.before_optimizer_step,
            self.world_size,
            self.spec.report.step_time,
        )
        return self._model

    # -- data ------------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """This rank's slice of each global batch from the cursor to the end of the run's last
        epoch, on this worker's device: the columns form's dict of tensors (through
        ``data.transform`` and ``data.collate``), a torch Dataset's collated samples
        (``{"input", "labels"}`` for ``(input, target)`` pairs), or ``{"features", "labels"}``
        for the tabular form. ``epoch``, ``end_of_epoch`` and ``ends_step`` say where the batch
        lies; ``report`` ends its step (a step not reported is ended, with no metrics, when the
        next batch is asked for; one not reported when the loop returns is not counted)."""
        self.passes.begin("batches()", self.checkpoints is not None)
        yield from self._hand_out(lambda place: True)

    def epochs(self) -> Iterator[int]:
        """The run's epochs from the cursor's, for a loop that keeps a script's per-epoch
        structure: ``for epoch in run.epochs(): for batch in run.dataloader(...)``."""
        self.passes.begin("epochs()", self.checkpoints is not None)
        yield from self.passes.epochs(self.ledger.cursor.epoch, self.num_epochs)
        self._end_step()

    def dataloader(
        self,
        dataset: Any = None,
        *,
        batch_size: int | None = None,
        num_workers: int | None = None,
        collate_fn: Any = None,
    ) -> Iterator[Any]:
        """This epoch's batches from the cursor (inside ``epochs()``): the one-line replacement
        for a script's ``DataLoader(dataset, batch_size=..., num_workers=..., collate_fn=...)``.
        ``dataset``: the loop's own Dataset object, of the length the run pinned (None: the
        one ``data.dataset`` returns); ``batch_size``: the global batch, which is
        ``data.batch_size`` (the cursor and the checkpoints count it); ``num_workers`` and
        ``collate_fn`` replace ``data.loader_workers`` and ``data.collate``. A torch Dataset's
        batches come as that ``DataLoader``'s would, as the collate function made them (an
        ``(input, target)`` pair's as ``[inputs, targets]``), on the worker's device."""
        epoch = self.passes.serve(batch_size)
        self.data.use(dataset, num_workers, collate_fn)
        return self._hand_out(lambda place: place.epoch == epoch, epoch)

    def _hand_out(self, wanted: Any, epoch: int | None = None) -> Iterator[Any]:
        """The run's stream (opened on the first call) on this worker's device, for as long
        as ``wanted(place)``: the whole run, or ``epoch``'s batches, ending at its last."""
        if self._stream is None:
            self._stream = self.data.training(self.ledger.cursor)
        for place, rows in self._stream:
            if not wanted(place):
                raise misuse(
                    f"dataloader() in epoch {epoch} got a batch of epoch {place.epoch}: "
                    "iterate over each epoch's dataloader() to its end"
                )
            self._end_step()
            if not self._open:  # the step's first batch: the step begins
                self.faults.check(self.ledger.step + 1)
                self._open, self._metrics = True, {}
            self.place = place
            with self.windows.clock.part("h2d"):
                batch = self.data.on_device(rows)
            yield batch
            if epoch is not None and place.end_of_epoch:
                return
        self._end_step()

    def validation(self) -> Iterator[Any]:
        """This rank's share of the validation rows, in batches on this worker's device
        (through ``data.eval_transform``). Sum what you measure and its count over the ranks
        with ``sum_over_ranks``: the figure is then that of every validation row."""
        clock = self.windows.clock
        started = clock.start()
        try:
            yield from self.data.validation()
        finally:
            clock.stop("validation", started)

    def sum_over_ranks(self, values: list[float]) -> list[float]:
        """``values`` summed over every rank (a collective: every rank calls it alike)."""
        return all_reduce([float(v) for v in values])

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Run the batch's forward and backward in this block: on a batch that does not end
        its optimizer step (``optimizer.grad_accumulation``) under DDP's ``no_sync``, so the
        gradients add up on each rank and are all-reduced once, in the step's last backward."""
        no_sync = getattr(self._model, "no_sync", None)
        if self.ends_step or no_sync is None:
            yield
            return
        with no_sync():
            yield

    # -- steps -----------------------------------------------------------------------------

    def report(self, metrics: dict[str, Any] | None = None) -> None:
        """End the optimizer step of the batches ``batches()`` handed out, with rank 0's
        ``metrics`` (numbers or one-element tensors; give every rank's figure through
        ``sum_over_ranks``): its row in the history, and a checkpoint when ``checkpoint.every``
        steps or the epoch's end (or a drain's notice) say so. Call it at the batch that ends
        the step (``ends_step``), after the optimizer step. Report validation metrics at the
        epoch's last batch (``end_of_epoch``): the checkpoint of the weights they measured
        records them."""
        if not self._open:
            raise misuse(
                "report() ends the step of the batch batches() handed out: call it once per "
                "optimizer step, after the optimizer step"
            )
        if not self.ends_step:
            raise misuse(
                f"report() at a batch that does not end its optimizer step (with "
                f"optimizer.grad_accumulation={self.accumulation}, a step takes "
                f"{self.place.step_batches} batches): step the optimizer and report where "
                "run.ends_step is true"
            )
        self._metrics = dict(metrics or {})
        self._end_step()

    def _end_step(self) -> None:
        if not (self._open and self.ends_step):
            return
        self._open = False
        assert self.checkpoints is not None
        ledger, place = self.ledger, self.place
        ledger.step += 1
        self.relay.completed(ledger.step)
        if ledger.step == ledger.resumed_from + 1:  # the optimizer state exists now
            self.checkpoints.reserve()
        if self.checkpoints.failed():
            self.checkpoints.wait()  # raises the checkpoint's error
        self.timings.num_steps += 1
        row = ledger.record(place, self._metrics)
        self.windows.count_step()
        at_report = ledger.report_due(place)
        timing = self.windows.end(self.world_size) if at_report else {}
        self.relay.send("metrics", rows=[ledger.keep(row, timing)])
        notice = self.drains.new_notice() if at_report else None
        if ledger.checkpoint_due(place) or notice is not None:
            with self.windows.clock.part("checkpoint"):
                ledger.save(self.checkpoints, self.relay)
        if notice is not None:
            self.drains.hold(ledger.step, notice)

    def finish(self) -> None:
        """After the loop returns: its last step checkpointed when it was not (a loop that
        returns early keeps its work; the run goes on from there next time). Batches handed
        out but not reported (the loop broke out of ``batches()`` first, maybe mid-step) are
        not counted: the next run trains them."""
        self._open = False
        assert self.checkpoints is not None
        if self.step > self.checkpoints.last_step:
            self.ledger.save(self.checkpoints, self.relay)
        share_peak_rss(self.relay)
        self.checkpoints.wait()
        if self.step == self.ledger.resumed_from and self.step > 0:
            self.relay.send("already_complete", step=self.step)
        self.relay.finished(
            step=self.step,
            metrics=self.ledger.latest,
            timings=self.timings.to_json(),
            stopped=False,
        )

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()
        if self._stream is not None:
            self._stream.close()  # type: ignore[attr-defined]  # a generator
        self.data.close()


#: What relaytrain gives ``DistributedDataParallel`` itself: not a loop's to set.
_DDP_OWN_ARGUMENTS = ("module", "process_group", "device_ids", "output_device")


def ddp_options(spec_options: dict[str, Any], own: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments of ``DistributedDataParallel``: the spec's ``scaling.ddp``, with
    a loop's ``setup(..., ddp=...)`` over them. Pure."""
    own = dict(own or {})
    if not all(isinstance(key, str) for key in own):
        raise misuse(f"setup(ddp={own!r}): ddp is a dict of DistributedDataParallel keywords")
    taken = [key for key in _DDP_OWN_ARGUMENTS if key in own]
    if taken:
        raise misuse(
            f"setup(ddp=...) sets {taken}, which relaytrain sets for the worker's device and "
            "group: drop them (the others, such as find_unused_parameters, are yours)"
        )
    return {**spec_options, **own}


def own_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` that runs a loop of the user's own on this API."""
    global _current
    worker_config = WorkerConfig.from_dict(config)
    loop = OwnLoop(worker_config)
    _current = loop
    try:
        assert loop.spec.train_loop is not None
        fn = workloads.resolve_train_loop(loop.spec.train_loop)
        with rank_output(loop.relay):  # what the loop prints, to the driver's log
            workloads.call_train_loop(fn, loop.spec.train_loop_config)
        if loop.checkpoints is None:
            raise misuse(
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
            error = wind_down(error, loop.checkpoints, loop.relay)
        if error is e:
            raise
        raise error from e
    finally:
        _current = None
        loop.close()
