"""The tools users already run: TensorBoard event files, a real `mlflow server`, and the
`relaytrain` command, on a run that a fault interrupted and a retry resumed."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import yaml

from flows.pytest_plugin import tiny_spec_dict, with_fault
from flows.training import training
from tests.conftest import ONE_WORKER
from tests.mlflow_server import MlflowServer
from tests.net import free_port, stop, wait_until_answers
from tests.prefect_api import artifacts
from tests.recovery import losses, run_dir_of
from trainer_core.checkpoint.exports import read_model_weights
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.spec.overrides import build_spec
from trainer_core.tracking import mlflow_state, tensorboard_log

pytestmark = pytest.mark.integration
RELAYTRAIN = str(Path(sys.executable).with_name("relaytrain"))
SCREENSHOTS = Path(__file__).resolve().parents[2] / "runs" / "e2e-screenshots"


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    server = MlflowServer(tmp_path_factory.mktemp("mlflow")).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def retried(relaytrain_ray, relaytrain_prefect, mlflow_server, tmp_path_factory):
    """A tiny run that raises at step 23 on attempt 1 and resumes from step 20, tracked in
    MLflow."""
    storage = tmp_path_factory.mktemp("tracked")
    raw = tiny_spec_dict(
        storage, "tracked", tracking={"mlflow_uri": mlflow_server.uri}, scaling=ONE_WORKER
    )
    spec = with_fault(build_spec(raw), "raise", at_step=23)
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    return spec, state, storage


def test_tensorboard_holds_one_value_per_step_after_a_retry(retried, uninterrupted_one_worker):
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    spec, state, _ = retried
    run_dir = run_dir_of(spec)
    assert [a.status for a in state.result().attempts] == ["failed", "completed"]
    files = tensorboard_log.event_files(run_dir)
    assert len(files) == 1, files
    path = Path(run_dir.location.path, files[0])
    series: dict[str, list[tuple[int, float]]] = {}
    for event in LegacyEventFileLoader(str(path)).Load():
        for value in event.summary.value:
            series.setdefault(value.tag, []).append((event.step, value.simple_value))
    steps = [step for step, _ in series["train/loss"]]
    assert steps == sorted(set(steps))  # steps 21-23 ran twice; each is shown once
    # the same curve as a run nothing interrupted (float32 in the event file)
    expected = [
        (step, float(torch.tensor(loss, dtype=torch.float32)))
        for step, loss in uninterrupted_one_worker["losses"]
    ]
    assert series["train/loss"] == expected
    assert {"train/lr", "val/loss"} <= set(series)
    assert len(series["val/loss"]) == spec.schedule.epochs
    # The step-time breakdown under time/*, at each kept report window of the history.
    windows = [r for r in read_metrics_history(run_dir) if "step_time" in r]
    assert [step for step, _ in series["time/step"]] == [r["step"] for r in windows]
    assert all(value > 0 for _, value in series["time/forward_backward"])


def test_mlflow_continues_one_run_across_the_retry(
    retried, mlflow_server, uninterrupted_one_worker
):
    import mlflow.pytorch

    spec, state, _ = retried
    result = state.result()
    run_dir = run_dir_of(spec)
    assert result.mlflow is not None and result.mlflow.pending is None, result.mlflow
    client = mlflow_server.client()
    experiment = client.get_experiment_by_name("relaytrain")
    runs = client.search_runs(
        [experiment.experiment_id], filter_string=f"tags.`relaytrain.run_uri` = '{run_dir.uri}'"
    )
    assert [r.info.run_id for r in runs] == [result.mlflow.run_id]  # one run, not one per try
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.info.run_name == "tracked"
    # per-step metrics from the merged history, once per step across the retry
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == uninterrupted_one_worker["losses"]
    assert len({m.step for m in history}) == len(history)
    assert len(client.get_metric_history(run.info.run_id, "val_loss")) == spec.schedule.epochs
    windows = [r["step"] for r in read_metrics_history(run_dir) if "step_time" in r]
    timed = client.get_metric_history(run.info.run_id, "time/step")
    assert sorted(m.step for m in timed) == windows
    # the spec as params; the attempts and their errors as tags
    params = run.data.params
    assert params["scaling.num_workers"] == "1" and params["optimizer.lr"] == "0.01"
    assert params["model.kwargs.hidden"] == "[16, 16]"
    tags = run.data.tags
    assert tags["relaytrain.attempts"] == "2"
    assert tags["relaytrain.attempt.1"].startswith("failed: TrainingCodeError")
    assert "-> " in tags["relaytrain.attempt.1"]  # the retry decision
    assert tags["relaytrain.attempt.2"] == "completed (resumed from step 20)"
    assert tags["relaytrain.status"] == "completed"
    # the best checkpoint as an MLflow pytorch model that loads and holds its weights
    assert result.mlflow.model_uri and result.mlflow.model_step is not None
    assert result.best_checkpoint_uri.endswith(f"checkpoint-{result.mlflow.model_step:09d}")
    mlflow.set_tracking_uri(mlflow_server.uri)  # models:/ URIs resolve through the server
    model = mlflow.pytorch.load_model(result.mlflow.model_uri)
    expected = read_model_weights(result.best_checkpoint_uri)
    loaded = model.state_dict()
    assert set(loaded) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert {"loss_curve.png", "step_time.png", "summary.json"} <= names
    png = client.download_artifacts(run.info.run_id, "loss_curve.png")
    assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # and the run's summary says where
    summary = artifacts(state.state_details.flow_run_id)["tracked-summary"].data
    assert f"MLflow run {result.mlflow.run_id} at {mlflow_server.uri}" in summary
    assert mlflow_state.read_state(run_dir).run_id == result.mlflow.run_id


def test_a_stopped_tracking_server_never_fails_training_and_is_backfilled(
    relaytrain_ray, relaytrain_prefect, mlflow_server, uninterrupted_one_worker, tmp_path
):
    """The server goes down after attempt 1 failed (once MLflow shows it) and stays down for the
    retry and finalize: the run completes, the summary says what is pending, and `relaytrain
    sync` later logs the rest into the same MLflow run, each step once."""
    raw = tiny_spec_dict(
        tmp_path,
        "tracked-down",
        tracking={"mlflow_uri": mlflow_server.uri, "mlflow_experiment": "down"},
        retries={"delay_s": 3, "jitter": 0},
        scaling=ONE_WORKER,
    )
    spec = with_fault(build_spec(raw), "raise", at_step=23)
    run_dir = run_dir_of(spec)
    client = mlflow_server.client()
    stopped = threading.Event()

    def stop_after_attempt_1() -> None:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            state = mlflow_state.read_state_quietly(run_dir)
            if state and state.run_id:
                tags = client.get_run(state.run_id).data.tags
                if tags.get("relaytrain.attempt.1", "").startswith("failed"):
                    mlflow_server.stop()
                    stopped.set()
                    return
            time.sleep(0.1)

    watcher = threading.Thread(target=stop_after_attempt_1, daemon=True)
    watcher.start()
    try:
        state = training(spec, return_state=True)
    finally:
        watcher.join(5)
        if not stopped.is_set():
            mlflow_server.start()
    assert stopped.is_set(), "the server was not stopped between the attempts"
    assert state.is_completed(), state
    result = state.result()
    assert result.status == "completed" and len(result.attempts) == 2
    assert result.mlflow is not None and result.mlflow.pending, result.mlflow
    logged_before = result.mlflow.logged_through_step
    assert 20 <= logged_before < 39  # attempt 1's committed steps, nothing of attempt 2
    summary = artifacts(state.state_details.flow_run_id)["tracked-down-summary"].data
    assert "not reached" in summary and "relaytrain sync" in summary

    mlflow_server.start()
    done = subprocess.run(
        [RELAYTRAIN, "sync", run_dir.uri], capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "logged through step 39" in done.stdout
    # Without the spec it imports nothing run.json names: all but the model (docs/security.md).
    assert "is not logged" in done.stdout and "--config" in done.stdout
    assert mlflow_state.read_state(run_dir).model_uri is None
    config = tmp_path / "spec.yaml"
    config.write_text(yaml.safe_dump(raw))
    done = subprocess.run(
        [RELAYTRAIN, "sync", run_dir.uri, "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "is not logged" not in done.stdout
    run = client.get_run(result.mlflow.run_id)  # the same run, continued
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == uninterrupted_one_worker["losses"]
    assert run.data.tags["relaytrain.attempt.2"] == "completed (resumed from step 20)"
    stored = mlflow_state.read_state(run_dir)
    assert stored.pending is None and stored.finished and stored.model_uri
    assert losses(run_dir) == uninterrupted_one_worker["losses"]


# -- the relaytrain command -------------------------------------------------------------------


def _relaytrain(capsys, *args: str) -> str:
    """``relaytrain ARGS`` in this process (the console script itself is test_flow's)."""
    from flows import cli

    capsys.readouterr()
    code = cli.main(list(args))
    out, err = capsys.readouterr()
    assert code == 0, out + err
    return out


def test_relaytrain_commands_read_a_local_run(retried, tmp_path, capsys):
    spec, state, storage = retried
    result = state.result()
    listed = _relaytrain(capsys, "runs", str(storage))
    line = next(row for row in listed.splitlines() if row.strip().startswith("tracked"))
    assert "completed" in line and " 39 " in line and "val_loss" in line
    shown = _relaytrain(capsys, "show", str(Path(storage, "tracked")))
    assert "run tracked: completed" in shown
    assert "TrainingCodeError" in shown and "resumed from" in shown
    sections = shown.split("\n\n")
    checkpoints = next(s for s in sections if s.startswith("checkpoints"))
    rows = [line.split() for line in checkpoints.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [c.step for c in run_dir_of(spec).scan().committed]
    assert [r[-1] for r in rows].count("best") == 1
    epochs = next(s for s in sections if s.startswith("metrics per epoch"))
    assert "train_loss" in epochs and len(epochs.splitlines()) == 2 + spec.schedule.epochs
    out = tmp_path / "best.pt"
    _relaytrain(capsys, "export", str(Path(storage, "tracked")), str(out))
    exported = torch.load(out, weights_only=True)
    expected = read_model_weights(result.best_checkpoint_uri)
    assert set(exported) == set(expected)
    assert all(torch.equal(exported[k], v) for k, v in expected.items())
    latest_file = str(tmp_path / "last.pt")
    _relaytrain(capsys, "export", str(Path(storage, "tracked")), "--latest", latest_file)
    latest = torch.load(tmp_path / "last.pt", weights_only=True)
    newest = read_model_weights(result.latest_checkpoint_uri)
    assert all(torch.equal(latest[k], v) for k, v in newest.items())


def test_relaytrain_refuses_what_is_not_a_run(tmp_path, capsys):
    from flows import cli

    assert cli.main(["show", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "not a relaytrain run directory" in err and "relaytrain runs" in err
    assert cli.main(["run", "--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err


@pytest.mark.e2e
def test_tensorboard_shows_the_retried_run_as_one_curve(retried, uninterrupted_one_worker):
    """`tensorboard --logdir STORAGE`, read through its own HTTP API and seen in headless
    chromium (screenshot: runs/e2e-screenshots/tensorboard-scalars.png)."""
    import requests
    from playwright.sync_api import sync_playwright

    _, _, storage = retried
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = Path(storage, "tensorboard.log")
    command = [str(Path(sys.executable).with_name("tensorboard")), "--logdir", str(storage)]
    with log.open("w") as out:
        process = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        wait_until_answers(f"{url}/data/runs", process, log, "tensorboard", 120)
        deadline = time.monotonic() + 60  # it loads event files in the background
        while "tracked" not in requests.get(f"{url}/data/runs", timeout=5).json():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.5)
        served = requests.get(
            f"{url}/data/plugin/scalars/scalars",
            params={"run": "tracked", "tag": "train/loss"},
            timeout=10,
        ).json()
        assert [step for _, step, _ in served] == [
            step for step, _ in uninterrupted_one_worker["losses"]
        ]
        # The step-time breakdown is served too (its own time/* group, before train/ and val/:
        # the page below filters to the training curves, which the cards of time/* would push
        # out of view).
        tags = requests.get(f"{url}/data/plugin/scalars/tags", timeout=10).json()["tracked"]
        assert {"time/step", "time/forward_backward", "time/data_wait"} <= set(tags)
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        with sync_playwright() as p:
            browser = p.chromium.launch(
                executable_path=shutil.which("chromium") or "/usr/bin/chromium",
                args=["--no-sandbox", "--disable-gpu", "--no-first-run"],
            )
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            page.goto(f"{url}/?darkMode=false#scalars&_smoothingWeight=0&tagFilter=loss%7Clr")
            page.get_by_text("train/loss", exact=True).first.wait_for(timeout=60000)
            page.wait_for_timeout(2000)  # the charts draw after their data arrives
            page.screenshot(path=str(SCREENSHOTS / "tensorboard-scalars.png"), full_page=True)
            # the page draws inside web components: ask playwright's locators, which see them
            shown = {
                label: page.get_by_text(label, exact=True).count()
                for label in ("tracked", "train/loss", "train/lr", "val/loss")
            }
            browser.close()
        assert all(shown.values()), shown
    finally:
        stop(process)


def test_a_language_model_is_tracked_with_its_perplexity_and_logged_as_a_model(
    relaytrain_ray, relaytrain_prefect, mlflow_server, tmp_path
):
    """examples/lm_gpt.yaml's model on 100 rows of its corpus, 1 worker, 2 epochs, through
    the flow: MLflow and TensorBoard hold its val_perplexity, and the best checkpoint is an
    MLflow pytorch model (built from the columns form's fn(**kwargs)) that holds its weights."""
    import mlflow.pytorch
    import yaml
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    from tests.columns_workloads import write_lm_dataset

    raw = yaml.safe_load((Path(__file__).parents[2] / "examples" / "lm_gpt.yaml").read_text())
    raw["run"] = {"name": "tracked-lm", "storage": str(tmp_path)}
    raw["model"]["kwargs"] |= {"block_size": 32, "layers": 1, "width": 16, "heads": 2}
    raw["data"] |= {"dataset": write_lm_dataset(tmp_path / "lm.parquet", count=100, group=50)}
    raw["data"] |= {"batch_size": 16, "validation_fraction": 0.2}
    raw["checkpoint"] |= {"every": 4}
    raw["scaling"] = {"num_workers": 1}
    raw["tracking"] = {"mlflow_uri": mlflow_server.uri}
    spec = build_spec(raw)
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    result = state.result()
    client = mlflow_server.client()
    history = client.get_metric_history(result.mlflow.run_id, "val_perplexity")
    assert [m.value for m in history][-1] == pytest.approx(result.final_metrics["val_perplexity"])
    assert result.mlflow.model_uri, result.mlflow
    mlflow.set_tracking_uri(mlflow_server.uri)
    model = mlflow.pytorch.load_model(result.mlflow.model_uri)
    expected = read_model_weights(result.best_checkpoint_uri)
    for name, tensor in expected.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    run_dir = run_dir_of(spec)
    (path,) = tensorboard_log.event_files(run_dir)
    tags = {
        value.tag
        for event in LegacyEventFileLoader(str(Path(run_dir.location.path, path))).Load()
        for value in event.summary.value
    }
    assert {"train/loss", "val/perplexity"} <= tags, tags


def test_a_sweep_is_a_parent_run_in_mlflow_with_a_child_run_per_trial(
    relaytrain_ray, relaytrain_prefect, mlflow_server, tmp_path
):
    """Three trials, halving by 3 after epoch 1 (one goes on): MLflow holds the sweep as a
    parent run with its settings, and each trial's own run as its child, tagged with how the
    trial ended; the parent ends FINISHED with the best metric, the result and the picture."""
    from flows.sweep import sweep

    raw = tiny_spec_dict(
        tmp_path,
        "tracked-sweep",
        tracking={"mlflow_uri": mlflow_server.uri, "mlflow_experiment": "sweeps"},
        scaling=ONE_WORKER,
        schedule={"epochs": 2},
    )
    raw["sweep"] = {
        "trials": 3,
        "concurrent": 1,
        "metric": "val_loss",
        "pruner": {"successive_halving": {"reduction_factor": 3}},
        "seed": 1,
        "space": {"optimizer.lr": {"log_uniform": [1.0e-3, 1.0e-1]}},
    }
    result = sweep(raw)
    assert sorted(t.status for t in result.trials) == ["completed", "pruned", "pruned"]
    client = mlflow_server.client()
    parent = client.get_run(result.mlflow_run_id)
    assert parent.info.run_name == "tracked-sweep" and parent.info.status == "FINISHED"
    assert parent.data.params["sweep.sampler"] == "random"
    assert parent.data.params["sweep.space.optimizer.lr"] == '{"log_uniform": [0.001, 0.1]}'
    assert parent.data.metrics["best_val_loss"] == pytest.approx(result.best.metric)
    assert parent.data.tags["relaytrain.best_trial"] == result.best.run_name
    children = client.search_runs(
        [parent.info.experiment_id],
        filter_string=f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'",
    )
    assert {c.info.run_name: c.data.tags["relaytrain.sweep_status"] for c in children} == {
        t.run_name: t.status for t in result.trials
    }
    for child in children:  # each child is the trial's own run, with its own lr as a param
        (trial,) = [t for t in result.trials if t.run_name == child.info.run_name]
        assert float(child.data.params["optimizer.lr"]) == trial.values["optimizer.lr"]
    artifacts = {a.path for a in client.list_artifacts(parent.info.run_id)}
    assert {"result.json", "sweep.png"} <= artifacts
