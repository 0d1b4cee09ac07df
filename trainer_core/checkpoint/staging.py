"""Asynchronous checkpoints: stage state to memory, write it in the background.

``Stager.stage`` copies the state into buffers kept from one checkpoint to the next (no
allocation, so no page faults after the first). What only the optimizer step changes (the
parameters and the optimizer's state) can be deferred: ``copy_deferred`` copies it on the
checkpoint thread while the next step's forward and backward run, and that step's optimizer
waits for the copy (the overlap torchtitan's asynchronous checkpoints use). Serializing,
hashing, uploading, committing and retention then run on ``Background``'s single thread while the
next steps train. Up to ``depth`` checkpoints are in flight, each in a stager of its own, written
one after the other: a checkpoint due while the previous one is still being written (a
validation's, a few steps after the cadence's) is staged and queued rather than waited for.
The next one past the depth, the end of training and a failing step wait; the commit order is
the step order, an error in the background surfaces on the training thread, and nothing queued
behind a failed write is written.
"""

from __future__ import annotations

import copy
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TYPE_CHECKING, Any

import torch

from trainer_core.tensors import is_dtensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

logger = logging.getLogger("relaytrain.worker")


class Stager:
    """Copies nested state (dicts, lists, tuples of tensors and plain values) into kept buffers.
    A DTensor's local shard is copied, and the copy wrapped in a DTensor of the same sharding
    (what DCP needs to place it)."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], torch.Tensor] = {}
        #: A DTensor's kept buffer in its DTensor wrapper, kept too (making one costs more than
        #: copying a small shard).
        self.wrappers: dict[tuple[Any, ...], DTensor] = {}
        #: Copies ``stage`` left to ``copy_deferred``: (buffer, source).
        self.deferred: list[tuple[torch.Tensor, torch.Tensor]] = []

    def stage(self, value: Any, defer: Callable[[torch.Tensor], bool] | None = None) -> Any:
        """``value`` with every tensor copied into its kept buffer; tensors ``defer`` picks get
        their buffer now and their data at ``copy_deferred``."""
        self.deferred = []
        return self._stage(value, (), defer=defer)

    def copy_deferred(self) -> None:
        deferred, self.deferred = self.deferred, []
        for buffer, tensor in deferred:
            buffer.copy_(tensor)

    def reserve(self, value: Any) -> None:
        """Allocate (and fault in) the buffers ``value`` will be staged into, ahead of time: run
        on the checkpoint thread, it takes the first checkpoint's allocation off training."""
        self._stage(value, (), copy_data=False)

    def _stage(
        self,
        value: Any,
        path: tuple[Any, ...],
        copy_data: bool = True,
        defer: Callable[[torch.Tensor], bool] | None = None,
    ) -> Any:
        if is_dtensor(value):
            return self._copy_dtensor(value, path, copy_data, defer)
        if isinstance(value, torch.Tensor):
            return self._copy(value, path, copy_data, defer)
        if isinstance(value, dict):
            return type(value)(
                (k, self._stage(v, (*path, k), copy_data, defer)) for k, v in value.items()
            )
        if isinstance(value, list):
            return [self._stage(v, (*path, i), copy_data, defer) for i, v in enumerate(value)]
        if isinstance(value, tuple):
            items = [self._stage(v, (*path, i), copy_data, defer) for i, v in enumerate(value)]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return copy.deepcopy(value) if copy_data else None

    def _copy_dtensor(
        self,
        value: DTensor,
        path: tuple[Any, ...],
        copy_data: bool,
        defer: Callable[[torch.Tensor], bool] | None,
    ) -> torch.Tensor:
        # The shard itself (``to_local`` would go through autograd, a tenth of a millisecond
        # per tensor).
        local = self._copy(value._local_tensor, path, copy_data, defer)
        wrapper = self.wrappers.get(path)
        if wrapper is None or wrapper._local_tensor is not local or wrapper._spec != value._spec:
            # Around the host buffer itself, as torch's own DCP staging does: ``from_local``
            # would move a GPU shard's buffer back onto the GPU, a copy taken now and stale once
            # a deferred copy fills the buffer.
            from torch.distributed.tensor import DTensor

            wrapper = DTensor(local, value._spec, requires_grad=False)
            self.wrappers[path] = wrapper
        return wrapper

    def _copy(
        self,
        tensor: torch.Tensor,
        path: tuple[Any, ...],
        copy_data: bool,
        defer: Callable[[torch.Tensor], bool] | None = None,
    ) -> torch.Tensor:
        tensor = tensor.detach()
        if tensor.layout != torch.strided or tensor.is_quantized:
            return tensor.to("cpu", copy=True) if copy_data else tensor
        buffer = self.buffers.get(path)
        if (
            buffer is None
            or buffer.is_pinned() != tensor.is_cuda
            or buffer.shape != tensor.shape
            or buffer.dtype != tensor.dtype
            or buffer.stride() != tensor.stride()
        ):
            # Host memory; page-locked for a GPU tensor, so its copy is a DMA.
            buffer = torch.empty_strided(
                tensor.shape,
                tensor.stride(),
                dtype=tensor.dtype,
                device="cpu",
                pin_memory=tensor.is_cuda,
            )
            self.buffers[path] = buffer
            if not copy_data:
                buffer.zero_()  # touch every page now, not during the first checkpoint
        if copy_data and defer is not None and defer(tensor):
            self.deferred.append((buffer, tensor))
        elif copy_data:
            buffer.copy_(tensor)
        return buffer


class Background:
    """Jobs run in submission order on one thread, at most ``depth`` in flight; an error is
    raised on the thread that waits for its job, and the jobs queued behind a failed one do not
    run (a later checkpoint never commits after an earlier one failed)."""

    def __init__(self, name: str = "relaytrain-checkpoint", depth: int = 1):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.depth = depth
        #: The jobs in flight, oldest first.
        self.jobs: deque[Future[Any]] = deque()
        #: The jobs queued together until an error is raised to the waiter, numbered; the
        #: batch a failed job was in (set on the job thread): the jobs behind it are skipped.
        self.batch = 0
        self.failed_batch: int | None = None

    def submit(self, fn: Callable[[], Any]) -> None:
        """Queue ``fn`` behind the jobs in flight, once fewer than ``depth`` are."""
        self.make_room()
        self.jobs.append(self.executor.submit(self._run, fn, self.batch))

    def make_room(self) -> None:
        """Block until fewer than ``depth`` jobs are in flight; raise an error of those waited
        for."""
        while len(self.jobs) >= self.depth:
            self._wait_oldest(None)

    def _run(self, fn: Callable[[], Any], batch: int) -> Any:
        if self.failed_batch == batch:
            raise RuntimeError("not run: a job queued before it failed")
        try:
            return fn()
        except BaseException:
            self.failed_batch = batch
            raise

    def _wait_oldest(self, timeout_s: float | None) -> None:
        job = self.jobs[0]
        try:
            job.result(timeout=timeout_s)
        except FutureTimeout:
            raise  # still running: kept in flight
        except BaseException:
            # The first error is the one raised; those behind it in its batch never run
            self.jobs.clear()
            self.batch += 1
            raise
        self.jobs.popleft()

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until every job in flight is done; raise the first error (once)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self.jobs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            self._wait_oldest(left)

    def in_flight(self) -> int:
        return len(self.jobs)

    def failed(self) -> bool:
        """True when a job in flight has ended with an error (cheap: for every step)."""
        return any(job.done() and job.exception() is not None for job in self.jobs)

    def settle(self, timeout_s: float) -> BaseException | None:
        """Before an error ends the worker: let the jobs in flight finish (commit what they
        can), for at most ``timeout_s``. The first error is returned, not raised."""
        try:
            self.wait(timeout_s)
        except FutureTimeout:
            logger.warning("a checkpoint still being written after %.0f s is abandoned", timeout_s)
        except BaseException as e:
            logger.warning("the checkpoint being written failed too: %s", e)
            return e
        return None

    def close(self) -> None:
        self.executor.shutdown(wait=False)
