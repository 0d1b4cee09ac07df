"""relaytrain's part of Ray Train's controller process, kept free of torch.

Every fit() starts a controller actor that unpickles what the trainer hands it: the controller
class, the failure policy and the backend config. Ray's ``TorchConfig`` lives in a module that
imports torch at the top, and so does ``trainer_core.run.engine``. Either one made the controller
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
from ray.train import ControllerError, PreemptionError, WorkerGroupError
from ray.train._internal.utils import get_address_and_port
from ray.train.backend import Backend, BackendConfig
from ray.train.constants import (
    DEFAULT_TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
    TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S,
)
from ray.train.v2._internal.exceptions import (
    WorkerGroupStartupFailedError,
    WorkerGroupStartupTimeoutError,
)
from ray.train.v2._internal.execution.callback import WorkerCallback, WorkerGroupCallback
from ray.train.v2._internal.execution.controller import TrainController
from ray.train.v2._internal.execution.controller.state import ResizingState
from ray.train.v2._internal.execution.failure_handling import FailureDecision, FailurePolicy
from ray.train.v2._internal.util import TrainingFramework

from trainer_core.execution.classify import classify, name_preemption_now
from trainer_core.execution.elastic_capacity import CurrentCapacityPolicy
from trainer_core.execution.worker_start import PooledWorkerGroup

logger = logging.getLogger("relaytrain.engine")

#: A worker group that could not start: retried in place by elastic runs ("startup" budget).
STARTUP_FAILURES = (WorkerGroupStartupFailedError, WorkerGroupStartupTimeoutError)


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


#: The relay event that names a worker group's placement group (for the driver, not the user).
PLACEMENT_GROUP_EVENT = "placement_group"


class PlacementGroupsToDriver(WorkerGroupCallback):
    """Tells the driver, through the relay, each worker group's placement group, so that the
    driver removes one a controller that died left behind (``trainer.fit``).

    In place of Ray Train's ``PlacementGroupCleanerCallback``, which does the same from a
    detached actor of its own: a process started at every fit() on the path to the first step
    (the controller waits for it before training starts) that asks Ray's state API about the
    controller every second while training runs. Without it a Prefect retry's first step came
    1.5 s sooner on 2 cores (7.6 -> 6.1 s), and a first run's 0.6 s.
    """

    def __init__(self, relay: Any) -> None:
        self.relay = relay

    def after_worker_group_start(self, worker_group: Any) -> None:
        handle = worker_group.get_worker_group_state().placement_group_handle
        self.relay.push.remote(
            {
                "kind": PLACEMENT_GROUP_EVENT,
                "time": time.time(),
                "placement_group": handle.placement_group,
            }
        )


class RelayFlushBeforeShutdown(WorkerCallback):
    """On each worker, when Ray ends the group: rank 0 pushes the metric rows it holds back
    (``Relay.flush_before_shutdown``). A rank 0 that was computing when another rank died
    learns of it only when Ray shuts it down; the steps its held rows name ran, and ran again
    after the restart, and would otherwise be missing from the restart's lost steps."""

    def before_worker_shutdown(self) -> None:
        from trainer_core.execution.worker_group import Relay

        try:
            Relay.flush_before_shutdown()
        except Exception:  # the group is going away: the restart matters more than the rows
            logger.debug("relay flush before shutdown failed", exc_info=True)


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
    worker group and ``init_method="env"``, the same worker calls in the same order; a failed
    group is not asked to destroy its process group."""

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
        # Ray's on_shutdown destroys the process group on every worker, a failed group's too. A
        # failed group's ranks have left their training function and Ray kills them next; the
        # call only waits on the ranks that are gone (a second each, before Ray says so) and
        # ends in "graceful shutdown of backend failed". It is skipped for a failed group.
        latest = getattr(worker_group, "get_latest_poll_status", lambda: None)()
        if latest is not None and latest.errors:
            return
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
    (its constructor already reads the run directory), that tells the relay when its elastic
    scaling policy resizes a healthy worker group (a failed one is the failure policy's), ends
    an elastic run's failed group before the next is sized, and starts its workers in idle
    processes where it can (``worker_start``)."""

    worker_group_cls = PooledWorkerGroup

    def __init__(
        self,
        *,
        environment: dict[str, str],
        storage_credentials: list[Any],
        relay: Any,
        **kwargs: Any,
    ) -> None:
        # Ray Train's settings for this controller and, propagated, its workers (Ray reads them
        # where it uses them); this process is the controller's alone.
        os.environ.update(environment)
        apply_credentials(storage_credentials)
        self._relay = relay
        super().__init__(**kwargs)

    def _make_and_handle_scaling_decision_for_non_running_worker_group(
        self, controller_state: Any
    ) -> Any:
        # The group that failed ends before the next is sized (Ray 2.60 ends it only as it
        # starts the next): an elastic run's policy sizes the next group by the resources free
        # now (``elastic_capacity``), and those the failed group held are then free.
        if self._worker_group is not None and isinstance(
            self._scaling_policy, CurrentCapacityPolicy
        ):
            self._shutdown_worker_group()
        return super()._make_and_handle_scaling_decision_for_non_running_worker_group(
            controller_state
        )

    def _set_state(self, state: Any) -> None:
        group = self.get_worker_group()
        if isinstance(state, ResizingState) and group is not None:
            self._relay.push.remote(
                {
                    "kind": "resizing",
                    "time": time.time(),
                    "world_size": len(group),
                    "to": getattr(state.scaling_decision, "num_workers", None),
                }
            )
        super()._set_state(state)


class InPlacePolicy(FailurePolicy):
    """Ray Train's failure policy: restart the worker group in place, within the attempt, after
    a failure whose budget allows it; anything else (the training code, storage refusing access,
    a spent budget) ends the attempt as relaytrain classifies it.

    ``limits`` maps a budget ("infrastructure", "preemption", "startup") to the restarts
    allowed, None for no limit. Each restart is pushed to the relay; the new group resumes from
    the newest commit.

    A failure while a node drains for preemption, or after one not in ``reclaimed_before`` was
    reclaimed, draws on the preemption budget (``classify.name_preemption_now``).
    """

    def __init__(
        self,
        failure_config: Any,
        limits: dict[str, int | None],
        relay: Any,
        reclaimed_before: set[str] | None = None,
    ):
        super().__init__(failure_config)
        self.limits = limits
        self.relay = relay
        self.reclaimed_before = reclaimed_before or set()
        self.used = dict.fromkeys(limits, 0)
        self.restarts = 0

    def make_decision(self, training_failed_error: Any) -> Any:
        blamed: set[str] = set()
        if isinstance(training_failed_error, (WorkerGroupError, PreemptionError)):
            classified, blamed = name_preemption_now(
                classify(training_failed_error), self.reclaimed_before
            )
            if isinstance(training_failed_error, PreemptionError):  # Ray's watcher names them
                info = training_failed_error.preemption_info
                blamed |= set(getattr(info, "preempted_node_ids", ()))
            # A preemption is answered once: a later failure (a node killed after this one was
            # reclaimed) is not blamed on it again.
            self.reclaimed_before = self.reclaimed_before | blamed
            budget = getattr(classified, "budget", "none")
        elif isinstance(training_failed_error, ControllerError) and isinstance(
            training_failed_error.controller_failure, STARTUP_FAILURES
        ):
            # A group sized to what the cluster held a moment ago could not start (a node
            # went away meanwhile): an elastic run sizes it again.
            classified, budget = training_failed_error.controller_failure, "startup"
        else:
            return FailureDecision.RAISE  # the controller itself failed: end the attempt
        if budget not in self.limits:
            return FailureDecision.RAISE
        limit = self.limits[budget]
        if limit is not None and self.used[budget] >= limit:
            return FailureDecision.RAISE
        self.used[budget] += 1
        self.restarts += 1
        logger.warning(
            "restarting the worker group in place (%s %d of %s): %s",
            budget,
            self.used[budget],
            "unlimited" if limit is None else limit,
            classified,
        )
        self.relay.push.remote(
            {
                "kind": "restarting",
                "time": time.time(),
                "restart": self.restarts,
                "limit": limit,
                "error_budget": budget,
                "error_class": type(classified).__name__,
                "error_message": str(classified)[:2000],
                "preempted_nodes": sorted(blamed),
            }
        )
        return FailureDecision.RETRY
