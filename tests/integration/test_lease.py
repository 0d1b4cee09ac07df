"""The run lease under real use, through the flow, on local storage and on the moto S3 server:
it is held across a retry's delay, a holder that loses it stops and commits nothing more, and a
finalize without it deletes nothing.

The lease lasts 3 s here (``RELAYTRAIN_LEASE_TTL_S``; 60 s by default), renewed every second:
a retry delay of 6 s outlasts it, as Prefect's 80-120 s delays outlast the default."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

import pytest
from prefect import flow

from flows.pytest_plugin import with_fault
from flows.training import training
from tasks import Prepared, finalize
from tests.conftest import ONE_WORKER, tiny_raw
from tests.prefect_api import task_runs
from tests.recovery import run_dir_of
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import lease
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage import conditional_write

pytestmark = pytest.mark.integration
TTL_S = 3.0


@pytest.fixture(params=["local", "s3"])
def runs_at(request, tmp_path, monkeypatch) -> str:
    """Where the runs live: a directory, or a prefix on the moto S3 server."""
    monkeypatch.setenv("RELAYTRAIN_LEASE_TTL_S", str(TTL_S))
    if request.param == "local":
        return str(tmp_path)
    server = request.getfixturevalue("s3_server")
    for key, value in server.credential_env().items():
        monkeypatch.setenv(key, value)
    return server.uri(f"lease-{tmp_path.name}")


def _in_thread(spec: RunSpec) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: box.update(state=training(spec, return_state=True)))
    thread.start()
    return thread, box


def _wait_for(condition: Any, thread: threading.Thread, what: str) -> None:
    """Until ``condition()``, while the flow in ``thread`` runs (its own work bounds it)."""
    while not condition():
        assert thread.is_alive(), f"{what} never happened"
        time.sleep(0.05)


def test_a_second_flow_in_the_retry_delay_is_refused(
    relaytrain_ray, relaytrain_prefect, runs_at
) -> None:
    """The first flow's attempt fails and Prefect waits 6 s, twice the lease's life, before
    its retry. A second flow started in that wait is refused with LeaseHeldError, and the first
    flow's retry resumes and completes. Then another flow holds the finished run (every
    checkpoint kept), and a finalize without the lease deletes nothing."""
    raw = tiny_raw(
        runs_at,
        "held",
        retries={"delay_s": 6, "jitter": 0},
        scaling=ONE_WORKER,
        checkpoint={"keep_last": None},
    )
    spec = with_fault(build_spec(raw), "raise", at_step=8)
    run_dir = run_dir_of(spec)
    thread, box = _in_thread(spec)
    _wait_for(
        lambda: any(a.get("status") == "failed" for a in run_dir.read_attempts()),
        thread,
        "attempt 1's failure",
    )
    time.sleep(TTL_S + 1)  # an unrenewed lease has expired by now
    second = training(spec, return_state=True)
    assert second.is_failed()
    refused = second.result(raise_on_failure=False)
    assert isinstance(refused, lease.LeaseHeldError), repr(refused)
    assert "held by flow-run-" in str(refused) and "run.name" in str(refused)
    thread.join(300)
    assert box["state"].is_completed(), box["state"]
    assert box["state"].result().steps_completed == 39
    assert [a["status"] for a in run_dir.read_attempts()] == ["failed", "completed"]
    assert not run_dir.lease_file.exists()  # released at the end
    _finalize_without_the_lease_deletes_nothing(runs_at, "held", run_dir)


def _finalize_without_the_lease_deletes_nothing(
    runs_at: str, name: str, run_dir: RunDirectory
) -> None:
    """A run trained with every checkpoint kept; another flow holds it now. finalize of a
    spec keeping one checkpoint (retention would delete the rest) deletes nothing, writes no
    summary, and leaves the other flow's lease."""
    before = {c.step for c in run_dir.scan().committed}
    assert len(before) > 1  # retention would delete some
    summary = run_dir.summary_file.read_bytes()
    lease.acquire(run_dir.location, owner="another-flow", settle_s=0)
    keep_one = build_spec(
        tiny_raw(runs_at, name, checkpoint={"keep_last": 1, "keep_best": 0}, scaling=ONE_WORKER)
    )
    prepared = Prepared(
        run_name=name,
        storage_uri=keep_one.run.storage,
        run_uri=run_dir.uri,
        lease_owner="this-flow",
        plan_reason="test",
        total_steps=39,
        resume_step=39,
    )

    @flow
    def finalize_only() -> Any:
        return finalize(keep_one, prepared, status="failed")

    result = finalize_only()
    assert result.steps_completed == 39
    assert {c.step for c in RunDirectory(run_dir.location).scan().committed} == before
    assert run_dir.summary_file.read_bytes() == summary
    assert run_dir.lease_file.read_json()["owner"] == "another-flow"


def test_a_holder_whose_lease_is_taken_over_stops_and_commits_nothing_more(
    relaytrain_ray, relaytrain_prefect, runs_at
) -> None:
    """Mid-run, another owner rewrites lock.json. The holder's attempt ends with
    LeaseLostError within about a renewal (not retried); no checkpoint whose manifest was
    written after the takeover is committed, and its finalize deletes nothing and writes no
    summary."""
    slow = {"name": "tests.helpers:slow_mlp", "kwargs": {"hidden": [16, 16], "delay_s": 0.1}}
    spec = build_spec(
        tiny_raw(runs_at, "taken", model=slow, checkpoint={"every": 5}, scaling=ONE_WORKER)
    )
    run_dir = run_dir_of(spec)
    thread, box = _in_thread(spec)
    _wait_for(lambda: len(run_dir.scan().committed) >= 2, thread, "two commits")
    taken_at = time.time()
    run_dir.lease_file.write_json(
        {
            "schema": 1,
            "owner": "another-flow",
            "host": "elsewhere",
            "pid": 1,
            "acquired_at": taken_at,
            "expires_at": taken_at + 3600,
        }
    )
    committed = {c.step for c in run_dir.scan().committed}
    thread.join(300)
    stopped_s = time.time() - taken_at
    state = box["state"]
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, lease.LeaseLostError), repr(error)
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1
    after = run_dir.scan().committed
    assert all(c.manifest["created_at"] < taken_at for c in after), [c.step for c in after]
    assert committed <= {c.step for c in after}  # nothing deleted after the takeover
    assert not run_dir.summary_file.exists()
    assert run_dir.lease_file.read_json()["owner"] == "another-flow"
    assert stopped_s < 60, stopped_s  # the attempt stopped, it did not train to the end


@pytest.fixture(params=["s3", "gs", "fsspec+gcs"])
def object_store(request, tmp_path, monkeypatch) -> str:
    """A prefix on the moto S3 server, or on the GCS server through pyarrow or gcsfs."""
    server = request.getfixturevalue("s3_server" if request.param == "s3" else "gcs_server")
    for key, value in server.credential_env().items():
        monkeypatch.setenv(key, value)
    if request.param == "s3":
        return server.uri(f"race-{tmp_path.name}")
    return server.uri(f"race-{tmp_path.name}", fsspec=request.param == "fsspec+gcs")


def test_of_flows_racing_for_a_free_lease_on_object_stores_exactly_one_wins(object_store) -> None:
    """On the object stores acquire and renew are compare-and-swap writes (S3: PutObject with
    If-None-Match: * / If-Match: ETag; GCS: an upload with ifGenerationMatch): of 6 acquires
    racing for a free lease one wins (10 races), and a renewal after another owner wrote
    lock.json is refused."""
    root = storage.resolve(object_store)
    assert conditional_write.supported(root)
    for race in range(10):
        location = root.child(f"run-{race}")
        start = threading.Barrier(6)
        won: list[str] = []

        def contend(name: str, where=location, barrier=start, winners=won) -> None:
            barrier.wait()
            with contextlib.suppress(lease.LeaseHeldError):
                winners.append(lease.acquire(where, owner=name, settle_s=0).owner)

        threads = [threading.Thread(target=contend, args=(f"flow-{i}",)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(won) == 1, (race, won)
        assert location.child("lock.json").read_json()["owner"] == won[0]
    held = lease.acquire(root.child("renewed"), owner="a", settle_s=0)
    root.child("renewed", "lock.json").write_json({**held.to_json(), "owner": "b"})
    with pytest.raises(lease.LeaseLostError, match="held by b"):
        lease.renew(root.child("renewed"), held)


def test_a_finalize_whose_lease_lapsed_leaves_another_flows_completed_summary(
    relaytrain_prefect, tmp_path
) -> None:
    """This flow's lease lapsed before its finalize (its process stalled past the TTL);
    meanwhile another flow took the run, completed it, wrote summary.json and released it. The
    late finalize finds the lease free, but the summary is not the one this flow's setup saw:
    it writes nothing (not over the other flow's completed summary, bytes identical) and
    leaves the run unheld."""
    spec = build_spec(tiny_raw(str(tmp_path), "lapsed", scaling=ONE_WORKER))
    run_dir = run_dir_of(spec)
    lease.acquire(run_dir.location, owner="this-flow", ttl_s=0.01, settle_s=0)  # setup
    prepared = Prepared(
        run_name="lapsed",
        storage_uri=spec.run.storage,
        run_uri=run_dir.uri,
        lease_owner="this-flow",
        plan_reason="test",
        total_steps=39,
        resume_step=None,
        summary_seen=lease.summary_version(run_dir.location),  # as setup records it: none
    )
    time.sleep(0.05)  # this flow's lease has expired
    lease.acquire(run_dir.location, owner="another-flow", settle_s=0)
    run_dir.summary_file.write_json(
        {"schema": 1, "run_name": "lapsed", "status": "completed", "steps_completed": 39}
    )
    lease.release(run_dir.location, "another-flow")
    theirs = run_dir.summary_file.read_bytes()

    @flow
    def finalize_only() -> Any:
        return finalize(spec, prepared, status="failed")

    finalize_only()
    assert run_dir.summary_file.read_bytes() == theirs
    assert not run_dir.lease_file.exists()
