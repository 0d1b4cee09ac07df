"""The cluster capacity decision, with plain values: a group that fits the live nodes starts; a
shortfall more nodes could fix is waited for; only a request no node the cluster can have could
ever hold is a spec error. The oracle is the nodes themselves (what each can hold, counted by
hand in each case), not the function's arithmetic."""

from __future__ import annotations

from trainer_core.execution.capacity import Fits, NeverFits, NodeType, WaitForNodes, decide

CPU1 = {"CPU": 1.0}
HEAD = {"CPU": 0.0, "memory": 8e9}


def test_a_group_the_live_nodes_hold_fits():
    assert decide(CPU1, 2, [HEAD, {"CPU": 1.0}, {"CPU": 1.0}], None) == Fits()
    assert decide({"CPU": 2.0}, 3, [{"CPU": 4.0}, {"CPU": 2.0}], []) == Fits()  # 2 + 1 slots


def test_a_lost_node_is_waited_for_when_more_nodes_of_its_kind_could_come():
    """Two one-CPU nodes, one lost: the group of 2 waits (the lost node's kind can come back)."""
    lost_one = decide(CPU1, 2, [HEAD, {"CPU": 1.0}], [NodeType("seen", {"CPU": 1.0})])
    assert isinstance(lost_one, WaitForNodes)
    assert "2 workers" in lost_one.reason and "1" in lost_one.reason


def test_a_cluster_whose_workers_autoscale_from_zero_is_waited_for():
    types = [NodeType("ray.head.default", HEAD, 0), NodeType("cpu1", CPU1, 3)]
    assert isinstance(decide(CPU1, 2, [HEAD], types), WaitForNodes)
    # An autoscaler that does not publish its node types (Ray's v1): no request is refused.
    assert isinstance(decide({"CPU": 64.0}, 8, [HEAD], None), WaitForNodes)


def test_an_unplaceable_group_is_not_taken_for_one_that_fits():
    """2 nodes of 3 CPUs hold 6 CPUs in all, but only 2 workers of 2 CPUs (one each)."""
    nodes = [{"CPU": 3.0}, {"CPU": 3.0}]
    waiting = decide({"CPU": 2.0}, 3, nodes, [NodeType("n3", {"CPU": 3.0})])
    assert isinstance(waiting, WaitForNodes)
    assert "3 workers" in waiting.reason and "hold 2" in waiting.reason
    # No more such nodes can come (each kind at most the 2 there are): never.
    never = decide({"CPU": 2.0}, 3, nodes, [NodeType("n3", {"CPU": 3.0}, max_count=2)])
    assert isinstance(never, NeverFits) and never.field == "scaling.num_workers"


def test_a_worker_larger_than_every_node_type_never_fits():
    types = [NodeType("small", {"CPU": 2.0}), NodeType("large", {"CPU": 3.0, "GPU": 1.0})]
    never = decide({"CPU": 4.0}, 1, [HEAD], types)
    assert isinstance(never, NeverFits)
    assert never.field == "scaling.resources_per_worker"
    assert "4 CPU" in never.reason and "3 CPU" in never.reason  # the request, the largest type
    assert "scaling.resources_per_worker" in never.reason
    # Each resource on some type, but not both on one: no node holds a worker either.
    assert isinstance(decide({"CPU": 3.0, "TPU": 1.0}, 1, [], types), NeverFits)


def test_placement_strategies_count_what_they_allow():
    one_big = [{"CPU": 4.0}]
    assert decide(CPU1, 2, one_big, None) == Fits()
    assert isinstance(decide(CPU1, 2, one_big, None, "STRICT_SPREAD"), WaitForNodes)
    two_small = [{"CPU": 1.0}, {"CPU": 1.0}]
    assert decide(CPU1, 2, two_small, None) == Fits()
    assert isinstance(decide(CPU1, 2, two_small, None, "STRICT_PACK"), WaitForNodes)
