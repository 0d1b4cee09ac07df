"""A worker's memory follows data.memory_mb, not the files' row groups: measured (VmHWM) on
1 KB rows in row groups far larger than the budget, and on 100 KB binary rows (encoded
images), against the figure setup accepts or refuses."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import (
    run_dir_of,
)
from tests.streaming_data import REPO
from trainer_core.errors import SpecError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec

pytestmark = pytest.mark.integration


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
