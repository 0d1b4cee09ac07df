"""Batch norm under DDP, 2 gloo workers: every rank validates with the running statistics the
checkpoint holds (rank 0's), so a validated checkpoint's recorded metrics are those of its own
weights. The oracle: the checkpoint's weights evaluated on the driver, on the same rows."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_raw
from tests.recovery import run_dir_of
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec
from trainer_core.train import evaluate

pytestmark = pytest.mark.integration


def test_validation_uses_the_checkpointed_batch_norm_statistics(ray_cluster, tmp_path):
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "batchnorm",
            model={"name": "tests.helpers:batchnorm_mlp", "kwargs": {"hidden": 16}},
            # 3 row groups of synthetic rows (1024 each, the last 52), so both ranks validate:
            # rank 0 row groups 0 and 2, rank 1 row group 1.
            data={"batch_size": 64, "synthetic": {"num_samples": 2100, "num_features": 6}},
            schedule={"epochs": 2},
            checkpoint={"keep_last": None},
        )
    )
    assert run_attempt(spec).status == "completed"
    validated = [c for c in run_dir_of(spec).scan().committed if "val_loss" in c.metrics]
    assert len(validated) == 2  # after each epoch's validation
    rows = evaluate.holdout(spec)
    for checkpoint in validated:
        measured = evaluate.evaluate(spec, checkpoint.uri, rows)
        recorded = checkpoint.metrics["val_loss"]
        assert recorded == pytest.approx(measured["val_loss"], rel=1e-5), checkpoint.step
