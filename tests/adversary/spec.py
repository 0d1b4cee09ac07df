"""The run spec a scenario's commands run (``spec_raw``): its shape (``scenario.Shape``) as the
YAML a user writes, in the tabular form, the columns form with the user's own code, or a loop of
the user's own (``world.USER_MODULE``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.adversary.scenario import Scenario, Shape
from tests.adversary.world import USER_MODULE


def spec_raw(
    scenario: Scenario,
    *,
    name: str,
    storage: str,
    dataset: Path,
    epochs: int,
    workers: int,
    faults: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The run spec of the scenario's shape at ``epochs`` on ``workers`` (up to ``workers`` for
    an elastic shape), over the scenario's Parquet files (``tests/adversary/data.py``): a small
    MLP with dropout in the tabular form, the user's model and transform in the columns form,
    or the user's own loop."""
    shape: Shape = scenario.shape
    optimizer: dict[str, Any] = {"name": shape.optimizer, "lr": 0.01}
    if shape.optimizer == "sgd":
        optimizer.update(lr=0.05, momentum=0.9)
    if shape.accumulation != 1:
        optimizer["grad_accumulation"] = shape.accumulation
    schedule: dict[str, Any] = {"epochs": epochs}
    if shape.cosine:
        schedule.update(lr_schedule="cosine", warmup_steps=3)
    raw: dict[str, Any] = {
        "run": {"name": name, "storage": storage, "seed": shape.seed},
        "model": {"name": "mlp", "kwargs": {"hidden": list(shape.hidden), "dropout": 0.1}},
        "data": {
            "dataset": str(dataset),
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": shape.batch_size,
            "validation_fraction": 0.25 if shape.validation and not shape.validation_file else 0,
            "shuffle_window": 64,
            "partitions": 2,
        },
        "optimizer": optimizer,
        "schedule": schedule,
        "scaling": {"num_workers": [1, workers] if shape.elastic and workers > 1 else workers},
        "checkpoint": {
            "every": shape.every,
            "keep_last": shape.keep_last,
            "keep_best": shape.keep_best,
            "best_metric": "val_loss" if shape.validation else "loss",
        },
        "report": {"every": 5},
        "retries": {"infrastructure": 2, "code": 1, "delay_s": 0, "jitter": 0},
        "faults": faults or [],
    }
    if shape.elastic and workers > 1:  # a group short of workers grows within seconds of
        # the CPUs coming free (a crowd), within the tiny run's steps, not after a minute
        raw["scaling"]["resize_interval_s"] = 1
    if shape.validation_file:  # beside the table's directory: what data.validation reads
        raw["data"]["validation"] = str(validation_directory(dataset))
    if shape.precision != "fp32":
        raw["precision"] = shape.precision
    if shape.form == "columns":  # the user's transform makes each batch: x and labels
        for key in ("features", "label"):
            del raw["data"][key]
        raw["data"].update(columns=["x", "y"], transform=f"{USER_MODULE}:row")
        kwargs = {"inputs": scenario.data.features, **raw["model"]["kwargs"]}
        raw["model"] = {"name": f"{USER_MODULE}:mlp", "kwargs": kwargs}
    elif shape.form == "own_loop":  # the user's loop builds its model, optimizer, schedule
        del raw["model"], raw["optimizer"]
        raw["schedule"] = {"epochs": epochs}
        raw["train_loop"] = f"{USER_MODULE}:train"
        raw["train_loop_api"] = "relaytrain"
        raw["train_loop_config"] = {
            "inputs": scenario.data.features,
            "hidden": list(shape.hidden),
            "dropout": 0.1,
            "optimizer": shape.optimizer,
            "cosine": shape.cosine,
            "validation": shape.validation,
        }
    return raw


def validation_directory(dataset: Path) -> Path:
    return dataset.parent / "validation"
