"""Restarts in place on a real local Ray cluster: Ray Train restarts a worker group that lost a
rank within the attempt, the new group scans the run again, and the driver records how far the
lost group got, whoever could tell it."""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from pathlib import Path

import pytest
import ray

from tests.conftest import ONE_WORKER, tiny_raw
from tests.helpers import steps_by_process
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import build_result
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


@pytest.fixture
def reference(uninterrupted):
    return uninterrupted


def test_in_place_restart_resumes_within_the_attempt(reference, tmp_path):
    """Rank 0 dies in step 21, just after step 20's commit relayed its rows, so the driver
    knows exactly how far the group got whoever tells it; step 20's checkpoint is damaged
    meanwhile, so the restarted group, which scans the run again, falls back to step 13 and
    runs 14-20 again. The steps the workers ran are counted from what rank 0's model saw."""
    forwards = tmp_path / "forwards"
    forwards.mkdir()
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "in-place",
            retries={"in_place": 1},
            # Rank 0 dies in step 21's forward pass, once rank 1 waits in its all-reduce; the
            # model (the tiny spec's MLP, computing the same) logs every training forward pass.
            model={
                "name": "tests.helpers:step_log_mlp",
                "kwargs": {
                    "hidden": [16, 16],
                    "dropout": 0.1,
                    "log_dir": str(forwards),
                    "kill_at": 21,
                    "pause_s": 0.5,
                },
            },
            # Synchronous checkpoints, so step 20's is committed by then (rank 0's death can
            # take an asynchronous write in flight with it).
            checkpoint={"asynchronous": False},
        )
    )
    events = []
    started_ms = time.time() * 1000
    torch_loaded: dict[str, dict[int, bool]] = {}

    def on_event(event):  # while fit() runs: which of its processes have libtorch mapped
        events.append(event)
        if event["kind"] == "restarting":  # before the new group starts (seconds)
            model_file = tmp_path / "in-place" / "checkpoint-000000020" / "model.pt"
            data = bytearray(model_file.read_bytes())
            data[len(data) // 2] ^= 0xFF  # same size: only the manifest's digest can tell
            model_file.write_bytes(bytes(data))
        for actor in ray._private.state.actors().values():
            if actor["State"] == "ALIVE" and actor["StartTime"] >= started_ms:
                # It may have just exited (reading its maps then raises either).
                with contextlib.suppress(FileNotFoundError, ProcessLookupError):
                    maps = Path(f"/proc/{actor['Pid']}/maps").read_text()
                    loaded = torch_loaded.setdefault(actor["ActorClassName"], {})
                    loaded[actor["Pid"]] = loaded.get(actor["Pid"], False) or "libtorch" in maps

    result = run_attempt(spec, on_event=on_event)
    assert result.status == "completed" and result.attempt == 1
    # The controller and the relay never import torch (it would delay every worker group's
    # start); the workers show that the probe sees torch where it is.
    assert set(torch_loaded["CredentialedController"].values()) == {False}
    assert set(torch_loaded["MetricsRelay"].values()) == {False}
    assert True in torch_loaded["RayTrainWorker"].values()  # (one seen before its import: False)
    # Two worker groups, and none of Ray's helper actors that relaytrain has no use for (one
    # node: nothing for a preemption watcher to watch; no Ray datasets to manage).
    started = Counter(
        actor["ActorClassName"]
        for actor in ray._private.state.actors().values()
        if actor["StartTime"] >= started_ms
    )
    assert started["RayTrainWorker"] == 4 and started["SynchronizationActor"] == 2
    assert started["DatasetManager"] == 0 and started["PreemptionWatcher"] == 0
    assert started["PlacementGroupCleaner"] == 0  # the driver cleans up (next test)
    run_dir = run_dir_of(spec)
    (attempt,) = run_dir.read_attempts()  # one attempt: Ray restarted its worker group
    assert attempt["status"] == "completed"
    (restart,) = attempt["restarts"]
    assert restart["error_class"] == "InfrastructureError"
    # The restarted group scanned the run again: step 20's commit is damaged, 13 is not.
    assert restart["resumed_from_step"] == 13
    regroup = next(i for i, e in enumerate(events) if e["kind"] == "resumed" and e["group"])
    assert [s["step"] for s in events[regroup]["skipped"]] == [20]
    # What the workers ran, counted from what rank 0's model saw in each worker group: the
    # first group completed steps 1-20, the restarted one 14-39 (14-20 again).
    ran = steps_by_process(forwards)
    assert ran == [20, 26]
    # The first group's rows, relayed with step 20's commit before rank 0 died, say so too.
    relayed = [row["step"] for e in events[:regroup] if e["kind"] == "metrics" for row in e["rows"]]
    assert relayed == list(range(1, 21))
    assert restart["last_step"] == ran[0]
    assert restart["resumed_at"] >= restart["failed_at"]
    # goodput: steps kept / steps the workers ran
    summary = build_result(spec, run_dir, spec.run.storage, "completed")
    assert summary.steps_computed == sum(ran)
    assert summary.goodput == round(39 / sum(ran), 4)
    assert [e["group"] for e in events if e["kind"] in ("resumed", "fresh_start")] == [0, 1]
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]


def test_a_lone_rank_killed_between_reports_is_counted_to_its_last_step(
    uninterrupted_one_worker, tmp_path
):
    """One worker, SIGKILLed as step 13 begins, 2 steps after its last report (every 5) and
    its step-10 checkpoint (written synchronously: an asynchronous write in flight may go with
    the process): no peer outlives it to say how far it got, and its rows stop at step
    10. The restart in place still records step 12 as its last, so the 2 steps it ran again
    are counted lost."""
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "lone-kill",
            scaling=ONE_WORKER,
            retries={"in_place": 1},
            faults=[{"kind": "kill", "at_step": 13, "rank": 0}],
            checkpoint={"asynchronous": False},  # step 10's committed before the kill
        )
    )
    result = run_attempt(spec)
    assert result.status == "completed" and result.attempt == 1
    (attempt,) = run_dir_of(spec).read_attempts()
    (restart,) = attempt["restarts"]
    assert restart["resumed_from_step"] == 10
    assert restart["last_step"] == 12
    summary = build_result(spec, run_dir_of(spec), spec.run.storage, "completed")
    assert summary.attempts[0].restarts[0].steps_lost == 2
    assert summary.steps_computed == 39 + 2
    assert_same_tensors(final_state(run_dir_of(spec)), uninterrupted_one_worker["state"])
