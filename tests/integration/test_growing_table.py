"""A run reads a pinned snapshot of its dataset (docs/data.md), through the flow: what lands in
the table between attempts (a Parquet file, what writers leave half-done, another schema, a
text file) is counted and never read, and the run ends bit-identical to an uninterrupted run
over the original files; a file rewritten or damaged is refused, naming it; a relative dataset
rerun from another directory is refused, naming both places."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.prefect_api import logs as flow_logs
from tests.prefect_api import task_runs
from tests.recovery import (
    assert_same_tensors,
    final_state,
    losses,
    record_matrix_row,
    run_dir_of,
)
from tests.streaming_data import BATCH, EPOCHS, REPO, write_dataset
from trainer_core.errors import DataFileDamagedError, SpecError, TrainingCodeError
from trainer_core.run import preflight
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec

pytestmark = pytest.mark.integration


def _write_file(directory: Path, name: str, seed: int, rows: int = 100) -> None:
    """One more Parquet file of the dataset's schema (row ids from 1000 on, so a row of it
    trained would show in the weights)."""
    rng = np.random.default_rng(seed)
    ids = np.arange(1000, 1000 + rows)
    features = np.concatenate([ids[:, None], rng.standard_normal((rows, 4))], axis=1)
    features = features.astype(np.float32)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 5),
            "y": pa.array(features[:, 1] + features[:, 2], pa.float32()),
        }
    )
    pq.write_table(table, directory / name, row_group_size=50)


def _snapshot_spec(tmp_path: Path, dataset: Path, name: str, faults: list) -> RunSpec:
    """A flow run over the directory dataset: validation rows too (chosen by row id), and a
    Prefect retry delay in which the test changes the dataset."""
    raw = tiny_raw(
        tmp_path / "runs",
        name,
        data={
            "dataset": str(dataset),
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": BATCH,
            "validation_fraction": 0.2,
        },
        schedule={"epochs": EPOCHS, "lr_schedule": "cosine", "warmup_steps": 3},
        checkpoint={"every": 5},
        retries={"delay_s": 4, "in_place": 0},
        faults=faults,
        scaling=ONE_WORKER,
    )
    return build_spec(raw)


def _between_attempts(spec: RunSpec, change: Any) -> Any:
    """Run the flow; once its first attempt has failed, ``change()`` the dataset (the retry
    waits ``retries.delay_s``); the flow's final state. Bounded by the flow's own work: it
    ends, completed or not, within its retry budget."""
    box: dict = {}
    thread = threading.Thread(target=lambda: box.update(state=training(spec, return_state=True)))
    thread.start()
    run_dir = run_dir_of(spec)
    while not any(a.get("status") == "failed" for a in run_dir.read_attempts()):
        assert thread.is_alive(), "the flow ended before its first attempt failed"
        time.sleep(0.05)
    change()
    thread.join()
    return box["state"]


@pytest.fixture(scope="module")
def snapshot_reference(ray_cluster, tmp_path_factory) -> dict[str, Any]:
    """An uninterrupted run of ``_snapshot_spec`` over ``write_dataset``'s files."""
    root = tmp_path_factory.mktemp("snapshot-reference")
    write_dataset(str(root / "table"))
    spec = _snapshot_spec(root, root / "table", "reference", [])
    result = run_attempt(spec)
    assert result.status == "completed"
    run_dir = run_dir_of(spec)
    return {"result": result, "state": final_state(run_dir), "losses": losses(run_dir)}


def test_a_file_added_between_attempts_is_ignored(relaytrain_prefect, snapshot_reference, tmp_path):
    """The run pins its dataset at the first attempt: a Parquet file that lands before the
    retry is not read, and the run ends bit-identical to an uninterrupted run over the
    original files. A new run over the same directory pins the new file too."""
    dataset = tmp_path / "table"
    write_dataset(str(dataset))
    reference = snapshot_reference["result"]
    spec = _snapshot_spec(tmp_path, dataset, "grown", [{"kind": "raise", "at_step": 8}])
    state = _between_attempts(spec, lambda: _write_file(dataset, "part-3.parquet", seed=1))
    assert state.is_completed(), state
    run_dir = run_dir_of(spec)
    assert [a["status"] for a in run_dir.read_attempts()] == ["failed", "completed"]
    assert_same_tensors(final_state(run_dir), snapshot_reference["state"])
    assert losses(run_dir) == snapshot_reference["losses"]
    pinned = run_dir.read_dataset_snapshot()
    assert [Path(f["path"]).name for f in pinned["files"]] == [
        f"part-{i}.parquet" for i in (0, 1, 2)
    ]
    # A new run pins the directory as it is now, the new file with it: more rows, so more steps
    # (the plan its first attempt would train).
    fresh = _snapshot_spec(tmp_path, dataset, "fresh", [])
    now = preflight.pin_dataset(fresh, run_dir_of(fresh))
    assert now is not None and now.record is not None
    assert "part-3.parquet" in {Path(f["path"]).name for f in now.record["files"]}
    assert preflight.validate_workload(fresh, now) > reference.steps_completed


def _land_what_writers_leave(dataset: Path, scratch: Path) -> list[str]:
    """What lands in a table that other jobs write while the run waits for its retry: a
    Parquet file still being written (a valid file cut in half), a Parquet file of another
    schema, and a text file. Returns their names."""
    scratch.mkdir()
    _write_file(scratch, "whole.parquet", seed=3)
    whole = (scratch / "whole.parquet").read_bytes()
    (dataset / "part-3.parquet").write_bytes(whole[: len(whole) // 2])
    pq.write_table(
        pa.table({"user": pa.array(["a", "b", "c"]), "clicks": pa.array([1, 2, 3])}),
        dataset / "part-4.parquet",
    )
    (dataset / "README.txt").write_text("clicks by user, one file per hour\n")
    return ["part-3.parquet", "part-4.parquet", "README.txt"]


def test_what_writers_leave_between_attempts_is_counted_not_read(
    relaytrain_prefect, snapshot_reference, tmp_path
):
    """A half-written Parquet file, one of another schema and a text file land in the table
    before the retry: none is read (nor is its footer), the retry trains on the snapshot and
    the run ends bit-identical to an uninterrupted run over the original files; the train
    task's log names the three as added and ignored."""
    dataset = tmp_path / "table"
    write_dataset(str(dataset))
    spec = _snapshot_spec(tmp_path, dataset, "leftovers", [{"kind": "raise", "at_step": 8}])
    landed: list[str] = []
    state = _between_attempts(
        spec, lambda: landed.extend(_land_what_writers_leave(dataset, tmp_path / "scratch"))
    )
    assert state.is_completed(), state
    run_dir = run_dir_of(spec)
    assert [a["status"] for a in run_dir.read_attempts()] == ["failed", "completed"]
    assert_same_tensors(final_state(run_dir), snapshot_reference["state"])
    assert losses(run_dir) == snapshot_reference["losses"]
    lines = flow_logs(state.state_details.flow_run_id)
    said = [line for line in lines if "3 file(s) added" in line]
    assert said and all(name in said[0] for name in landed), said


def test_a_relative_dataset_rerun_from_another_directory_is_refused(
    relaytrain_prefect, relaytrain_ray, tmp_path, monkeypatch
):
    """``data.dataset: table`` (relative) trained from one working directory and failed; the
    same command run again (same run.name and storage) from another directory that holds
    another ``table``: setup refuses it with a SpecError naming both places, before any
    attempt, and the run directory is left as it was."""
    first, other = tmp_path / "checkout-a", tmp_path / "checkout-b"
    write_dataset(str(first / "table"))
    write_dataset(str(other / "table"))
    _write_file(other / "table", "part-1.parquet", seed=2, rows=150)  # another copy
    raw = tiny_raw(
        tmp_path / "runs",
        "moved",
        data={
            "dataset": "table",
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": BATCH,
            "validation_fraction": 0,
        },
        schedule={"epochs": 1, "lr_schedule": "constant", "warmup_steps": 0},
        checkpoint={"every": 5, "keep_best": 0, "best_metric": "loss"},
        faults=[{"kind": "raise", "at_step": 8}],
        retries={"code": 0, "delay_s": 0},
        scaling=ONE_WORKER,
    )
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    monkeypatch.chdir(first)
    state = training(build_spec(raw), return_state=True)
    assert state.is_failed() and isinstance(state.result(raise_on_failure=False), TrainingCodeError)
    monkeypatch.undo()
    run_dir = run_dir_of(build_spec(raw))
    before = {c.step: c.manifest for c in run_dir.scan().committed}
    assert before and len(run_dir.read_attempts()) == 1

    from prefect.settings import PREFECT_API_URL

    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "PREFECT_API_URL": str(PREFECT_API_URL.value()),
        "RAY_ADDRESS": relaytrain_ray.get_runtime_context().gcs_address,
    }
    command = [sys.executable, "-m", "flows.training", "--config", str(spec_file)]
    rerun = subprocess.run(
        command, cwd=other, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    output = rerun.stdout + rerun.stderr
    assert rerun.returncode == 2, output
    assert "SpecError" in output and "data.dataset" in output, output
    assert str(first / "table") in output and str(other / "table") in output, output
    assert len(run_dir.read_attempts()) == 1  # no attempt, no retry spent
    assert {c.step: c.manifest for c in run_dir.scan().committed} == before


def test_a_file_rewritten_between_attempts_is_refused(relaytrain_prefect, ray_cluster, tmp_path):
    """A file of the snapshot rewritten before the retry: the retry fails with a SpecError that
    names the file and the fix, is not retried again, and leaves every checkpoint as it was."""
    dataset = tmp_path / "table"
    write_dataset(str(dataset))
    spec = _snapshot_spec(tmp_path, dataset, "rewritten", [{"kind": "raise", "at_step": 8}])
    run_dir = run_dir_of(spec)
    before: dict = {}

    def rewrite() -> None:
        before.update({c.step: c.manifest for c in run_dir.scan().committed})
        _write_file(dataset, "part-1.parquet", seed=2, rows=150)

    state = _between_attempts(spec, rewrite)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, SpecError), repr(error)
    assert "part-1.parquet" in str(error) and "run.name" in str(error)
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 2  # no 3rd
    assert {c.step: c.manifest for c in run_dir.scan().committed} == before


def test_a_damaged_page_fails_once_then_resumes_when_restored(
    relaytrain_prefect, snapshot_reference, tmp_path
):
    """A byte flipped in a data page of a checksummed file between attempts (same size and
    footer: the snapshot still matches). The retry stops at the page's checksum with an error
    naming the file and row group, spends no more retries and leaves the checkpoints as they
    were; with the file restored, the run resumes and ends bit-identical to the
    uninterrupted run."""
    dataset = tmp_path / "table"
    write_dataset(str(dataset), page_checksums=True)
    victim = dataset / "part-1.parquet"
    original = victim.read_bytes()
    spec = _snapshot_spec(tmp_path, dataset, "damaged", [{"kind": "raise", "at_step": 8}])
    run_dir = run_dir_of(spec)
    before: dict = {}

    def damage() -> None:
        before.update({c.step: c.manifest for c in run_dir.scan().committed})
        chunk = pq.ParquetFile(victim).metadata.row_group(1).column(0)
        data = bytearray(original)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        data[start + chunk.total_compressed_size // 2] ^= 0x5A
        victim.write_bytes(bytes(data))

    state = _between_attempts(spec, damage)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, DataFileDamagedError), repr(error)
    assert "part-1.parquet" in str(error) and "row group 1" in str(error)
    assert task_runs(state.state_details.flow_run_id)["train"].run_count == 2  # no 3rd
    assert {c.step: c.manifest for c in run_dir.scan().committed} == before
    victim.write_bytes(original)
    rerun = training(spec, return_state=True)
    assert rerun.is_completed(), rerun
    assert [a["status"] for a in run_dir.read_attempts()] == ["failed", "failed", "completed"]
    assert_same_tensors(final_state(run_dir), snapshot_reference["state"])
    assert losses(run_dir) == snapshot_reference["losses"]
    record_matrix_row("10 a data page damaged (checksum), then restored", run_dir)
