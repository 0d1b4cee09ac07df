"""How Ray Train starts a worker group's processes: without a runtime env of their own unless a
worker reads one of the settings it carries (kept free of torch: the controller imports it).

Ray Train hands every worker the Ray Train settings set in the driver's environment, as the
``env_vars`` of a runtime env. An actor with a runtime env of its own cannot take an idle worker
process of its job: Ray starts a new one through its ``setup_worker`` step, about 0.5 s more per
group start on 2 cores (measured: first worker call 1.6 s after the controller started the
group, against 2.1 s). relaytrain's own settings (``cluster.RAY_ENV_DEFAULTS``, the preemption
watcher's switch) and Ray Train's default for blocking gets are read by the controller alone,
which has them; a setting a worker reads (a collective timeout, logging) still reaches it.
"""

from __future__ import annotations

import os
import time
from typing import Any

from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
from ray.train.v2._internal.constants import (
    ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR,
    ENABLE_PREEMPTION_WATCHER_ENV_VAR,
    HEALTH_CHECK_INTERVAL_S_ENV_VAR,
    PREEMPTION_POLL_INTERVAL_S_ENV_VAR,
    WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
    WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR,
    get_env_vars_to_propagate,
)
from ray.train.v2._internal.execution.worker_group import WorkerGroup
from ray.train.v2._internal.execution.worker_group.placement_group_handle import (
    DefaultPlacementGroupHandle,
)

from trainer_core.execution.cluster import held_by_other_work, short_of_nodes

#: Ray Train settings that only its controller (and the callbacks it runs) reads. Ray 2.60's
#: readers: the controller (health checks, group start, preemption watcher and its poll) and
#: the async controller actor (blocking-get warnings).
CONTROLLER_SETTINGS = frozenset(
    {
        HEALTH_CHECK_INTERVAL_S_ENV_VAR,
        WORKER_HEALTH_CHECK_TIMEOUT_S_ENV_VAR,
        WORKER_GROUP_START_TIMEOUT_S_ENV_VAR,
        ENABLE_CONTROLLER_STRUCTURED_LOGGING_ENV_VAR,
        ENABLE_PREEMPTION_WATCHER_ENV_VAR,
        PREEMPTION_POLL_INTERVAL_S_ENV_VAR,
        RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
    }
)


def worker_runtime_env(custom: dict[str, Any]) -> dict[str, Any]:
    """``WorkerGroup._get_worker_runtime_env`` without the controller's settings: the user's
    runtime env plus the propagated settings a worker reads; ``{}`` when there are none."""
    env_vars = {
        key: value
        for key, value in get_env_vars_to_propagate().items()
        if key not in CONTROLLER_SETTINGS
    }
    env_vars.update(custom.get("env_vars", {}))
    runtime_env = dict(custom)
    if env_vars:
        runtime_env["env_vars"] = env_vars
    return runtime_env


#: Set in a controller's environment (``scaling.wait_for_resources_s``): how long the first
#: worker group it starts may wait for its resources in Ray's queue, other work holding them.
FIRST_GROUP_WAIT_ENV = "RELAYTRAIN_FIRST_GROUP_WAIT_S"
#: How long a group whose resources came free (or whose nodes are gone) still waits for Ray to
#: place it before it fails as at Ray's own start timeout.
PLACING_GRACE_S = 5.0


class QueuedPlacementGroup(DefaultPlacementGroupHandle):
    """The attempt's first group's placement group, which waits past Ray's start timeout, up to
    ``wait_s`` in all, while other work holds what the group needs (``held_by_other_work``:
    the cluster's live nodes hold it in all, but not free) or while the cluster is short of
    nodes that could come (``short_of_nodes``: a node lost and not yet replaced, an autoscaler
    starting nodes for this very placement group). Once the cluster has room for it, or no node
    could come for it, it fails as at Ray's timeout (a placement Ray did not make), a grace of
    ``PLACING_GRACE_S`` after."""

    def __init__(
        self,
        placement_group: Any,
        needs: dict[str, float],
        wait_s: float,
        group: tuple[dict[str, float], int, str] | None = None,
    ):
        super().__init__(placement_group)
        self.needs, self.wait_s = needs, wait_s
        #: One worker's resources, the group's size and its placement strategy.
        self.group = group

    def _waits(self) -> bool:
        """Whether the group waits on: other work holds what it needs, or nodes may come."""
        if held_by_other_work(self.needs):
            return True
        return self.group is not None and short_of_nodes(*self.group) is not None

    def wait(self, timeout_seconds: float | int = 30) -> bool:
        deadline = time.monotonic() + max(self.wait_s, float(timeout_seconds))
        if super().wait(timeout_seconds):
            return True
        grace_until = None
        while (left := deadline - time.monotonic()) > 0:
            if self._waits():
                grace_until = None
            elif grace_until is None:
                grace_until = time.monotonic() + PLACING_GRACE_S
            elif time.monotonic() >= grace_until:
                return False
            if super().wait(min(left, PLACING_GRACE_S)):
                return True
        return False


class PooledWorkerGroup(WorkerGroup):
    """Ray Train's worker group, its workers started as the job's plain worker processes (an
    idle one when Ray has one) when no setting they read asks for a runtime env.

    The attempt's first group waits for its resources up to ``FIRST_GROUP_WAIT_ENV`` while other
    work holds them (``QueuedPlacementGroup``): on a cluster other runs share, it waits in
    Ray's queue of placement groups for them to finish. A group restarted in place keeps Ray's
    timeout, which tells a group sized to a node that is gone from one that must queue."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        wait_s = os.environ.pop(FIRST_GROUP_WAIT_ENV, None)  # the first group's alone
        self._queue_wait_s = float(wait_s) if wait_s is not None else None

    def _create_placement_group(self, scaling_config: Any, context: Any) -> Any:
        handle = super()._create_placement_group(scaling_config, context)
        if self._queue_wait_s is None or not isinstance(handle, DefaultPlacementGroupHandle):
            return handle
        per_worker = dict(context.resources_per_worker)
        needs = {name: n * context.num_workers for name, n in per_worker.items()}
        group = (per_worker, context.num_workers, scaling_config.placement_strategy)
        return QueuedPlacementGroup(handle.placement_group, needs, self._queue_wait_s, group)

    @staticmethod
    def _get_worker_runtime_env(custom_runtime_env: Any) -> Any:
        return worker_runtime_env(dict(custom_runtime_env))
