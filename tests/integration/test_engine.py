"""The engine on a real local Ray cluster with 2 gloo DDP workers."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import ray
import yaml

from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import (
    assert_recovered,
    assert_same_tensors,
    fail_then_resume,
    final_state,
    losses,
    record_matrix_row,
    run_dir_of,
)
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.errors import (
    ClusterCapacityError,
    InfrastructureError,
    SpecError,
    TrainingCodeError,
)
from trainer_core.run import attempts
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def reference(uninterrupted):
    return uninterrupted


def test_reference_run_is_complete(reference):
    steps = [step for step, _ in reference["losses"]]
    assert steps == list(range(1, reference["result"].steps_completed + 1))
    assert reference["result"].steps_completed == 39  # 3 epochs x 13 batches per rank
    assert "val_loss" in reference["result"].final_metrics
    timings = reference["result"].timings
    # every 10 steps, after each validation (13, 26) and at the end: 10 13 20 26 30 39
    assert timings["num_steps"] == 39 and timings["num_checkpoints"] == 6


def test_golden_exact_resume_after_raise(reference, tmp_path):
    # in_place=1 too: Ray's in-place restart is for infrastructure; code errors end the attempt.
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "golden",
            retries={"in_place": 1},
            faults=[{"kind": "raise", "at_step": 17}],
        )
    )
    with pytest.raises(TrainingCodeError) as failure:
        run_attempt(spec)
    assert failure.value.step == 17 and failure.value.error_type == "InjectedFault"
    newest = run_dir_of(spec).scan().newest
    second = run_attempt(spec)
    assert second.attempt == 2 and second.resumed_from_step == 13
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]
    attempts = run_dir.read_attempts()
    assert [a["status"] for a in attempts] == ["failed", "completed"]
    assert attempts[0]["error_class"] == "TrainingCodeError" and attempts[0]["error_step"] == 17
    assert attempts[0]["restarts"] == []
    assert attempts[1]["resumed_from_step"] == 13
    # Rank 0's model and optimizer and the schedule are read once for the node's 2 ranks (and
    # handed on), each RNG state by its own rank: every file once.
    assert attempts[1]["restore"]["bytes_read"] == sum(e["size"] for e in newest.files.values())
    # Each attempt's world size and its workers' peak memory (every rank's, max-reduced at
    # each checkpoint: the failed attempt's as of step 10). A Ray worker with torch: > 100 MB.
    assert [a["world_size"] for a in attempts] == [2, 2]
    assert all(a["peak_worker_rss_mb"] > 100 for a in attempts)


def test_kill_mid_epoch_then_resume(reference, tmp_path):
    """With restarts in place off, a killed worker ends the attempt; the next one resumes."""
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "killed",
            retries={"in_place": 0},
            faults=[{"kind": "kill", "at_step": 23, "rank": 1}],
        )
    )
    with pytest.raises(InfrastructureError):
        run_attempt(spec)
    # Ray's snapshot can lag the newest committed checkpoint after a crash (the tests saw it
    # list step 10, or nothing yet: registration is asynchronous). Take the extreme: Ray knows
    # of no checkpoint at all.
    (tmp_path / "killed" / "checkpoint_manager_snapshot.json").unlink(missing_ok=True)
    assert run_dir_of(spec).scan().newest.step == 20
    second = run_attempt(spec)
    assert second.resumed_from_step == 20  # relaytrain's newest committed, not Ray's newest
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]


def test_the_only_rank_killed_ends_the_attempt_and_its_lost_steps_are_counted(
    uninterrupted_one_worker, tmp_path
):
    """With restarts in place off, the only rank is SIGKILLed as step 23 begins: nobody is left
    to say how far it got, and its metric rows stop at its last push. The next attempt's rank,
    on the same node, reads the step the killed rank marked (22), so the failed attempt lost
    exactly the steps after the resume point (20, or 13 when the kill took step 20's write in
    flight): the fault's step is the oracle. (The adversary's seed 276 met it: 0 steps lost
    recorded where 3 were.)"""
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "alone",
            scaling=ONE_WORKER,
            retries={"in_place": 0},
            faults=[{"kind": "kill", "at_step": 23, "rank": 0}],
        )
    )
    with pytest.raises(InfrastructureError):
        run_attempt(spec)
    run_attempt(spec)
    attempts = assert_recovered(
        run_dir_of(spec), uninterrupted_one_worker, interval=10, write_lost=True, fault_step=23
    )
    assert attempts[0]["last_step"] == 22


def test_corrupt_newest_checkpoint_falls_back(reference, tmp_path):
    # Synchronous checkpoints here (the other tests use the default, asynchronous).
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "corrupt",
            checkpoint={"asynchronous": False},
            faults=[{"kind": "raise", "at_step": 25}],
        )
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    run_dir = run_dir_of(spec)
    newest = run_dir.scan().newest
    assert newest is not None and newest.step == 20
    model_file = tmp_path / "corrupt" / newest.name / "model.pt"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte: only the sha256 can tell
    model_file.write_bytes(bytes(data))
    events = []
    stored_at_resume = []  # what the attempt's record said once its workers resumed

    def on_event(event):
        events.append(event)
        if event["kind"] == "resumed":
            stored_at_resume.append(attempts.read(run_dir)[-1].resumed_from_step)

    second = run_attempt(spec, on_event=on_event)
    resumed = next(e for e in events if e["kind"] == "resumed")
    assert resumed["step"] == 13
    assert [s["step"] for s in resumed["skipped"]] == [20]
    assert second.resumed_from_step == 13
    # A record its driver cannot close (the flow killed, the store full) keeps where the workers
    # resumed, not the plan's first candidate: the damaged step 20.
    assert stored_at_resume == [13]
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]
    record_matrix_row("6 newest checkpoint corrupted (flipped byte)", run_dir, retry="run_attempt")


def test_sharded_checkpoints_resume_exactly(reference, tmp_path):
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "sharded",
            checkpoint={"sharded": True},
            faults=[{"kind": "raise", "at_step": 12, "rank": 1}],
        )
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    assert run_attempt(spec).resumed_from_step == 10
    run_dir = run_dir_of(spec)
    files = set(run_dir.scan().newest.files)
    assert {"model-rank0.pt", "model-rank1.pt", "optimizer-rank1.pt"} <= files
    assert "model.pt" not in files
    for rank in (0, 1):
        assert_same_tensors(final_state(run_dir, f"-rank{rank}"), reference["state"])
    assert losses(run_dir) == reference["losses"]


def test_more_workers_than_cluster_fails_fast(ray_cluster, tmp_path):
    raw = tiny_raw(tmp_path, "too-big", scaling={"num_workers": 64}, data={"batch_size": 64})
    spec = build_spec(raw)
    with pytest.raises(ClusterCapacityError, match=r"scaling\.num_workers=64"):
        run_attempt(spec)
    assert not (tmp_path / "too-big" / "attempts.jsonl").exists()


def test_bad_model_import_fails_before_any_worker(ray_cluster, tmp_path):
    spec = build_spec(tiny_raw(tmp_path, "bad-import", model={"name": "nowhere.models:net"}))
    with pytest.raises(SpecError, match="nowhere"):
        run_attempt(spec)
    assert not (tmp_path / "bad-import").exists()


def test_a_dead_controller_leaves_no_placement_group_behind(uninterrupted_one_worker, tmp_path):
    """Ray Train's controller SIGKILLed mid-run: its workers go with it, and the driver removes
    the placement group it left (Ray would keep its CPUs reserved until the driver exits, and the
    next attempt could never start). The next attempt resumes, exact.

    Each training forward pass sleeps 0.1 s (the same MLP otherwise), so the run is still
    training when the driver hears of the first commit: on a loaded machine the tiny run had
    finished by then, and the kill ended nothing (DID NOT RAISE, in two full-suite runs)."""
    from ray.util.placement_group import placement_group_table

    slow = {"name": "tests.helpers:slow_mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.1}}
    slow["kwargs"]["delay_s"] = 0.1
    # One worker: the controller's death and the placement group are the same for any number.
    spec = build_spec(
        tiny_raw(
            tmp_path, "controller-killed", model=slow, retries={"in_place": 0}, scaling=ONE_WORKER
        )
    )
    before = set(placement_group_table())
    started_ms = time.time() * 1000
    killed: list[int] = []

    def on_event(event):
        if event["kind"] == "checkpoint" and not killed:  # a commit to resume from
            (pid,) = [
                actor["Pid"]
                for actor in ray._private.state.actors().values()
                if actor["State"] == "ALIVE"
                and actor["ActorClassName"] == "CredentialedController"
                and actor["StartTime"] >= started_ms
            ]
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    with pytest.raises(InfrastructureError, match=r"Ray failed: Actor(Died|Unavailable)Error"):
        run_attempt(spec, on_event=on_event)
    assert killed
    states = [g["state"] for i, g in placement_group_table().items() if i not in before]
    assert states and set(states) == {"REMOVED"}, states
    second = run_attempt(spec)
    assert second.status == "completed" and second.resumed_from_step >= 10
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
    assert losses(run_dir) == uninterrupted_one_worker["losses"]


def test_ray_data_datasets_reach_a_stock_loop_and_resume_at_an_epoch(ray_cluster, tmp_path):
    """``datasets`` becomes TorchTrainer(datasets=...): the stock loop's get_dataset_shard
    works unchanged, and every epoch the two workers' shards cover the table. A fault at the
    second report (epoch 1, before its checkpoint) resumes from epoch 0's checkpoint, and
    epoch 1 runs again from its beginning (Ray Data has no mid-epoch cursor)."""
    raw = yaml.safe_load((REPO / "examples" / "ray_data_loop.yaml").read_text())
    raw["run"].update({"name": "ray-data", "storage": str(tmp_path)})
    raw["datasets"]["train"] = str(REPO / raw["datasets"]["train"])
    raw["train_loop_config"]["num_epochs"] = 2  # epoch 1 runs again: enough to show the resume
    raw["faults"] = [{"kind": "raise", "at_step": 2}]
    spec = build_spec(raw)
    fail_then_resume(spec)
    history = read_metrics_history(run_dir_of(spec))
    assert [row["epoch"] for row in history] == [0, 1]
    # 1797 digits, split equally between 2 workers: at most one row left out an epoch.
    assert {row["rows"] for row in history} <= {1796, 1797}
    assert len({row["rows"] for row in history}) == 1
