"""Jobs on the multi-node cluster under faults: a worker node killed or drained for preemption,
the flow process killed while its job runs, a flow run cancelled through Prefect."""

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
from tests.integration.multinode.runs import run_flow_in_thread, slow_raw
from tests.multinode import wait_until
from tests.prefect_api import task_runs
from tests.recovery import (
    REPO,
    assert_recovered,
    committed_step,
    record_matrix_row,
    run_dir_of,
)
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import jobs
from trainer_core.spec.overrides import build_spec

pytestmark = [pytest.mark.integration, pytest.mark.e2e]


def recovered_in_a_retry(
    thread: threading.Thread, box: dict, run_dir: RunDirectory, reference: dict, before: int
) -> list[dict]:
    """The flow run of ``run_flow_in_thread`` completed, recovered (``assert_recovered``, no
    commit from ``before`` on lost; a lost node may take the checkpoint being written with it)
    in two attempts, Prefect's retry running the train task again; the attempt records."""
    thread.join(timeout=600)
    state = box["state"]
    assert state.is_completed(), state
    attempts = assert_recovered(
        run_dir, reference, interval=10, committed_before=before, write_lost=True
    )
    assert [a["status"] for a in attempts] == ["failed", "completed"]
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 2
    return attempts


def test_job_server_binds_loopback_only(cluster):
    port = int(cluster.job_address.rsplit(":", 1)[1])
    listening = [
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    ]
    assert listening and set(listening) == {"127.0.0.1"}


def test_a_worker_larger_than_any_node_is_refused_before_it_queues(
    cluster, relaytrain_prefect, run_storage
):
    """Three one-CPU nodes hold 3 CPUs in all but no worker of 2: the run is refused at once
    with an error that names scaling.resources_per_worker and the largest node, on no retry
    (one Ray job), with no attempt recorded. The oracle is the cluster's own nodes."""
    raw = slow_raw(run_storage, "multinode-too-large", cluster)
    raw["scaling"].update(num_workers=1, resources_per_worker={"CPU": 2})
    spec = build_spec(raw)
    cluster.ensure_worker_nodes(2)  # 2 CPUs or more in all: the total check lets it through
    state = training(spec, return_state=True)
    assert state.is_failed()
    message = str(state.message) + str(state.result(raise_on_failure=False))
    assert "scaling.resources_per_worker asks 2 CPU for each worker" in message
    assert "the largest node of the Ray cluster has 1" in message
    submitted = [
        j.submission_id
        for j in JobSubmissionClient(cluster.job_address).list_jobs()
        if (j.submission_id or "").startswith("relaytrain-multinode-too-large-")
    ]
    assert submitted == [jobs.submission_id("multinode-too-large", 1)]
    assert run_dir_of(spec).read_attempts() == []


def test_a_preempted_node_then_a_killed_node_resume_on_the_remaining_nodes(
    cluster, relaytrain_prefect, uninterrupted, run_storage, tmp_path
):
    """Two worker nodes lost in one run (``retries.in_place`` 0), each a row of the fault matrix:

    - at a commit >= 10, a node of the group drained for preemption (a 2 s deadline), then
      killed: the group restarts in place, within the attempt, on the preemption budget;
    - that group (on the 2 nodes left) held at its first step (a gate file) and one of its
      nodes killed: the attempt fails on the infrastructure budget, and Prefect's retry submits
      attempt 2 as a new Ray job (the path this case records; the default restart in place
      after a killed node is test_fault_matrix's). The retry meets one live node of the two it
      needs and waits for nodes; a node is added back only once it has begun, as a slow spot
      replacement comes (before, it was added back first, and the retry never met the lack).

    The run ends bit-identical to the uninterrupted one, no commit lost."""
    raw = slow_raw(run_storage, "multinode-lost-nodes", cluster)
    raw["retries"]["in_place"] = 0
    gate = tmp_path / "hold"
    raw["model"]["kwargs"]["hold_while"] = str(gate)
    spec = build_spec(raw)
    run_dir = run_dir_of(spec)
    cluster.ensure_worker_nodes(3)
    thread, box = run_flow_in_thread(spec)
    nodes = wait_until(
        lambda: len(cluster.worker_nodes()) == 2 and cluster.worker_nodes(), what="2 workers"
    )
    assert len(set(nodes)) == 2  # spread: one DDP worker per node
    wait_until(lambda: committed_step(run_dir) >= 10, what="a commit")
    before_drain = committed_step(run_dir)
    answer = cluster.command("drain", nodes[-1], "2")
    assert answer["accepted"], answer
    time.sleep(2)
    gate.touch()  # the next group holds at its first step until its node is killed
    cluster.command("kill", nodes[-1])  # 2 nodes left: the group restarts on them

    def restarted():
        (record,) = run_dir.read_attempts()
        started = [r for r in record.get("restarts") or [] if "resumed_at" in r]
        workers = cluster.worker_nodes()
        return started and len(workers) == 2 and nodes[-1] not in workers and workers

    survivors = wait_until(restarted, what="the group restarted in place on 2 nodes")
    before_kill = committed_step(run_dir)
    cluster.command("kill", survivors[-1])
    gate.unlink()
    # One node left of the 2 the retry needs: it waits for nodes, and one comes only after it
    # began (its record opened before its group waits).
    wait_until(lambda: len(run_dir.read_attempts()) == 2 or not thread.is_alive(), 600, "retry")
    assert len(cluster.nodes()) == 1
    cluster.command("add")
    # The lost node may be rank 0's, and take the checkpoint it was writing with it.
    attempts = recovered_in_a_retry(thread, box, run_dir, uninterrupted, before_drain)
    (restart,) = attempts[0]["restarts"]  # the drained node: in place, on preemption's budget
    assert restart["reason"] == "preemption" and "preempted" in restart["error_message"]
    assert restart["world_size_before"] == restart["world_size_after"] == 2
    assert restart["last_step"] - restart["resumed_from_step"] <= 20  # two intervals
    assert attempts[0]["error_budget"] == "infrastructure"  # the killed node: a Prefect retry
    assert attempts[1]["resumed_from_step"] >= before_kill
    ids = {j.submission_id for j in JobSubmissionClient(cluster.job_address).list_jobs()}
    assert {jobs.submission_id(spec.run.name, n) for n in (1, 2)} <= ids
    for case, before in (
        ("8 node preempted (drain-node PREEMPTION)", before_drain),
        ("3 node killed", before_kill),
    ):
        record_matrix_row(case, run_dir, committed_before=before, storage="s3 (moto), Jobs API")


def test_a_head_restarted_mid_attempt_loses_its_job_and_the_retry_resumes(
    cluster, relaytrain_prefect, uninterrupted, run_storage, caplog
):
    """The head node lost mid-attempt (its machine, its pod) and, without GCS fault tolerance,
    every node with it; a new head started at the same addresses once the flow has said it
    waits for it (``RELAYTRAIN_RAY_HEAD_WAIT_S``). The new head's job server does not know the
    attempt's job (jobs live in the old head's GCS): the attempt fails on the infrastructure
    budget, naming the address (the flow's or the driver's word, whichever came first), and
    Prefect's retry submits attempt 2 to the new cluster, which
    resumes and ends bit-identical to the uninterrupted run."""
    name = "multinode-head-restart"
    spec = build_spec(slow_raw(run_storage, name, cluster))
    run_dir = run_dir_of(spec)
    cluster.ensure_worker_nodes(2)
    thread, box = run_flow_in_thread(spec)
    wait_until(lambda: committed_step(run_dir) >= 10, what="a commit")
    before = committed_step(run_dir)
    killed = cluster.command("head_kill")
    assert killed["worker_nodes"] >= 2, killed
    try:
        wait_until(
            lambda: "does not answer (its head restarting?)" in caplog.text,
            what="the flow to wait for the job server",
        )
    finally:
        cluster.command("head_start")  # the package's later tests need the cluster
    # the worker nodes went with the head, and may take the checkpoint being written with them
    attempts = recovered_in_a_retry(thread, box, run_dir, uninterrupted, before)
    # Who records the loss first: the flow, whose job server came back without the job, or the
    # attempt's driver, which here outlives its head (one machine: a node's Ray processes are
    # killed, not the job's entrypoint) and finds the new head answering as another cluster.
    # Either names the lost head's address; the other record is not written over it.
    lost = (
        f"the Ray job server at {cluster.job_address} no longer knows job",
        f"the Ray cluster at {cluster.gcs_address} lost its head",
    )
    assert attempts[0]["error_class"] == "InfrastructureError", attempts[0]
    assert attempts[0]["error_budget"] == "infrastructure"
    assert any(x in attempts[0]["error_message"] for x in lost), attempts[0]["error_message"]
    ids = {j.submission_id for j in JobSubmissionClient(cluster.job_address).list_jobs()}
    assert ids >= {jobs.submission_id(name, 2)}  # the new cluster's job: attempt 2's
    assert jobs.submission_id(name, 1) not in ids
    record_matrix_row(
        "13 the Ray head at job_address restarted mid-attempt",
        run_dir,
        committed_before=before,
        storage="s3 (moto), Jobs API",
    )


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

    from tests.outage_proxy import OutageProxy

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
            worker.wait(10)
        except subprocess.TimeoutExpired:  # Prefect's worker, told to stop, often goes on
            worker.kill()  # polling (60 s here): what this test checks was decided before
            worker.wait(30)
        print(log.read_text()[-5000:])  # shown when the test fails
    result = training(build_spec(raw))  # run it again: it resumes
    assert result.status == "completed" and result.attempts[-1].resumed_from_step >= before
