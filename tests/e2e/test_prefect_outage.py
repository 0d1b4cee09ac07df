"""The Prefect server goes away mid-run and comes back (a real `prefect server start`, SIGKILLed
and started again on the same port and database, SQLite and PostgreSQL): training goes on while
the API is down, loses no step, and the API holds the whole run once it is back.

The flow runs as a user runs it, ``python -m flows.training --config``, its Prefect client
pointed at the server, its attempts on the session's local Ray cluster. The oracle is the
uninterrupted tiny run (``uninterrupted``): the same parameters, bit for bit.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from flows.pytest_plugin import tiny_spec_dict
from tests.multinode import wait_until
from tests.prefect_server import REPO, PrefectServer
from tests.recovery import assert_recovered, committed_step, run_dir_of
from trainer_core.spec.overrides import build_spec

pytestmark = [pytest.mark.e2e, pytest.mark.integration]


def slow_raw(storage: Path, name: str, delay_s: float) -> dict[str, Any]:
    """The tiny spec (39 steps, commits at 10, 13, 20, 26, 30 and 39), its MLP made slow."""
    model = {"name": "tests.helpers:slow_mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.1}}
    model["kwargs"]["delay_s"] = delay_s
    return tiny_spec_dict(storage, name, model=model)


def launch(server: PrefectServer, raw: dict[str, Any], tmp_path: Path, **env: str):
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    log = open(tmp_path / "flow.log", "w")  # noqa: SIM115 - closed with the process, below
    process = subprocess.Popen(
        [sys.executable, "-m", "flows.training", "--config", str(spec_file)],
        cwd=REPO,
        env={**server.env, "PYTHONPATH": str(REPO), **env},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    return process, log


def finish(process: subprocess.Popen, log: Any, tmp_path: Path) -> str:
    code = process.wait(timeout=300)
    log.close()
    output = (tmp_path / "flow.log").read_text()
    assert code == 0, output[-6000:]
    return output


def api_view(server: PrefectServer) -> dict[str, Any]:
    """What the API holds of the run once the server is back: the flow run, its task runs by
    name, its artifacts by key."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tests.prefect_api import artifacts, task_runs

    with temporary_settings({PREFECT_API_URL: server.api}):
        with get_client(sync_client=True) as client:
            (flow_run,) = client.read_flow_runs()
        return {
            "flow_run": flow_run,
            "tasks": task_runs(flow_run.id),
            "artifacts": artifacts(flow_run.id),
        }


def assert_whole_in_the_api(view: dict[str, Any], run_name: str, train_runs: int) -> None:
    assert view["flow_run"].state.is_completed(), view["flow_run"].state
    tasks = view["tasks"]
    assert set(tasks) == {"setup", "train", "finalize"}
    assert all(t.state.is_completed() for t in tasks.values()), tasks
    assert tasks["train"].run_count == train_runs
    found = view["artifacts"]
    assert found[f"{run_name}-progress"].data == 100
    summary = found[f"{run_name}-summary"].data
    assert "completed" in summary and "39" in summary, summary


def test_training_goes_on_while_the_api_is_down_and_the_api_holds_the_run(
    relaytrain_ray, uninterrupted, tmp_path
):
    """SQLite. The flow's Prefect client gives a request up after about 6 s
    (PREFECT_CLIENT_MAX_RETRIES 2): progress updates fail while the server is down, which
    training must not notice. The server is back before training ends."""
    address = relaytrain_ray.get_runtime_context().gcs_address
    home = tmp_path / "prefect-home"
    home.mkdir()
    name = "outage"
    raw = slow_raw(tmp_path / "runs", name, delay_s=0.8)
    run_dir = run_dir_of(build_spec(raw))
    server = PrefectServer(home, address)
    server.start()
    try:
        flow, log = launch(server, raw, tmp_path, PREFECT_CLIENT_MAX_RETRIES="2")
        wait_until(lambda: committed_step(run_dir) >= 10, timeout_s=240, what="a commit")
        server.kill()
        down_at = time.time()
        # Training goes on: a commit made while nothing answers, after longer than the
        # client's patience (2 + 4 s, each +-20%) for the progress updates.
        wait_until(lambda: committed_step(run_dir) >= 20, timeout_s=120, what="a commit")
        time.sleep(max(0.0, 9 - (time.time() - down_at)))
        assert flow.poll() is None, (tmp_path / "flow.log").read_text()[-6000:]
        server.start()
        output = finish(flow, log, tmp_path)
        # Said once when the API stopped answering, once when it answered again.
        assert output.count("the Prefect API did not take a progress update") == 1
        assert output.count("the Prefect API answers again") == 1
        assert f"Prefect UI:       {server.ui}/runs" in output  # where to see the run
        view = api_view(server)
    finally:
        server.stop()
    attempts = assert_recovered(run_dir, uninterrupted, interval=10)
    assert [a["status"] for a in attempts] == ["completed"]
    assert_whole_in_the_api(view, name, train_runs=1)


def test_a_retry_while_the_api_is_down_waits_for_it(relaytrain_ray, uninterrupted, tmp_path):
    """PostgreSQL, Prefect's default client patience (5 retries, about a minute): the training
    code raises at step 17 while the server is down; the train task's retry waits for the API,
    then resumes from step 13."""
    from tests.postgres import Postgres

    address = relaytrain_ray.get_runtime_context().gcs_address
    home = tmp_path / "prefect-home"
    home.mkdir()
    name = "outage-retry"
    raw = slow_raw(tmp_path / "runs", name, delay_s=0.3)
    raw["faults"] = [{"kind": "raise", "at_step": 17, "rank": 0, "attempt": 1}]
    run_dir = run_dir_of(build_spec(raw))
    database = Postgres().start()
    server = PrefectServer(home, address, database.url())
    try:
        server.start()
        flow, log = launch(server, raw, tmp_path)
        wait_until(lambda: committed_step(run_dir) >= 10, timeout_s=240, what="a commit")
        server.kill()
        wait_until(
            lambda: any(a["status"] == "failed" for a in run_dir.read_attempts()),
            timeout_s=120,
            what="attempt 1 to fail",
        )
        time.sleep(10)  # the task's failure and retry wait on the API meanwhile
        assert flow.poll() is None, (tmp_path / "flow.log").read_text()[-6000:]
        server.start()
        finish(flow, log, tmp_path)
        view = api_view(server)
    finally:
        server.stop()
        database.stop()
    attempts = assert_recovered(run_dir, uninterrupted, interval=10, committed_before=13)
    assert [a["status"] for a in attempts] == ["failed", "completed"]
    assert attempts[1]["resumed_from_step"] == 13
    assert_whole_in_the_api(view, name, train_runs=2)
