"""The fault matrix on the shared local Ray cluster, through the training flow.

Every case ends with ``tests.recovery.assert_recovered``: the run completed, its final parameters
and optimizer state and every per-step loss are bit-identical to the uninterrupted run's, no
committed checkpoint was lost, and each failure lost at most one checkpoint interval (two where
the newest checkpoint itself was destroyed). Each case adds its row to runs/fault-matrix.jsonl.
Cases elsewhere: 1 and 4 (an exception in training code, the flow process killed) in
test_flow.py, 3 and 8 (node killed, node preempted) in multinode/test_jobs.py, 5 and 7 (S3
outage, storage full or denied) in test_storage_faults.py, 6 with a flipped byte in
test_engine.py.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import subprocess
import sys
import threading
import time

import psutil
import pytest
import yaml

from flows import cli
from flows.pytest_plugin import with_fault
from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.prefect_api import task_runs
from tests.recovery import (
    REPO,
    assert_recovered,
    committed_before,
    record_matrix_row,
    run_dir_of,
)
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("case", "strategy", "in_place", "rank"),
    [
        # rank 0, the rank that relays the metrics: only its peer can say where it got
        ("2 worker process SIGKILL (restarted in place, the default)", "ddp", None, 0),
        ("2p worker process SIGKILL, retries.in_place 0 (Prefect retry)", "ddp", 0, 1),
        # FSDP on 2 gloo ranks ends bit-identical to the DDP reference (test_fsdp.py).
        ("2f worker process SIGKILL, scaling.strategy fsdp", "fsdp", None, 1),
    ],
)
def test_killed_worker_is_restarted_or_retried_and_exact(
    relaytrain_prefect, uninterrupted, tmp_path, capsys, case, strategy, in_place, rank
):
    """The process of ``rank`` SIGKILLed as step 23 begins."""
    at_step = 23
    raw = tiny_raw(tmp_path, f"matrix-kill-{strategy}-{in_place}", scaling={"strategy": strategy})
    if in_place is not None:
        raw["retries"]["in_place"] = in_place
    # The rank that writes (every rank under FSDP, rank 0 under DDP) killed while the
    # asynchronous write of the newest checkpoint is still in flight (on a loaded machine, 3
    # steps did not cover it) loses that write, and the group resumes from the one before. What
    # must not be lost is what was committed when the rank died (its commit marker older than
    # the failure), and the loss stays within one interval.
    writer_killed = strategy == "fsdp" or (rank == 0 and in_place is None)
    if writer_killed:  # every commit marker kept, to read when each was written
        raw["checkpoint"]["keep_last"] = None
    spec = with_fault(build_spec(raw), "kill", at_step, rank=rank)
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    run_dir = run_dir_of(spec)
    # The newest checkpoint an uninterrupted run commits before the fault (it keeps them all).
    committed = max(step for step in uninterrupted["checkpoints"] if step < at_step)
    if writer_killed:
        (restart,) = run_dir.read_attempts()[0]["restarts"]
        before = max(step for step in uninterrupted["checkpoints"] if step < committed)
        committed = committed_before(run_dir, restart["failed_at"])
        assert committed in (before, max(s for s in uninterrupted["checkpoints"] if s < at_step))
    attempts = assert_recovered(
        run_dir, uninterrupted, interval=10, committed_before=committed, fault_step=at_step
    )
    runs = task_runs(state.state_details.flow_run_id)["train"].run_count
    if in_place is None:
        # Ray Train restarted the worker group within the attempt, from the newest commit
        assert [a["status"] for a in attempts] == ["completed"] and runs == 1
        (restart,) = attempts[0]["restarts"]
        assert restart["reason"] == "infrastructure", restart
        assert restart["resumed_from_step"] == committed and restart["last_step"] >= committed
        assert restart["world_size_before"] == restart["world_size_after"] == 2
        # `relaytrain show` lists the restart under its attempt, with what it lost: the steps
        # before the fault's that ran after the checkpoint resumed from
        assert cli.main(["show", run_dir.uri]) == 0
        shown = capsys.readouterr().out
        lost = at_step - 1 - committed
        assert re.search(
            rf"^\s+1\.1\s+restarted in place\s+{committed}\s+{at_step - 1}\s+{lost}\s.*"
            r"infrastructure: InfrastructureError: a training worker died",
            shown,
            re.MULTILINE,
        ), shown
    else:
        assert [a["status"] for a in attempts] == ["failed", "completed"] and runs == 2
        assert attempts[0]["error_budget"] == "infrastructure"
        assert attempts[0]["restarts"] == []
    record_matrix_row(case, run_dir, committed_before=committed, fault_step=at_step)


def corrupt(run_dir: RunDirectory, step: int, how: str) -> None:
    """Damage checkpoint ``step`` on disk the way a crash or a bad disk would."""
    checkpoint = run_dir.location.child(f"checkpoint-{step:09d}")
    path = checkpoint.child("model.pt").path
    if how == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    else:  # the commit marker never made it
        os.remove(checkpoint.child("COMMITTED").path)


# A flipped byte (same size: only the sha256 tells) is test_engine's corrupt case, which adds its
# row here; these two go through Prefect retries, one flow run meeting both.
def test_corrupt_newest_checkpoint_falls_back(
    relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    """Attempt 1 fails at step 25 and, in the retry delay, its newest checkpoint (20) is
    truncated: attempt 2 resumes from 13. It fails at step 35 and its newest (30) loses its
    commit marker: attempt 3 resumes from 26, and the run ends as the uninterrupted one. Each
    resume's record says when the checkpoint it read was written: by the attempt before it."""
    # One worker: which checkpoint a retry resumes from does not depend on how many ranks train.
    raw = tiny_raw(tmp_path, "matrix-corrupt", scaling=ONE_WORKER)
    raw["retries"] = {**raw["retries"], "code": 2, "delay_s": 4}  # damage between attempts
    raw["faults"] = [
        {"kind": "raise", "at_step": 25, "attempt": 1},
        {"kind": "raise", "at_step": 35, "attempt": 2},
    ]
    spec = build_spec(raw)
    run_dir = run_dir_of(spec)
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(state=training(spec, return_state=True)))
    thread.start()
    # Bounded by the flow's work: it ends, completed or not, within its retry budget
    for failed, (step, how) in enumerate([(20, "truncated"), (30, "missing marker")], start=1):
        while sum(a.get("status") == "failed" for a in run_dir.read_attempts()) < failed:
            assert thread.is_alive(), f"attempt {failed} never failed"
            time.sleep(0.1)
        corrupt(run_dir, step, how)
    thread.join()
    assert box["state"].is_completed(), box["state"]
    attempts = assert_recovered(run_dir, uninterrupted_one_worker, interval=20, committed_before=13)
    # past the damaged step 20, then past the unmarked step 30
    assert [a.get("resumed_from_step") for a in attempts[1:]] == [13, 26]
    # each read the checkpoint the attempt before it wrote (when, its record says)
    for before, resumed in itertools.pairwise(attempts):
        written = resumed["restore"]["checkpoint_created_at"]
        assert before["started_at"] < written < before["ended_at"], (before, resumed)
    for how in ("truncated", "missing marker"):
        record_matrix_row(f"6 newest checkpoint corrupted ({how})", run_dir)


def test_same_run_started_twice_at_once(
    relaytrain_prefect, relaytrain_ray, uninterrupted_one_worker, tmp_path
):
    """Two flows on one run at the same moment: one trains, the other is refused at once. (One
    worker: the lease is the flows', whatever the ranks.)"""
    from prefect.settings import PREFECT_API_URL

    name = "matrix-twice"
    raw = tiny_raw(tmp_path, name, scaling=ONE_WORKER)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "RAY_ADDRESS": relaytrain_ray.get_runtime_context().gcs_address,
    }
    command = [sys.executable, "-m", "flows.training", "--config", str(spec_file)]
    processes = [
        subprocess.Popen(
            command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for _ in range(2)
    ]
    outputs = [p.communicate(timeout=600)[0] for p in processes]
    codes = sorted(p.returncode for p in processes)
    assert codes == [0, 2], outputs
    refused = outputs[[p.returncode for p in processes].index(2)]
    assert "LeaseHeldError" in refused and "run.name" in refused, refused
    run_dir = run_dir_of(build_spec(raw))
    attempts = assert_recovered(run_dir, uninterrupted_one_worker, interval=10)
    assert len(attempts) == 1  # the refused flow never started an attempt
    record_matrix_row("9 the same run started twice at once", run_dir, exit_codes=codes)


def start_slowed_flow(
    name: str, tmp_path, ray_address: str | None
) -> tuple[subprocess.Popen[str], list[str], threading.Thread, RunDirectory]:
    """``python -m flows.training`` on the tiny spec, one worker, its first attempt slowed from
    step 11 on (so that it is still training when its Ray head goes), run until a checkpoint is
    committed; returns the flow, its output so far, the thread reading it, and the run."""
    from prefect.settings import PREFECT_API_URL

    raw = tiny_raw(tmp_path, name, scaling=ONE_WORKER)
    raw["faults"] = [{"kind": "slow", "at_step": 11, "rank": 0, "attempt": 1, "seconds": 0.5}]
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    env.pop("RAY_ADDRESS", None)
    if ray_address is not None:
        env["RAY_ADDRESS"] = ray_address
    command = [sys.executable, "-m", "flows.training", "--config", str(spec_file)]
    flow = subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(flow.stdout or []), daemon=True)
    reader.start()
    run_dir = run_dir_of(build_spec(raw))
    while not run_dir.scan().committed:  # the flow commits, or ends
        assert flow.poll() is None, "".join(output)
        time.sleep(0.2)
    return flow, output, reader, run_dir


def still_running(process: psutil.Process) -> bool:
    with contextlib.suppress(psutil.NoSuchProcess):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def head_loss_retried(
    run_dir: RunDirectory, reference: dict, killed_at: float, output: list[str]
) -> str:
    """The run recovered from its lost head (``assert_recovered``, no commit from before the
    kill lost) in two attempts, the first failed on the infrastructure budget; returns that
    failure's message."""
    print("".join(output))  # shown if an assertion below fails
    committed = committed_before(run_dir, killed_at)
    attempts = assert_recovered(run_dir, reference, interval=10, committed_before=committed)
    assert [a["status"] for a in attempts] == ["failed", "completed"]
    assert attempts[0]["error_budget"] == "infrastructure"
    return str(attempts[0]["error_message"])


def test_the_local_ray_head_lost_mid_attempt_is_retried_on_a_new_cluster(
    relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    """A flow process that started its own local Ray cluster (no ``RAY_ADDRESS``) loses the
    cluster's head (its GCS server and raylet SIGKILLed, as by the OOM killer) once a checkpoint
    is committed: the process lives on (Ray's driver would end it after 60 s without its GCS),
    the attempt fails on the infrastructure budget naming the lost head, and the retry starts a
    new local cluster and resumes, ending at the uninterrupted run's bits. Nothing of the dead
    cluster is left running."""
    flow, output, reader, run_dir = start_slowed_flow("matrix-head", tmp_path, None)
    cluster = psutil.Process(flow.pid).children(recursive=True)
    head = [p for p in cluster if p.name() in ("gcs_server", "raylet")]
    assert len(head) == 2, [p.name() for p in cluster]
    for process in head:
        process.kill()
    killed_at = time.time()
    assert flow.wait(timeout=300) == 0, "".join(output)
    reader.join(30)
    message = head_loss_retried(run_dir, uninterrupted_one_worker, killed_at, output)
    # The watch names what it found dead first: the GCS server, the raylet, or both.
    assert "local Ray cluster this process started lost its head: " in message, message
    assert "gcs_server (pid" in message or "raylet (pid" in message, message
    # The first cluster's processes ended as the attempt left it, its raylet's agents too (Ray
    # ends them a minute after the raylet, once they fail to tell the dead GCS); the second
    # was stopped at the flow's end.
    running = [p for p in cluster if still_running(p)]  # a zombie ran nothing: its reaper is late
    assert not running, [p.name() for p in running]
    record_matrix_row("11 the local Ray head lost mid-attempt", run_dir)


def test_the_ray_address_head_restarted_mid_attempt_is_reconnected_and_resumed(
    relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    """The flow drives a cluster a user started (`ray start --head`, at ``RAY_ADDRESS``), whose
    head node goes down (every process SIGKILLed) once a checkpoint is committed, and comes back
    at the same address once the retry says it waits for it: a new cluster (no GCS fault
    tolerance: the attempt's workers went with the old one). Without the watch the driver
    blocks on the dead cluster, and Ray ends the flow process 60 s later (or, once the new head
    answers, a call to it aborts on WrongClusterID). The attempt fails on the infrastructure
    budget naming the address; the retry waits for the head (``RELAYTRAIN_RAY_HEAD_WAIT_S``),
    connects to it and resumes, ending at the uninterrupted run's bits."""
    from tests.ray_start import RayStartHead

    head = RayStartHead().start()
    try:
        flow, output, reader, run_dir = start_slowed_flow("matrix-address", tmp_path, head.address)
        try:
            head.kill()
            killed_at = time.time()
            while not any("does not answer (its head restarting?)" in line for line in output):
                assert flow.poll() is None, "".join(output)  # the flow says so, or ends
                time.sleep(0.2)
            head.start()
            assert flow.wait() == 0, "".join(output)
            reader.join(30)
        except BaseException:  # pytest-timeout's too: what the flow said, where it stood
            print("".join(output))
            flow.kill()
            raise
    finally:
        head.stop()
    message = head_loss_retried(run_dir, uninterrupted_one_worker, killed_at, output)
    assert f"the Ray cluster at {head.address} lost its head" in message, message
    record_matrix_row("12 the Ray head at RAY_ADDRESS restarted mid-attempt", run_dir)
