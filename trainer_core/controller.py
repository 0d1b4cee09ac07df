"""relaytrain's part of Ray Train's controller process, kept free of torch.

Every fit() starts a controller actor that unpickles what the trainer hands it: the controller
class, the failure policy and the backend config. Ray's ``TorchConfig`` lives in a module that
imports torch at the top, and so does ``trainer_core.engine``. Either one made the controller
import torch before it created a worker, about 1.7 s on 2 cores at every attempt and retry. The
controller never runs torch code: it only tells the workers to set up their process group.

This module holds what the controller and the metrics relay need, and imports nothing heavier than
Ray Train's own controller. ``ProcessGroupConfig`` is ``TorchConfig`` for CPU and GPU workers.
Its backend sends Ray's own worker-side functions from ``ray.train.torch.config``, called by name
on the workers, which import torch anyway.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import ray
from ray._private import ray_constants
from ray.exceptions import GetTimeoutError
from ray.train import PreemptionError, WorkerGroupError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
from ray.train.v2._internal.util import TrainingFramework

from trainer_core.classify import classify

logger = logging.getLogger("relaytrain.engine")


def apply_credentials(credentials: list[Any]) -> None:
    """Set the storage credentials that ``engine._trainer`` shares, as a Ray object nested in a
    list (so Ray passes it by reference), in this controller or worker process's environment."""
    if credentials:
        os.environ.update(ray.get(credentials[0]))


@ray.remote(num_cpus=0)
class MetricsRelay:
    """Collects rank 0's events so the driver can stream them while fit() runs."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.groups = 0

    def push(self, event: dict[str, Any]) -> None:
        self.events.append(event)

    def begin_group(self) -> int:
        """A worker group started; how many started before it in this attempt."""
        self.groups += 1
        return self.groups - 1

    def drain(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events


# -- the torch process group, set up from a torch-free controller ---------------------------------


@dataclass
class ProcessGroupConfig(BackendConfig):
    """Ray's ``TorchConfig`` with ``init_method="env"``, for gloo (CPU) or nccl (GPU)."""

    backend: str = "gloo"
    timeout_s: int = 1800

    @property
    def backend_cls(self) -> type[Backend]:
        return ProcessGroupBackend

    @property
    def train_func_context(self) -> Any:
        # Read once, on the driver, when the trainer wraps the training function.
        from ray.train.torch.config import TorchConfigContextManager

        return TorchConfigContextManager

    @property
    def framework(self) -> TrainingFramework:
        return TrainingFramework.TORCH

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "init_method": "env", "timeout_s": self.timeout_s}


def _torch_config_call(name: str, **kwargs: Any) -> Any:
    """On a worker: call ``ray.train.torch.config.<name>``."""
    from ray.train.torch import config

    return getattr(config, name)(**kwargs)


def _set_master_address(addr: str, port: int) -> None:
    os.environ["MASTER_ADDR"] = addr
    os.environ["MASTER_PORT"] = str(port)


class ProcessGroupBackend(Backend):
    """``_TorchBackend.on_start`` and ``on_shutdown`` of Ray 2.60 (pinned exactly) for a V2
    worker group and ``init_method="env"``, the same worker calls in the same order."""

    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: Any) -> None:
        master_addr, master_port = worker_group.execute_single(0, get_address_and_port)
        worker_group.execute(_set_master_address, addr=master_addr, port=master_port)
        worker_group.execute(_torch_config_call, "_set_torch_distributed_env_vars")
        ray.get(
            [
                worker_group.execute_single_async(
                    rank,
                    _torch_config_call,
                    "_setup_torch_process_group",
                    backend=backend_config.backend,
                    world_rank=rank,
                    world_size=len(worker_group),
                    init_method="env://",
                    timeout_s=backend_config.timeout_s,
                )
                for rank in range(len(worker_group))
            ]
        )

    def on_shutdown(self, worker_group: Any, backend_config: Any) -> None:
        futures = worker_group.execute_async(
            _torch_config_call, "_shutdown_torch", destroy_process_group=len(worker_group) > 1
        )
        timeout_s = ray_constants.env_integer(
            TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S, DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S
        )
        try:
            ray.get(futures, timeout=timeout_s)
        except GetTimeoutError:
            logger.warning("torch process group shutdown timed out after %s s", timeout_s)


# -- the controller and its failure policy --------------------------------------------------------


class CredentialedController(TrainController):
    """Ray Train's controller, with the storage credentials set before it touches storage
    (its constructor already reads the run directory)."""

    def __init__(self, *, storage_credentials: list[Any], **kwargs: Any) -> None:
        apply_credentials(storage_credentials)
        super().__init__(**kwargs)


class InPlacePolicy(FailurePolicy):
    """Ray Train's failure policy for ``retries.in_place``: restart the worker group in place
    after an infrastructure failure, up to the limit; anything else (the training code, storage
    refusing access) ends the attempt as relaytrain classifies it."""

    def __init__(self, failure_config: Any, limit: int, relay: Any):
        super().__init__(failure_config)
        self.limit = limit
        self.relay = relay
        self.restarts = 0

    def make_decision(self, training_failed_error: Any) -> Any:
        if not isinstance(training_failed_error, (WorkerGroupError, PreemptionError)):
            return FailureDecision.RAISE  # the controller itself failed: end the attempt
        classified = classify(training_failed_error)
        infrastructure = getattr(classified, "budget", None) == "infrastructure"
        if not infrastructure or self.restarts >= self.limit:
            return FailureDecision.RAISE
        self.restarts += 1
        logger.warning(
            "restarting the worker group in place (%d of %d): %s",
            self.restarts,
            self.limit,
            classified,
        )
        self.relay.push.remote(
            {
                "kind": "restarting",
                "time": time.time(),
                "restart": self.restarts,
                "limit": self.limit,
                "error_class": type(classified).__name__,
                "error_message": str(classified)[:2000],
            }
        )
        return FailureDecision.RETRY
