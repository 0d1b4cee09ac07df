"""A multi-node local Ray cluster driven through Ray's Jobs API, with the run on S3.

One head node (no CPUs; the job server on 127.0.0.1) and three one-CPU worker nodes, each its
own raylet (tests/multinode.py). The two DDP workers are spread across nodes; the train task
submits every attempt as a Ray job and follows it. Faults: a worker node killed (fault matrix
3), a node drained for preemption and then reclaimed (8), and the flow process killed while
its job runs (re-running attaches to the job instead of starting a second one).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml
from ray.job_submission import JobSubmissionClient

from flows.training import training
from tests.conftest import tiny_raw
from tests.integration.test_streaming import (
    assert_epochs_cover_every_sample_once,
    expected_batches,
    write_dataset,
)
from tests.multinode import MultiNodeCluster, wait_until
from tests.prefect_api import task_runs
from tests.recovery import (
    REPO,
    assert_recovered,
    committed_step,
    record_matrix_row,
    run_dir_of,
)
from trainer_core.run import jobs
from trainer_core.run.report import render_markdown
from trainer_core.spec.overrides import build_spec

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


@pytest.fixture(scope="module")
def cluster(s3_server):
    """The cluster's nodes hold their own storage credentials, as a production cluster's would
    (relaytrain never ships credentials in a Ray job's runtime env); so does this process."""
    with pytest.MonkeyPatch.context() as env:
        for key, value in s3_server.credential_env().items():
            env.setenv(key, value)
        cluster = MultiNodeCluster(num_workers=3, env=s3_server.credential_env())
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="module")
def run_storage(s3_server) -> str:
    return s3_server.uri("multinode")


def slow_raw(storage: str, name: str, cluster: MultiNodeCluster, delay_s: float = 0.25) -> dict:
    """The uninterrupted reference's spec (SlowMLP is the same MLP, only slower) on the cluster."""
    return tiny_raw(
        storage,
        name,
        model={
            "name": "tests.helpers:slow_mlp",
            "kwargs": {"hidden": [16, 16], "dropout": 0.1, "delay_s": delay_s},
        },
        scaling={
            "num_workers": 2,
            "placement_strategy": "SPREAD",
            "job_address": cluster.job_address,
        },
        retries={"infrastructure": 2, "code": 0, "delay_s": 1, "jitter": 0},
    )


def run_flow_in_thread(spec):
    import threading

    box: dict = {}
    thread = threading.Thread(
        target=lambda: box.setdefault("state", training(spec, return_state=True))
    )
    thread.start()
    return thread, box


def test_job_server_binds_loopback_only(cluster):
    port = int(cluster.job_address.rsplit(":", 1)[1])
    listening = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening and set(listening) == {"127.0.0.1"}


@pytest.mark.parametrize("how", ["killed", "preempted"])
def test_lost_node_resumes_on_the_remaining_nodes(
    cluster, relaytrain_prefect, uninterrupted, run_storage, how
):
    raw = slow_raw(run_storage, f"multinode-{how}", cluster)
    # A killed node ends the attempt (in_place 0), and Prefect's retry submits attempt 2 as a new
    # Ray job: the path this case records (the default restart in place is test_fault_matrix's)
    raw["retries"]["in_place"] = 0
    spec = build_spec(raw)
    run_dir = run_dir_of(spec)
    if len(cluster.nodes()) < 3:
        cluster.command("add")
    thread, box = run_flow_in_thread(spec)
    nodes = wait_until(
        lambda: len(cluster.worker_nodes()) == 2 and cluster.worker_nodes(), what="2 workers"
    )
    assert len(set(nodes)) == 2  # spread: one DDP worker per node
    wait_until(lambda: committed_step(run_dir) >= 10, what="a commit")
    before = committed_step(run_dir)
    victim = nodes[-1]
    if how == "preempted":
        answer = cluster.command("drain", victim, "2")
        assert answer["accepted"], answer
        time.sleep(2)
    cluster.command("kill", victim)
    thread.join(timeout=600)
    state = box["state"]
    assert state.is_completed(), state
    # The lost node may be rank 0's, and take the checkpoint it was writing with it.
    attempts = assert_recovered(
        run_dir, uninterrupted, interval=10, committed_before=before, write_lost=True
    )
    runs = task_runs(state.state_details.flow_run_id)["train"].run_count
    ids = {j.submission_id for j in JobSubmissionClient(cluster.job_address).list_jobs()}
    if how == "preempted":  # in place, within the attempt, on the preemption budget
        assert [a["status"] for a in attempts] == ["completed"] and runs == 1
        (restart,) = attempts[0]["restarts"]
        assert restart["reason"] == "preemption" and "preempted" in restart["error_message"]
        assert restart["world_size_before"] == restart["world_size_after"] == 2
        assert restart["last_step"] - restart["resumed_from_step"] <= 20  # two intervals
    else:
        assert [a["status"] for a in attempts] == ["failed", "completed"] and runs == 2
        assert attempts[0]["error_budget"] == "infrastructure"
        assert jobs.submission_id(spec.run.name, 2) in ids
    assert jobs.submission_id(spec.run.name, 1) in ids
    case = "3 node killed" if how == "killed" else "8 node preempted (drain-node PREEMPTION)"
    record_matrix_row(case, run_dir, committed_before=before, storage="s3 (moto), Jobs API")


def test_killed_flow_reattaches_to_its_running_job(
    cluster, relaytrain_prefect, uninterrupted, run_storage, tmp_path
):
    """The flow process killed while its job runs; run again, it re-attaches to the job. The
    job server is reached through a proxy that is down when the rerun starts, as a head node
    restarting would be: the rerun, whose run has an attempt already, waits for it
    (``RELAYTRAIN_RAY_HEAD_WAIT_S``) instead of refusing the address. The job's steps are held
    (a gate file) from the kill until the rerun has re-attached, so the job is still running
    however long the rerun takes to start."""
    from prefect.settings import PREFECT_API_URL

    from tests.s3 import OutageProxy

    name = "multinode-reattach"
    port = int(cluster.job_address.rsplit(":", 1)[1])
    with OutageProxy(port) as proxy:
        raw = slow_raw(run_storage, name, cluster)
        raw["scaling"]["job_address"] = f"http://127.0.0.1:{proxy.port}"
        gate = tmp_path / "hold"
        raw["model"]["kwargs"]["hold_while"] = str(gate)
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(raw))
        if len(cluster.nodes()) < 2:
            cluster.command("add")
        env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
        command = [sys.executable, "-m", "flows.training", "--config", str(spec_file)]
        first = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        run_dir = run_dir_of(build_spec(raw))
        wait_until(lambda: committed_step(run_dir) >= 10, what="a commit")
        gate.touch()
        before = committed_step(run_dir)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        client = JobSubmissionClient(cluster.job_address)
        job_id = jobs.submission_id(name, 1)
        assert str(client.get_job_status(job_id)) == "RUNNING"  # the job outlives its caller
        proxy.down()
        rerun = subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        lines: list[str] = []
        reader = threading.Thread(target=lambda: lines.extend(rerun.stdout or ()), daemon=True)
        reader.start()
        # back once the rerun has said it waits for the server (it refused it before)
        try:
            wait_until(
                lambda: any("does not answer (its head restarting?)" in x for x in lines),
                what="the rerun to wait for the job server",
            )
            proxy.up()
            wait_until(
                lambda: any("re-attaching to the running Ray job" in x for x in lines),
                what="the rerun to re-attach to the running job",
            )
        finally:
            gate.unlink()
        assert rerun.wait(timeout=600) == 0, "".join(lines)
        reader.join(timeout=30)
    run_jobs = [
        j for j in client.list_jobs() if (j.metadata or {}).get(jobs.RUN_KEY) == run_dir.uri
    ]
    assert [j.submission_id for j in run_jobs] == [job_id]  # one job, never a second one
    attempts = assert_recovered(run_dir, uninterrupted, interval=10, committed_before=before)
    assert len(attempts) == 1 and attempts[0]["status"] == "completed"


PREFECT_FILE = "deployments/prefect.yaml"


def test_prefect_cancel_through_a_worker_stops_the_job(
    cluster, relaytrain_prefect, uninterrupted, run_storage, tmp_path
):
    """The README: a cancelled flow stops its job. Cancelled as a Prefect user cancels: the
    deployment runs on a process worker, and `prefect flow-run cancel` goes through the API."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    name = "multinode-cancelled"
    raw = slow_raw(run_storage, name, cluster)
    if len(cluster.nodes()) < 2:
        cluster.command("add")
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "PATH": f"{os.path.dirname(sys.executable)}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(REPO),  # the flow process imports tests.helpers:slow_mlp
    }

    def prefect(*args: str) -> str:
        done = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "prefect"), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    prefect("work-pool", "create", "relaytrain-process", "--type", "process", "--overwrite")
    prefect("--no-prompt", "deploy", "--name", "default", "--prefect-file", PREFECT_FILE)
    log = tmp_path / "worker.log"
    with open(log, "w") as out:
        worker = subprocess.Popen(
            [
                os.path.join(os.path.dirname(sys.executable), "prefect"),
                "worker",
                "start",
                "--pool",
                "relaytrain-process",
            ],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        with get_client(sync_client=True) as client:
            deployment = client.read_deployment_by_name("training/default")
            flow_run = client.create_flow_run_from_deployment(
                deployment.id, parameters={"spec": raw}
            )
        run_dir = run_dir_of(build_spec(raw))
        jobs_client = JobSubmissionClient(cluster.job_address)
        job_id = jobs.submission_id(name, 1)
        wait_until(lambda: committed_step(run_dir) >= 10, what="a commit")
        assert str(jobs_client.get_job_status(job_id)) == "RUNNING"
        before = committed_step(run_dir)
        prefect("flow-run", "cancel", str(flow_run.id))

        def cancelled():
            with get_client(sync_client=True) as client:
                return client.read_flow_run(flow_run.id).state.is_cancelled()

        wait_until(cancelled, timeout_s=120, what="the flow run to be Cancelled")
        wait_until(
            lambda: str(jobs_client.get_job_status(job_id)) == "STOPPED",
            timeout_s=60,
            what="the Ray job to stop",
        )
        assert committed_step(run_dir) >= before  # nothing committed was lost
    finally:
        worker.terminate()
        try:
            worker.wait(60)
        except subprocess.TimeoutExpired:  # Prefect's worker, told to stop, sometimes goes on
            worker.kill()  # polling: what this test checks was decided before
            worker.wait(30)
        print(log.read_text()[-5000:])  # shown when the test fails
    result = training(build_spec(raw))  # run it again: it resumes
    assert result.status == "completed" and result.attempts[-1].resumed_from_step >= before


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
    grows to 2 at its next look (a CI run saw the wait for exactly 2 time out)."""
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

    def shrunk():
        (record,) = run_dir.read_attempts()
        restarts = record.get("restarts") or []
        return bool(restarts) and restarts[0].get("world_size_after") in (1, 2)

    wait_until(shrunk, what="the group to go on with fewer workers")
    cluster.command("add")
    thread.join(timeout=600)
    state = box["state"]
    assert state.is_completed(), state
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1
    (attempt,) = run_dir.read_attempts()
    assert attempt["status"] == "completed"
    lost, *later = attempt["restarts"]
    # The group fails when its rank on the lost node dies; or Ray's policy, which looks at the
    # nodes every resize_interval_s, finds the node gone first and shrinks the group.
    assert lost["reason"] in ("infrastructure", "capacity"), lost
    assert lost["world_size_before"] == 3 and lost["world_size_after"] in (1, 2), lost
    assert lost["last_step"] - lost["resumed_from_step"] <= 10  # two intervals at most
    grown = [r for r in later if r["reason"] == "capacity" and r["world_size_after"] == 3]
    assert grown, later
    kept = kept_batches(groups_trained(logs), attempt["restarts"])
    assert_epochs_cover_every_sample_once(kept, ELASTIC_EPOCHS)
    assert kept == expected_batches(spec, ELASTIC_EPOCHS)
    result = state.result()  # the flow's result, and the summary artifact, say the sizes
    assert result.attempts[0].restarts[0].world_size_after == lost["world_size_after"]
    text = render_markdown(spec, result)
    assert f"3 → {lost['world_size_after']} workers" in text and " → 3 workers" in text
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


def test_a_seeded_chaos_campaign_ends_as_the_uninterrupted_run(cluster, s3_server, tmp_path):
    """bench/chaos.py's short campaign: one fault of every kind in the fault matrix (worker and
    node killed, a drain with notice, the flow process killed and run again, a second flow, an
    S3 outage, S3 slow, the newest checkpoint damaged, the Prefect server killed and started
    again) at seeded 8 s gaps, overlapping recoveries. The run ends bit-identical to the
    uninterrupted one, every step's row once, no commit lost, each failure on its fault's budget
    (``bench.chaos.verdict``)."""
    from bench.chaos import KINDS, QUICK, campaign, flow_env, prefect_server
    from tests.s3 import OutageProxy

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
