"""Capacity on the multi-node cluster: an elastic group shrinks and grows back, a drain notice
is answered with a checkpoint just in time; and the seeded chaos campaign."""

from __future__ import annotations

import time

import pytest

from tests.conftest import tiny_raw
from tests.integration.multinode.runs import run_flow_in_thread
from tests.multinode import MultiNodeCluster, wait_until
from tests.prefect_api import task_runs
from tests.recovery import (
    committed_step,
    record_matrix_row,
    run_dir_of,
)
from tests.streaming_data import (
    assert_epochs_cover_every_sample_once,
    expected_batches,
    write_dataset,
)
from trainer_core.run.report import render_markdown
from trainer_core.spec.overrides import build_spec

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


# -- elastic capacity ------------------------------------------------------------------------------

ELASTIC_EPOCHS = 3


def elastic_raw(storage: str, name: str, cluster: MultiNodeCluster, logs, dataset: str, **extra):
    """[1, 3] workers on the recording model (tests/helpers.py: each rank logs the row ids it
    trains on) over a 420-row table: 20 global batches of 21 an epoch."""
    raw = tiny_raw(
        storage,
        name,
        model={
            "name": "tests.helpers:recording_mlp",
            "kwargs": {"log_dir": str(logs), "delay_s": 0.5},
        },
        data={
            "dataset": dataset,
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": 21,
            "validation_fraction": 0,
            "partitions": 4,
            "shuffle_window": 64,
        },
        schedule={"epochs": ELASTIC_EPOCHS, "lr_schedule": "constant", "warmup_steps": 0},
        checkpoint={"every": 5, "keep_last": 2, "keep_best": 0, "best_metric": "loss"},
        scaling={"num_workers": [1, 3], "resize_interval_s": 5, "job_address": cluster.job_address},
        retries={"infrastructure": 2, "code": 0, "delay_s": 1, "jitter": 0},
    )
    for section, values in extra.items():
        raw[section] = {**raw.get(section, {}), **values}
    return raw


def groups_trained(logs) -> list[tuple[int, list[list[int]]]]:
    """Each worker group's world size and the global batches it trained, oldest group first:
    a group is the W worker processes (one log file each) that started together."""
    import json

    processes = []
    for path in logs.glob("*.jsonl"):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        if records:
            processes.append(records)
    processes.sort(key=lambda records: records[0]["time"])
    groups = []
    while processes:
        size = processes[0][0]["world_size"]
        members, processes = processes[:size], processes[size:]
        by_rank = {records[0]["rank"]: records for records in members}
        assert sorted(by_rank) == list(range(size)), "a group's processes are its ranks"
        count = min(len(records) for records in by_rank.values())
        batches = [[i for r in range(size) for i in by_rank[r][n]["ids"]] for n in range(count)]
        groups.append((size, batches))
    return groups


def kept_batches(groups, restarts) -> list[list[int]]:
    """The global batches the run kept: each group's after the step its successor resumed
    from were trained again by it (one optimizer step is one global batch here)."""
    assert len(groups) == len(restarts) + 1, (len(groups), restarts)
    kept = list(groups[0][1])
    for (_, batches), restart in zip(groups[1:], restarts, strict=True):
        kept = kept[: restart["resumed_from_step"]] + batches
    return kept


def test_an_elastic_run_goes_on_with_fewer_workers_and_grows_back(
    cluster, relaytrain_prefect, run_storage, tmp_path
):
    """[1, 3] workers on 3 one-CPU nodes: a node is killed mid-run, the group goes on with
    fewer within the attempt (no Prefect retry); a node is added, the group grows back to 3.
    The global batches trained are the uninterrupted run's, each sample once an epoch.

    Fewer is usually 2, but Ray's policy sizes the new group by the CPUs free at that moment,
    and a dead group's actor on a surviving node can still hold its CPU: then it starts 1 and
    grows to 2 at its next look (a CI run saw the wait for exactly 2 time out). On a loaded
    machine Ray may not know the node is dead yet: the group it sizes to 3 then times out
    starting (a "startup" restart, which starts no group) and the next one has fewer (seen in a
    full suite run: restart 1 infrastructure, restart 2 startup after 60 s, then 2 workers)."""
    cluster.ensure_worker_nodes(3)
    dataset, logs = str(tmp_path / "table"), tmp_path / "logs"
    write_dataset(dataset)
    logs.mkdir()
    spec = build_spec(elastic_raw(run_storage, "multinode-elastic", cluster, logs, dataset))
    run_dir = run_dir_of(spec)
    thread, box = run_flow_in_thread(spec)
    nodes = wait_until(lambda: len(cluster.worker_nodes()) == 3 and cluster.worker_nodes())
    wait_until(lambda: committed_step(run_dir) >= 5, what="a commit")
    cluster.command("kill", nodes[-1])

    def shrunk():  # the first group that started after the node was lost
        (record,) = run_dir.read_attempts()
        return next((r for r in record.get("restarts") or [] if "resumed_at" in r), None)

    wait_until(shrunk, what="the group to go on with fewer workers")
    cluster.command("add")
    thread.join(timeout=600)
    state = box["state"]
    assert state.is_completed(), state
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1
    (attempt,) = run_dir.read_attempts()
    assert attempt["status"] == "completed"
    restarts = attempt["restarts"]
    lost = restarts[0]
    # The group fails when its rank on the lost node dies; or Ray's policy, which looks at the
    # nodes every resize_interval_s, finds the node gone first and shrinks the group.
    assert lost["reason"] in ("infrastructure", "capacity"), lost
    assert lost["world_size_before"] == 3, lost
    started = [r for r in restarts if "resumed_at" in r]  # each started a group
    shrink = started[0]
    between = restarts[1 : restarts.index(shrink)]
    assert all(r["reason"] == "startup" for r in between), between  # sized to the dead node
    assert shrink["world_size_after"] in (1, 2), shrink
    assert lost["last_step"] - shrink["resumed_from_step"] <= 10  # two intervals at most
    later = started[1:]
    grown = [r for r in later if r["reason"] == "capacity" and r["world_size_after"] == 3]
    assert grown, later
    kept = kept_batches(groups_trained(logs), started)
    assert_epochs_cover_every_sample_once(kept, ELASTIC_EPOCHS)
    assert kept == expected_batches(spec, ELASTIC_EPOCHS)
    result = state.result()  # the flow's result, and the summary artifact, say the sizes
    shown = result.attempts[0].restarts[restarts.index(shrink)]
    assert shown.world_size_after == shrink["world_size_after"]
    text = render_markdown(spec, result)
    assert f"3 → {shrink['world_size_after']} workers" in text and " → 3 workers" in text
    record_matrix_row("elastic node killed, grown back", run_dir, storage="s3 (moto), Jobs API")


def test_a_drain_notice_commits_a_checkpoint_just_in_time(
    cluster, relaytrain_prefect, run_storage, tmp_path
):
    """[1, 3] workers, a checkpoint every 25 steps, a report every 2. A node drains for
    preemption with a deadline 12 s away and is reclaimed just before it. The loop commits a
    checkpoint at its first report after Ray's notice, before the deadline, and waits; the
    group goes on with 2 workers from it. Steps lost: at most report.every. The preemption
    budget is charged (the infrastructure budget is 0)."""
    cluster.ensure_worker_nodes(3)
    dataset, logs = str(tmp_path / "table"), tmp_path / "logs"
    write_dataset(dataset)
    logs.mkdir()
    raw = elastic_raw(
        run_storage,
        "multinode-notice",
        cluster,
        logs,
        dataset,
        checkpoint={"every": 25},
        report={"every": 2},
        retries={"infrastructure": 0},
    )
    spec = build_spec(raw)
    run_dir = run_dir_of(spec)
    thread, box = run_flow_in_thread(spec)
    nodes = wait_until(lambda: len(cluster.worker_nodes()) == 3 and cluster.worker_nodes())
    wait_until(lambda: sum(len(p.read_text().splitlines()) for p in logs.glob("*")) >= 9)
    answer = cluster.command("drain", nodes[-1], "12")
    assert answer["accepted"], answer
    time.sleep(11)
    cluster.command("kill", nodes[-1])
    thread.join(timeout=600)
    state = box["state"]
    assert state.is_completed(), state
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1
    (attempt,) = run_dir.read_attempts()
    preempted, *_ = attempt["restarts"]
    assert preempted["reason"] == "preemption", preempted
    assert preempted["world_size_before"] == 3
    assert preempted["world_size_after"] in (1, 2)  # as in the elastic test above
    step = preempted["just_in_time_step"]
    assert step % 25 and preempted["resumed_from_step"] == step  # off the cadence: the notice's
    assert preempted["seconds_to_deadline"] > 0  # committed before the deadline
    assert preempted["last_step"] - step <= spec.report.every
    kept = kept_batches(groups_trained(logs), attempt["restarts"])
    assert_epochs_cover_every_sample_once(kept, ELASTIC_EPOCHS)
    assert kept == expected_batches(spec, ELASTIC_EPOCHS)
    record_matrix_row("elastic node drained (notice) then reclaimed", run_dir, storage="s3 (moto)")


# -- chaos ---------------------------------------------------------------------------------------


# No wall-clock bound: the campaign fails once nothing moved for 4 times its uninterrupted
# reference's wall time (``Settings.stall_references``), measured on this machine under its load,
# and ends every process it started, pass or fail (``Campaign.close``).
@pytest.mark.timeout(0)
def test_a_seeded_chaos_campaign_ends_as_the_uninterrupted_run(cluster, s3_server, tmp_path):
    """bench/chaos.py's short campaign: one fault of every kind in the fault matrix (worker and
    node killed, a drain with notice, the flow process killed and run again, a second flow, an
    S3 outage, S3 slow, the newest checkpoint damaged, the Prefect server killed and started
    again, the store full for a while) at seeded 5 s gaps, overlapping recoveries. The run ends
    bit-identical to the uninterrupted one, every step's row once, no commit lost, each failure
    on its fault's budget (``bench.chaos.verdict``)."""
    from bench.chaos import KINDS, QUICK, campaign, flow_env, prefect_server
    from tests.outage_proxy import OutageProxy

    cluster.ensure_worker_nodes(3)
    wait_until(lambda: not cluster.worker_nodes(), what="the previous run's workers to go")
    with OutageProxy(s3_server.port) as proxy, prefect_server(tmp_path) as server:
        env = flow_env(server, s3_server.credential_env())
        outcome = campaign(tmp_path, QUICK, (cluster, s3_server, proxy, env, server))
    figures = outcome["figures"]
    print(figures)  # shown when the test fails
    assert outcome["problems"] == []
    assert figures["faults_by_kind"] == dict.fromkeys(KINDS, 1)
    # the kills and the drain ended worker groups, which resumed: two of them end one together
    # when they overlap (a worker killed 2 s before a drained node goes is one preemption)
    assert figures["failures"] >= 2 and figures["steps_computed"] >= figures["steps"]
