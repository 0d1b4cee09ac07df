"""Ray Train's TorchTrainer as relaytrain runs it (``AbortableTorchTrainer``): it keeps its
controller's handle, so an interrupted driver can stop it, and starts none of Ray's helper
actors that relaytrain has no use for.

Ray 2.60 keeps the handle local to ``_initialize_and_run_controller``; this mirrors that method
(Ray is pinned exactly) minus the SIGINT handler, which cannot be installed off the main thread
anyway. Each helper actor is a process start (about 2 s of CPU on 2 cores, contending with the
workers' own start), paid again by every attempt and in-place restart. What the controller
unpickles comes from ``trainer_core.execution.controller``, which imports no torch. Ray's
placement-group cleaner (a detached actor per fit) is replaced by the driver's own cleanup
(``PlacementGroupsToDriver``, ``trainer._remove_left_behind``).

Imported when an attempt builds its trainer (``trainer._trainer``): ``ray.train.torch`` imports
torch and Ray Train's internals.
"""

from __future__ import annotations

import contextlib
from typing import Any

import ray
from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
from ray.train.v2._internal.callbacks.placement_group_callback import (
    PlacementGroupCleanerCallback,
)
from ray.train.v2._internal.constants import (
    DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
    get_env_vars_to_propagate,
)

from trainer_core.execution.cluster import PREEMPTION_WATCHER_ENV
from trainer_core.execution.controller import (
    CredentialedController,
    InPlacePolicy,
    PlacementGroupsToDriver,
    RelayFlushBeforeShutdown,
)
from trainer_core.execution.elastic_capacity import CurrentCapacityPolicy
from trainer_core.execution.worker_start import FIRST_GROUP_WAIT_ENV


class AbortableTorchTrainer(TorchTrainer):
    controller: Any = None
    #: The storage credentials as a Ray object, nested so Ray passes it by reference.
    storage_credentials: list[Any] = []
    #: In-place restarts allowed per budget (``restart_limits``), and the relay that hears
    #: of each.
    restart_limits: dict[str, int | None] = {}
    relay: Any = None
    #: Nodes reclaimed for preemption before this attempt (not its failures' cause).
    reclaimed_before: set[str] = set()
    #: Whether Ray's preemption watcher runs (``watches_preemption``).
    watch_preemption: bool = False
    #: How long the attempt's first worker group may wait in Ray's queue while other work holds
    #: its resources (``scaling.wait_for_resources_s``, ``QueuedPlacementGroup``); None: Ray's.
    first_group_wait_s: float | None = None

    def _create_default_callbacks(self) -> list[Any]:
        # Ray's datasets callback starts a DatasetManager actor for every worker group,
        # datasets or not; relaytrain's loops read their own data and pass none. Its
        # placement-group cleaner is the driver's job here (PlacementGroupsToDriver).
        callbacks = super()._create_default_callbacks()  # type: ignore[misc]  # V2 method
        unused = (PlacementGroupCleanerCallback,) + (() if self.datasets else (DatasetsCallback,))
        kept = [c for c in callbacks if not isinstance(c, unused)]
        return [*kept, PlacementGroupsToDriver(self.relay), RelayFlushBeforeShutdown()]

    def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
        env_vars = get_env_vars_to_propagate()
        env_vars.setdefault(
            RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
            DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        )
        env_vars[PREEMPTION_WATCHER_ENV] = "1" if self.watch_preemption else "0"
        if self.first_group_wait_s is not None:
            env_vars[FIRST_GROUP_WAIT_ENV] = repr(self.first_group_wait_s)
        # The controller sets these itself (Ray Train reads them when it uses them), not
        # through a runtime_env: an actor with a runtime_env of its own needs a new process,
        # one without takes an idle one of the job's (0.5-1 s sooner to the first step).
        controller_class = ray.remote(
            num_cpus=0,
            label_selector={
                ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()  # type: ignore[attr-defined]
            },
        )(CredentialedController)
        controller_init_kwargs["scaling_policy"] = CurrentCapacityPolicy.replacing(
            controller_init_kwargs["scaling_policy"]
        )
        controller_init_kwargs["failure_policy"] = InPlacePolicy(
            controller_init_kwargs["failure_policy"].failure_config,
            self.restart_limits,
            self.relay,
            self.reclaimed_before,
        )
        self.controller = controller_class.remote(
            environment=env_vars,
            storage_credentials=self.storage_credentials,
            relay=self.relay,
            **controller_init_kwargs,
        )
        ray.get(self.controller.run.remote())
        return ray.get(self.controller.get_result.remote())

    def abort(self, timeout_s: float = 15.0) -> None:
        """Stop the worker group (controller.abort), then the controller itself."""
        if self.controller is None:
            return
        with contextlib.suppress(Exception):
            ray.get(self.controller.abort.remote(), timeout=timeout_s)
        with contextlib.suppress(Exception):
            ray.kill(self.controller)
