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
import time

import psutil
import pytest
import yaml
from ray.job_submission import JobSubmissionClient

from flows.training import training
from tests.conftest import tiny_raw
from tests.multinode import MultiNodeCluster
from tests.prefect_api import task_runs
from tests.recovery import REPO, assert_recovered, record_matrix_row, run_dir_of
from trainer_core import jobs
from trainer_core.checkpoints import RunDirectory
from trainer_core.spec import build_spec

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


def worker_nodes(cluster: MultiNodeCluster) -> list[str]:
    """Ids of the nodes that host a Ray Train worker now."""
    return [n["node_id"] for n in cluster.nodes() if "RayTrainWorker" in n["actors"]]


def wait_until(predicate, timeout_s: float = 180, what: str = "condition"):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


def committed_step(run_dir: RunDirectory) -> int:
    newest = run_dir.scan().newest
    return newest.step if newest else 0


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
    spec = build_spec(slow_raw(run_storage, f"multinode-{how}", cluster))
    run_dir = run_dir_of(spec)
    if len(cluster.nodes()) < 3:
        cluster.command("add")
    thread, box = run_flow_in_thread(spec)
    nodes = wait_until(
        lambda: len(worker_nodes(cluster)) == 2 and worker_nodes(cluster), what="2 workers"
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
    assert [a["status"] for a in attempts] == ["failed", "completed"]
    assert attempts[0]["error_budget"] == "infrastructure"
    if how == "preempted":
        assert "preempted" in attempts[0]["error_message"]
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 2
    ids = {j.submission_id for j in JobSubmissionClient(cluster.job_address).list_jobs()}
    assert {jobs.submission_id(spec.run.name, 1), jobs.submission_id(spec.run.name, 2)} <= ids
    case = "3 node killed" if how == "killed" else "8 node preempted (drain-node PREEMPTION)"
    record_matrix_row(case, run_dir, committed_before=before, storage="s3 (moto), Jobs API")


def test_killed_flow_reattaches_to_its_running_job(
    cluster, relaytrain_prefect, uninterrupted, run_storage, tmp_path
):
    from prefect.settings import PREFECT_API_URL

    name = "multinode-reattach"
    raw = slow_raw(run_storage, name, cluster)
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
    before = committed_step(run_dir)
    first.send_signal(signal.SIGKILL)
    first.wait(timeout=30)
    client = JobSubmissionClient(cluster.job_address)
    job_id = jobs.submission_id(name, 1)
    assert str(client.get_job_status(job_id)) == "RUNNING"  # the job outlives its caller
    rerun = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "re-attaching to the running Ray job" in rerun.stdout + rerun.stderr
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
