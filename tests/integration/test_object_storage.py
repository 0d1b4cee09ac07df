"""The training flow on a real S3-compatible server (moto over HTTP, IAM auth enforced):
runs through pyarrow's S3FileSystem and through s3fs, the relaytrain commands on them, bad
storage inputs rejected in setup, credentials blocks, and how storage failures are classified
(the faults of storage mid-run: tests/integration/test_storage_faults.py)."""

from __future__ import annotations

import time
import uuid

import pytest

from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.net import free_port
from tests.prefect_api import artifacts, task_runs
from tests.recovery import (
    assert_retained,
    assert_same_tensors,
    expected_retention,
    final_state,
    losses,
    run_dir_of,
)
from tests.s3 import record_timing
from trainer_core import storage
from trainer_core.errors import (
    SpecError,
    StorageError,
)
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


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


@pytest.mark.parametrize("kind", ["pyarrow", "s3fs"])
def test_a_scan_seen_again_lists_each_checkpoint_once_and_reads_none(
    s3_runs, s3_server, kind, monkeypatch
):
    """Retention scans the run after every commit. A scan by a directory that scanned before
    lists the run and each checkpoint (its files' sizes; pyarrow in one request each), as the
    server sees it: no marker, manifest or file is read or asked about again."""
    from tests.outage_proxy import OutageProxy
    from trainer_core.checkpoint.run_directory import RunDirectory

    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    with OutageProxy(s3_server.port) as proxy:
        uri = s3_server.uri(f"runs-{kind}", port=proxy.port, fsspec=kind == "s3fs")
        run_dir = RunDirectory.of(uri, f"s3-{kind}")
        first = run_dir.scan()
        proxy.request_log = []
        again = run_dir.scan()
        requests = [line.decode() for _, line in proxy.request_log]
    steps = [c.step for c in first.committed]
    assert len(steps) >= 2 and [c.step for c in again.committed] == steps
    assert [c.manifest for c in again.committed] == [c.manifest for c in first.committed]
    reads = [r for r in requests if "list-type=2" not in r and "/checkpoint-" in r]
    assert reads == [], requests  # (s3fs asks after the run's directory itself too)
    if kind == "pyarrow":  # s3fs lists a directory in more than one request
        assert len(requests) == 1 + len(steps), requests


def test_finalize_reads_each_metrics_segment_once(s3_runs, s3_server, monkeypatch):
    """The finalize task, run again on a finished run: its TensorBoard file, result, artifacts
    (and MLflow, when tracked) share one read of the metrics history. Each segment is one GET
    as the server sees it, and the result is the first finalize's."""
    from prefect import flow

    from tasks.finalize import finalize
    from tasks.setup import Prepared
    from tests.outage_proxy import OutageProxy

    spec, state, _, _ = s3_runs["pyarrow"]
    first = state.result()
    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    with OutageProxy(s3_server.port) as proxy:
        uri = s3_server.uri("runs-pyarrow", port=proxy.port)
        prepared = Prepared(
            run_name=spec.run.name,
            storage_uri=uri,
            run_uri=f"{uri}/{spec.run.name}",
            lease_owner="finalize-again",
            plan_reason="finalize again",
            total_steps=None,
            resume_step=None,
        )
        proxy.request_log = []
        result = flow(name="finalize-again")(lambda: finalize(spec, prepared))()
        requests = [line.decode().split(" ")[:2] for _, line in proxy.request_log]
    segments = [path for verb, path in requests if verb == "GET" and "/metrics/segment-" in path]
    assert segments and len(segments) == len(set(segments)), segments
    assert (result.steps_completed, result.best_checkpoint_uri, result.final_metrics) == (
        first.steps_completed,
        first.best_checkpoint_uri,
        first.final_metrics,
    )


def test_relaytrain_commands_read_runs_on_s3(s3_runs, s3_server, s3, tmp_path, capsys):
    """`relaytrain runs/show/export` (in this process: the console script itself is
    test_flow's) against the server alone, with the credentials from the environment: the fsdp
    run's best model comes out as one plain state_dict file, locally and written back to S3."""
    import io

    import torch

    from flows import cli
    from trainer_core.checkpoint import exports

    def command(*args: str) -> str:
        capsys.readouterr()
        code = cli.main(list(args))
        out, err = capsys.readouterr()
        assert code == 0, out + err
        return out

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
    # Without credentials moto answers 500 (real S3: 403), which reads as the store being down:
    # setup waits for it (30 s by default), then the message says what is missing.
    monkeypatch.setenv("RELAYTRAIN_STORAGE_SETUP_WAIT_S", "2")
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
