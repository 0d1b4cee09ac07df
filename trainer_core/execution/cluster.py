"""The Ray cluster: start or connect to it, what it can hold, which nodes it has lost or is
draining, and the Ray settings relaytrain sets."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from typing import Any

import ray

from trainer_core.errors import ClusterCapacityError
from trainer_core.execution import data_capacity, ray_address, ray_head
from trainer_core.execution.capacity import (
    CapacityDecision,
    Fits,
    NeverFits,
    NodeType,
    WaitForNodes,
    decide,
    holds,
    workers_placed,
)
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
        with ray_address.driver_settings():  # Ray must not end the driver before the watch leaves
            ray.init(address=address, **kwargs)
        ray_head.watch_connected_cluster(address)  # its head lost: leave it, not block or end
    else:
        # "local": a new cluster of our own, not whatever `ray start` left on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
        ray_head.watch_started_cluster()  # its head lost: leave it, not end this process
    global _started_here
    _started_here = address == "local" or not address
    try:
        yield True
    finally:
        _started_here = False
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


def check_capacity(spec: RunSpec, first_attempt: bool = True) -> CapacityDecision:
    """The cluster's capacity for the worker group of ``spec`` (``capacity``), refusing at
    setup (``first_attempt``) a group no node the cluster can have could ever hold: a
    ``ClusterCapacityError`` that names the request, the largest node type and the knob. A
    group more nodes could hold is no error here: the attempt waits for them (``trainer.fit``).
    With ``datasets``, the same for the CPU Ray Data's reads need beside the group
    (``data_capacity``): refused where the cluster can never leave one, warned where its live
    nodes leave none now.
    """
    decision = capacity(spec)
    if isinstance(decision, NeverFits) and first_attempt:
        raise ClusterCapacityError(decision.reason, field=decision.field)
    if spec.datasets:
        reads = data_capacity.decide(
            worker_needs(spec),
            (spec.scaling.min_workers, spec.scaling.max_workers),
            _live_nodes(),
            most_nodes(),
            spec.scaling.placement_strategy,
        )
        if isinstance(reads, NeverFits) and first_attempt:
            raise ClusterCapacityError(reads.reason, field=reads.field)
        if isinstance(reads, WaitForNodes) and isinstance(decision, Fits):
            logger.warning(
                "%s: they start when the cluster adds a node (a cluster that adds none never "
                "runs them: leave a CPU free with fewer scaling.num_workers or a smaller "
                "scaling.resources_per_worker CPU)",
                reads.reason,
            )
    return decision


def capacity(spec: RunSpec) -> CapacityDecision:
    """Whether the live nodes hold the smallest worker group of ``spec`` (an elastic run's MIN),
    more nodes could, or no node the cluster can have could (``capacity.decide``)."""
    return decide_now(worker_needs(spec), spec.scaling.min_workers, spec.scaling.placement_strategy)


def groups_held(spec: RunSpec) -> int:
    """How many smallest worker groups of ``spec`` the live nodes hold side by side (at least
    1): as many runs of it as can train at once."""
    slots = [holds(node, worker_needs(spec)) for node in _live_nodes()]
    placed = workers_placed(slots, spec.scaling.placement_strategy)
    return max(1, placed // max(1, spec.scaling.min_workers))


def decide_now(per_worker: dict[str, float], num_workers: int, strategy: str) -> CapacityDecision:
    """``capacity.decide`` on the cluster as it is now: its live nodes and ``node_types()``."""
    return decide(per_worker, num_workers, _live_nodes(), node_types(), strategy)


def _live_nodes() -> list[dict[str, float]]:
    """The resources of each live node."""
    return [dict(n.get("Resources", {})) for n in ray.nodes() if n.get("Alive")]


def short_of_nodes(per_worker: dict[str, float], num_workers: int, strategy: str) -> str | None:
    """What the live nodes lack for the group, when more nodes could hold it (a node lost, an
    autoscaling cluster still to start its workers); None when they hold it, or none could."""
    decision = decide_now(per_worker, num_workers, strategy)
    return decision.reason if isinstance(decision, WaitForNodes) else None


#: Whether this process started the cluster it is connected to (``ray_cluster``, "local"):
#: nobody adds nodes to it, so its live nodes are all the nodes it can have.
_started_here = False


def node_types() -> list[NodeType] | None:
    """The kinds of node the cluster can have, for ``capacity.decide``:

    - a cluster this process started: its live nodes, one of each (nobody adds nodes to it);
    - the autoscaler's node types, with their bounds, where it publishes them in the GCS (Ray's
      autoscaler v2 and KubeRay report them: ``ReportClusterConfig``, which Ray Data reads
      the same way);
    - None under an autoscaler that does not (Ray's v1 autoscaler writes only its status), or
      while it is not yet known whether one runs: the node types are unknown here, so no request
      is refused and a shortfall is waited for;
    - any other cluster (nodes started with ``ray start``, a fixed-size KubeRay cluster): every
      node it has had, alive or lost, as many as it takes (a lost one can be replaced, others
      can join).
    """
    if _started_here:
        return [
            NodeType(n["NodeID"], dict(n.get("Resources", {})), 1)
            for n in ray.nodes()
            if n.get("Alive")
        ]
    config = _autoscaler_config()
    if config is not None and config.node_group_configs:
        return [
            NodeType(
                group.name,
                {name: float(amount) for name, amount in group.resources.items()},
                None if group.max_count < 0 else int(group.max_count),
            )
            for group in config.node_group_configs
        ]
    if _has_autoscaler() is not False:
        return None
    return [NodeType(node_id, resources) for node_id, resources in _every_node_had()]


def _every_node_had() -> list[tuple[str, dict[str, float]]]:
    """Each node the cluster has had, alive or lost, with its total resources: from the GCS's
    node table, which keeps a lost node's (``ray.nodes()`` gives a dead node none, and a lost
    node's kind would be taken for one the cluster can never have)."""
    from ray._raylet import GcsClient  # type: ignore[attr-defined]  # compiled, unstubbed

    try:
        gcs = GcsClient(address=ray.get_runtime_context().gcs_address)
        table = gcs.get_all_node_info(timeout=30)
        return [(node_id.hex(), dict(n.resources_total)) for node_id, n in table.items()]
    except Exception:  # a GCS that did not answer: the nodes ray.nodes() gives
        return [(n["NodeID"], dict(n.get("Resources", {}))) for n in ray.nodes()]


def most_nodes() -> list[dict[str, float]] | None:
    """The resources of every node of the largest cluster it can be, for
    ``data_capacity.decide``: a cluster this process started, its live nodes; one whose
    autoscaler bounds every node type, as many of each as it allows, and the live nodes on top
    (a type it starts none of, a head's, may be live: counting more can only refuse less);
    None where more nodes can always come or it is unknown (``node_types``)."""
    types = node_types()
    if types is None or any(t.max_count is None for t in types):
        return None
    bounded = [t.resources for t in types for _ in range(t.max_count or 0)]
    return bounded if _started_here else bounded + _live_nodes()


def _autoscaler_config() -> Any:
    """The cluster config an autoscaler reported to the GCS (node types), or None."""
    from ray._private.state import state

    try:
        return state.get_cluster_config()
    except Exception:  # an older GCS, or none reported: unknown
        return None


def _has_autoscaler() -> bool | None:
    """Whether an autoscaler manages the cluster's nodes (None: not known yet). Ray's monitor
    runs on every head and writes its status to the GCS; without an autoscaling config its node
    provider is Ray's read-only stand-in, which names each node's type ``node_<node id>``
    (``format_readonly_node_type``): any other node type is an autoscaler's. Until the monitor
    has made its first report (a head just started) it is not known."""
    from ray._private import ray_constants
    from ray.experimental import internal_kv

    try:
        raw = internal_kv._internal_kv_get(ray_constants.DEBUG_AUTOSCALING_STATUS)
    except Exception:  # the GCS did not answer: not known
        return None
    if raw is None:  # no monitor on this head (``--no-monitor``): nobody adds nodes
        return False
    try:
        report = json.loads(raw).get("autoscaler_report")
    except (ValueError, AttributeError):  # a status this reading does not know
        return None
    if not report:
        return None
    types = {*(report.get("node_type_mapping") or {}).values(), *(report.get("active_nodes") or {})}
    types |= {*(report.get("pending_launches") or {})}
    return any(not _READONLY_NODE_TYPE.fullmatch(str(name)) for name in types)


_READONLY_NODE_TYPE = re.compile(r"node_[0-9a-f]+")


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
