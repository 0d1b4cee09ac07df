"""The rows retraining compares a challenger and its champion on (``evaluate.holdout``): the
rows the training loop holds out for validation, no more, no fewer. Checked on a dataset whose
features name their row, against what the loop's own stream trains and validates on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import tiny_raw
from trainer_core.data import footers, rank_stream
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import evaluate

NUM_ROWS = 400


def spec_on_rows(tmp_path: Path, validation_fraction: float, num_rows: int = NUM_ROWS) -> RunSpec:
    """A spec on a file of ``num_rows`` rows whose features are (row id, -row id)."""
    ids = np.arange(num_rows)
    path = tmp_path / "rows.parquet"
    features = list(np.stack([ids, -ids], axis=1).astype(np.float32))
    pq.write_table(pa.table({"x": features, "y": ids % 3}), path, row_group_size=50)
    data = {
        "dataset": str(path),
        "features": "x",
        "label": "y",
        "task": "classification",
        "validation_fraction": validation_fraction,
        "batch_size": 1,  # an epoch then trains every training row
    }
    # Without validation rows the loop can only rank checkpoints by the training loss.
    checkpoint = {"best_metric": "val_loss" if validation_fraction else "loss"}
    raw = tiny_raw(
        tmp_path / "runs", "holdout", data=data, scaling={"num_workers": 1}, checkpoint=checkpoint
    )
    return build_spec(raw)


def row_ids(features: np.ndarray) -> list[int]:
    return sorted(int(v) for v in features[:, 0])


def loop_validation_ids(spec: RunSpec, world_size: int) -> list[int]:
    """The rows the loop validates on: every rank's share, as the loop's stream gives it."""
    assert spec.data is not None
    data = spec.data.resolved()
    layout = footers.scan(data)
    found: list[int] = []
    for rank in range(world_size):
        ranks = rank_stream.RankStream(layout, data, spec.run.seed, world_size, rank)
        found += [i for part in ranks.validation() for i in row_ids(part.features)]
    return sorted(found)


def loop_training_ids(spec: RunSpec) -> set[int]:
    """The rows one epoch of the loop trains on (batches of one: every training row)."""
    assert spec.data is not None
    data = spec.data.resolved()
    ranks = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    epoch = ranks.epoch(0)
    try:
        return {i for _, _, rows in epoch for i in row_ids(rows.features)}
    finally:
        epoch.close()


@pytest.mark.parametrize("validation_fraction", [0.05, 0.3])
def test_the_holdout_is_exactly_the_rows_the_loop_validates_on(tmp_path, validation_fraction):
    spec = spec_on_rows(tmp_path, validation_fraction)
    holdout = row_ids(evaluate.holdout(spec).features)
    validated = loop_validation_ids(spec, world_size=2)
    trained = loop_training_ids(spec)
    assert validated == loop_validation_ids(spec, world_size=1)  # the same split on any workers
    assert 0 < len(validated) < NUM_ROWS // 2
    assert set(validated) | trained == set(range(NUM_ROWS)) and not set(validated) & trained
    assert holdout == validated
    assert not set(holdout) & trained


def test_no_validation_rows_is_a_spec_error_for_the_comparison(tmp_path):
    spec = spec_on_rows(tmp_path, validation_fraction=0)
    with pytest.raises(SpecError, match=r"data\.validation_fraction") as caught:
        evaluate.holdout(spec)
    assert caught.value.field == "data.validation_fraction"
    # The retraining flow refuses the spec before it trains a challenger it cannot compare.
    from tasks.retraining import load_champion

    with pytest.raises(SpecError, match=r"data\.validation_fraction"):
        load_champion.fn(spec, "holdout-model")


def test_a_fraction_that_holds_out_no_row_is_a_spec_error(tmp_path):
    spec = spec_on_rows(tmp_path, validation_fraction=0.001, num_rows=3)
    assert loop_validation_ids(spec, world_size=1) == []
    with pytest.raises(SpecError, match=r"holds out none of the 3 rows"):
        evaluate.holdout(spec)
