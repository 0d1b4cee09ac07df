"""Whether a worker group fits the Ray cluster: a pure decision over plain values (the
cluster's live nodes and the node types it can have), taken by the driver on every attempt.

- ``Fits``: the live nodes hold the group (free or not: other work holding it is a busy
  cluster, waited for in Ray's queue, ``worker_start.QueuedPlacementGroup``);
- ``WaitForNodes``: more nodes could hold it (a node lost and not yet replaced, an autoscaling
  cluster that starts its workers from zero, a group the live nodes cannot pack): the attempt
  waits for them up to ``scaling.wait_for_resources_s``, then fails as a failure of the cluster,
  on the infrastructure budget;
- ``NeverFits``: no node the cluster can have could ever hold it (a worker larger than every
  node type, or more workers than the most nodes it can have hold): a spec error, at setup.

Workers of a group are alike, so packing is exact without a search: a node holds as many
workers as its scarcest resource allows, and the group fits when the nodes' counts add up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: Per resource, a request's amounts and a node's are floats in Ray; compare with some slack.
_EPSILON = 1e-9
#: How many workers that ask for no resource at all a node holds.
_UNBOUNDED = 2**31


@dataclass(frozen=True)
class NodeType:
    """A kind of node the cluster can have: its resources, and how many of it at most (None:
    no bound known; a cluster without an autoscaler can have nodes added)."""

    name: str
    resources: dict[str, float]
    max_count: int | None = None


@dataclass(frozen=True)
class Fits:
    """The live nodes hold the worker group."""


@dataclass(frozen=True)
class WaitForNodes:
    """More nodes could hold the group; ``reason`` says what the live nodes lack."""

    reason: str


@dataclass(frozen=True)
class NeverFits:
    """No node the cluster can have could hold the group; ``field`` is the knob to change."""

    reason: str
    field: str


CapacityDecision = Fits | WaitForNodes | NeverFits


def decide(
    per_worker: dict[str, float],
    num_workers: int,
    live_nodes: list[dict[str, float]],
    node_types: list[NodeType] | None,
    strategy: str = "PACK",
) -> CapacityDecision:
    """Whether ``num_workers`` workers of ``per_worker`` (resource -> amount) fit.

    ``live_nodes``: the resources of each live node. ``node_types``: the kinds of node the
    cluster can have (an autoscaler's node types, or the nodes it has had); None where they are
    unknown (an autoscaler that does not publish them): then nothing is refused.
    ``strategy``: the placement strategy (STRICT_SPREAD: a node each; STRICT_PACK: one node).
    """
    live = [holds(node, per_worker) for node in live_nodes]
    if placeable(live, num_workers, strategy):
        return Fits()
    asked = _describe(per_worker)
    if node_types is not None:
        kinds = [(t, holds(t.resources, per_worker)) for t in node_types]
        if all(slots == 0 for _, slots in kinds):
            largest = max(node_types, key=lambda t: _size(t.resources, per_worker), default=None)
            shown = _describe(largest.resources, per_worker) if largest else "no node type"
            return NeverFits(
                f"scaling.resources_per_worker asks {asked} for each worker, but the largest "
                f"node of the Ray cluster has {shown} (of the node types it can have; a worker "
                "runs on one node): no node it can have holds one. Lower "
                "scaling.resources_per_worker, or give the cluster a node type that large",
                field="scaling.resources_per_worker",
            )
        if all(t.max_count is not None for t, _ in kinds):
            most = [slots for t, slots in kinds for _ in range(t.max_count or 0)]
            if not placeable(most, num_workers, strategy):
                return NeverFits(
                    f"scaling.num_workers={num_workers} workers of {asked} need more nodes than "
                    f"the Ray cluster can have: its nodes, as many as it can have of each "
                    f"type, hold {workers_placed(most, strategy)} such workers "
                    f"(strategy {strategy}). "
                    "Lower scaling.num_workers or scaling.resources_per_worker, or let the "
                    "cluster have more nodes",
                    field="scaling.num_workers",
                )
    return WaitForNodes(
        f"{num_workers} workers of {asked} need more nodes: the {len(live_nodes)} live "
        f"node(s) hold {workers_placed(live, strategy)} (strategy {strategy})"
    )


def holds(node: dict[str, float], per_worker: dict[str, float]) -> int:
    """How many workers of ``per_worker`` the node holds (its scarcest resource decides)."""
    counts = [
        math.floor(node.get(name, 0.0) / amount + _EPSILON)
        for name, amount in per_worker.items()
        if amount > 0
    ]
    return max(0, min(counts)) if counts else _UNBOUNDED  # asks nothing: fits anywhere


def placeable(slots: list[int], num_workers: int, strategy: str) -> bool:
    """Whether nodes holding ``slots`` workers each can place ``num_workers`` under
    ``strategy``."""
    return workers_placed(slots, strategy) >= num_workers


def workers_placed(slots: list[int], strategy: str) -> int:
    """How many workers nodes holding ``slots`` each can place together under ``strategy``."""
    if strategy == "STRICT_SPREAD":
        return sum(1 for s in slots if s > 0)
    if strategy == "STRICT_PACK":
        return max(slots, default=0)
    return sum(slots)


def _size(resources: dict[str, float], per_worker: dict[str, float]) -> tuple[float, ...]:
    """A node type's size as far as the request goes: its amounts of the requested resources."""
    return tuple(resources.get(name, 0.0) for name in per_worker)


def _describe(resources: dict[str, float], only: dict[str, float] | None = None) -> str:
    """``{"CPU": 2, "GPU": 1}`` as "2 CPU, 1 GPU" (only the resources of ``only``)."""
    names = list(only) if only is not None else list(resources)
    return ", ".join(f"{resources.get(name, 0.0):g} {name}" for name in names)
