"""Runs on an autoscaling Ray cluster (Ray's fake multi-node provider, tests/autoscaling.py): a
head of no CPUs whose autoscaler starts one-CPU worker nodes when work waits for them, none at
start. The attempts run as Ray jobs on it (``scaling.job_address``), their runs on this
machine's disk.

- a run on the cluster with no worker nodes waits for one and completes;
- every worker node of a fixed-size run is lost; the autoscaler starts a new one only once the
  retry waits for it (the node starts after the retry began: the oracle is the node's own start
  time), and the run ends bit-identical to the uninterrupted one;
- a worker no node comes for (a resource no node has) is waited for, then fails on the
  infrastructure budget, not as a spec error.
"""

from __future__ import annotations

import pytest
from ray.util.state import list_nodes

from flows.training import training
from tests.autoscaling import FakeAutoscalingCluster
from tests.conftest import ONE_WORKER, tiny_raw
from tests.integration.multinode.runs import run_flow_in_thread
from tests.multinode import wait_until
from tests.recovery import assert_same_tensors, committed_step, final_state, losses, run_dir_of
from trainer_core.spec.overrides import build_spec

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


@pytest.fixture(scope="module")
def autoscaling():
    # Ray's start timeout short (60 s by default): the groups that wait for nodes wait past it,
    # in Ray's queue, and the one no node comes for fails soon after its wait.
    cluster = FakeAutoscalingCluster(
        {"cpu1": {"resources": {"CPU": 1}, "max_workers": 2}},
        env={"RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": "10"},
    )
    try:
        yield cluster.start()
    finally:
        cluster.stop()  # asserts that none of its processes remains


def on_cluster(tmp_path, name: str, cluster: FakeAutoscalingCluster, **sections) -> dict:
    """The tiny one-worker spec (SlowMLP: the same MLP, slower) as jobs on ``cluster``."""
    raw = tiny_raw(
        tmp_path,
        name,
        model={
            "name": "tests.helpers:slow_mlp",
            "kwargs": {"hidden": [16, 16], "dropout": 0.1, "delay_s": 0.3},
        },
        scaling={**ONE_WORKER, "job_address": cluster.job_address, "wait_for_resources_s": 300},
        retries={"infrastructure": 3, "code": 0, "delay_s": 1, "jitter": 0, "in_place": 0},
    )
    for key, value in sections.items():
        raw[key] = {**raw[key], **value}
    return raw


def assert_bit_identical(run_dir, reference: dict) -> None:
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]


def test_a_run_on_a_cluster_with_no_worker_nodes_waits_for_one_and_completes(
    autoscaling, relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    assert autoscaling.worker_nodes() == {}  # nothing to run on until the autoscaler adds it
    spec = build_spec(on_cluster(tmp_path, "from-zero", autoscaling))
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    run_dir = run_dir_of(spec)
    assert [a["status"] for a in run_dir.read_attempts()] == ["completed"]
    assert autoscaling.worker_nodes()  # the node it ran on, started for it
    assert_bit_identical(run_dir, uninterrupted_one_worker)


def test_a_lost_node_that_comes_back_only_after_the_retry_is_waited_for(
    autoscaling, relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    autoscaling.ensure_worker_node()  # the run starts on a node, which is then lost
    spec = build_spec(on_cluster(tmp_path, "lost-node", autoscaling))
    run_dir = run_dir_of(spec)
    thread, box = run_flow_in_thread(spec)
    wait_until(lambda: committed_step(run_dir) >= 10 or not thread.is_alive(), 600, "a commit")
    assert thread.is_alive(), box  # training, not ended before its first commit
    lost = set(autoscaling.worker_nodes())
    assert lost
    for node_id in lost:  # every worker node: the group's node among them
        autoscaling.kill_node(node_id)
    thread.join(timeout=900)
    state = box["state"]
    assert state.is_completed(), state
    attempts = run_dir.read_attempts()
    assert attempts[0]["status"] == "failed"
    assert attempts[0]["error_budget"] == "infrastructure"
    assert attempts[-1]["status"] == "completed"
    # The node the retry ran on came after the retry began (the autoscaler starts one for
    # the group that waits for it): the retry met a cluster without the node it needs.
    retry_began = attempts[1]["started_at"]
    nodes = list_nodes(address=autoscaling.job_address, detail=True, limit=100)
    new = [n for n in nodes if n.node_id not in lost and not n.is_head_node]
    assert new and all(n.start_time_ms / 1000 > retry_began for n in new), (retry_began, new)
    assert_bit_identical(run_dir, uninterrupted_one_worker)


def test_a_shortfall_no_node_comes_for_fails_on_the_infrastructure_budget(
    autoscaling, relaytrain_prefect, tmp_path
):
    """A worker needs a resource no node has; Ray's v1 autoscaler does not publish its node
    types, so no request can be called impossible: the attempt waits for nodes
    (``scaling.wait_for_resources_s``), then fails as a failure of the cluster."""
    raw = on_cluster(
        tmp_path,
        "never-comes",
        autoscaling,
        scaling={"resources_per_worker": {"CPU": 1, "accelerator": 1}, "wait_for_resources_s": 3},
        retries={"infrastructure": 0},
    )
    spec = build_spec(raw)
    state = training(spec, return_state=True)
    assert state.is_failed()
    (attempt,) = run_dir_of(spec).read_attempts()
    assert attempt["error_budget"] == "infrastructure", attempt
    assert "scaling.wait_for_resources_s=3" in attempt["error_message"]
    assert "nodes" in attempt["error_message"]
