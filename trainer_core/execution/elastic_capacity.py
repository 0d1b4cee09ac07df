"""Elastic capacity: Ray Train's elastic scaling policy, sizing a worker group to the cluster
as it is now (kept free of torch: the controller imports it)."""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import ray
from ray.train.v2._internal.execution.scaling_policy import ElasticScalingPolicy

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
        return super().make_decision_for_non_running_worker_group()

    def _count_possible_workers(self, reserved_resources: Any) -> int:
        looked_at, answering = self._answering
        if time.monotonic() - looked_at >= self.LOOK_INTERVAL_S:
            answering = _answering_nodes(set(reserved_resources))
            self._answering = (time.monotonic(), answering)
        reserved_resources = {n: r for n, r in reserved_resources.items() if n in answering}
        return int(super()._count_possible_workers(reserved_resources))


def _answering_nodes(node_ids: set[str], timeout_s: float = 1.0) -> set[str]:
    """The nodes among ``node_ids`` whose raylet takes a TCP connection now."""
    answering = set()
    for node in ray.nodes():
        if node["NodeID"] not in node_ids or not node.get("Alive"):
            continue
        address = (node["NodeManagerAddress"], node["NodeManagerPort"])
        try:
            with socket.create_connection(address, timeout=timeout_s):
                answering.add(node["NodeID"])
        except OSError:
            logger.warning("node %s does not answer: not counted", node["NodeID"])
    return answering
