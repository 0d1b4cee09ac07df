"""The built-in loop's streaming data path: the global batches of an epoch stay the same when a
run resumes on another number of workers, and a dataset on a real S3 server streams and
resumes. The model records what each rank trained on (``tests.helpers:recording_mlp``: the
dataset's feature 0 is the row id)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tiny_raw
from tests.recovery import (
    recorded_batches,
    run_dir_of,
)
from tests.streaming_data import (
    BATCH,
    EPOCHS,
    assert_epochs_cover_every_sample_once,
    expected_batches,
    write_dataset,
)
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec

pytestmark = pytest.mark.integration


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
