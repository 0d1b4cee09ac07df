"""A run that arrives while other work holds the shared cluster's CPUs (another run, on a cluster
that fits only some at once): it waits its turn, within ``scaling.wait_for_resources_s``, and
then trains as it would have alone; past that bound it fails with an error that names the bound,
draws on no retry budget and commits nothing. Ray's own wait for a worker group
(``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s by default) is set to 3 s here: the time Ray
gives a group on a cluster with room, which a busy cluster must not cut short."""

from __future__ import annotations

import time

import pytest
import ray

from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.errors import ClusterBusyError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
#: How long the other work holds every CPU of the shared cluster (4).
HOLD_S = 8.0


@ray.remote(num_cpus=4)
def hold_cluster(seconds: float) -> float:
    """Another run's worth of work: every CPU of the shared cluster, for ``seconds``."""
    time.sleep(seconds)
    return time.time()


def held(seconds: float) -> ray.ObjectRef:
    """Start ``hold_cluster`` and return once it holds the CPUs."""
    ref = hold_cluster.remote(seconds)
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0.0) > 0:
        assert time.time() < deadline, "the holding task did not start"
        time.sleep(0.1)
    return ref


@pytest.fixture
def short_ray_wait(monkeypatch):
    monkeypatch.setenv("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", "3")


def test_a_run_on_a_busy_cluster_waits_its_turn_and_trains_as_alone(
    relaytrain_ray, uninterrupted_one_worker, tmp_path, short_ray_wait
):
    """The tiny spec on 1 worker while the cluster is held for HOLD_S: one attempt, which
    starts training only after the hold ends, and ends at the reference's bits (the oracle:
    the same spec run alone on an idle cluster)."""
    spec = build_spec(tiny_raw(tmp_path, "busy", scaling=ONE_WORKER))
    released = held(HOLD_S)
    events: list[dict] = []
    result = run_attempt(spec, on_event=events.append)
    assert result.status == "completed"
    first_step = min(e["time"] for e in events if e["kind"] == "metrics")
    assert first_step >= ray.get(released)  # it trained only once the hold had ended
    (waited,) = [e for e in events if e["kind"] == "waiting_for_resources"]
    assert waited["short"] == "1 CPU needed, 0 free" and waited["wait_s"] > HOLD_S
    run_dir = run_dir_of(spec)
    assert [a["status"] for a in run_dir.read_attempts()] == ["completed"]
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
    assert losses(run_dir) == uninterrupted_one_worker["losses"]


def test_past_its_wait_a_run_fails_naming_the_bound_and_spends_no_retry(
    relaytrain_ray, tmp_path, short_ray_wait
):
    """Past ``wait_for_resources_s`` (4 s; 0: not at all) the attempt fails with
    ClusterBusyError, on no retry budget, having committed nothing."""
    released = held(60.0)
    try:
        for wait_s, at_least in ((0, 0.0), (4, 4.0)):
            scaling = {**ONE_WORKER, "wait_for_resources_s": wait_s}
            spec = build_spec(tiny_raw(tmp_path, f"too-busy-{wait_s}", scaling=scaling))
            started = time.time()
            with pytest.raises(ClusterBusyError) as raised:
                run_attempt(spec)
            # The bound, not Ray's 3 s, nor the hold.
            assert at_least <= time.time() - started < at_least + 20
            message = str(raised.value)
            assert "1 CPU needed, 0 free" in message
            assert f"scaling.wait_for_resources_s={wait_s}" in message
            assert raised.value.budget == "none"  # Prefect does not retry it
            run_dir = run_dir_of(spec)
            assert run_dir.scan().newest is None  # nothing committed
            assert [a["status"] for a in run_dir.read_attempts()] == ["failed"]
    finally:
        ray.cancel(released, force=True)


@ray.remote(num_cpus=3)
def hold_all_but_one(seconds: float) -> None:
    """Other work on 3 of the shared cluster's 4 CPUs: room for one 1-worker group at a time."""
    time.sleep(seconds)


def test_two_runs_started_at_the_same_instant_take_turns_and_train_as_alone(
    relaytrain_prefect, relaytrain_ray, uninterrupted_one_worker, tmp_path, short_ray_wait
):
    """Two flow processes (``python -m flows.training``, each its own Ray driver, as two flow
    runs of a schedule) started at the same instant on a cluster with room for one of their
    groups: both look, find it free, and ask for it together. Both complete in one attempt
    (no retry, no ClusterBusyError), each at the bits of the run alone, and their training
    never overlaps: one waited in Ray's queue for the other (Ray's own start timeout is 3 s
    here, so a wait cut short there would be a failed attempt)."""
    import os
    import subprocess
    import sys

    import yaml
    from prefect.settings import PREFECT_API_URL

    from tests.recovery import REPO
    from trainer_core.checkpoint.history import read_metrics_history

    holder = hold_all_but_one.remote(600.0)
    deadline = time.time() + 30
    while ray.available_resources().get("CPU", 0.0) > 1:
        assert time.time() < deadline, "the holding task did not start"
        time.sleep(0.1)
    env = {
        **os.environ,
        "PREFECT_API_URL": PREFECT_API_URL.value(),
        "RAY_ADDRESS": ray._private.worker._global_node.address,  # the shared cluster
    }
    try:
        flows, specs = [], []
        for name in ("same-instant-a", "same-instant-b"):
            raw = tiny_raw(tmp_path, name, scaling=ONE_WORKER)
            spec_file = tmp_path / f"{name}.yaml"
            spec_file.write_text(yaml.safe_dump(raw))
            specs.append(build_spec(raw))
            command = [sys.executable, "-m", "flows.training", "--config", str(spec_file)]
            flows.append((command, tmp_path / f"{name}.log"))
        processes = [  # started together: each imports, connects and looks at the cluster
            subprocess.Popen(
                command,
                cwd=REPO,
                env=env,
                stdout=open(log, "w"),  # noqa: SIM115 (the process's)
                stderr=subprocess.STDOUT,
            )
            for command, log in flows
        ]
        codes = [p.wait(timeout=600) for p in processes]
        outputs = [log.read_text() for _, log in flows]
        assert codes == [0, 0], "\n\n".join(outputs)
    finally:
        ray.cancel(holder, force=True)
    windows = []
    for spec in specs:
        run_dir = run_dir_of(spec)
        assert [a["status"] for a in run_dir.read_attempts()] == ["completed"]
        assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
        assert losses(run_dir) == uninterrupted_one_worker["losses"]
        times = [row["time"] for row in read_metrics_history(run_dir)]
        windows.append((min(times), max(times)))
    first, second = sorted(windows)
    assert first[1] <= second[0], windows  # one trained only once the other's group had left
