from datetime import datetime

import pytest

from tests.conftest import tiny_raw
from trainer_core import storage
from trainer_core.checkpoint.registry import Champion, Registry, decide_promotion
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import build_spec


def test_promotion_needs_a_margin():
    assert decide_promotion(0.5, None, metric="val_loss", mode="min", margin=0.1).promote
    assert decide_promotion(0.3, 0.5, metric="val_loss", mode="min", margin=0.1).promote
    assert not decide_promotion(0.45, 0.5, metric="val_loss", mode="min", margin=0.1).promote
    assert decide_promotion(0.9, 0.8, metric="val_accuracy", mode="max", margin=0.05).promote
    assert not decide_promotion(0.8, 0.9, metric="val_accuracy", mode="max", margin=0).promote
    assert not decide_promotion(float("nan"), 0.5, metric="x", mode="min", margin=0).promote


def test_registry_keeps_history_and_moves_the_pointer(tmp_path):
    registry = Registry(storage.resolve(str(tmp_path)), "digits")
    assert registry.champion() is None
    for n in (1, 2):
        registry.promote(
            Champion(
                model_name="digits",
                run_name=f"r{n}",
                checkpoint_uri=f"/c{n}",
                metric="val_loss",
                metrics={"val_loss": 1.0 / n},
                promoted_at=float(n),
                fingerprint="f",
            )
        )
    assert registry.champion().run_name == "r2"
    assert [h["run_name"] for h in registry.history()] == ["r1", "r2"]
    with pytest.raises(SpecError):
        Registry(storage.resolve(str(tmp_path)), "../escape")


def test_dataset_templates_fill_from_the_slot(tmp_path):
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "x",
            data={
                "dataset": "s3://lake/d/date={date}/h={hour}",
                "features": "x",
                "label": "y",
                "task": "regression",
            },
        )
    )
    filled = spec.for_slot(datetime(2026, 3, 4, 5, 6))
    assert filled.data.dataset == "s3://lake/d/date=2026-03-04/h=05"
    bad = build_spec(
        tiny_raw(
            tmp_path,
            "x",
            data={
                "dataset": "/d/{nope}.parquet",
                "features": "x",
                "label": "y",
                "task": "regression",
            },
        )
    )
    with pytest.raises(SpecError, match="placeholder"):
        bad.for_slot(datetime(2026, 3, 4))
    assert build_spec(tiny_raw(tmp_path, "x")).for_slot(datetime(2026, 1, 1)).data.dataset == (
        "synthetic"
    )


def test_join_uri_keeps_the_query():
    assert storage.join_uri("s3://b/p?endpoint_override=h:1", "run", "c") == (
        "s3://b/p/run/c?endpoint_override=h:1"
    )
    assert storage.join_uri("/runs", "a") == "/runs/a"
