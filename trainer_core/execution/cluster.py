"""The Ray cluster: start or connect to it, what it can hold, which nodes it has lost or is
draining, and the Ray settings relaytrain sets."""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator
from typing import Any

import ray

from trainer_core.errors import ClusterCapacityError
from trainer_core.execution import ray_head
from trainer_core.spec.run_spec import RunSpec

logger = logging.getLogger("relaytrain.engine")


#: Ray settings relaytrain runs with; a value set in the environment wins.
#:
#: - ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``: Ray Train's controller polls workers this often; a
#:   report blocks up to one interval when the previous one was not yet consumed (relaytrain
#:   reports asynchronously, at checkpoints only), and worker deaths are noticed within about
#:   one interval. Ray Train hands the driver's value to the controller and workers.
#: - ``RAY_timeout_ms_task_wait_for_death_info``: a call to an actor whose node is gone fails
#:   at once instead of waiting a second for the GCS to say why (it learns of a lost node only
#:   after its health checks fail, ~15 s later). Ray Train's shutdown of a group that lost a
#:   node waits on such calls; KubeRay sets the same 0 for Ray Serve. A core setting: each Ray
#:   process reads its own environment, so it reaches a cluster relaytrain starts (set before
#:   ``ray.init``) and one whose nodes were started with it.
RAY_ENV_DEFAULTS = {
    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5",
    "RAY_timeout_ms_task_wait_for_death_info": "0",
}


def apply_ray_env_defaults() -> None:
    """Set relaytrain's Ray settings in this (driver) process unless the user set them: before
    it starts a local cluster, whose processes inherit them."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def ray_cluster(num_cpus: int | None = None, address: str | None = None) -> Iterator[bool]:
    """Use the running Ray, or connect to ``address`` (default ``RAY_ADDRESS``), or start a
    local cluster (``address="local"`` always does).

    Yields whether this call started (or connected) Ray; only then is it shut down afterwards.
    Whoever starts Ray stops it: a cluster someone else connected to is left alone. The
    cluster's head is watched (``ray_head``): lost, Ray is left, and the next call starts a new
    local cluster, or waits (bounded) for the address to answer again.
    """
    ray_head.settle()  # a lost head's cluster left first
    if ray.is_initialized():
        yield False
        return
    apply_ray_env_defaults()
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"log_to_driver": False}
    if address and address != "local":
        ray_head.await_head(address)  # a lost head waited for; an address of none refused
        with ray_head.driver_settings():  # Ray must not end the driver before the watch leaves
            ray.init(address=address, **kwargs)
        ray_head.watch_connected_cluster(address)  # its head lost: leave it, not block or end
    else:
        # "local": a new cluster of our own, not whatever `ray start` left on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
        ray_head.watch_started_cluster()  # its head lost: leave it, not end this process
    try:
        yield True
    finally:
        ray_head.stop_watching()
        ray.shutdown()


@contextlib.contextmanager
def local_cluster(num_cpus: int) -> Iterator[Any]:
    """The running Ray, or a new local cluster of ``num_cpus`` (never one ``ray start`` left on
    this machine, nor ``RAY_ADDRESS``'s), stopped afterwards; yields the ``ray`` module (tests'
    handle on the cluster)."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    with ray_cluster(num_cpus, address="local"):
        yield ray


def worker_needs(spec: RunSpec) -> dict[str, float]:
    """What one worker of ``spec`` needs, by resource (1 CPU, or 1 GPU, unless it says)."""
    per_worker = dict(spec.scaling.resources_per_worker or {})
    per_worker.setdefault("GPU" if spec.scaling.use_gpu else "CPU", 1.0)
    return per_worker


def group_needs(spec: RunSpec) -> dict[str, float]:
    """What the smallest worker group of ``spec`` needs in all (an elastic run's MIN), by
    resource."""
    workers = spec.scaling.min_workers
    return {name: amount * workers for name, amount in worker_needs(spec).items()}


def short_of(spec: RunSpec) -> str | None:
    """What the worker group needs that is not free now, other work holding it ("2 CPU
    needed, 1 free"); None when the group fits in what is free."""
    return shortfall(group_needs(spec))


def shortfall(needs: dict[str, float]) -> str | None:
    """What of ``needs`` (resource -> amount) is not free now ("2 CPU needed, 1 free"); None
    when all of it is."""
    free = ray.available_resources()
    for resource, needed in needs.items():
        if needed > free.get(resource, 0.0):
            return f"{needed:g} {resource} needed, {free.get(resource, 0.0):g} free"
    return None


def held_by_other_work(needs: dict[str, float]) -> bool:
    """Whether the cluster's live nodes hold ``needs`` in all but not free now: other work
    holds what a group needs (a busy cluster), as against nodes lost or the group placeable."""
    total = ray.cluster_resources()
    fits_in_all = all(needed <= total.get(name, 0.0) for name, needed in needs.items())
    return fits_in_all and shortfall(needs) is not None


def check_capacity(spec: RunSpec) -> None:
    """Refuse a worker group the cluster can never hold (Ray would wait forever): the fixed
    count, or an elastic run's MIN, in all; one worker on the largest of its live nodes."""
    total = ray.cluster_resources()
    workers = spec.scaling.min_workers
    asked = spec.scaling.num_workers
    shown = f"{list(asked)} (at least {workers})" if isinstance(asked, tuple) else f"{asked}"
    for resource, needed in group_needs(spec).items():
        available = total.get(resource, 0.0)
        if needed > available:
            raise ClusterCapacityError(
                f"scaling.num_workers={shown} workers need {needed:g} {resource} in all, but "
                f"the Ray cluster has {available:g}: lower scaling.num_workers or "
                "scaling.resources_per_worker, or add nodes",
                field="scaling.num_workers",
            )
    largest: dict[str, float] = {}
    for node in ray.nodes():
        if node.get("Alive"):
            for resource, amount in node.get("Resources", {}).items():
                largest[resource] = max(largest.get(resource, 0.0), amount)
    for resource, needed in worker_needs(spec).items():
        if needed > largest.get(resource, 0.0):
            raise ClusterCapacityError(
                f"scaling.resources_per_worker asks {needed:g} {resource} for each worker, but "
                f"the largest node of the Ray cluster has {largest.get(resource, 0.0):g} (a "
                "worker runs on one node): lower scaling.resources_per_worker, or add a node "
                "that large",
                field="scaling.resources_per_worker",
            )


def alive_nodes() -> set[str]:
    """Ids of the cluster's live nodes."""
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def preempted_nodes() -> set[str]:
    """Ids of the dead nodes Ray records as reclaimed after a drain for preemption."""
    from ray.core.generated.common_pb2 import NodeDeathInfo  # type: ignore[attr-defined]

    return {
        node["NodeID"]
        for node in ray.nodes()
        if not node.get("Alive")
        and node.get("DeathReason") == NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED
    }


def draining_nodes(due_only: bool = True) -> set[str]:
    """Ids of the nodes the GCS was told to drain for preemption (with a deadline) and still
    counts as alive; ``due_only``: only those whose deadline has come.

    Idle drains (no deadline) are left out, and with ``due_only`` notices that have not yet come
    due: their nodes are not the reason an attempt fails now.
    """
    from ray._private.state import state

    due_ms = time.time() * 1000 + 1000 if due_only else float("inf")
    return {
        node_id
        for node_id, deadline_ms in state.get_draining_nodes().items()
        if 0 < deadline_ms <= due_ms
    }


#: Ray Train's switch for its preemption watcher (an actor started with every worker group).
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def watches_preemption() -> bool:
    """Whether Ray Train watches the worker group's nodes for drains: as the user set it, else
    on a cluster of several nodes (a drain among the nodes of a one-node cluster ends it)."""
    value = os.environ.get(PREEMPTION_WATCHER_ENV)
    if value is not None:
        return value.strip().lower() in ("1", "true", "yes")
    return not single_node()


def single_node() -> bool:
    """Whether the Ray cluster is one node (a local cluster, or a head alone)."""
    return len(alive_nodes()) == 1


def ray_version() -> str:
    """The Ray this process runs (a run's snapshot is readable by this version only)."""
    return str(ray.__version__)


def job_submission_client(address: str) -> Any:
    """Ray's client of the job server at ``address`` (raises as Ray does when unreachable)."""
    from ray.job_submission import JobSubmissionClient

    return JobSubmissionClient(address)
