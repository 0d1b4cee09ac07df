"""Storage failing under a running flow, on a real S3-compatible server (moto over HTTP, IAM
auth enforced) behind a proxy that can cut or slow it, and on a small tmpfs: fault 5 (the server
goes away during a checkpoint upload), storage turning slow, a store down when the flow starts,
a file rewritten by another client, and fault 7 (write denied, storage full, read-only)."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.outage_proxy import OutageProxy
from tests.prefect_api import logs, task_runs
from tests.recovery import (
    assert_recovered,
    assert_same_tensors,
    final_state,
    losses,
    record_matrix_row,
    run_dir_of,
)
from tests.s3 import record_timing
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import (
    StorageAccessError,
    StorageFullError,
)
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


# -- fault 5: the S3 server stops during a checkpoint upload, and comes back ------------------


def test_fault5_s3_outage_during_checkpoint_upload(
    uninterrupted_one_worker, relaytrain_prefect, s3
):
    # The proxy cuts every connection the moment rank 0 starts uploading step 20's model, and
    # refuses connections for 8 s. The checkpoint thread retries a lost connection for 5 s
    # (RELAYTRAIN_STORAGE_PATIENCE_S) after its first failure, and S3's own client retries
    # before that: depending on when the first failure comes back, the write either rides the
    # outage out (one attempt, step 20 committed late) or fails, and the next attempt resumes
    # from step 10. The driver's patience outlasts the outage, so a failure is recorded. Either
    # way the run must end exact, with nothing committed lost.
    cut_on = rb"PUT /[^ ]*/checkpoint-000000020/model\.pt"
    with OutageProxy(s3.port, cut_on=cut_on, outage_s=8.0) as proxy:
        uri = s3.uri("fault5", port=proxy.port)
        # in_place 0: a failed upload ends the attempt (the path this case records)
        retries = {"delay_s": 4, "in_place": 0}
        spec = build_spec(tiny_raw(uri, "fault5", retries=retries, scaling=ONE_WORKER))
        state = training(spec, return_state=True)
    assert proxy.was_cut, "the outage never happened"
    assert state.is_completed(), state.result(raise_on_failure=False)
    run_dir = RunDirectory(storage.resolve(s3.uri("fault5")).child("fault5"))
    attempts = assert_recovered(
        run_dir, uninterrupted_one_worker, interval=10, committed_before=10, write_lost=True
    )
    scan = run_dir.scan()  # nothing partial left
    assert not scan.uncommitted and not scan.damaged, scan
    runs = task_runs(state.state_details.flow_run_id)
    if len(attempts) == 1:  # ridden out: attempt 1 committed every step (retention may have
        # dropped step 20 since; what is kept was committed after the cut, by attempt 1)
        assert attempts[0]["status"] == "completed"
        assert all(c.manifest["attempt"] == 1 for c in scan.committed), scan
        assert all(c.manifest["created_at"] > proxy.cut_at for c in scan.committed if c.step >= 20)
        assert runs["train"].run_count == 1
        outcome = "ridden out by the checkpoint thread"
    else:
        assert [a["status"] for a in attempts] == ["failed", "completed"]
        failed = attempts[0]
        assert failed["error_class"] == "StorageUnavailableError", failed
        assert failed["error_budget"] == "infrastructure"
        assert "resuming" in failed["retry_decision"]
        assert attempts[1]["resumed_from_step"] == 13  # step 20 never committed in attempt 1
        assert all(c.manifest["attempt"] == 2 for c in scan.committed if c.step >= 20), scan
        assert runs["train"].run_count == 2
        outcome = "attempt failed, resumed"
    record_matrix_row(
        "5 S3 outage during checkpoint upload",
        run_dir,
        outage_s=round(proxy.outage_seconds() or 0, 1),
        outcome=outcome,
        storage="s3 (moto) via pyarrow",
    )


def test_slow_storage_lags_the_commits_not_the_training(
    uninterrupted_one_worker, relaytrain_prefect, s3
):
    """S3 turns slow for the checkpoints' bulk: each upload of a checkpoint's files waits
    0.3-1 s at the proxy (seeded). Nothing fails: the run ends in one attempt, bit-identical to
    the uninterrupted run, with every checkpoint committed. Training went on while each write
    was in flight and waited only where the asynchronous design makes it (one write in
    flight): the task's log says the writes
    outlast checkpoint.every and names the fix, and the result's time account shows the
    seconds blocked on checkpoints, which the fast reference hardly has."""
    with OutageProxy(s3.port) as proxy:
        proxy.slow(0.3, 1.0, only=rb"PUT /[^ ]*/checkpoint-")
        # every 20: the validations' checkpoints (13, 26), 20 and the last (39)
        raw = tiny_raw(s3.uri("slow", port=proxy.port), "slow", scaling=ONE_WORKER)
        spec = build_spec(raw, ["checkpoint.every=20"])
        state = training(spec, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert proxy.delayed >= 16  # 4 files of each of 4 checkpoints at least
    flow_run_id = state.state_details.flow_run_id
    assert task_runs(flow_run_id)["train"].run_count == 1
    run_dir = RunDirectory(storage.resolve(s3.uri("slow")).child("slow"))
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
    assert losses(run_dir) == uninterrupted_one_worker["losses"]
    scan = run_dir.scan()
    assert not scan.uncommitted and not scan.damaged and scan.newest.step == 39, scan
    said = [line for line in logs(flow_run_id) if "outlast checkpoint.every" in line]
    assert len(said) == 1 and "faster storage" in said[0], said
    blocked = state.result().time.checkpoint_blocked_s
    reference = uninterrupted_one_worker["result"].timings["checkpoint_wait_s"]
    assert blocked > 1.0 and blocked > 10 * reference, (blocked, reference)
    record_timing("slow storage", checkpoint_blocked_s=blocked, requests_delayed=proxy.delayed)


def test_a_flow_launched_while_s3_is_down_waits_for_it_in_setup(relaytrain_prefect, s3):
    """A flow launched while its store is unreachable (a relaunch during a blip: the chaos
    campaign met one) waits for the store in setup, within RELAYTRAIN_STORAGE_SETUP_WAIT_S,
    instead of failing at once: setup runs once, and the run trains to its end."""
    with OutageProxy(s3.port) as proxy:
        proxy.down()
        threading.Timer(8.0, proxy.up).start()
        spec = build_spec(
            tiny_raw(s3.uri("late-store", port=proxy.port), "late-store", scaling=ONE_WORKER)
        )
        state = training(spec, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert [why for _, why in proxy.events][:3] == ["up", "down", "up"]
    result = state.result()
    assert result.status == "completed" and result.epochs_completed == result.target_epochs
    runs = task_runs(state.state_details.flow_run_id)
    assert runs["setup"].run_count == 1 and runs["train"].run_count == 1


def test_a_file_another_client_rewrote_reads_fresh_through_s3fs(s3, monkeypatch):
    """The lease is rewritten every few seconds by the flow's keeper while the same process
    lists and reads the run directory through s3fs. s3fs remembers a listing with each object's
    ETag and opened a file with that ETag: once the object was replaced, every read failed
    (FileExpired) until the storage patience ran out, and a flow run on s3fs failed with
    StorageUnavailableError."""
    from trainer_core.storage.torn_reads import read_whole_json

    monkeypatch.setenv("RELAYTRAIN_STORAGE_PATIENCE_S", "2")
    name = f"rewritten-{uuid.uuid4().hex[:8]}"
    through_s3fs = storage.resolve(s3.uri(name, fsspec=True))
    other_client = storage.resolve(s3.uri(name))  # pyarrow's S3 client: another writer
    lock = through_s3fs.child("lock.json")
    lock.write_json({"owner": "a", "expires": 1})
    assert [info.base_name for info in through_s3fs.list()] == ["lock.json"]
    other_client.child("lock.json").write_json({"owner": "a", "expires": 2, "renewed": True})
    assert read_whole_json(lock) == {"owner": "a", "expires": 2, "renewed": True}


# -- fault 7: permission denied, storage full ---------------------------------------------------


def _assert_nothing_lost(run_dir: RunDirectory, committed_steps: list[int]) -> None:
    """Every committed checkpoint still verifies, and nothing newer is counted."""
    scan = run_dir.scan()
    assert [c.step for c in scan.committed] == committed_steps, scan
    for checkpoint in scan.committed:
        for name in checkpoint.files:
            run_dir.read_verified(checkpoint, name)


def _rerun_resumes(
    spec, run_dir: RunDirectory, reference: dict, case: str, error: BaseException, where: str
) -> None:
    """Once the store is fixed, the flow run again completes and recovers exactly from the
    newest commit before the fault (step 10); the case's fault-matrix row."""
    again = training(spec, return_state=True)
    assert again.is_completed(), again.result(raise_on_failure=False)
    assert_recovered(run_dir, reference, interval=10, committed_before=10, write_lost=True)
    record_matrix_row(
        case, run_dir, first_flow=f"failed, not retried: {type(error).__name__}", storage=where
    )


def test_fault7_s3_write_denied_mid_run(uninterrupted_one_worker, relaytrain_prefect, s3):
    """An IAM policy denies writing step 20's checkpoint: a clear, non-retried StorageError;
    steps 10 and 13 intact; once access is granted again, the same run resumes and ends exact."""
    uri = s3.uri("fault7")
    spec = build_spec(tiny_raw(uri, "f7-denied", scaling=ONE_WORKER))
    run_dir = run_dir_of(spec)
    denied = f"arn:aws:s3:::{s3.bucket}/fault7/f7-denied/checkpoint-000000020/*"
    with s3.denied(["s3:PutObject"], denied):
        state = training(spec, return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, StorageAccessError), error
    assert "checkpoint-000000020" in str(error) and "run.credentials" in str(error)
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1  # not retried
    attempts = run_dir.read_attempts()
    assert attempts[-1]["error_class"] == "StorageAccessError"
    assert "not retryable" in attempts[-1]["retry_decision"]
    _assert_nothing_lost(run_dir, [10, 13])  # 13: epoch 0's validation
    # access granted again: resume, exactly
    _rerun_resumes(
        spec,
        run_dir,
        uninterrupted_one_worker,
        "7 S3 permission denied mid-run (IAM Deny s3:PutObject on a checkpoint)",
        error,
        "s3 (moto) via pyarrow",
    )


@pytest.mark.parametrize("client", ["pyarrow", "s3fs"])
@pytest.mark.parametrize("store", ["minio", "ceph"])
def test_a_full_object_store_is_storage_full_not_an_outage(s3, client, store, caplog):
    """A full S3-compatible store answers writes with its own error: MinIO HTTP 507
    XMinioStorageFull, Ceph's RGW 403 QuotaExceeded. Both were read as something else: MinIO's
    as an outage (StorageUnavailableError, retried on the infrastructure budget; the docs say a
    full store is not), Ceph's as refused credentials. Each is StorageFullError, raised at once
    (no outage patience: no "retrying" warning), naming the location and the fix; what was
    written stays readable, and writes work again once space is freed."""
    name = f"full-{client}-{store}-{uuid.uuid4().hex[:8]}"
    with OutageProxy(s3.port) as proxy:
        run = storage.resolve(s3.uri(name, port=proxy.port, fsspec=client == "s3fs"))
        run.child("kept.bin").write_bytes(b"committed")
        proxy.fill(store)
        for size in (5, 12 << 20):  # one request, and a multipart upload (parts of 5 MiB+)
            target = run.child(f"new-{size}.bin")
            with (
                caplog.at_level("WARNING", logger="relaytrain.storage"),
                pytest.raises(StorageFullError) as raised,
            ):
                target.write_bytes(b"x" * size)
            assert [r.message for r in caplog.records if "retrying" in r.message] == []
            assert target.uri in str(raised.value) and "Free space" in str(raised.value)
            assert raised.value.field == "run.storage"
        assert proxy.refused >= 2
        assert run.child("kept.bin").read_bytes() == b"committed"
        proxy.free()
        run.child("new-5.bin").write_bytes(b"room again")
        assert run.child("new-5.bin").read_bytes() == b"room again"


@contextlib.contextmanager
def tmpfs(path: Path, size: str):
    """A real small filesystem (tmpfs) at ``path`` (needs CAP_SYS_ADMIN: root here)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def _fill(path: Path) -> Path:
    """Fill the filesystem holding ``path`` to the last byte."""
    filler = path / "filler.bin"
    with contextlib.suppress(OSError), filler.open("wb", buffering=0) as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()
    return filler


def _fill_after_commit(
    run_dir: RunDirectory, root: Path, step: int, gate: Path
) -> threading.Thread:
    """Fill ``root`` once ``step`` is committed, then open ``gate`` (the run waits at it after
    ``step``, so no later commit or retention can come first)."""

    def watch() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if run_dir.read_committed(step) is not None:
                _fill(root)
                break
            time.sleep(0.01)
        gate.unlink()

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_fault7_storage_full_mid_run(uninterrupted_one_worker, relaytrain_prefect, tmp_path):
    """The disk fills up after step 13 is committed: a clear, non-retried StorageFullError;
    steps 10 and 13 intact, no partial checkpoint counted; after freeing space the run resumes."""
    with tmpfs(tmp_path / "small", "8m") as root:
        gate = tmp_path / "gate"
        gate.touch()
        slow = {"name": "tests.helpers:slow_mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.1}}
        # the worker waits at the gate after step 13 (epoch 0's validated checkpoint) until
        # the test has seen it committed and filled the disk
        slow["kwargs"] |= {"delay_s": 0.0, "hold_while": str(gate), "hold_after": 13}
        spec = build_spec(tiny_raw(root, "f7-full", model=slow, scaling=ONE_WORKER))
        run_dir = run_dir_of(spec)
        watcher = _fill_after_commit(run_dir, root, 13, gate)
        state = training(spec, return_state=True)
        watcher.join(5)
        assert state.is_failed()
        error = state.result(raise_on_failure=False)
        assert isinstance(error, StorageFullError), error
        assert str(root) in str(error) and "run.storage" in str(error)
        assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1
        _assert_nothing_lost(run_dir, [10, 13])
        (root / "filler.bin").unlink()
        _rerun_resumes(
            spec,
            run_dir,
            uninterrupted_one_worker,
            "7 storage full mid-run (ENOSPC on an 8 MiB tmpfs)",
            error,
            "local tmpfs",
        )


def test_fault7_read_only_storage_is_refused_in_setup(relaytrain_prefect, tmp_path):
    """Permission denied on a local disk, for root: a read-only filesystem (chmod does not stop
    root). Refused by setup with the location and the fix; nothing written."""
    with tmpfs(tmp_path / "ro", "1m") as root:
        (root / "existing").mkdir()
        subprocess.run(["mount", "-o", "remount,ro", str(root)], check=True)
        spec = build_spec(tiny_raw(root / "existing", "f7-readonly"))
        state = training(spec, return_state=True)
        error = state.result(raise_on_failure=False)
        assert isinstance(error, StorageAccessError), error
        assert "read-only" in str(error) and "run.storage" in str(error)
        assert "train" not in task_runs(state.state_details.flow_run_id)
        assert list((root / "existing").iterdir()) == []
