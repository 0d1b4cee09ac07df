"""pytest fixtures for testing flows that call relaytrain (loaded automatically with relaytrain).

- ``relaytrain_ray``: one real local Ray cluster for the whole test session.
- ``relaytrain_prefect``: Prefect's test harness (a temporary API) for the whole session.
- ``relaytrain_spec``: a factory of tiny real specs that train in seconds on 2 gloo workers.
- ``with_fault(spec, kind, at_step, rank=0, attempt=1, seconds=None)``: the spec with one more
  fault (``slow``: ``seconds`` of sleep per step, a straggler).

Example::

    def test_my_flow_survives_a_crash(relaytrain_ray, relaytrain_prefect, relaytrain_spec):
        spec = with_fault(relaytrain_spec(name="crash"), "raise", at_step=12)
        result = my_flow(spec)
        assert result.status == "completed" and len(result.attempts) == 2
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec


def tiny_spec_dict(storage: str | Path, name: str, **sections: Any) -> dict[str, Any]:
    """A spec that trains for real in seconds: synthetic regression, an MLP with dropout, Adam,
    a cosine schedule with warm-up (so an exact resume must restore RNG, optimizer, schedule).
    Keyword arguments replace or extend whole sections."""
    raw: dict[str, Any] = {
        "run": {"name": name, "storage": str(storage), "seed": 3},
        "model": {"name": "mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.1}},
        "data": {
            "dataset": "synthetic",
            "batch_size": 32,  # the global batch: 13 steps an epoch
            "synthetic": {"num_samples": 560, "num_features": 6},
        },
        "optimizer": {"name": "adam", "lr": 0.01},
        "schedule": {"epochs": 3, "lr_schedule": "cosine", "warmup_steps": 5},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every": 10, "keep_last": 2, "keep_best": 1},
        "report": {"every": 5},
        "retries": {"infrastructure": 2, "code": 1, "delay_s": 0, "jitter": 0},
    }
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def with_fault(
    spec: RunSpec,
    kind: str,
    at_step: int,
    rank: int = 0,
    attempt: int = 1,
    seconds: float | None = None,
) -> RunSpec:
    """``spec`` with one more injected fault on the given attempt: ``raise`` or ``kill`` at
    ``at_step``, or ``slow``: ``seconds`` of sleep in each of the rank's steps from it on."""
    raw = spec.model_dump(mode="json")
    fault = {"kind": kind, "at_step": at_step, "rank": rank, "attempt": attempt}
    if seconds is not None:
        fault["seconds"] = seconds
    raw["faults"] = [*raw["faults"], fault]
    return RunSpec.model_validate(raw)


@pytest.fixture(scope="session")
def relaytrain_ray() -> Iterator[Any]:
    """A real local Ray cluster shared by the session (4 logical CPUs: 2 workers and room); the
    value is the ``ray`` module."""
    from trainer_core.execution.cluster import local_cluster

    with local_cluster(num_cpus=4) as ray:
        yield ray


@pytest.fixture(scope="session")
def relaytrain_prefect() -> Iterator[None]:
    """Prefect's test harness: a temporary API (SQLite) for the whole session."""
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def relaytrain_spec(tmp_path: Path) -> Callable[..., RunSpec]:
    """``relaytrain_spec(name="x", **sections)`` builds a tiny spec stored under tmp_path."""

    def make(name: str = "tiny", **sections: Any) -> RunSpec:
        return build_spec(tiny_spec_dict(tmp_path, name, **sections))

    return make
