"""The built-in loop's streaming data path: the global batches of an epoch stay the same when a
run resumes on another number of workers, and a dataset on a real S3 server streams and
resumes. The model records what each rank trained on (``tests.helpers:recording_mlp``: the
dataset's feature 0 is the row id)."""

from __future__ import annotations

import json
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
    recorded_batches,
    run_dir_of,
)
from trainer_core import storage
from trainer_core.data import footers, rank_stream
from trainer_core.errors import DataFileDamagedError, SpecError, TrainingCodeError
from trainer_core.run import preflight
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec

pytestmark = pytest.mark.integration

ROWS = 420  # 20 global batches of 21: every sample trains once an epoch (none left over)
BATCH = 21  # odd: two workers take slices of 10 and 11, their losses weighted
EPOCHS = 2
REPO = Path(__file__).resolve().parents[2]


def write_dataset(uri: str, page_checksums: bool = False) -> None:
    """Row ids in feature 0, then 4 features and a regression label; 3 files, uneven row
    groups (with each page's CRC32, as Spark writes them, when ``page_checksums``)."""
    location = storage.resolve(uri)
    location.filesystem.create_dir(location.path, recursive=True)
    rng = np.random.default_rng(0)
    for index, (first, last, group) in enumerate([(0, 150, 40), (150, 300, 64), (300, 420, 50)]):
        ids = np.arange(first, last)
        features = np.concatenate(
            [ids[:, None], rng.standard_normal((len(ids), 4))], axis=1
        ).astype(np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 5),
                "y": pa.array(features[:, 1] - features[:, 2], pa.float32()),
            }
        )
        with location.filesystem.open_output_stream(f"{location.path}/part-{index}.parquet") as f:
            pq.write_table(table, f, row_group_size=group, write_page_checksum=page_checksums)


def spec_for(tmp_path: Path, dataset: str, logs: Path, workers: int, faults: list) -> RunSpec:
    raw = tiny_raw(
        tmp_path / "runs",
        "elastic",
        model={"name": "tests.helpers:recording_mlp", "kwargs": {"log_dir": str(logs)}},
        data={
            "dataset": dataset,
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": BATCH,
            "validation_fraction": 0,
            "partitions": 4,
            "shuffle_window": 64,
        },
        schedule={"epochs": EPOCHS, "lr_schedule": "constant", "warmup_steps": 0},
        checkpoint={"every": 5, "keep_last": 2, "keep_best": 0, "best_metric": "loss"},
        faults=faults,
    )
    return build_spec(raw, [f"scaling.num_workers={workers}"])


def expected_batches(spec: RunSpec, epochs: int = EPOCHS) -> list[list[int]]:
    """The uninterrupted run's global batches of ``epochs``, as one worker reads them."""
    assert spec.data is not None
    data = spec.data.resolved()
    one = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    batches: list[list[int]] = []
    for epoch in range(epochs):
        ahead = one.epoch(epoch)
        batches += [ids.tolist() for _, ids, _ in ahead]
        ahead.close()
    return batches


def run_attempts(
    tmp_path: Path, dataset: str, plan: list[tuple[int, int | None]]
) -> tuple[list[list[int]], list[dict[str, Any]], RunSpec]:
    """Attempts on ``plan``'s worker counts, each but the last failing at its step; returns
    the global batches the run kept (an attempt's steps after the checkpoint the next one
    resumed from were trained again), the attempt records and the last spec."""
    logs = tmp_path / "logs"
    logs.mkdir()
    faults = [
        {"kind": "raise", "at_step": at, "attempt": n + 1}
        for n, (_, at) in enumerate(plan)
        if at is not None
    ]
    kept: list[list[int]] = []
    resumed = 0
    spec = None
    for workers, fails_at in plan:
        spec = spec_for(tmp_path, dataset, logs, workers, faults)
        if fails_at is not None:
            with pytest.raises(TrainingCodeError):
                run_attempt(spec)
            batches = recorded_batches(logs, "ids")
            assert len(batches) >= fails_at - 1 - resumed
        else:
            result = run_attempt(spec)
            assert result.status == "completed"
            batches = recorded_batches(logs, "ids")
        kept = kept[:resumed] + batches
        resumed = run_dir_of(spec).scan().newest.step if fails_at is not None else resumed
    assert spec is not None
    return kept, run_dir_of(spec).read_attempts(), spec


def assert_epochs_cover_every_sample_once(batches: list[list[int]], epochs: int = EPOCHS) -> None:
    per_epoch = ROWS // BATCH
    assert len(batches) == epochs * per_epoch
    for epoch in range(epochs):
        ids = [i for batch in batches[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch]
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}"
        assert ids != sorted(ids)  # shuffled


def test_global_batches_survive_two_workers_then_one_then_two(ray_cluster, tmp_path):
    """2 workers fail at step 8 (resume from 5), 1 worker goes on across the epoch boundary
    and fails at step 27 (resume from 25), 2 workers finish: every epoch trains every sample
    exactly once, in the uninterrupted run's global batches."""
    dataset = str(tmp_path / "table")
    write_dataset(dataset)
    kept, attempts, spec = run_attempts(tmp_path, dataset, [(2, 8), (1, 27), (2, None)])
    assert [a.get("world_size") for a in attempts] == [2, 1, 2]
    assert all(a.get("peak_worker_rss_mb", 0) > 0 for a in attempts)
    assert [a.get("resumed_from_step") for a in attempts][1:] == [5, 25]
    assert_epochs_cover_every_sample_once(kept)
    assert kept == expected_batches(spec)


def test_a_dataset_on_s3_streams_and_resumes(ray_cluster, tmp_path, s3_server, monkeypatch):
    """The dataset on the moto server (the run directory local): 1 worker fails at step 13,
    the retry resumes from step 10 and trains the same global batches (which do not depend on
    the worker count: the test above)."""
    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    dataset = s3_server.uri(f"tables/elastic-{tmp_path.name}")
    write_dataset(dataset)
    kept, attempts, spec = run_attempts(tmp_path, dataset, [(1, 13), (1, None)])
    assert [a.get("resumed_from_step") for a in attempts] == [0, 10]
    assert_epochs_cover_every_sample_once(kept)
    assert kept == expected_batches(spec)


# -- a run reads a pinned snapshot of its dataset --------------------------------------------


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


# -- a worker's memory follows data.memory_mb, not the row groups -------------------------------

WIDE = 256  # float32 features: 1 KB a row, as in the 1.2 GB dataset
MEMORY_MB = 128


def _write_wide(
    directory: Path, rows_per_file: int, files: int, row_group_size: int | None
) -> None:
    """``files`` Parquet files of 256 float32 features and a class label, written as pyarrow
    writes them by default (row_group_size None: one row group of the whole file) or in
    row groups of ``row_group_size``."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(files):
        features = rng.standard_normal((rows_per_file, WIDE), dtype=np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), WIDE),
                "y": pa.array(rng.integers(0, 10, rows_per_file)),
            }
        )
        pq.write_table(table, directory / f"part-{index}.parquet", row_group_size=row_group_size)


def _peak_rss_mb(tmp_path: Path, dataset: Path, name: str) -> float:
    """The largest peak resident memory of any worker of a one-epoch run over ``dataset``."""
    raw = tiny_raw(
        tmp_path / "runs",
        name,
        model={"name": "mlp", "kwargs": {"hidden": [16]}},
        data={
            "dataset": str(dataset),
            "features": "x",
            "label": "y",
            "task": "classification",
            "batch_size": 2048,
            "validation_fraction": 0.1,
            "partitions": 2,
            "shuffle_window": 4096,
            "memory_mb": MEMORY_MB,
        },
        schedule={"epochs": 1, "lr_schedule": "constant", "warmup_steps": 0},
        checkpoint={"every": 1000},
        scaling=ONE_WORKER,  # the bound is each rank's: one rank reads every partition
    )
    result = run_attempt(build_spec(raw))
    assert result.status == "completed"
    (attempt,) = run_dir_of(build_spec(raw)).read_attempts()
    return float(attempt["peak_worker_rss_mb"])


@pytest.fixture(scope="module")
def idle_worker_rss_mb(ray_cluster, tmp_path_factory) -> float:
    """A training worker's peak over data it hardly holds (one small row group a file)."""
    tmp_path = tmp_path_factory.mktemp("idle")
    _write_wide(tmp_path / "table", 2048, 2, None)
    return _peak_rss_mb(tmp_path, tmp_path / "table", "idle")


@pytest.mark.parametrize("row_group_size", [None, 4096], ids=["pyarrow-default", "small"])
def test_a_worker_holds_at_most_data_memory_mb_whatever_the_row_groups(
    idle_worker_rss_mb, tmp_path, row_group_size
):
    """192 MB in two files; pyarrow's default writes each as one 96 MB row group. A worker's
    peak resident memory above an idle training worker's stays within data.memory_mb (128)."""
    _write_wide(tmp_path / "table", 96 * 1024, 2, row_group_size)
    peak = _peak_rss_mb(tmp_path, tmp_path / "table", "wide")
    assert peak - idle_worker_rss_mb <= MEMORY_MB, (peak, idle_worker_rss_mb)


IMAGE_BYTES = 100_000  # an encoded image a row


def _write_images(directory: Path, rows_per_file: int, files: int, row_group_size: int) -> None:
    """``files`` Parquet files of ``rows_per_file`` rows: 100 KB of random bytes (encoded images
    do not compress either) and the row's number, in row groups of ``row_group_size``."""
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for index in range(files):
        first = index * rows_per_file
        raw = [rng.bytes(IMAGE_BYTES) for _ in range(rows_per_file)]
        table = pa.table(
            {
                "raw": pa.array(raw, pa.binary()),
                "n": pa.array(np.arange(first, first + rows_per_file, dtype=np.int64)),
            }
        )
        pq.write_table(table, directory / f"part-{index}.parquet", row_group_size=row_group_size)


def _image_spec(tmp_path: Path, memory_mb: int) -> RunSpec:
    """The built-in loop over ``tmp_path / "images"`` at ``data.memory_mb``: 2 partitions and a
    window of 32 rows, one worker reading both."""
    raw = {
        "run": {"name": "images", "storage": str(tmp_path / "runs")},
        "model": {"name": "tests.columns_workloads:tiny_lm"},
        "data": {
            "dataset": str(tmp_path / "images"),
            "columns": ["raw", "n"],
            "transform": "tests.columns_workloads:image_header",
            "task": "causal_lm",
            "batch_size": 8,
            "validation_fraction": 0.0,
            "partitions": 2,
            "shuffle_window": 32,
            "memory_mb": memory_mb,
        },
        "schedule": {"epochs": 1},
        "checkpoint": {"best_metric": "loss"},
        "scaling": ONE_WORKER,
    }
    return build_spec(raw)


def _reader_held_mb(spec: RunSpec) -> float:
    """What a fresh process reading one epoch of ``spec``'s data as a worker's rank stream does
    holds at its peak above its peak before the first read (VmHWM, MB)."""
    assert spec.data is not None
    done = subprocess.run(
        [sys.executable, "-m", "tests.reader_memory", spec.data.model_dump_json()],
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    measured = json.loads(done.stdout.strip().splitlines()[-1])
    assert measured["rows"] == 3 * 640, measured  # every row read once
    return float(measured["peak_mb"] - measured["idle_mb"])


def test_a_reader_of_100_kb_rows_holds_the_data_memory_mb_setup_accepts(tmp_path):
    """Encoded images of 100 KB a row: 183 MB in three files of 640 rows, in row groups of 32
    rows (more than any budget here: a reader that held it whole would break it). At
    data.memory_mb 128 setup refuses the spec, naming data.memory_mb and the figure it would
    take, and writes nothing. At that figure setup accepts it, and a fresh process reading one
    epoch as a worker's rank stream does holds at most that much above its peak before the
    first read, in each of two runs: the oracle is the peak measured (VmHWM), not what setup
    reckons. (Before the reader returned decoding's freed memory at once and setup counted the
    decoding of whole row groups, setup accepted 128 and the reader held 118-158 MB.)"""
    from trainer_core.run.preflight import validate_workload

    _write_images(tmp_path / "images", rows_per_file=640, files=3, row_group_size=32)
    with pytest.raises(SpecError) as refused:
        validate_workload(_image_spec(tmp_path, MEMORY_MB))
    assert refused.value.field == "data.memory_mb"
    message = str(refused.value)
    assert f"more than data.memory_mb ({MEMORY_MB})" in message, message
    needed = int(message.split("raise data.memory_mb to at least ")[1].split(",")[0])
    assert needed > MEMORY_MB, message
    assert not (tmp_path / "runs").exists()  # refused before anything was written

    spec = _image_spec(tmp_path, needed)
    assert validate_workload(spec) == 3 * 640 // 8  # accepted: the epoch's steps
    held = [_reader_held_mb(spec) for _ in range(2)]
    assert max(held) <= needed, (held, needed)
