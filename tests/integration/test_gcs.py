"""The training flow on a real GCS-compatible server (fake-gcs-server over HTTP, tests/gcs.py):
``gs://`` through pyarrow's GcsFileSystem, and ``fsspec+gcs://`` through gcsfs, an fsspec
protocol other than S3.

The credentials (a service-account key file) are set in this process's environment after the
session's Ray cluster started, as a user's are: they reach Ray's controller and workers only as
relaytrain hands them on.
"""

from __future__ import annotations

import time

import pytest

from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.net import free_port
from tests.prefect_api import task_runs
from tests.recovery import (
    assert_retained,
    assert_same_tensors,
    expected_retention,
    final_state,
    losses,
    run_dir_of,
)
from trainer_core.errors import StorageAccessError, StorageUnavailableError
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
KINDS = {"pyarrow": False, "gcsfs": True}


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The GCS server, with its credentials in this process's environment."""
    for key, value in gcs_server.credential_env().items():
        monkeypatch.setenv(key, value)
    return gcs_server


@pytest.fixture(scope="module")
def gcs_runs(uninterrupted_one_worker, relaytrain_prefect, gcs_server):
    """The tiny spec's flow run once through each client."""
    done = {}
    with pytest.MonkeyPatch.context() as patch:
        for key, value in gcs_server.credential_env().items():
            patch.setenv(key, value)
        for kind, via_fsspec in KINDS.items():
            uri = gcs_server.uri(f"runs-{kind}", fsspec=via_fsspec)
            spec = build_spec(tiny_raw(uri, kind, scaling=ONE_WORKER))
            started = time.monotonic()
            state = training(spec, return_state=True)
            done[kind] = (spec, state, time.monotonic() - started)
    return done


@pytest.mark.parametrize("kind", list(KINDS))
def test_run_on_gcs_is_exact_and_lives_on_the_server(gcs_runs, uninterrupted_one_worker, gcs, kind):
    spec, state, wall_s = gcs_runs[kind]
    assert state.is_completed(), state
    result = state.result()
    print(f"run on GCS via {kind}: {wall_s:.1f} s")
    scheme = "gcs" if KINDS[kind] else "gs"
    prefix = f"{scheme}://{gcs.bucket}/runs-{kind}/{kind}"
    assert result.status == "completed" and len(result.attempts) == 1
    assert result.run_uri == prefix
    assert result.latest_checkpoint_uri == f"{prefix}/checkpoint-000000039"
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
    assert losses(run_dir) == uninterrupted_one_worker["losses"]
    kept, best = expected_retention(uninterrupted_one_worker["checkpoints"], keep_last=2)
    assert_retained(run_dir, result.best_checkpoint_uri, kept, best)
    # Read back from the server itself, over its JSON API.
    names = gcs.objects(f"runs-{kind}/{kind}/")
    assert f"runs-{kind}/{kind}/checkpoint-000000039/COMMITTED" in names
    assert f"runs-{kind}/{kind}/summary.json" in names
    assert {n.split("/")[2] for n in names if "/checkpoint-" in n} == {
        f"checkpoint-{step:09d}" for step in kept
    }


@pytest.mark.parametrize(
    "case, error_class, words",
    [
        ("unreachable endpoint", StorageUnavailableError, "could not be reached"),
        ("bucket does not exist", StorageAccessError, "its bucket does not exist"),
    ],
)
def test_bad_gcs_storage_is_refused_in_setup(gcs_runs, gcs, monkeypatch, case, error_class, words):
    """Refused by setup with its class (nothing retried), leaving the finished run alone."""
    existing = "runs-pyarrow/pyarrow/"
    before = gcs.objects(existing)
    if case == "unreachable endpoint":
        monkeypatch.setenv("RELAYTRAIN_STORAGE_SETUP_WAIT_S", "2")  # 30 s by default
        uri = gcs.uri("runs-pyarrow", port=free_port())
    else:
        uri = f"gs://no-such-bucket/runs?endpoint_override={gcs.endpoint}&scheme=http"
    state = training(build_spec(tiny_raw(uri, "pyarrow")), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, error_class) and words in str(error), error
    assert "run.storage" in str(error)
    runs = task_runs(state.state_details.flow_run_id)
    assert "train" not in runs and runs["setup"].state.is_failed()
    assert gcs.objects(existing) == before
