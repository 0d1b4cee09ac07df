"""Security: a canary credential (the moto trainer user's generated key pair) used for a real S3
run, once from the environment and once from a Prefect Secret block, appears nowhere it should
not; checkpoints never unpickle code; run names cannot escape the storage prefix."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import pytest
import torch
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.logging.handlers import APILogHandler

from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import run_dir_of
from trainer_core import storage
from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import CheckpointCorruptError, SpecError
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


def canaries(s3_server) -> list[bytes]:
    return [s3_server.access_key_id.encode(), s3_server.secret_access_key.encode()]


def prefect_records(state) -> dict[str, str]:
    """Everything Prefect keeps about the flow run: parameters, logs, artifacts, the result."""
    flow_run_id = state.state_details.flow_run_id
    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_run(flow_run_id)
        logs = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    assert logs and found  # there is something to look at
    return {
        "parameters": repr(flow_run.parameters),
        "logs": "\n".join(log.message for log in logs),
        "artifacts": "\n".join(f"{a.key} {a.description} {a.data}" for a in found),
        "result": state.result().model_dump_json(),
        "state message": str(state.message),
    }


def ray_session_files() -> dict[str, bytes]:
    """Every regular file of the test Ray cluster's session directory (logs included)."""
    import ray

    session = Path(ray._private.worker._global_node.get_session_dir_path())
    files = {}
    for path in session.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                files[str(path)] = path.read_bytes()
            except OSError:
                continue
    assert any("/logs/" in name for name in files)
    return files


def assert_no_canary(s3_server, prefix: str, state) -> None:
    leaks = []
    secrets = canaries(s3_server)
    for where, text in prefect_records(state).items():
        leaks += [f"prefect {where}" for secret in secrets if secret.decode() in text]
    run_files = s3_server.objects(prefix)
    assert any(key.endswith("/COMMITTED") for key in run_files)  # checkpoints were scanned
    assert any(key.endswith("attempts.jsonl") for key in run_files)
    for key, body in run_files.items():
        leaks += [f"run file {key}" for secret in secrets if secret in body]
    for name, body in ray_session_files().items():
        leaks += [f"ray file {name}" for secret in secrets if secret in body]
    assert not leaks, leaks


@pytest.fixture
def clean_env(monkeypatch):
    """No storage credentials in this process's environment (restored afterwards)."""
    for name in storage.CREDENTIAL_ENV_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_canary_from_environment_does_not_leak(relaytrain_ray, relaytrain_prefect, s3_server):
    with pytest.MonkeyPatch.context() as patch:
        for key, value in s3_server.credential_env().items():
            patch.setenv(key, value)
        spec = build_spec(tiny_raw(s3_server.uri("security-env"), "canary-env", scaling=ONE_WORKER))
        state = training(spec, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert_no_canary(s3_server, "security-env/canary-env/", state)


def test_canary_from_secret_block_does_not_leak(
    relaytrain_ray, relaytrain_prefect, s3_server, clean_env
):
    block = f"lake-keys-{uuid.uuid4().hex[:8]}"
    Secret(value=s3_server.credential_env()).save(block)
    raw = tiny_raw(s3_server.uri("security-block"), "canary-block", scaling=ONE_WORKER)
    spec = build_spec({**raw, "run": {**raw["run"], "credentials": f"secret/{block}"}})
    state = training(spec, return_state=True)
    assert state.is_completed(), state.result(raise_on_failure=False)
    # The block's values held for the run only: the environment is as it was.
    assert not storage.credential_env()
    assert "AWS_SECRET_ACCESS_KEY" in prefect_records(state)["logs"]  # names are logged...
    assert_no_canary(s3_server, "security-block/canary-block/", state)  # ...values never


# -- checkpoints never unpickle code ----------------------------------------------------------


class _RunsCode:
    """A pickle payload that creates ``path`` when unpickled (what an attacker would plant)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def _plant(tmp_path: Path, sentinel: Path) -> RunDirectory:
    """A committed checkpoint at step 10 whose files would run code if unpickled."""
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child("evil"))
    payload = training_state.to_bytes({"weight": _RunsCode(sentinel)})
    entries = [
        run_dir.write_checkpoint_file(10, name, payload)
        for name in ("model.pt", "optimizer.pt", "scheduler.pt")
    ]
    run_dir.commit_checkpoint(10, entries, {"cursor": {"epoch": 0, "batch": 10}})
    return run_dir


def test_checkpoint_files_never_unpickle_code(tmp_path):
    sentinel = tmp_path / "code-ran"
    run_dir = _plant(tmp_path, sentinel)
    checkpoint = run_dir.read_committed(10)
    assert checkpoint is not None  # committed and verified against its manifest
    data = run_dir.read_verified(checkpoint, "model.pt")
    with pytest.raises(CheckpointCorruptError, match="not plain tensor data"):
        training_state.from_bytes(data)
    assert not sentinel.exists()
    # The payload is live: an unsafe load would have run it (so the test above can fail).
    torch.load(__import__("io").BytesIO(data), weights_only=False)
    assert sentinel.exists()


def test_resume_refuses_a_checkpoint_that_would_run_code(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """The planted checkpoint is skipped like a corrupt one (here: the only one, so training
    starts fresh) and its code never runs."""
    sentinel = tmp_path / "code-ran"
    _plant(tmp_path, sentinel)
    spec = build_spec(tiny_raw(tmp_path, "evil", retries={"code": 0}, scaling=ONE_WORKER))
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    assert not sentinel.exists()
    attempts = run_dir_of(spec).read_attempts()
    assert [a["status"] for a in attempts] == ["completed"]
    assert attempts[0]["resumed_from_step"] == 0  # started fresh: step 10 was refused


# -- run names cannot escape the storage prefix -------------------------------------------------


@pytest.mark.parametrize("name", ["..", "../up", "a/../../b", "a/b", "/etc", "./x", ".hidden", ""])
def test_run_names_cannot_escape_the_storage_prefix(tmp_path, name):
    with pytest.raises(SpecError) as raised:
        build_spec(tiny_raw(tmp_path, name))
    assert raised.value.field == "run.name"
    root = storage.resolve("s3://bucket/prefix?endpoint_override=127.0.0.1:1&scheme=http")
    for part in ("..", "/abs", ""):
        with pytest.raises(ValueError, match="unsafe path component"):
            root.child(part)
    assert not any(p.name != "run.json" for p in tmp_path.iterdir() if p.is_file())
    assert os.listdir(tmp_path) == []
