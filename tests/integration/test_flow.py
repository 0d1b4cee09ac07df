"""The training flow under Prefect's test harness on the shared local Ray cluster."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from operator import methodcaller
from pathlib import Path

import pytest
import yaml
from prefect.client.orchestration import get_client

from flows.pytest_plugin import tiny_spec_dict, with_fault
from flows.training import training
from tests.conftest import ONE_WORKER
from tests.helpers import steps_by_process
from tests.prefect_api import artifacts, task_runs
from tests.recovery import (
    assert_records_what_it_measures,
    assert_recovered,
    assert_retained,
    assert_same_tensors,
    expected_retention,
    final_state,
    losses,
    measure_checkpoints,
    record_matrix_row,
    run_dir_of,
)
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError
from trainer_core.run import lease
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def happy(relaytrain_ray, relaytrain_prefect, tmp_path_factory):
    """The tiny spec's run through the flow, on one worker (what its tests check does not
    depend on the ranks; the 2-worker flow is the fault test's)."""
    spec = build_spec(
        tiny_spec_dict(tmp_path_factory.mktemp("flow"), "flow-happy", scaling=ONE_WORKER)
    )
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    return spec, state


def test_happy_path_tasks_artifacts_and_result(happy):
    spec, state = happy
    result = state.result()
    flow_run_id = state.state_details.flow_run_id
    assert result.status == "completed" and result.run_name == "flow-happy"
    assert result.steps_completed == 39 and result.epochs_completed == 3
    assert result.steps_computed == 39 and result.goodput == 1.0
    assert len(result.attempts) == 1 and result.attempts[0].status == "completed"
    assert result.best_checkpoint_uri and result.latest_checkpoint_uri.endswith(
        "checkpoint-000000039"
    )
    assert "val_loss" in result.final_metrics and result.storage_bytes > 0
    # A DDP run's model file is the checkpoint's own model.pt (an fsdp run's: test_fsdp).
    assert result.latest_model_uri == f"{result.latest_checkpoint_uri}/model.pt"
    assert result.best_model_uri == f"{result.best_checkpoint_uri}/model.pt"
    runs = task_runs(flow_run_id)
    assert set(runs) == {"setup", "train", "finalize"}
    assert all(r.state.is_completed() for r in runs.values())
    found = artifacts(flow_run_id)
    assert {
        "flow-happy-metrics",
        "flow-happy-summary",
        "flow-happy-best-checkpoint",
        "flow-happy-best-model",
        "flow-happy-loss-curve",
        "flow-happy-progress",
    } <= set(found)
    table = json.loads(found["flow-happy-metrics"].data)
    assert [row["epoch"] for row in table] == [1, 2, 3] and "val_loss" in table[-1]  # from 1
    assert found["flow-happy-progress"].data == 100
    assert found["flow-happy-loss-curve"].data.startswith("data:image/png;base64,")
    assert "Attempts" in found["flow-happy-summary"].data
    run_dir = run_dir_of(spec)
    assert run_dir.location.child("summary.json").read_json()["steps_completed"] == 39
    assert run_dir.location.child("loss_curve.png").read_bytes()[:4] == b"\x89PNG"
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(flow_run_id).name == "flow-happy"


def test_retention_keeps_the_newest_and_the_measured_best(happy, uninterrupted_one_worker):
    """On the run's real directory: keep_last 2 + keep_best 1 by val_loss (min) left exactly
    those, and the best checkpoint is the one whose weights score the lowest val_loss when
    evaluated (the uninterrupted run kept every checkpoint of the same weights)."""
    spec, state = happy
    kept, best = expected_retention(uninterrupted_one_worker["checkpoints"], keep_last=2)
    assert_retained(run_dir_of(spec), state.result().best_checkpoint_uri, kept, best)


def test_the_best_checkpoint_is_the_one_its_metric_was_measured_on(
    uninterrupted_one_worker, tmp_path
):
    """checkpoint.every 10 does not divide the 13-step epoch. Every checkpoint records only
    what its own weights score, evaluated on the driver; the one called best (keep_best 1 by
    val_loss, max) scores its recorded value, no validated checkpoint of the same weights
    scores better, and it survives keep_last 1 though it is not the newest."""
    policy = {"keep_last": 1, "keep_best": 1, "best_metric": "val_loss", "best_mode": "max"}
    spec = build_spec(tiny_spec_dict(tmp_path, "flow-keep", checkpoint=policy, scaling=ONE_WORKER))
    result = training(spec)
    run_dir = run_dir_of(spec)
    measured = measure_checkpoints(spec, run_dir)
    assert_records_what_it_measures(measured)
    best = {c.uri: c for c in run_dir.scan().committed}[result.best_checkpoint_uri]
    assert result.best_metrics["val_loss"] == pytest.approx(
        measured[best.step]["measured"]["val_loss"], rel=1e-5
    )
    reference = uninterrupted_one_worker["checkpoints"]  # every checkpoint kept
    assert_records_what_it_measures(reference)
    kept, expected_best = expected_retention(reference, keep_last=1, mode="max")
    assert best.step == expected_best and expected_best != max(kept)
    assert_retained(run_dir, result.best_checkpoint_uri, kept, expected_best)


def test_finished_run_returns_stored_result_unless_more_epochs(happy):
    spec, first = happy
    again = training(spec, return_state=True)
    assert again.result().attempts == first.result().attempts
    assert "train" not in task_runs(again.state_details.flow_run_id)
    more = training(
        spec.model_copy(update={"schedule": spec.schedule.model_copy(update={"epochs": 4})}),
        return_state=True,
    )
    result = more.result()
    assert result.steps_completed == 52 and len(result.attempts) == 2
    assert result.attempts[1].resumed_from_step == 39


def test_a_paused_run_trains_on_to_the_uninterrupted_run(
    relaytrain_prefect, uninterrupted, tmp_path
):
    """until_epoch stops the run after that epoch, its checkpoint committed, and says paused (not
    finished: the same name trains on); asked again for the same epoch it trains nothing; run on,
    it ends bit for bit as the run that never paused (the reference)."""
    spec = build_spec(tiny_spec_dict(tmp_path, "flow-paused"))
    paused = training(spec, until_epoch=1, return_state=True).result()
    assert (paused.status, paused.epochs_completed, paused.steps_completed) == ("paused", 1, 13)
    assert paused.latest_checkpoint_uri is not None and paused.target_epochs == 3
    again = training(spec, until_epoch=1, return_state=True)
    assert "train" not in task_runs(again.state_details.flow_run_id)
    assert again.result().attempts == paused.attempts
    result = training(spec, return_state=True).result()
    assert (result.status, result.steps_completed) == ("completed", 39)
    assert [a.resumed_from_step for a in result.attempts] == [0, 13]
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), uninterrupted["state"])
    assert losses(run_dir) == uninterrupted["losses"]


def test_raise_fault_is_retried_and_resume_is_exact(relaytrain_prefect, uninterrupted, tmp_path):
    """Also the fault matrix's case 1 (an exception in training code), with its row. The
    figures' oracles: the fault's step (it fires as step 17 begins: 16 completed), and the
    steps the workers ran, counted from what rank 0's model saw in each attempt (the tiny
    spec's MLP, computing the same, logging every training forward pass)."""
    forwards = tmp_path / "forwards"
    forwards.mkdir()
    raw = tiny_spec_dict(tmp_path, "flow-fault")
    kwargs = {**raw["model"]["kwargs"], "log_dir": str(forwards)}
    raw["model"] = {"name": "tests.helpers:step_log_mlp", "kwargs": kwargs}
    spec = with_fault(build_spec(raw), "raise", at_step=17)
    state = training(spec, return_state=True)
    assert state.is_completed()
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 2
    run_dir = run_dir_of(spec)
    attempts = assert_recovered(
        run_dir, uninterrupted, interval=10, committed_before=13, fault_step=17
    )
    assert attempts[0]["error_budget"] == "code" and attempts[0]["restarts"] == []
    record_matrix_row("1 exception in training code", run_dir, committed_before=13, fault_step=17)
    result = state.result()
    assert [a.status for a in result.attempts] == ["failed", "completed"]
    assert result.attempts[0].error_class == "TrainingCodeError"
    assert result.attempts[1].resumed_from_step == 13  # the newest commit before the fault
    # 16 steps, then 14-39 again from the checkpoint at 13: 42 computed for 39 kept.
    ran = steps_by_process(forwards)
    assert ran == [16, 26]
    assert result.steps_computed == sum(ran) and result.goodput == round(39 / sum(ran), 4)
    # Where the time went counts each kept step once (the history holds no lost step), and
    # the retry cost time in each of its three parts, within the wall time.
    account = result.time
    assert account is not None and account.steps_measured == 39
    lost = account.restarts
    assert lost.detection_s > 0 and lost.new_group_s > 0 and lost.recompute_s > 0
    assert lost.new_group_s < result.attempts[1].duration_s
    assert lost.total_s + account.training_s < result.wall_time_s
    assert_same_tensors(final_state(run_dir), uninterrupted["state"])
    assert losses(run_dir) == uninterrupted["losses"]


def test_spec_error_is_not_retried(relaytrain_ray, relaytrain_prefect, tmp_path):
    spec = build_spec(tiny_spec_dict(tmp_path, "flow-bad", model={"name": "nowhere.nets:mlp"}))
    state = training(spec, return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, SpecError) and "model.name" in str(error)
    runs = task_runs(state.state_details.flow_run_id)
    assert runs["setup"].run_count == 1 and "train" not in runs


def test_same_error_twice_stops_retrying(relaytrain_ray, relaytrain_prefect, tmp_path):
    spec = build_spec(tiny_spec_dict(tmp_path, "flow-bug", retries={"code": 3}, scaling=ONE_WORKER))
    spec = with_fault(with_fault(spec, "raise", at_step=15), "raise", at_step=15, attempt=2)
    state = training(spec, return_state=True)
    assert state.is_failed()
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 2  # not 4
    attempts = run_dir_of(spec).read_attempts()
    assert "twice in a row" in attempts[-1]["retry_decision"]
    assert run_dir_of(spec).location.child("summary.json").read_json()["status"] == "failed"


def test_a_run_held_by_a_live_flow_is_refused(relaytrain_ray, relaytrain_prefect, tmp_path):
    spec = build_spec(tiny_spec_dict(tmp_path, "flow-held"))
    lease.acquire(run_dir_of(spec).location, owner="another-live-flow")  # this pid: alive
    state = training(spec, return_state=True)
    error = state.result(raise_on_failure=False)
    assert isinstance(error, lease.LeaseHeldError) and "another-live-flow" in str(error)
    assert "train" not in task_runs(state.state_details.flow_run_id)


def test_progress_artifact_moves_while_training_at_most_every_2_s(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """The README: the progress artifact is updated while training, at most every 2 s, and at
    the end. Polled as the UI polls it; spacing is read from the server's own timestamps."""
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    from tasks.train import PROGRESS_INTERVAL_S

    spec = build_spec(yaml.safe_load(slow_spec_file(tmp_path, "flow-progress").read_text()))
    seen: dict = {}  # server-side update time -> progress
    flow = threading.Thread(target=training, args=(spec,), kwargs={"return_state": True})
    flow.start()
    with get_client(sync_client=True) as client:
        while flow.is_alive() or not seen:
            for artifact in client.read_artifacts(
                artifact_filter=ArtifactFilter(
                    key=ArtifactFilterKey(any_=["flow-progress-progress"])
                )
            ):
                seen[artifact.updated] = artifact.data
            time.sleep(0.2)
        (artifact,) = client.read_artifacts(
            artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["flow-progress-progress"]))
        )
    flow.join()
    assert artifact.data == 100
    during = sorted((t, p) for t, p in seen.items() if 0 < p < 100)
    assert during, f"no progress between 0 and 100 was seen while training: {seen}"
    assert [p for _, p in during] == sorted(p for _, p in during)  # never backwards
    gaps = [(b - a).total_seconds() for (a, _), (b, _) in itertools.pairwise(during)]
    assert all(gap >= PROGRESS_INTERVAL_S - 0.1 for gap in gaps), gaps


# -- the flow as a separate process: SIGKILL, and cancellation by SIGTERM ------------------------


def slow_spec_file(tmp_path: Path, name: str) -> Path:
    raw = tiny_spec_dict(
        tmp_path,
        name,
        scaling=ONE_WORKER,
        # The 1-worker reference's MLP, slowed down so the kill lands mid-run.
        model={
            "name": "tests.helpers:slow_mlp",
            "kwargs": {"hidden": [16, 16], "dropout": 0.1, "delay_s": 0.25},
        },
    )
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def start_cli(
    spec_file: Path, name: str, ray_address: str, command: tuple[str, ...] = ()
) -> subprocess.Popen:
    """The run's command line, in the repository: ``python -m flows.training``, or ``command``
    (the console script ``relaytrain run``) with the same options. No PYTHONPATH: the spec's
    model, the tests' own, imports from the working directory, in the flow's process and in
    its Ray workers, as a user's project module would."""
    from prefect.settings import PREFECT_API_URL

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({"PREFECT_API_URL": str(PREFECT_API_URL.value()), "RAY_ADDRESS": ray_address})
    launcher = list(command) or [sys.executable, "-m", "flows.training"]
    return subprocess.Popen(
        [*launcher, "--config", str(spec_file), "--run-name", name],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def wait_for_commit(run_dir: RunDirectory, at_least: int, process, timeout_s: float = 120):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        newest = run_dir.scan().newest
        if newest and newest.step >= at_least:
            return newest.step
        assert process.poll() is None, process.stdout.read()
        time.sleep(0.2)
    raise AssertionError(f"no checkpoint at step >= {at_least} within {timeout_s} s")


def cpus_free(ray) -> float:
    return ray.available_resources().get("CPU", 0.0)


def test_interrupted_flow_process_resumes_on_rerun(
    relaytrain_ray, relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    """The flow's process SIGTERMed mid-run (how Prefect cancels a flow run's process), run
    again and SIGKILLed mid-run, then run again with the console script: each run resumes where
    the last committed, each interruption frees the run's workers, and the run ends as the
    uninterrupted one."""
    ray = relaytrain_ray
    name = "flow-interrupted"
    spec_file = slow_spec_file(tmp_path, name)
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child(name))
    address = ray.get_runtime_context().gcs_address
    free_before = cpus_free(ray)

    def interrupt(process, at_least: int, stop) -> int:
        committed = wait_for_commit(run_dir, at_least, process)
        stop(process)
        process.wait(timeout=30)
        deadline = time.time() + 30  # the worker group is gone within 30 s
        while cpus_free(ray) < free_before and time.time() < deadline:
            time.sleep(0.5)
        assert cpus_free(ray) >= free_before
        assert run_dir.scan().newest.step >= committed  # nothing committed was lost
        return committed

    sigterm = methodcaller("send_signal", signal.SIGTERM)
    terminated = interrupt(start_cli(spec_file, name, address), 10, sigterm)
    second_at = time.time()
    # a commit of the second process's own: the first may have committed more while it stopped
    after_first = run_dir.scan().newest.step + 1
    killed = interrupt(start_cli(spec_file, name, address), after_first, methodcaller("kill"))
    third_at = time.time()
    # run again as a user would, with the console script (the same run, resumed): it imports
    # the spec's model (tests.helpers) from the working directory, as `python -m` does
    relaytrain = str(Path(sys.executable).with_name("relaytrain"))
    rerun = start_cli(spec_file, name, address, command=(relaytrain, "run"))
    output, _ = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, output
    assert f"run {name}: completed" in output and "relaytrain show" in output
    attempts = assert_recovered(
        run_dir, uninterrupted_one_worker, interval=10, committed_before=terminated
    )
    assert len(attempts) == 3 and attempts[-1]["status"] == "completed"
    assert attempts[2]["resumed_from_step"] >= killed
    for case, committed, attempt, rerun_at in (
        ("4b flow cancelled (SIGTERM)", terminated, attempts[1], second_at),
        ("4 flow process SIGKILLed, re-run", killed, attempts[2], third_at),
    ):
        record_matrix_row(
            case,
            run_dir,
            committed_before=committed,
            rerun_to_resume_s=round(attempt["resumed_at"] - rerun_at, 1),
        )


def test_cli_refuses_a_bad_spec_before_running(capsys):
    from flows.training import main

    assert main(["--config", "examples/digits_cnn.yaml", "--set", "scaling.num_workers=0"]) == 2
    assert "scaling.num_workers" in capsys.readouterr().err
    assert main(["--config", "examples/digits_cnn.yaml", "--run-name", "../up"]) == 2
