"""Whether Ray Data's reads of a Ray loop's ``datasets`` can get a CPU beside the worker group,
with plain values. The oracle is the CPUs counted by hand in each case, and what was measured
on a 2-CPU Ray cluster with Ray 2.60 (a read task needs a whole CPU free: 2 workers of 1 CPU or
of 0.75 never read a row, 2 of 0.5 train); the refusal's suggested fixes are tried back."""

from __future__ import annotations

import re

from trainer_core.execution.capacity import Fits, NeverFits, WaitForNodes
from trainer_core.execution.data_capacity import decide

CPU1 = {"CPU": 1.0}
FOUR = [{"CPU": 4.0}]  # the test session's cluster: one node, started by the test (no more)


def test_workers_that_take_every_cpu_never_let_a_read_start():
    never = decide(CPU1, (4, 4), FOUR, FOUR)
    assert isinstance(never, NeverFits)
    assert never.field == "scaling.resources_per_worker"
    message = never.reason
    assert "has 4 CPU at most" in message and "takes 4 of them" in message, message
    assert "scaling.num_workers" in message and "at least 1 CPU free for Ray Data" in message


def test_one_cpu_left_is_enough_and_less_is_not():
    assert decide(CPU1, (3, 3), FOUR, FOUR) == Fits()  # 1 CPU left
    two = [{"CPU": 2.0}]
    assert decide({"CPU": 0.5}, (2, 2), two, two) == Fits()  # measured: trains
    assert isinstance(decide({"CPU": 0.75}, (2, 2), two, two), NeverFits)  # measured: hangs
    # CPUs of several nodes add up (a read runs on one node: the sum can only say more).
    halves = [{"CPU": 1.5}, {"CPU": 1.5}]
    assert decide(CPU1, (2, 2), halves, halves) == Fits()


def test_the_suggested_fixes_leave_a_cpu():
    never = decide(CPU1, (4, 4), FOUR, FOUR)
    assert isinstance(never, NeverFits)
    assert "scaling.resources_per_worker: {CPU: 0.75}" in never.reason, never.reason
    assert "scaling.num_workers=3" in never.reason, never.reason
    assert decide({"CPU": 0.75}, (4, 4), FOUR, FOUR) == Fits()  # 3 taken, 1 left
    assert decide(CPU1, (3, 3), FOUR, FOUR) == Fits()
    # The repo's example on a 2-core machine: 2 workers of 1 CPU; 0.5 each leaves one.
    two = [{"CPU": 2.0}]
    example = decide(CPU1, (2, 2), two, two)
    assert isinstance(example, NeverFits)
    assert "{CPU: 0.5}" in example.reason and "scaling.num_workers=1" in example.reason


def test_an_elastic_group_grows_to_what_the_nodes_hold():
    """[2, 8] workers of 1 CPU on 4 CPUs: the group takes 4, none left; [2, 3] takes 3."""
    never = decide(CPU1, (2, 8), FOUR, FOUR)
    assert isinstance(never, NeverFits)
    assert "as many as it holds, up to 8" in never.reason
    fewer = re.search(r"scaling\.num_workers=\[2, (\d+)\]", never.reason)
    assert fewer and fewer.group(1) == "3", never.reason
    assert decide(CPU1, (2, 3), FOUR, FOUR) == Fits()
    # 0.37 CPU each (the suggestion, for 8 workers) leaves a CPU even at MAX: 8 x 0.37 = 2.96.
    assert "{CPU: 0.37}" in never.reason, never.reason
    assert decide({"CPU": 0.37}, (2, 8), FOUR, FOUR) == Fits()


def test_a_cluster_that_can_grow_waits_for_a_node():
    """Every live CPU taken, but more nodes can come: the reads wait, nothing is refused."""
    head = {"CPU": 0.0}
    live = [head, {"CPU": 2.0}]
    assert isinstance(decide(CPU1, (2, 2), live, None), WaitForNodes)  # no bound known
    bounded = [*live, {"CPU": 2.0}]  # an autoscaler that can add one more such node
    waiting = decide(CPU1, (2, 2), live, bounded)
    assert isinstance(waiting, WaitForNodes)
    assert "2 CPU" in waiting.reason and "takes 2" in waiting.reason, waiting.reason
    # ... unless even its largest size leaves none: 4 workers on the 2 nodes' 4 CPUs.
    assert isinstance(decide(CPU1, (4, 4), live, bounded), NeverFits)


def test_workers_that_take_no_cpu_leave_the_cpus_to_ray_data():
    gpu_node = [{"CPU": 8.0, "GPU": 2.0}]
    assert decide({"GPU": 1.0}, (2, 2), gpu_node, gpu_node) == Fits()
    no_cpu = [{"CPU": 0.0, "GPU": 2.0}]  # a node of no CPU: nothing could read
    assert isinstance(decide({"GPU": 1.0}, (2, 2), no_cpu, no_cpu), NeverFits)
