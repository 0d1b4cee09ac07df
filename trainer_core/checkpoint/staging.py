"""Asynchronous checkpoints: stage state to memory, write it in the background.

``Stager.stage`` copies the state into buffers kept from one checkpoint to the next (no
allocation, so no page faults after the first). What only the optimizer step changes (the
parameters and the optimizer's state) can be deferred: ``copy_deferred`` copies it on the
checkpoint thread while the next step's forward and backward run, and that step's optimizer
waits for the copy (the overlap torchtitan's asynchronous checkpoints use). Serializing,
hashing, uploading, committing and retention then run on ``Background``'s single thread while the
next steps train. One checkpoint is in flight at a time: the next one, the end of training and
a failing step all wait for it first, so the commit order is the step order and an error in the
background surfaces on the training thread.
"""

from __future__ import annotations

import copy
import logging
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
    """One background job at a time; its error is raised on the thread that waits for it."""

    def __init__(self, name: str = "relaytrain-checkpoint"):
        self.executor = ThreadPoolExecutor(1, thread_name_prefix=name)
        self.job: Future[Any] | None = None

    def submit(self, fn: Callable[[], Any]) -> None:
        self.wait()
        self.job = self.executor.submit(fn)

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the job in flight is done; raise its error (once)."""
        job, self.job = self.job, None
        if job is None:
            return
        try:
            job.result(timeout=timeout_s)
        except FutureTimeout:
            self.job = job
            raise

    def failed(self) -> bool:
        """True when the job in flight has ended with an error (cheap: for every step)."""
        job = self.job
        return job is not None and job.done() and job.exception() is not None

    def settle(self, timeout_s: float) -> BaseException | None:
        """Before an error ends the worker: let the job in flight finish (commit what it can),
        for at most ``timeout_s``. Its own error is returned, not raised."""
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
