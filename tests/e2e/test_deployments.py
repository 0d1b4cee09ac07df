"""End to end: a real `prefect server start`, deployments on a process worker, the UI in chromium.

Flow runs connect to the session's local Ray cluster (RAY_ADDRESS), so they start no Ray of
their own. Screenshots land in runs/e2e-screenshots/ (git-ignored).
"""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

from flows.pytest_plugin import tiny_spec_dict
from tests.conftest import ONE_WORKER
from tests.e2e.ui import browse
from tests.prefect_server import BIN, REPO, background, prefect_server
from trainer_core import storage
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory

pytestmark = [pytest.mark.e2e, pytest.mark.integration]
SCREENSHOTS = REPO / "runs" / "e2e-screenshots"


@pytest.fixture(scope="module")
def database():
    """The README's PostgreSQL set-up: a real PostgreSQL (initdb in a temp dir, on loopback)."""
    from tests.postgres import Postgres

    database = Postgres().start()
    try:
        yield database
    finally:
        database.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, relaytrain_ray, database):
    """The module's Prefect server, on PostgreSQL as the README sets one up for production;
    ``fresh_server`` below is SQLite, the default."""
    address = relaytrain_ray.get_runtime_context().gcs_address
    home = tmp_path_factory.mktemp("prefect-home")
    with prefect_server(home, address, database.url()) as running:
        yield running


def test_prefect_server_listens_on_loopback_only(server):
    """`make server` and these tests start it with --host 127.0.0.1: nothing else can reach it."""
    import psutil

    port = int(server["ui"].rsplit(":", 1)[1])
    listening = {
        c.laddr.ip
        for c in psutil.net_connections(kind="tcp")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port
    }
    assert listening == {"127.0.0.1"}


def prefect(
    server, *args: str, timeout: float = 300, cwd: Path = REPO
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(BIN / "prefect"), *args],
        env=server["env"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@contextlib.contextmanager
def deployed(server, elsewhere: Path):
    """`make deploy`'s two commands, then a worker started as a Prefect user starts one: plain
    `prefect worker start`, in a directory of its own, with nothing of relaytrain's set."""
    for args in (
        ("work-pool", "create", "relaytrain-process", "--type", "process", "--overwrite"),
        ("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect.yaml"),
    ):
        done = prefect(server, *args)
        assert done.returncode == 0, done.stdout + done.stderr
    command = [str(BIN / "prefect"), "worker", "start", "--pool", "relaytrain-process"]
    with background(command, server["env"], server["home"] / "worker.log", elsewhere) as process:
        yield process


@pytest.fixture(scope="module")
def worker(server, tmp_path_factory):
    with deployed(server, tmp_path_factory.mktemp("worker-cwd")) as process:
        yield process


@contextlib.contextmanager
def client_for(server):
    """A sync Prefect client of the e2e server (the session's test harness stays untouched)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: server["api"]}), get_client(sync_client=True) as c:
        yield c


def flow_run_named(server, name: str):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterName

    with client_for(server) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(name=FlowRunFilterName(any_=[name]))
        )
    assert runs, f"no flow run named {name}"
    return runs[0]


def test_deployment_run_with_a_fault_shows_everything_in_the_ui(server, worker, database, tmp_path):
    """`make deploy`'s commands and a worker on the PostgreSQL-backed server: a deployment run
    with a fault and its retry, its artifacts read back and seen in the UI, and the rows really
    in PostgreSQL."""
    flow_run = run_with_a_fault_and_see_it(server, tmp_path, "e2e-deployed", SCREENSHOTS)
    rows = database.query(
        f"SELECT f.name, f.state_type, count(t.id) FROM flow_run f "
        f"JOIN task_run t ON t.flow_run_id = f.id WHERE f.id = '{flow_run.id}' "
        "GROUP BY f.name, f.state_type"
    )
    assert rows == [("e2e-deployed", "COMPLETED", 3)]
    (artifacts,) = database.query(
        f"SELECT count(*) FROM artifact WHERE flow_run_id = '{flow_run.id}'"
    )
    assert artifacts[0] >= 6


def run_with_a_fault_and_see_it(server, tmp_path: Path, name: str, shots: Path):
    """`prefect deployment run` of a spec whose attempt 1 raises at step 17: it retries,
    completes, and every artifact reads back, through the API and in the UI."""
    raw = tiny_spec_dict(
        tmp_path, name, faults=[{"kind": "raise", "at_step": 17}], scaling=ONE_WORKER
    )
    started = time.time()
    deployment_run(server, "training/default", raw)
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child(name))
    first_row = read_metrics_history(run_dir)[0]
    print(
        f"deployment run -> first training step (window published): "
        f"{first_row['time'] - started:.1f} s"
    )

    summary = run_dir.location.child("summary.json").read_json()
    assert summary["status"] == "completed" and summary["steps_completed"] == 39
    assert [a["status"] for a in summary["attempts"]] == ["failed", "completed"]

    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterId,
    )

    flow_run = flow_run_named(server, name)
    assert flow_run.state.is_completed() and flow_run.deployment_id is not None
    with client_for(server) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id]))
        )
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]))
        )
    by_task = {t.name.rsplit("-", 1)[0]: t for t in task_runs}
    assert set(by_task) == {"setup", "train", "finalize"} and by_task["train"].run_count == 2
    keys = {a.key for a in artifacts}
    assert keys == {
        f"{name}-{k}"
        for k in ("progress", "metrics", "summary", "best-checkpoint", "best-model", "loss-curve")
    }

    seen = browse(server, flow_run, artifacts, shots)
    assert not seen["problems"], seen["problems"]
    progress_artifacts = [a for a in artifacts if a.type == "progress"]
    assert len(seen["known_noise"]) <= len(progress_artifacts)  # only the progress-icon bug
    for task in ("setup", "train", "finalize"):
        assert task in seen["run_page"]
    assert "Retry" in seen["run_page"] and "InjectedFault" in seen["run_page"]  # the retry log
    pages = {page["key"]: page for page in seen["artifacts"]}
    assert "val_loss" in pages[f"{name}-metrics"]["text"]
    assert "Attempts" in pages[f"{name}-summary"]["text"]
    assert "steps lost" in pages[f"{name}-summary"]["text"]
    progress = [p["text"] for p in seen["artifacts"] if p["key"] == f"{name}-progress"]
    assert len(progress) == 2 and any("Progress: 100%" in text for text in progress)
    assert not any("Progress: 0%" in text for text in progress)  # the failed attempt got somewhere
    assert pages[f"{name}-best-checkpoint"]["links"] == [f"file://{summary['best_checkpoint_uri']}"]
    assert pages[f"{name}-best-model"]["links"] == [f"file://{summary['best_model_uri']}"]
    assert pages[f"{name}-loss-curve"]["images"] and all(pages[f"{name}-loss-curve"]["images"])
    return flow_run


def deployment_run(server, deployment: str, raw: dict) -> None:
    """`prefect deployment run DEPLOYMENT --param spec=RAW --watch` on ``server``, which its
    worker runs: it must complete."""
    done = prefect(
        server,
        "deployment",
        "run",
        deployment,
        "--param",
        f"spec={json.dumps(raw)}",
        "--watch",
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.parametrize(
    ("deployment", "metric", "low", "high"),
    [
        ("vision-resnet", "val_accuracy", 0.1, 1.0),  # above chance's 1 in 10
        ("lm-gpt", "val_perplexity", 1.0, 256.0),  # below the uniform guess over 256 bytes
    ],
)
def test_a_columns_deployment_trains_its_own_spec(
    server, worker, tmp_path, deployment, metric, low, high
):
    """`prefect deployment run training/<deployment>` with the deployment's own spec (its data
    a path in the checkout, decoded and augmented on the workers), shortened to 1 epoch on 1
    worker and stored under tmp_path."""
    deployments = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (found,) = [d for d in deployments["deployments"] if d["name"] == deployment]
    raw = found["parameters"]["spec"]
    raw["run"] |= {"name": f"e2e-{deployment}", "storage": str(tmp_path)}
    raw["schedule"]["epochs"] = 1
    raw["scaling"]["num_workers"] = 1
    deployment_run(server, f"training/{deployment}", raw)
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child(f"e2e-{deployment}"))
    result = run_dir.location.child("summary.json").read_json()
    assert result["status"] == "completed" and result["epochs_completed"] == 1
    assert low < result["final_metrics"][metric] < high


def test_a_deployment_whose_checkout_is_gone_fails_naming_the_fix(server, worker, tmp_path):
    """A checkout moved after `make deploy`: the run fails with what to do, not a bare Crashed."""
    checkout = tmp_path / "checkout"
    for folder in ("flows", "deployments"):
        shutil.copytree(REPO / folder, checkout / folder, ignore=shutil.ignore_patterns("__py*"))
    prefect_file = checkout / "deployments" / "prefect.yaml"
    config = yaml.safe_load(prefect_file.read_text())
    config["deployments"] = [{**config["deployments"][0], "name": "moved-checkout"}]
    prefect_file.write_text(yaml.safe_dump(config, sort_keys=False))
    done = prefect(
        server, "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file), cwd=checkout
    )
    assert done.returncode == 0, done.stdout + done.stderr
    shutil.rmtree(checkout)

    done = prefect(server, "deployment", "run", "training/moved-checkout", "--watch", timeout=300)
    assert done.returncode != 0
    with client_for(server) as client:
        (deployment,) = [d for d in client.read_deployments() if d.name == "moved-checkout"]
        (flow_run,) = client.read_flow_runs(
            deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id]))
        )
    assert flow_run.state.is_failed(), flow_run.state
    message = flow_run.state.message
    assert repr(str(checkout)) in message and "does not exist" in message
    assert "make deploy" in message


def test_a_pool_capped_at_what_the_cluster_holds_queues_the_runs_in_prefect(
    server, worker, tmp_path
):
    """docs/deployments.md's Prefect-side queue: the work pool capped at the runs the cluster
    holds (`prefect work-pool set-concurrency-limit`, 1 here) and two flow runs of the default
    deployment created at once. The worker starts the second only once the first has ended
    (Prefect holds it, Scheduled, with no flow process), and both complete in one attempt."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    pool = "relaytrain-process"
    done = prefect(server, "work-pool", "set-concurrency-limit", pool, "1")
    assert done.returncode == 0, done.stdout + done.stderr
    try:
        with client_for(server) as client:
            deployment = client.read_deployment_by_name("training/default")
            ids = [
                client.create_flow_run_from_deployment(
                    deployment.id,
                    parameters={"spec": tiny_spec_dict(tmp_path, name, scaling=ONE_WORKER)},
                ).id
                for name in ("pooled-a", "pooled-b")
            ]
            deadline = time.time() + 600
            while True:
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=ids))
                )
                if all(r.state.is_final() for r in runs):
                    break
                assert time.time() < deadline, [(r.name, r.state) for r in runs]
                time.sleep(2)
    finally:
        done = prefect(server, "work-pool", "clear-concurrency-limit", pool)
        assert done.returncode == 0, done.stdout + done.stderr
    assert all(r.state.is_completed() for r in runs), [(r.name, r.state) for r in runs]
    first, second = sorted(runs, key=lambda r: r.start_time)
    assert first.end_time <= second.start_time, [(r.start_time, r.end_time) for r in runs]
    for name in ("pooled-a", "pooled-b"):
        run_dir = RunDirectory(storage.resolve(str(tmp_path)).child(name))
        assert [a["status"] for a in run_dir.read_attempts()] == ["completed"]


@pytest.fixture
def fresh_server(tmp_path, relaytrain_ray):
    """Served deployments reuse the names of deployments/prefect.yaml: a server of their own."""
    address = relaytrain_ray.get_runtime_context().gcs_address
    home = tmp_path / "prefect-home"
    home.mkdir()
    with prefect_server(home, address) as running:
        yield running


def test_a_served_schedule_produces_a_completed_run(fresh_server, tmp_path):
    server = fresh_server
    raw = tiny_spec_dict(tmp_path, None, scaling=ONE_WORKER)
    raw["run"].pop("name")
    spec_file = tmp_path / "nightly.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    command = [
        sys.executable,
        "-m",
        "deployments.serve",
        "--spec",
        str(spec_file),
        "--model-name",
        "e2e-nightly",
        "--nightly-every",
        "20",
    ]
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    with background(command, server["env"], tmp_path / "serve.log") as serve:
        deadline = time.time() + 360
        completed = []
        while time.time() < deadline and not completed:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            with client_for(server) as client:
                completed = client.read_flow_runs(
                    deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["nightly"])),
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(
                            type=FlowRunFilterStateType(any_=[StateType.COMPLETED])
                        )
                    ),
                )
            time.sleep(3)
        assert completed, (tmp_path / "serve.log").read_text()[-3000:]
        run = completed[0]
        assert run.auto_scheduled and run.name.startswith("e2e-nightly-")
    champion = storage.resolve(str(tmp_path)).child("registry", "e2e-nightly", "champion.json")
    assert champion.exists()
