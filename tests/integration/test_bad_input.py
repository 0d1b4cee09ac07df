"""A catalog of bad inputs: each is refused with a message naming the field and the fix, before
any train attempt (no retry burned), and without touching an existing run directory.

Every case breaks one thing in the tiny spec (``tests.conftest.tiny_raw``) or in a command line.
Where it is refused:
- ``spec``: the spec cannot be built. Checked through ``build_spec`` and the CLI (exit code 2);
  the cases marked ``flow`` also through the ``training`` flow given the raw dict (Prefect
  refuses the parameter before any task).
- ``setup``: the spec builds, and the checks of the flow's setup task refuse it with a SpecError
  (``tasks.setup.refuse_bad_input``, called directly); the cases marked ``flow`` run the whole
  ``training`` flow, whose setup task refuses it, and no ``train`` task run exists.
- ``serve``: ``python -m deployments.serve`` refuses the option before serving anything.
The wall time of each rejection is appended to ``runs/bad-input.jsonl`` (not asserted).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from deployments.serve import main as serve_main
from flows.training import main as cli_main
from flows.training import training
from tasks.setup import refuse_bad_input
from tests.bad_inputs import CASES, EXISTING, REQUIRED, Case, World
from tests.conftest import ONE_WORKER, tiny_raw
from tests.prefect_api import task_runs
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError, TrainingCodeError
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
TIMINGS = REPO / "runs" / "bad-input.jsonl"


# -- the run every case must leave alone ---------------------------------------------------------


def snapshot(root: Path) -> dict[str, str]:
    """Every directory and file below ``root``: path -> sha256 (or "dir")."""
    found: dict[str, str] = {}
    for path in sorted(root.rglob("*")):
        relative = str(path.relative_to(root))
        found[relative] = "dir" if path.is_dir() else hashlib.sha256(path.read_bytes()).hexdigest()
    return found


@pytest.fixture(scope="module")
def world(relaytrain_ray, relaytrain_prefect, tmp_path_factory) -> World:
    root = tmp_path_factory.mktemp("bad-input")
    state = training(
        build_spec(tiny_raw(root / "runs", EXISTING, scaling=ONE_WORKER)), return_state=True
    )
    assert state.is_completed(), state
    rows = 64
    rng = np.random.default_rng(0)
    table = pa.table(
        {
            "x": pa.array(list(rng.standard_normal((rows, 6)).astype(np.float32))),
            "y": pa.array(rng.standard_normal(rows).astype(np.float32)),
            "cls": pa.array(rng.integers(0, 3, rows)),
            "name": pa.array([f"row-{i}" for i in range(rows)]),
        }
    )
    pq.write_table(table, root / "table.parquet")
    (root / "table.data").write_text("x,y\n0.5,1.0\n")  # CSV under a name that hides it
    return World(root / "runs", root / "table.parquet")


def assert_names(case: Case, message: str) -> None:
    assert case.field in message, f"{case.id}: {case.field!r} not in {message!r}"
    assert case.fix.lower() in message.lower(), f"{case.id}: {case.fix!r} not in {message!r}"


def timed(call: Callable[[], Any]) -> tuple[Any, float]:
    started = time.perf_counter()
    value = call()
    return value, time.perf_counter() - started


def record(case: Case, seconds: dict[str, float]) -> None:
    TIMINGS.parent.mkdir(exist_ok=True)
    line = {
        "case": case.id,
        "field": case.field,
        "stage": case.stage,
        "seconds": round(max(seconds.values()), 3),
        "paths": {k: round(v, 3) for k, v in seconds.items()},
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    with TIMINGS.open("a") as f:
        f.write(json.dumps(line) + "\n")


def test_the_catalog_has_the_cases_the_issue_names():
    ids = [c.id for c in CASES]
    assert len(ids) >= 25 and len(set(ids)) == len(ids)
    assert set(ids) >= REQUIRED, REQUIRED - set(ids)
    # each stage that the flow reports is tried through it, more than once
    for stage in ("spec", "setup"):
        assert sum(c.flow for c in CASES if c.stage == stage) >= 3, stage


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_up_front(case: Case, world: World, tmp_path, capsys):
    seconds: dict[str, float] = {}
    if case.stage == "serve":
        started = time.perf_counter()
        with pytest.raises(SystemExit) as exit_info:
            serve_main(list(case.argv))
        seconds["serve"] = time.perf_counter() - started
        assert exit_info.value.code == 2
        assert_names(case, capsys.readouterr().err)
        record(case, seconds)
        return
    raw = case.raw(world)
    before = snapshot(world.storage)
    if case.stage == "spec":
        started = time.perf_counter()
        with pytest.raises(SpecError) as error:
            _build(raw, case)
        seconds["build_spec"] = time.perf_counter() - started
        assert error.value.field, "a SpecError names its field"
        assert_names(case, str(error.value))
        spec_file = tmp_path / "spec.yaml"
        spec_file.write_text(yaml.safe_dump(raw))
        argv = ["--config", str(spec_file)]
        argv += [a for o in case.overrides for a in ("--set", o)]
        argv += ["--run-name", case.run_name] if case.run_name is not None else []
        code, seconds["cli"] = timed(lambda: cli_main(argv))
        assert code == 2
        assert_names(case, capsys.readouterr().err)
        if case.flow:  # the flow given the raw parameter
            assert not case.overrides and case.run_name is None
            state, seconds["flow"] = timed(lambda: training(raw, return_state=True))
            assert state.is_failed()
            assert task_runs(state.state_details.flow_run_id) == {}
            assert_names(case, str(state.result(raise_on_failure=False)))
    else:
        spec = build_spec(raw)
        started = time.perf_counter()
        with pytest.raises(SpecError) as refused:
            refuse_bad_input(spec)
        seconds["setup"] = time.perf_counter() - started
        assert refused.value.field, "a SpecError names its field"
        assert_names(case, str(refused.value))
        if case.flow:
            state, seconds["flow"] = timed(lambda: training(spec, return_state=True))
            assert state.is_failed()
            error = state.result(raise_on_failure=False)
            assert isinstance(error, SpecError), repr(error)
            assert error.field, "a SpecError names its field"
            assert_names(case, str(error))
            assert set(task_runs(state.state_details.flow_run_id)) == {"setup"}  # no train run
    assert snapshot(world.storage) == before
    record(case, seconds)


def _build(raw: dict[str, Any], case: Case) -> Any:
    spec = build_spec(raw, case.overrides)
    return spec.with_run_name(case.run_name) if case.run_name is not None else spec


def test_existing_run_still_reads_as_complete(world: World):
    """After the whole catalog the existing run still reads as a completed, committed run."""
    run_dir = RunDirectory(storage.resolve(str(world.storage)).child(EXISTING))
    assert run_dir.read_run_record() is not None
    newest = run_dir.scan().newest
    assert newest is not None and newest.step == 39
    assert not run_dir.lease_file.exists()


# -- NaN loss: a training error that stops at once ---------------------------------------------


@pytest.mark.parametrize(
    ("case_id", "model", "step", "committed"),
    [
        # The loss itself becomes NaN at step 25.
        ("nan-loss", {"name": "tests.bad_workloads:nan_after", "nan_at_step": 25}, 25, [13, 20]),
        # Step 20's loss is finite, its update is not: checkpoint 20 must not be committed.
        (
            "nan-weights-at-a-checkpoint",
            {"name": "tests.bad_workloads:nan_gradient_at", "nan_gradient_at_step": 20},
            20,
            [10, 13],
        ),
    ],
    ids=["nan-loss", "nan-weights-at-a-checkpoint"],
)
def test_non_finite_training_stops_at_once_and_keeps_good_checkpoints(
    relaytrain_ray, relaytrain_prefect, tmp_path, case_id, model, step, committed
):
    kwargs = {k: v for k, v in model.items() if k != "name"}
    model_section = {"name": model["name"], "kwargs": {"hidden": [16], **kwargs}}
    spec = build_spec(tiny_raw(tmp_path, case_id, model=model_section, scaling=ONE_WORKER))
    state, seconds = timed(lambda: training(spec, return_state=True))
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, TrainingCodeError) and error.deterministic, repr(error)
    assert error.step == step and f"step {step}" in str(error)
    assert "optimizer.lr" in str(error) and "model" in str(error)
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 1  # no retry
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child(case_id))
    assert [c.step for c in run_dir.scan().committed] == committed
    assert run_dir.scan().uncommitted == []
    attempts = run_dir.read_attempts()
    assert len(attempts) == 1 and "will repeat" in attempts[0]["retry_decision"]
    record(Case(case_id, "optimizer.lr", "lower optimizer.lr", "train"), {"flow": seconds})
