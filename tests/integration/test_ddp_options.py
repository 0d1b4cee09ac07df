"""``scaling.ddp`` and an own loop's ``setup(..., ddp=...)`` reach DistributedDataParallel, on
2 gloo workers: a model with a layer its forward never uses fails under DDP's defaults (the
oracle that the option is what it needs) and trains with ``find_unused_parameters``."""

from __future__ import annotations

import pytest

from tests.conftest import tiny_raw
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration

ONE_EPOCH = {"epochs": 1, "lr_schedule": "constant", "warmup_steps": 0}  # 13 steps


def test_the_builtin_loop_passes_scaling_ddp_to_ddp(ray_cluster, tmp_path):
    model = {"name": "tests.own_functions:with_unused_layer", "kwargs": {}}
    sections = {"model": model, "schedule": ONE_EPOCH}
    with pytest.raises(TrainingCodeError, match="find_unused_parameters"):
        run_attempt(build_spec(tiny_raw(tmp_path, "ddp-defaults", **sections)))
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "ddp-unused",
            scaling={"ddp": {"find_unused_parameters": True}},
            **sections,
        )
    )
    assert run_attempt(spec).steps_completed == 13


def test_an_own_loop_passes_setup_ddp_to_ddp(ray_cluster, tmp_path):
    raw = tiny_raw(
        tmp_path,
        "own-ddp-unused",
        train_loop="tests.own_functions:unused_layer_loop",
        train_loop_api="relaytrain",
        train_loop_config={"ddp": {"find_unused_parameters": True}},
        schedule=ONE_EPOCH,
        data={"task": "regression"},
    )
    del raw["model"], raw["optimizer"]
    assert run_attempt(build_spec(raw)).steps_completed == 13
