"""Shared fixtures: one local Ray cluster for the whole session, tiny real specs."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")


@pytest.fixture(scope="session")
def ray_cluster():
    """A real local Ray cluster shared by every integration test (started once, stopped once)."""
    import ray

    # 4 logical CPUs on 2 cores: room for 2 gloo workers plus Ray's own actors.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def tiny_raw(storage: Path | str, name: str, **sections: Any) -> dict[str, Any]:
    """A spec that trains for real in seconds: synthetic regression, MLP with dropout, Adam,
    cosine schedule with warmup (so resume must restore RNG, optimizer and scheduler)."""
    raw: dict[str, Any] = {
        "run": {"name": name, "storage": str(storage), "seed": 3},
        "model": {"name": "mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.1}},
        "data": {
            "dataset": "synthetic",
            "batch_size": 16,
            "synthetic": {"num_samples": 512, "num_features": 6},
        },
        "optimizer": {"name": "adam", "lr": 0.01},
        "schedule": {"epochs": 3, "lr_schedule": "cosine", "warmup_steps": 5},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every": 10, "keep_last": 2, "keep_best": 1},
        "report": {"every": 5},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw
