"""The built-in loop's streaming data path: the global batches of an epoch stay the same when a
run resumes on another number of workers, and a dataset on a real S3 server streams and
resumes. The model records what each rank trained on (``tests.helpers:recording_mlp``: the
dataset's feature 0 is the row id)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_raw
from tests.recovery import run_dir_of
from trainer_core import storage, stream
from trainer_core.engine import run_attempt
from trainer_core.errors import TrainingCodeError
from trainer_core.spec import RunSpec, build_spec

pytestmark = pytest.mark.integration

ROWS = 420  # 20 global batches of 21: every sample trains once an epoch (none left over)
BATCH = 21  # odd: two workers take slices of 10 and 11, their losses weighted
EPOCHS = 2


def write_dataset(uri: str) -> None:
    """Row ids in feature 0, then 4 features and a regression label; 3 files, uneven row
    groups."""
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
            pq.write_table(table, f, row_group_size=group)


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


def trained(logs: Path) -> list[list[int]]:
    """The global batches an attempt trained, in order: every rank's recorded slices of each
    micro-batch, joined in rank order (rank r's slice is positions r*B//W.. of the batch).
    The records are taken away, so the next attempt's start empty."""
    by_rank: dict[int, list[list[int]]] = {}
    world_size = 0
    for path in sorted(logs.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            by_rank.setdefault(record["rank"], []).append(record["ids"])
            world_size = record["world_size"]
        path.unlink()
    assert sorted(by_rank) == list(range(world_size))
    # A rank that outlived the failing one may have recorded the failed step's forward.
    count = min(len(slices) for slices in by_rank.values())
    return [[i for rank in range(world_size) for i in by_rank[rank][n]] for n in range(count)]


def expected_batches(spec: RunSpec, epochs: int = EPOCHS) -> list[list[int]]:
    """The uninterrupted run's global batches of ``epochs``, as one worker reads them."""
    assert spec.data is not None
    data = spec.data.resolved()
    one = stream.RankStream(stream.scan(data), data, spec.run.seed, 1, 0)
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
            batches = trained(logs)
            assert len(batches) >= fails_at - 1 - resumed
        else:
            result = run_attempt(spec)
            assert result.status == "completed"
            batches = trained(logs)
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
    """The dataset on the moto server (the run directory local): 2 workers fail at step 13,
    the retry resumes from step 10 and trains the same global batches."""
    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    dataset = s3_server.uri(f"tables/elastic-{tmp_path.name}")
    write_dataset(dataset)
    kept, attempts, spec = run_attempts(tmp_path, dataset, [(2, 13), (2, None)])
    assert [a.get("resumed_from_step") for a in attempts] == [0, 10]
    assert_epochs_cover_every_sample_once(kept)
    assert kept == expected_batches(spec)
