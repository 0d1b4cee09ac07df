"""Scheduled retraining: dated data, warm start, same-holdout comparison, champion registry."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flows.pytest_plugin import tiny_spec_dict
from flows.retraining import retraining
from tests.conftest import ONE_WORKER
from trainer_core import storage
from trainer_core.checkpoint.registry import Registry
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data.arrays import synthetic_arrays
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


def write_day(folder, date: str, shift: float) -> None:
    arrays = synthetic_arrays(384, 6, 0.1)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(arrays.features.ravel()), 6),
            "y": pa.array(arrays.labels + shift),
        }
    )
    pq.write_table(table, folder / f"{date}.parquet")


def test_nightly_slots_warm_start_compare_and_promote(relaytrain_ray, relaytrain_prefect, tmp_path):
    """Night 1 fails in training (no retries), promotes nothing, and re-run (the README: same
    slot) resumes that night's run and promotes it; night 2 warm-starts from it, is compared on
    the same holdout and kept out by the margin; night 2 re-run trains nothing."""
    lake = tmp_path / "lake"
    lake.mkdir()
    write_day(lake, "2026-01-01", 0.0)
    write_day(lake, "2026-01-02", 0.05)
    raw = tiny_spec_dict(
        tmp_path / "runs",
        None,
        data={
            "dataset": str(lake / "{date}.parquet"),
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": 16,
        },
        retries={"infrastructure": 0, "code": 0},
        scaling=ONE_WORKER,
    )
    del raw["data"]["synthetic"]
    raw["run"].pop("name")
    spec = build_spec(raw)
    flaky = build_spec({**raw, "faults": [{"kind": "raise", "at_step": 17, "attempt": 1}]})
    night = datetime(2026, 1, 1, 2, tzinfo=UTC)
    failed = retraining(flaky, model_name="nightly-mlp", slot=night, return_state=True)
    assert failed.is_failed()
    runs = storage.resolve(str(tmp_path / "runs"))
    registry = Registry(runs, "nightly-mlp")
    assert registry.champion() is None  # a failed night promotes nothing
    committed = RunDirectory(runs.child("nightly-mlp-20260101-0200")).scan().newest.step
    first = retraining(flaky, model_name="nightly-mlp", slot=night)
    assert first.training.run_name == "nightly-mlp-20260101-0200"  # that night's run again
    failure, resumed = first.training.attempts
    assert (failure.status, failure.error_class) == ("failed", "TrainingCodeError")
    assert resumed.status == "completed" and resumed.resumed_from_step == committed < 17
    assert first.warm_started_from is None and first.comparison.promoted
    champion = registry.champion()
    assert champion.run_name == "nightly-mlp-20260101-0200"
    second = retraining(
        spec, model_name="nightly-mlp", promote_margin=1e9, slot=datetime(2026, 1, 2, 2, tzinfo=UTC)
    )
    assert second.warm_started_from == champion.checkpoint_uri
    assert not second.comparison.promoted and "not better" in second.comparison.reason
    assert set(second.comparison.challenger_metrics) == {"val_loss"}
    assert set(second.comparison.champion_metrics) == {"val_loss"}
    assert registry.champion() == champion and len(registry.history()) == 1
    again = retraining(
        spec, model_name="nightly-mlp", promote_margin=1e9, slot=datetime(2026, 1, 2, 2, tzinfo=UTC)
    )
    assert again.training.attempts == second.training.attempts  # the slot did not train twice
