"""Security: a canary credential (the moto trainer user's generated key pair) used for a real S3
run, once from the environment and once from a Prefect Secret block, appears nowhere it should
not; checkpoints never unpickle code, in either format, through any path that loads one
(resume, a warm start, export, finalize, MLflow); the commands that read a stored run import
nothing its run.json names; run names and stored names cannot escape the storage prefix."""

from __future__ import annotations

import os
import shutil
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    LogFilter,
    LogFilterFlowRunId,
)
from prefect.logging.handlers import APILogHandler

from flows.pytest_plugin import with_fault
from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.mlflow_server import MlflowServer
from tests.planted import (
    EVIL_MODULE,
    SENTINEL_ENV,
    RunsCode,
    planted_dcp_metadata,
    tamper_spec,
)
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core import storage
from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import CheckpointCorruptError, SpecError, TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import finalize_run
from trainer_core.spec.overrides import build_spec
from trainer_core.tracking import mlflow_state

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


def _plant(tmp_path: Path, sentinel: Path) -> RunDirectory:
    """A committed checkpoint at step 10 whose files would run code if unpickled."""
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child("evil"))
    payload = training_state.to_bytes({"weight": RunsCode(sentinel)})
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


# -- a planted DCP checkpoint, through every path that loads one --------------------------------

FSDP_ONE = {**ONE_WORKER, "strategy": "fsdp"}


@pytest.fixture(scope="module")
def fsdp_victim(relaytrain_ray, tmp_path_factory):
    """A tiny FSDP run on one worker that raised at step 23: DCP checkpoints at steps 13 (the
    first epoch's end) and 20 to plant into (each test on its own copy), and the run's spec."""
    root = tmp_path_factory.mktemp("victim")
    spec = with_fault(build_spec(tiny_raw(root, "victim", scaling=FSDP_ONE)), "raise", at_step=23)
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    assert [c.step for c in run_dir_of(spec).scan().committed] == [13, 20]
    return spec


def _victim_copy(spec, tmp_path: Path, plant_steps: tuple[int, ...], sentinel: Path):
    """A copy of the victim run under ``tmp_path`` whose checkpoints at ``plant_steps`` hold a
    planted ``.metadata``; its spec."""
    shutil.copytree(Path(spec.run.storage, spec.run.name), tmp_path / spec.run.name)
    raw = spec.model_dump(mode="json")
    copy = build_spec({**raw, "run": {**raw["run"], "storage": str(tmp_path)}})
    run_dir = run_dir_of(copy)
    for step in plant_steps:
        planted_dcp_metadata(Path(run_dir.checkpoint_location(step).path), sentinel)
        assert run_dir.read_committed(step) is not None  # committed, digests and all
    return copy


def test_resume_of_an_fsdp_run_skips_a_planted_dcp_metadata(
    fsdp_victim, uninterrupted_one_worker, tmp_path
):
    """The retry's newest checkpoint (20) holds a planted .metadata: every rank refuses it,
    naming the file, and resumes from step 13; the run ends as the uninterrupted one."""
    sentinel = tmp_path / "code-ran"
    spec = _victim_copy(fsdp_victim, tmp_path, (20,), sentinel)
    events: list[dict] = []
    run_attempt(spec, on_event=events.append)
    assert not sentinel.exists()
    resumed = next(e for e in events if e["kind"] == "resumed")
    assert resumed["step"] == 13
    assert [s["step"] for s in resumed["skipped"]] == [20]
    assert ".metadata names pathlib.Path.touch" in resumed["skipped"][0]["reason"]
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
    assert losses(run_dir) == uninterrupted_one_worker["losses"]


def test_a_warm_start_from_a_planted_dcp_checkpoint_is_refused_before_any_worker(
    fsdp_victim, tmp_path
):
    sentinel = tmp_path / "code-ran"
    victim = _victim_copy(fsdp_victim, tmp_path / "other-team", (13, 20), sentinel)
    planted = run_dir_of(victim).checkpoint_location(20).uri
    for scaling in (FSDP_ONE, ONE_WORKER):  # into a sharded run and a DDP one
        spec = build_spec(
            tiny_raw(
                tmp_path,
                f"warm-{scaling.get('strategy', 'ddp')}",
                scaling=scaling,
                run={"init_from": planted},
            )
        )
        with pytest.raises(SpecError, match=r"\.metadata names pathlib\.Path\.touch") as raised:
            run_attempt(spec)
        assert raised.value.field == "run.init_from"
        assert not run_dir_of(spec).read_attempts()  # refused at setup: no attempt began
    assert not sentinel.exists()


def test_export_show_and_finalize_never_run_a_planted_dcp_metadata(fsdp_victim, tmp_path, capsys):
    """Every checkpoint of the run holds a planted .metadata: `relaytrain export` fails naming
    the file, `show` still shows the run, finalize gives no model file for either checkpoint;
    nothing runs the payload."""
    from flows import cli

    sentinel = tmp_path / "code-ran"
    spec = _victim_copy(fsdp_victim, tmp_path, (13, 20), sentinel)
    run_dir = run_dir_of(spec)
    for which in ("--latest", "--best"):
        capsys.readouterr()
        assert cli.main(["export", run_dir.uri, str(tmp_path / "out.pt"), which]) == 2
        said = capsys.readouterr().err
        assert ".metadata names pathlib.Path.touch" in said, said
        assert "checkpoint-000000020" in said or "checkpoint-000000013" in said
    assert not (tmp_path / "out.pt").exists()
    assert cli.main(["show", run_dir.uri]) == 0
    result = finalize_run(spec, run_dir, spec.run.storage, "failed")
    assert result.latest_model_uri is None and result.best_model_uri is None
    assert not list(Path(run_dir.location.path).glob("exports/*.pt"))
    assert not sentinel.exists()


# -- commands that read a stored run import nothing its files name -------------------------------


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


def test_mlflow_never_runs_a_planted_dcp_metadata(fsdp_victim, mlflow_server, tmp_path, capsys):
    """`relaytrain sync --config`: the best checkpoint's model is refused, naming the file;
    the rest of the run is logged."""
    from flows import cli

    sentinel = tmp_path / "code-ran"
    spec = _victim_copy(fsdp_victim, tmp_path, (13, 20), sentinel)
    run_dir = run_dir_of(spec)
    finalize_run(spec, run_dir, spec.run.storage, "failed")
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(spec.model_dump(mode="json")))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
        capsys.readouterr()
        assert cli.main(["sync", run_dir.uri, "--config", str(config)]) == 0
    said = capsys.readouterr().out
    assert "best model is not logged" in said and ".metadata names pathlib.Path.touch" in said
    state = mlflow_state.read_state(run_dir)
    assert state.model_uri is None and state.pending is None
    history = read_metrics_history(run_dir)
    assert state.logged_through_step == max(row["step"] for row in history)
    tags = mlflow_server.client().get_run(state.run_id).data.tags
    assert ".metadata names pathlib.Path.touch" in tags["relaytrain.model"]
    assert not sentinel.exists()


def test_commands_never_import_what_a_tampered_run_json_names(
    fsdp_victim, mlflow_server, tmp_path, capsys
):
    """run.json's spec rewritten to name tests/evil_import.py for the model, loss and metrics:
    `runs`, `show`, `export` and `sync` import none of it; `sync --trust-stored-spec` does (the
    tampering is live)."""
    from flows import cli

    sentinel = tmp_path / "imported"
    spec = _victim_copy(fsdp_victim, tmp_path, (), sentinel)
    run_dir = run_dir_of(spec)
    finalize_run(spec, run_dir, spec.run.storage, "failed")
    tamper_spec(Path(run_dir.location.path))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(SENTINEL_ENV, str(sentinel))
        patch.setenv("MLFLOW_TRACKING_URI", mlflow_server.uri)
        assert cli.main(["runs", str(tmp_path)]) == 0
        assert cli.main(["show", run_dir.uri]) == 0
        assert cli.main(["export", run_dir.uri, str(tmp_path / "best.pt")]) == 0
        capsys.readouterr()
        assert cli.main(["sync", run_dir.uri]) == 0
        said = capsys.readouterr().out
        assert "is not logged" in said and "--config" in said, said
        assert not sentinel.exists() and EVIL_MODULE not in sys.modules
        history = read_metrics_history(run_dir)
        logged = mlflow_state.read_state(run_dir).logged_through_step
        assert logged == max(row["step"] for row in history)
        cli.main(["sync", run_dir.uri, "--trust-stored-spec"])
    assert sentinel.exists()  # the user said so: then it is imported
    sys.modules.pop(EVIL_MODULE, None)
    # The export holds the checkpoint's weights, read as data.
    exported = torch.load(tmp_path / "best.pt", weights_only=True)
    assert exported.keys() == final_state(run_dir)["model"].keys()


# -- run names cannot escape the storage prefix -------------------------------------------------


@pytest.mark.parametrize("name", ["..", "../up", "a/../../b", "a/b", "/etc", "./x", ".hidden", ""])
def test_run_names_cannot_escape_the_storage_prefix(tmp_path, name):
    with pytest.raises(SpecError) as raised:
        build_spec(tiny_raw(tmp_path, name))
    assert raised.value.field == "run.name"
    root = storage.resolve("s3://bucket/prefix?endpoint_override=127.0.0.1:1&scheme=http")
    for part in ("..", "/abs", "", "x/../../etc/passwd", "a/./b", "a//b", "a/", "a/.."):
        with pytest.raises(ValueError, match="unsafe path component"):
            root.child(part)
        with pytest.raises(ValueError, match="unsafe path component"):
            root.child("run", part)
    local = storage.resolve(str(tmp_path))
    with pytest.raises(ValueError, match="unsafe path component"):
        local.child("run/x/../../../escaped").write_bytes(b"outside")
    assert not (tmp_path.parent / "escaped").exists()
    assert local.child("metrics", "part-1").path == f"{tmp_path}/metrics/part-1"
    assert not any(p.name != "run.json" for p in tmp_path.iterdir() if p.is_file())
    assert os.listdir(tmp_path) == []
