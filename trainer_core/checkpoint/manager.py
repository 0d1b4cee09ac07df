"""The built-in loop's checkpoints, in one object: what is saved, under which names, in which
format, staged how and written on which thread (after torchtitan's ``CheckpointManager``).

The loop says when: ``save`` at a step (with what the manifest carries), ``load`` of the newest
checkpoint every rank can verify, ``before_optimizer_step`` so a deferred copy finishes before
the step changes what it copies, ``wait`` for the write in flight. Everything else is here:

- **State keys and file names.** ``model``, ``optimizer``, ``scheduler``, ``scaler`` (fp16) and
  every rank's ``rng``; ``model.pt`` and ``optimizer.pt`` from rank 0, or ``model-rank{r}.pt``
  and ``optimizer-rank{r}.pt`` from every rank (``checkpoint.sharded``), ``scheduler.pt`` and
  ``scaler.pt`` from rank 0, ``rng-rank{r}.pt`` from every rank.
- **The format.** ``relaytrain.torch/1``: the files above. ``relaytrain.dcp/1`` (``scaling.
  strategy: fsdp``): model and optimizer as a ``torch.distributed.checkpoint`` of every rank's
  shards (``.metadata`` and ``__{rank}_0.distcp``, written through ``dcp_storage``), which a
  group of any size loads, resharded; the schedule and RNG states as above. Either format loads
  into either strategy: a DDP checkpoint's whole tensors are sharded on load, a DCP one is
  gathered whole for DDP. Loading either is ``restore.Restorer``'s.
- **Staging** (``staging.Stager``): the state is copied into kept buffers; with
  ``checkpoint.asynchronous``, what only the optimizer step changes is copied on the copy
  thread while the next forward and backward run.
- **The write** (``staging.Background``): serialize and hash each file into the run directory,
  then (rank 0) the metrics segment, the manifest and ``COMMITTED``, and retention. Up to
  ``checkpoint.in_flight`` checkpoints are in flight, each staged into buffers of its own and
  written one after the other on the checkpoint thread, so commits come in step order.
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.exports import DCP_FORMAT, FORMAT
from trainer_core.checkpoint.files import FileEntry, file_names
from trainer_core.checkpoint.history import write_metrics_segment
from trainer_core.checkpoint.restore import Loaded, Restorer, TrainingState
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.checkpoint.staging import Background, Stager
from trainer_core.errors import TrainingCodeError
from trainer_core.execution.worker_group import Relay, Timings
from trainer_core.spec.operations import CheckpointSection
from trainer_core.tensors import local

logger = logging.getLogger("relaytrain.worker")

#: Training waiting for the previous checkpoint's write is worth a warning when the wait is this
#: share of the training time since that write began, and at least this long.
SLOW_WRITE_SHARE = 0.1
SLOW_WRITE_MIN_S = 0.05


def writes_outlast_interval(wait_s: float, since_s: float) -> bool:
    """Whether training waited long enough for the previous write to say so."""
    return wait_s >= SLOW_WRITE_MIN_S and wait_s >= SLOW_WRITE_SHARE * since_s


class CheckpointManager:
    """One rank's checkpoints of a run of the built-in loop."""

    def __init__(
        self,
        run_dir: RunDirectory,
        section: CheckpointSection,
        state: TrainingState,
        *,
        rank: int,
        world_size: int,
        attempt: int,
        relay: Relay,
        timings: Timings,
        dcp: bool = False,
        node_rank: int | None = None,
    ):
        self.run_dir = run_dir
        self.section = section
        self.state = state
        self.rank = rank
        self.world_size = world_size
        self.attempt = attempt
        self.relay = relay
        self.timings = timings
        #: Model and optimizer as DCP (``scaling.strategy: fsdp``: the model is sharded).
        self.dcp = dcp
        self.restorer = Restorer(
            run_dir, state, rank=rank, world_size=world_size, dcp=dcp, node_rank=node_rank
        )
        self.names = file_names(section.sharded, rank)
        #: The step of the newest checkpoint saved or loaded (0: none).
        self.last_step = 0
        #: Kept from retention: the checkpoint this group resumed from.
        self.resumed_from = 0
        #: A stager (its kept buffers) for each checkpoint that may be in flight, used in turn:
        #: the one a new checkpoint takes was freed by the write ``depth`` saves before.
        depth = section.in_flight if section.asynchronous else 1
        self.stagers = [Stager() for _ in range(depth)]
        self.num_saves = 0
        self.background = Background(depth=depth)
        #: Copies what the optimizer step changes while the write thread may still be busy
        #: with an earlier checkpoint.
        self.copier = ThreadPoolExecutor(1, thread_name_prefix="relaytrain-checkpoint-copy")
        #: The newest copy of what only the optimizer step changes (copies run in order, so
        #: when it is done every earlier one is); None before the first checkpoint.
        self.last_copy: Future[None] | None = None
        #: When the latest checkpoints went to the checkpoint thread (oldest first), and
        #: whether training has already been found waiting for one (said once per group).
        self.submitted: deque[float] = deque(maxlen=depth)
        self.slow_writes_said = False
        # Sharded and DCP checkpoints run collectives on the checkpoint thread (DCP's planning,
        # every rank's file list): on a group of their own, so they never interleave with the
        # training thread's.
        self.group = dist.new_group(backend="gloo") if section.sharded or dcp else None

    # -- load ----------------------------------------------------------------------------------

    def load(self, candidates: list[int]) -> Loaded:
        """Restore the newest of ``candidates`` (committed steps, newest first) that every rank
        can read and verify (``restore.Restorer.load``)."""
        loaded = self.restorer.load(candidates)
        if loaded.checkpoint is not None:
            self.last_step = self.resumed_from = loaded.checkpoint.step
        return loaded

    def load_weights(self, checkpoint_uri: str) -> None:
        """A warm start: the model's weights of another run's checkpoint."""
        self.restorer.load_weights(checkpoint_uri)

    def save(self, step: int, meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
        """Checkpoint ``step``: stage the state, then write it on the checkpoint thread (and wait
        for it, unless ``checkpoint.asynchronous``). ``meta`` goes into the manifest, ``rows``
        (metric rows since the last checkpoint) into the run's metrics history.

        Rank 0 writes the model, optimizer and scheduler (every rank its own shards when
        ``checkpoint.sharded``) and every rank's RNG state, gathered here, so the thread of an
        unsharded run needs no collective.
        """
        started = time.perf_counter()
        # Room for one more checkpoint in flight (the oldest committed when there was none), or
        # an error of the writes waited for raised
        self.background.make_room()
        waited = time.perf_counter()
        self._say_if_writes_are_slow(step, waited - started, started)
        sharded = self.section.sharded
        # Captured now, serialized on the checkpoint thread (torch.save of the states was most of
        # what a checkpoint blocked training for: 1-2 ms of 3)
        rng = training_state.capture_rng()  # small: kilobytes
        if self.group is not None or self.world_size == 1:  # every rank writes files of its own
            rngs = {self.rank: rng}
        else:
            gathered: list[Any] | None = [None] * self.world_size if self.rank == 0 else None
            dist.gather_object(training_state.rng_to_send(rng), gathered, dst=0)
            rngs = {r: training_state.rng_received(s) for r, s in enumerate(gathered or [])}
        asynchronous = self.section.asynchronous
        stager = self.stagers[self.num_saves % len(self.stagers)]
        self.num_saves += 1
        staged = stager.stage(
            self._state_to_stage(), defer=self._changed_by_step() if asynchronous else None
        )
        meta = {
            **meta,
            "world_size": self.world_size,
            "sharded": sharded,
            "attempt": self.attempt,
            "format": DCP_FORMAT if self.dcp else FORMAT,
        }
        self.last_step = step
        if staged or rngs:
            copy = self.last_copy = self.copier.submit(stager.copy_deferred)
            self.background.submit(lambda: self._write(step, staged, rngs, rows, meta, copy))
            self.submitted.append(time.perf_counter())
        if not asynchronous:
            self.background.wait()
        self.timings.checkpoint_s += time.perf_counter() - started
        self.timings.checkpoint_wait_s += waited - started
        self.timings.num_checkpoints += 1

    def reserve(self) -> None:
        """Allocate the staging buffers on the checkpoint thread (after the first step, when the
        optimizer's state exists), and start the copy thread, so the first checkpoint does
        neither."""
        state = self._state_to_stage()
        if state:  # the first stager's: the others' are made by their first checkpoint
            self.background.submit(lambda: self.stagers[0].reserve(state))
        self.copier.submit(lambda: None)  # its thread starts with its first job

    def before_optimizer_step(self) -> None:
        """Wait until the copy thread has copied what the optimizer step changes (a failed copy
        is its checkpoint's error, raised by the write)."""
        copy = self.last_copy
        if copy is None or copy.done():
            return
        started = time.perf_counter()
        futures.wait([copy])
        waited = time.perf_counter() - started
        self.timings.checkpoint_s += waited
        self.timings.checkpoint_copy_wait_s += waited

    def wait(self) -> None:
        """Block until the checkpoints in flight are committed; raise the first error."""
        self.background.wait()

    def failed(self) -> bool:
        """Whether a checkpoint in flight has failed (cheap: asked at every step)."""
        return self.background.failed()

    def settle(self, timeout_s: float) -> BaseException | None:
        """Before an error ends the worker: let the writes in flight commit what they can."""
        return self.background.settle(timeout_s)

    def close(self) -> None:
        self.background.close()
        self.copier.shutdown(wait=False)

    def _state_to_stage(self) -> dict[str, Any]:
        """What this rank's checkpoint copies: model and optimizer on rank 0 (every rank when
        sharded; every rank's shards, as DCP state, under FSDP), the schedule and fp16's scaler
        on rank 0."""
        state: dict[str, Any] = {}
        if self.dcp:
            # DCP is imported by the runs that use it only (trainer_core.tensors)
            from torch.distributed.checkpoint.state_dict import get_state_dict

            model_state, optimizer_state = get_state_dict(self.state.model, self.state.optimizer)
            state["dcp"] = {"model": model_state, "optimizer": optimizer_state}
        elif self.section.sharded or self.rank == 0:
            state["model"] = self.state.model.state_dict()
            state["optimizer"] = self.state.optimizer.state_dict()
        if self.rank == 0:
            state["scheduler"] = self.state.scheduler.state_dict()
            if self.state.scaler is not None:
                state["scaler"] = self.state.scaler.state_dict()
        return state

    def _changed_by_step(self) -> Callable[[torch.Tensor], bool]:
        """Picks what only the optimizer step changes, the parameters and the optimizer's state,
        for the checkpoint thread to copy while the next forward and backward run. The rest
        (buffers such as batch norm's running statistics, which a forward pass updates, and
        plain values) is copied before training goes on."""
        pointers = {local(p).data_ptr() for p in self.state.model.parameters()}
        for state in self.state.optimizer.state.values():
            pointers.update(
                local(v).data_ptr() for v in state.values() if isinstance(v, torch.Tensor)
            )
        return lambda tensor: local(tensor).data_ptr() in pointers

    def _say_if_writes_are_slow(self, step: int, wait_s: float, now: float) -> None:
        # The write waited for is the oldest of a full queue
        if self.slow_writes_said or len(self.submitted) < self.background.depth:
            return
        since = now - self.submitted[0]
        if not writes_outlast_interval(wait_s, since):
            return
        self.slow_writes_said = True
        self.relay.send(
            "slow_checkpoint_writes",
            step=step,
            wait_s=round(wait_s, 3),
            since_s=round(since, 3),
            every=self.section.every,
        )

    def _write(
        self,
        step: int,
        staged: dict[str, Any],
        rngs: dict[int, dict[str, Any]],
        rows: list[dict[str, Any]],
        meta: dict[str, Any],
        copy: Future[None],
    ) -> None:
        """The checkpoint thread: once the state is staged whole, check, write every file, then
        (rank 0) commit and retain."""
        started = time.perf_counter()
        copy.result()  # the copy's error, if any, is this checkpoint's
        if "dcp" in staged:
            self._check_finite_parameters(step, staged["dcp"]["model"])
        elif "model" in staged:
            self._check_finite_parameters(step, staged["model"])
        if self.rank == 0:
            self.run_dir.prepare_checkpoint_dir(step)
        if self.group is not None:
            dist.barrier(group=self.group)
        entries = [
            self.run_dir.stream_checkpoint_file(
                step, self.names[key], functools.partial(training_state.save, value)
            )
            for key, value in staged.items()
            if key != "dcp"
        ]
        if "dcp" in staged:
            location = self.run_dir.checkpoint_location(step)
            from trainer_core.checkpoint import dcp_storage

            entries += dcp_storage.save(staged["dcp"], location, self.group)
        entries += [
            self.run_dir.write_checkpoint_file(
                step, file_names(False, rank)["rng"], training_state.to_bytes(rng)
            )
            for rank, rng in sorted(rngs.items())
        ]
        if self.group is not None:
            gathered: list[list[FileEntry] | None] = [None] * self.world_size
            dist.all_gather_object(gathered, entries, group=self.group)
            entries = [e for part in gathered for e in (part or [])]
        if self.rank == 0:
            write_metrics_segment(self.run_dir, self.attempt, rows)
            info = self.run_dir.commit_checkpoint(step, entries, meta)
            self.run_dir.apply_retention(
                self.section, protected_steps={self.resumed_from}, in_flight_from_step=step + 1
            )
            self.relay.send(
                "checkpoint", step=step, checkpoint_uri=info.uri, metrics=meta["metrics"]
            )
        self.timings.checkpoint_write_s += time.perf_counter() - started

    def _check_finite_parameters(self, step: int, state: dict[str, torch.Tensor]) -> None:
        """Never commit NaN/inf weights: the loss of step N is computed before step N's update,
        so a finite loss does not prove the weights a checkpoint would save are finite."""
        bad = [
            name
            for name, value in state.items()
            if value.is_floating_point() and not bool(torch.isfinite(local(value)).all())
        ]
        if self.dcp:  # every rank checks its shards; all fail together, none waits in DCP
            anywhere = torch.tensor([float(bool(bad))])
            dist.all_reduce(anywhere, op=dist.ReduceOp.MAX, group=self.group)
            if anywhere.item() and not bad:
                raise TrainingCodeError(
                    f"parameters became non-finite by the update of step {step} on another "
                    f"rank (no checkpoint written at step {step}): lower optimizer.lr, or add "
                    "gradient clipping in your model",
                    error_type="NonFiniteParameters",
                    step=step,
                    rank=self.rank,
                    deterministic=True,
                )
        if bad:
            raise TrainingCodeError(
                f"parameters {bad[:3]} became non-finite by the update of step {step} on rank "
                f"{self.rank} (no checkpoint written at step {step}): lower optimizer.lr, or add "
                "gradient clipping in your model",
                error_type="NonFiniteParameters",
                step=step,
                rank=self.rank,
                deterministic=True,
            )
