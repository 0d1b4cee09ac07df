"""Elastic capacity: Ray Train's elastic scaling policy, sizing a worker group to the cluster
as it is now (kept free of torch: the controller imports it)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import ray
from ray._private import state as ray_state
from ray.train.v2._internal.execution.scaling_policy import (
    ElasticScalingPolicy,
    NoopDecision,
    ResizeDecision,
)

logger = logging.getLogger("relaytrain.engine")


class CurrentCapacityPolicy(ElasticScalingPolicy):
    """Ray Train's elastic scaling policy, sizing a group that must start or restart to the
    cluster as it is now.

    Ray's autoscaling coordinator looks at the cluster's nodes every 20 s. A group restarted
    sooner after a node loss was sized to the lost node too, and waited out Ray's worker-group
    start timeout (60 s) before it was sized again. So before each such decision the
    coordinator is asked to look again (its ``recompute``). And a node counts only if its
    raylet still takes a connection: Ray declares a lost node dead only after its health checks
    fail (about 15 s at Ray's defaults), and until then a healthy group would be grown onto it.

    The coordinator counts each node's resources whole, blind to what other work holds there
    (another run's workers, another team's job or placement group). On a cluster others share, a
    group sized to the nodes waited out the start timeout three times an attempt and spent every
    retry with 0 steps, though MIN workers were free all along (the adversary's seed 398). So a
    group counts only the workers whose resources are free now, beside those a running group
    holds: it starts on what is free (at least MIN), and grows once other work frees more. A
    start short of the nodes' count looks again ``SETTLE_S`` later first: Ray's view of free
    resources lags the release of those a restarted group just gave back.
    """

    @classmethod
    def replacing(cls, policy: Any) -> Any:
        """This policy in place of Ray's elastic one; any other policy as it is."""
        if isinstance(policy, ElasticScalingPolicy):
            return cls(policy.scaling_config)
        return policy

    #: Ray's controller asks again at once while it waits for MIN workers: look at most this
    #: often (Ray's own policy asks its coordinator at most once a second too).
    LOOK_INTERVAL_S = 1.0
    _last_look = float("-inf")
    _answering: tuple[float, set[str]] = (float("-inf"), set())
    #: How long a start short of the nodes' count waits for the resources a group just gave back
    #: to show as free (Ray's raylets report theirs every 100 ms; a loaded machine is slower).
    SETTLE_S = 2.0
    #: The running group's workers, while its resize is decided: its own resources are not free.
    _running = 0
    #: The last count: workers the nodes hold, and those free now.
    _counts = (0, 0)
    _short_since: float | None = None

    def make_decision_for_running_worker_group(
        self, worker_group_state: Any, worker_group_status: Any
    ) -> Any:
        self._running, self._short_since = worker_group_state.num_workers, None
        try:
            return super().make_decision_for_running_worker_group(
                worker_group_state, worker_group_status
            )
        finally:
            self._running = 0

    def make_decision_for_non_running_worker_group(self) -> Any:
        now = time.monotonic()
        if self._coordinator_client is not None and now - self._last_look >= self.LOOK_INTERVAL_S:
            self._last_look = now
            try:
                ray.get(
                    self._autoscaling_coordinator.get_reserved_resources.remote(
                        self._requester_id, recompute=True
                    ),
                    timeout=5,
                )
                self._latest_reserved_resources_query_time = float("-inf")
            except Exception as e:  # Ray's view of 20 s ago still sizes the group
                logger.warning("the autoscaling coordinator did not look again: %s", e)
        decision = super().make_decision_for_non_running_worker_group()
        nodes, free = self._counts
        if not isinstance(decision, ResizeDecision) or free >= nodes:
            self._short_since = None
            return decision
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since < self.SETTLE_S:
            return NoopDecision()
        self._short_since = None
        logger.warning(
            "other work holds part of the cluster: the worker group starts on the %d worker(s) "
            "free now, of %d the nodes hold, and grows as more are freed",
            free,
            nodes,
        )
        return decision

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        looked_at, answering = self._answering
        if time.monotonic() - looked_at >= self.LOOK_INTERVAL_S:
            answering = _answering_nodes()
            self._answering = (time.monotonic(), answering)
        reserved_resources = {n: r for n, r in reserved_resources.items() if n in answering}
        nodes = int(super()._count_possible_workers(reserved_resources))
        # Free on any live node, not only those the coordinator reserved: it places its
        # reservation by the nodes' whole resources, maybe where other work holds them all.
        counted = min(nodes, self._running + self._free_workers(answering))
        self._counts = (nodes, counted)
        return counted

    def _free_workers(self, node_ids: set[str]) -> int:
        """The workers whose resources are free now on the nodes ``node_ids`` (Ray's view of
        each node's available resources); where Ray cannot say, the nodes' count stands."""
        per_worker = {
            name: amount
            for name, amount in self.scaling_config._resources_per_worker_not_none.items()
            if amount > 0
        }
        if not per_worker:
            return self.scaling_config.max_workers
        try:
            available = ray_state.available_resources_per_node()
        except Exception as e:
            logger.warning("Ray did not say what is free on its nodes: %s", e)
            return self.scaling_config.max_workers
        return sum(
            int(min(free.get(name, 0.0) // amount for name, amount in per_worker.items()))
            for node, free in available.items()
            if node in node_ids
        )


def _answering_nodes(timeout_s: float = 1.0) -> set[str]:
    """The live nodes whose raylet takes a TCP connection now."""
    answering = set()
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        address = (node["NodeManagerAddress"], node["NodeManagerPort"])
        try:
            with socket.create_connection(address, timeout=timeout_s):
                answering.add(node["NodeID"])
        except OSError:
            logger.warning("node %s does not answer: not counted", node["NodeID"])
    return answering
