"""Whether Ray Data's reads of a Ray loop's ``datasets`` can get a CPU beside the worker group:
a pure decision over plain values, taken by the driver with the group's own (``capacity``).

Ray Data reads a table with tasks of a whole CPU at least: in Ray 2.60 the Parquet reader's
file listing (its ``ListFiles`` operator) asks 1 CPU whatever the read asks, and no setting
changes it, so a read cannot be made to run on no CPU. Ray Train's workers hold their
resources for the whole run, and Ray Data's budget is what they leave (Ray's
AutoscalingCoordinator grants Ray Train first): when the workers take every CPU but a fraction
of one, no read task starts, and the loop waits for its first batch forever, silently
(measured: 2 workers of 1 CPU, or of 0.75, on 2 CPUs hang; of 0.5 they train).

- ``Fits``: the live nodes leave a CPU beside the group;
- ``WaitForNodes``: they do not, but more nodes could come (an autoscaler adds them when Ray
  Data asks for them; a cluster of ``ray start`` nodes, when someone adds one): the reads wait
  for them;
- ``NeverFits``: the most nodes the cluster can have leave none: a spec error, at setup.

An elastic group takes as many workers as the nodes hold, up to its MAX; a fixed one its count.
CPUs are counted over all nodes at once, which can only leave more than a node has free
(a read task runs on one node): a refusal is certain, a pass is not a promise.
"""

from __future__ import annotations

import math

from trainer_core.execution.capacity import (
    CapacityDecision,
    Fits,
    NeverFits,
    WaitForNodes,
    holds,
    workers_placed,
)

#: The CPUs one Ray Data read task asks for at least (``ListFiles``: 1, not configurable).
READ_TASK_CPUS = 1.0
#: Amounts are floats in Ray; compare with some slack.
_EPSILON = 1e-9
_ONE_TASK = READ_TASK_CPUS - _EPSILON


def decide(
    per_worker: dict[str, float],
    workers: tuple[int, int],
    live_nodes: list[dict[str, float]],
    most_nodes: list[dict[str, float]] | None,
    strategy: str = "PACK",
) -> CapacityDecision:
    """Whether Ray Data's read tasks can get a CPU beside the worker group.

    ``per_worker``: what one worker takes (resource -> amount). ``workers``: the group's
    (MIN, MAX), equal for a fixed count. ``live_nodes``: each live node's resources.
    ``most_nodes``: each node of the largest cluster it can be (an over-count where unsure),
    None where it has no bound or the bound is unknown: then nothing is refused.
    """
    low, high = workers
    group_starts = workers_placed([holds(n, per_worker) for n in live_nodes], strategy) >= low
    if group_starts and _cpus_left(per_worker, high, live_nodes, strategy) >= _ONE_TASK:
        return Fits()
    if most_nodes is not None:
        left = _cpus_left(per_worker, high, most_nodes, strategy)
        if left < _ONE_TASK:
            return NeverFits(
                _never(per_worker, workers, most_nodes, strategy, left),
                field="scaling.resources_per_worker",
            )
    return WaitForNodes(
        f"Ray Data's reads of datasets wait for a free CPU: the {len(live_nodes)} live "
        f"node(s) have {_cpus(live_nodes):g} CPU, the worker group takes "
        f"{_taken(per_worker, high, live_nodes, strategy):g} of them, and a read task asks "
        f"{READ_TASK_CPUS:g}"
    )


def _group(
    per_worker: dict[str, float], high: int, nodes: list[dict[str, float]], strategy: str
) -> int:
    """The workers a group of at most ``high`` takes on ``nodes``: an elastic group grows to
    what they hold (a fixed group they do not hold never starts: ``capacity`` refuses it)."""
    return min(high, workers_placed([holds(n, per_worker) for n in nodes], strategy))


def _taken(
    per_worker: dict[str, float], high: int, nodes: list[dict[str, float]], strategy: str
) -> float:
    return _group(per_worker, high, nodes, strategy) * per_worker.get("CPU", 0.0)


def _cpus_left(
    per_worker: dict[str, float], high: int, nodes: list[dict[str, float]], strategy: str
) -> float:
    return _cpus(nodes) - _taken(per_worker, high, nodes, strategy)


def _cpus(nodes: list[dict[str, float]]) -> float:
    return sum(node.get("CPU", 0.0) for node in nodes)


def _never(
    per_worker: dict[str, float],
    workers: tuple[int, int],
    nodes: list[dict[str, float]],
    strategy: str,
    left: float,
) -> str:
    """What the refusal says: the cluster's CPUs, what the workers take, and fixes that leave
    a read task its CPU on the same cluster."""
    low, high = workers
    cpus, per_cpu = _cpus(nodes), per_worker.get("CPU", 0.0)
    group = _group(per_worker, high, nodes, strategy)
    count = f"{group}" if low == high else f"{group} (as many as it holds, up to {high})"
    fixes = []
    # Each worker's share of what leaves one CPU, for MAX workers (an elastic group may grow
    # to MAX once its workers are smaller), in hundredths, rounded down.
    smaller = math.floor((cpus - READ_TASK_CPUS) / high * 100 + _EPSILON) / 100
    if 0 < smaller < per_cpu:
        fixes.append(
            f"give each worker fewer CPUs (scaling.resources_per_worker: {{CPU: {smaller:g}}})"
        )
    fewer = math.floor((cpus - READ_TASK_CPUS) / per_cpu + _EPSILON) if per_cpu else high
    if (low if low < high else 1) <= fewer < high:  # an elastic group keeps its MIN
        shown = f"{fewer}" if low == high else f"[{low}, {fewer}]"
        fixes.append(f"run fewer workers (scaling.num_workers={shown})")
    fixes.append("give the cluster more CPUs")
    return (
        f"datasets: Ray Data reads them with tasks of at least {READ_TASK_CPUS:g} CPU (its file "
        f"listing asks a whole CPU, whatever the read asks), but the Ray cluster has "
        f"{cpus:g} CPU at most and the worker group takes {group * per_cpu:g} of them: "
        f"scaling.num_workers {count} x {per_cpu:g} CPU (scaling.resources_per_worker), "
        f"leaving {max(left, 0.0):g}. No read task could ever start, and the loop would wait for "
        f"its first batch forever. Leave at least {READ_TASK_CPUS:g} CPU free for Ray Data: "
        + ", or ".join(fixes)
    )
