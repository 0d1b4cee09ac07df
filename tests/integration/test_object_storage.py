"""The training flow on a real S3-compatible server (moto over HTTP, IAM auth enforced):
runs through pyarrow's S3FileSystem and through s3fs, bad storage inputs rejected in setup,
fault 5 (the server goes away during a checkpoint upload) and fault 7 (permission denied,
storage full)."""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pytest

from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.net import free_port
from tests.prefect_api import artifacts, logs, task_runs
from tests.recovery import (
    REPO,
    assert_recovered,
    assert_retained,
    assert_same_tensors,
    expected_retention,
    final_state,
    losses,
    record_matrix_row,
    run_dir_of,
)
from tests.s3 import OutageProxy
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import (
    SpecError,
    StorageAccessError,
    StorageError,
    StorageFullError,
    StorageUnavailableError,
)
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
TIMINGS_FILE = REPO / "runs" / "object-storage-timings.jsonl"


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 server, with the trainer's credentials in this process's environment."""
    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    return s3_server


def record_timing(case: str, **figures) -> None:
    TIMINGS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with TIMINGS_FILE.open("a") as f:
        f.write(json.dumps({"case": case, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **figures}))
        f.write("\n")


# -- runs on S3 ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def s3_runs(uninterrupted, uninterrupted_one_worker, relaytrain_prefect, s3_server):
    """One flow run through pyarrow's S3FileSystem and one through s3fs (credentials from the
    environment, which the shared Ray cluster was started without), each with its reference.
    The pyarrow one trains on one worker; the s3fs one with FSDP on 2 gloo ranks, so its
    checkpoints are DCP's shards (it ends at the 2-worker DDP reference's bits)."""
    done = {}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_server.credential_env().items():
            patch.setenv(key, value)
        for kind, via_fsspec, scaling, reference in (
            ("pyarrow", False, ONE_WORKER, uninterrupted_one_worker),
            ("s3fs", True, {"strategy": "fsdp"}, uninterrupted),
        ):
            uri = s3_server.uri(f"runs-{kind}", fsspec=via_fsspec)
            spec = build_spec(tiny_raw(uri, f"s3-{kind}", scaling=scaling))
            started = time.monotonic()
            state = training(spec, return_state=True)
            done[kind] = (spec, state, time.monotonic() - started, reference)
    return done


@pytest.mark.parametrize("kind", ["pyarrow", "s3fs"])
def test_run_on_s3_is_exact_and_names_s3_uris(s3_runs, s3, kind):
    spec, state, wall_s, reference = s3_runs[kind]
    assert state.is_completed(), state
    result = state.result()
    record_timing(f"run on S3 via {kind}", wall_s=round(wall_s, 1))
    assert result.status == "completed" and len(result.attempts) == 1
    prefix = f"s3://{s3.bucket}/runs-{kind}/s3-{kind}"
    assert result.run_uri == prefix and result.storage_uri == s3.uri(
        f"runs-{kind}", fsspec=kind == "s3fs"
    )
    assert result.latest_checkpoint_uri == f"{prefix}/checkpoint-000000039"
    assert result.best_checkpoint_uri.startswith(f"{prefix}/checkpoint-")
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]
    found = artifacts(state.state_details.flow_run_id)
    link = found[f"s3-{kind}-best-checkpoint"].data  # markdown: [text](url)
    assert link.endswith(f"({result.best_checkpoint_uri})")
    # The run really lives on the server: read back as another user, over HTTP.
    keys = s3.objects(f"runs-{kind}/s3-{kind}/")
    assert f"runs-{kind}/s3-{kind}/checkpoint-000000039/COMMITTED" in keys
    shards = {f"runs-{kind}/s3-{kind}/checkpoint-000000039/__{r}_0.distcp" for r in (0, 1)}
    assert shards <= set(keys) if kind == "s3fs" else not shards & set(keys)
    assert f"runs-{kind}/s3-{kind}/summary.json" in keys
    # TensorBoard's event file lives beside them, on the server too
    events = [k for k in keys if k.split("/")[2].startswith("events.out.tfevents.")]
    assert len(events) == 1 and events[0].endswith(".relaytrain") and keys[events[0]]
    # Retention on the server: the newest 2 and val_loss's argmin, nothing else.
    kept, best = expected_retention(reference["checkpoints"], keep_last=2)
    assert_retained(run_dir, result.best_checkpoint_uri, kept, best)
    names = {k.split("/")[2] for k in keys if k.split("/")[2].startswith("checkpoint-")}
    assert names == {f"checkpoint-{step:09d}" for step in kept}
    # An fsdp run's consumers get one torch.load file for best and latest, beside a record;
    # a DDP run's checkpoints hold model.pt already, so it exports nothing.
    exported = {k.split("/")[3] for k in keys if k.split("/")[2] == "exports"}
    if kind == "s3fs":
        ends = {result.best_model_uri.rsplit("/", 1)[1], result.latest_model_uri.rsplit("/", 1)[1]}
        assert exported == ends | {e.replace(".pt", ".json") for e in ends}
        assert result.latest_model_uri == f"{prefix}/exports/checkpoint-000000039.pt"
    else:
        assert not exported
        assert result.latest_model_uri == f"{prefix}/checkpoint-000000039/model.pt"


def test_relaytrain_commands_read_runs_on_s3(s3_runs, s3_server, s3, tmp_path, monkeypatch):
    """`relaytrain runs/show/export` against the server alone, with the credentials from the
    environment: the fsdp run's best model comes out as one plain state_dict file, locally and
    written back to S3."""
    import io
    import os
    import sys

    import torch

    from trainer_core.checkpoint import exports

    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    relaytrain = str(Path(sys.executable).with_name("relaytrain"))

    def command(*args: str) -> str:
        done = subprocess.run(
            [relaytrain, *args], capture_output=True, text=True, timeout=120, env=dict(os.environ)
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    listed = command("runs", s3.uri("runs-s3fs"))
    line = next(row for row in listed.splitlines() if row.strip().startswith("s3-s3fs"))
    assert "completed" in line and " 39 " in line
    run_uri = s3.uri("runs-s3fs/s3-s3fs")
    shown = command("show", run_uri)
    assert "run s3-s3fs: completed" in shown and "s3://" in shown
    spec, state, _, _ = s3_runs["s3fs"]
    run_dir = run_dir_of(spec)
    best = next(c for c in run_dir.scan().committed if c.uri == state.result().best_checkpoint_uri)
    expected = exports.read(run_dir, best)
    assert expected is not None
    command("export", run_uri, str(tmp_path / "best.pt"))
    local = torch.load(tmp_path / "best.pt", weights_only=True)
    assert set(local) == set(expected)
    assert all(torch.equal(local[k], v) for k, v in expected.items())
    command("export", run_uri, "--step", str(best.step), s3.uri("exported/best.pt"))
    written = torch.load(io.BytesIO(s3.objects("exported/")["exported/best.pt"]), weights_only=True)
    assert all(torch.equal(written[k], v) for k, v in expected.items())


# -- bad inputs: rejected by setup, no retry, nothing written, fast ---------------------------


def _snapshot(s3_server, prefix: str) -> dict[str, bytes]:
    return s3_server.objects(prefix)


def _wrong_secret(monkeypatch, s3_server) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret-" + "x" * 24)


def _short_setup_wait(monkeypatch, s3_server) -> None:
    """Setup waits 2 s for the dead endpoint (30 s by default: a store that comes back)."""
    monkeypatch.setenv("RELAYTRAIN_STORAGE_SETUP_WAIT_S", "2")


def _unknown_key(monkeypatch, s3_server) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIA" + "0" * 16)


BAD_INPUTS = {
    # case: (storage URI template, run.credentials, environment change, field, words)
    "unreachable endpoint": (
        "s3://{bucket}/runs-pyarrow?endpoint_override=127.0.0.1:{dead_port}&scheme=http",
        None,
        _short_setup_wait,
        "run.storage",
        "could not be reached in 2 s (RELAYTRAIN_STORAGE_SETUP_WAIT_S)",
    ),
    "wrong secret key": (
        "{uri}",
        None,
        _wrong_secret,
        "run.credentials",
        "Fix the credentials",
    ),
    "unknown access key": (
        "{uri}",
        None,
        _unknown_key,
        "run.credentials",
        "Fix the credentials",
    ),
    "credentials in the URI query": (
        "{uri}&secret_key=shh",
        None,
        None,
        "run.storage",
        "never put secrets in a URI",
    ),
    "credentials in the URI authority": (
        "s3://AKIAEXAMPLE:shh@{bucket}/runs-pyarrow?endpoint_override={endpoint}&scheme=http",
        None,
        None,
        "run.storage",
        "never put secrets in a URI",
    ),
    "missing credentials block": (
        "{uri}",
        "secret/no-such-block",
        None,
        "run.credentials",
        "does not exist",
    ),
    "unsupported block type": (
        "{uri}",
        "json/lake",
        None,
        "run.credentials",
        "use one of",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_storage_input_is_rejected_in_setup(s3_runs, s3, monkeypatch, case):
    template, block, change, field, words = BAD_INPUTS[case]
    existing = "runs-pyarrow/s3-pyarrow/"  # a finished run: nothing may be written into it
    before = _snapshot(s3, existing)
    uri = template.format(
        bucket=s3.bucket,
        dead_port=free_port(),
        endpoint=s3.endpoint,
        uri=s3.uri("runs-pyarrow"),
    )
    if change is not None:
        change(monkeypatch, s3)
    spec = build_spec(tiny_raw(uri, "s3-pyarrow", run={"credentials": block}))
    started = time.monotonic()
    state = training(spec, return_state=True)
    elapsed = time.monotonic() - started
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    runs = task_runs(state.state_details.flow_run_id)
    assert runs["setup"].run_count == 1 and runs["setup"].state.is_failed()
    assert "train" not in runs  # no retry burned: train never ran
    assert isinstance(error, SpecError | StorageError), error
    message = str(error)
    assert field in message and words in message, message
    assert "shh" not in message
    monkeypatch.undo()
    assert _snapshot(s3, existing) == before
    record_timing(
        f"bad input: {case}",
        flow_s=round(elapsed, 2),
        setup_task_s=round(runs["setup"].total_run_time.total_seconds(), 2),
        error=type(error).__name__,
    )


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
    from trainer_core.storage.locations import read_whole_json

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
    again = training(spec, return_state=True)  # access granted again: resume, exactly
    assert again.is_completed(), again.result(raise_on_failure=False)
    assert_recovered(
        run_dir, uninterrupted_one_worker, interval=10, committed_before=10, write_lost=True
    )
    record_matrix_row(
        "7 S3 permission denied mid-run (IAM Deny s3:PutObject on a checkpoint)",
        run_dir,
        first_flow="failed, not retried: StorageAccessError",
        storage="s3 (moto) via pyarrow",
    )


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


def _fill_after_commit(run_dir: RunDirectory, root: Path, step: int) -> threading.Thread:
    def watch() -> None:
        deadline = time.time() + 300
        while time.time() < deadline:
            if run_dir.read_committed(step) is not None:
                _fill(root)
                return
            time.sleep(0.01)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_fault7_storage_full_mid_run(uninterrupted_one_worker, relaytrain_prefect, tmp_path):
    """The disk fills up after step 13 is committed: a clear, non-retried StorageFullError;
    steps 10 and 13 intact, no partial checkpoint counted; after freeing space the run resumes."""
    with tmpfs(tmp_path / "small", "8m") as root:
        slow = {"name": "tests.helpers:slow_mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.1}}
        slow["kwargs"]["delay_s"] = 0.05  # ~1 s between commits: room to fill the disk
        spec = build_spec(tiny_raw(root, "f7-full", model=slow, scaling=ONE_WORKER))
        run_dir = run_dir_of(spec)
        watcher = _fill_after_commit(run_dir, root, 13)  # epoch 0's validated checkpoint
        state = training(spec, return_state=True)
        watcher.join(5)
        assert state.is_failed()
        error = state.result(raise_on_failure=False)
        assert isinstance(error, StorageFullError), error
        assert str(root) in str(error) and "run.storage" in str(error)
        assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1
        _assert_nothing_lost(run_dir, [10, 13])
        (root / "filler.bin").unlink()
        again = training(spec, return_state=True)
        assert again.is_completed(), again.result(raise_on_failure=False)
        assert_recovered(
            run_dir, uninterrupted_one_worker, interval=10, committed_before=10, write_lost=True
        )
        record_matrix_row(
            "7 storage full mid-run (ENOSPC on an 8 MiB tmpfs)",
            run_dir,
            first_flow=f"failed, not retried: {type(error).__name__}",
            storage="local tmpfs",
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


# -- credentials blocks and error classification (no training) ---------------------------------


def test_prefect_aws_blocks_reach_the_real_server(relaytrain_prefect, s3_server, monkeypatch):
    from prefect_aws import AwsCredentials, MinIOCredentials

    from tasks import credentials

    for name in storage.CREDENTIAL_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    tag = uuid.uuid4().hex[:8]
    AwsCredentials(
        aws_access_key_id=s3_server.access_key_id,
        aws_secret_access_key=s3_server.secret_access_key,
        region_name="us-east-1",
    ).save(f"lake-{tag}")
    MinIOCredentials(
        minio_root_user=s3_server.access_key_id,
        minio_root_password=s3_server.secret_access_key,
        region_name="us-east-1",
    ).save(f"dev-{tag}")
    for ref in (f"aws-credentials/lake-{tag}", f"minio-credentials/dev-{tag}"):
        with credentials.using(ref) as names:
            assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(names)
            storage.probe_writable(storage.resolve(s3_server.uri("blocks"), fail_fast=True))
        assert not storage.credential_env()  # restored: nothing left behind
    # Without credentials moto answers 500 (real S3: 403); the message says what is missing.
    with pytest.raises(StorageError, match="No storage credentials are set"):
        storage.probe_writable(storage.resolve(s3_server.uri("blocks"), fail_fast=True))


@pytest.mark.parametrize(
    "value, words",
    [
        ({"PATH": "/tmp"}, "not storage credential variables"),
        ("not json", "JSON object"),
        ({"AWS_ACCESS_KEY_ID": 3}, "JSON object"),
    ],
)
def test_secret_block_with_unusable_values_is_a_spec_error(relaytrain_prefect, value, words):
    from prefect.blocks.system import Secret

    from tasks import credentials

    name = f"bad-{uuid.uuid4().hex[:8]}"
    Secret(value=value).save(name)
    with pytest.raises(SpecError, match=words) as raised:
        credentials.block_env(f"secret/{name}")
    assert raised.value.field == "run.credentials"
    with pytest.raises(SpecError, match="block-type-slug"):
        credentials.block_env("lake-keys")


@pytest.mark.parametrize(
    "error, expected",
    [
        (PermissionError(13, "Permission denied"), StorageAccessError),
        (OSError(28, "No space left on device"), StorageFullError),
        (OSError(30, "Read-only file system"), StorageAccessError),
        (OSError("AWS Error ACCESS_DENIED during HeadBucket operation"), StorageAccessError),
        (OSError("AWS Error INVALID_ACCESS_KEY_ID during ListObjectsV2"), StorageAccessError),
        (OSError("AWS Error NO_SUCH_BUCKET during HeadBucket operation"), StorageAccessError),
        (OSError("AWS Error NETWORK_CONNECTION during PutObject"), StorageUnavailableError),
        (ValueError("not a storage failure"), type(None)),
    ],
)
def test_storage_failures_are_classified_by_what_fixes_them(error, expected):
    classified = storage.storage_error("s3://bucket/run", "write", error)
    assert type(classified) is expected
    if classified is not None and expected is not StorageUnavailableError:
        assert classified.budget == "none" and "run." in str(classified)
    if classified is not None:
        assert "s3://bucket/run" in str(classified)


def test_transport_errors_of_s3fs_are_transient():
    from botocore.exceptions import EndpointConnectionError

    error = EndpointConnectionError(endpoint_url="http://127.0.0.1:1")
    assert isinstance(storage.storage_error("s3://b/r", "list", error), StorageUnavailableError)
