"""``scaling.ddp``: refused where there is no DDP wrapper to take it, said to do nothing where
the wrapper is not made, and merged with an own loop's ``setup(..., ddp=...)``."""

from __future__ import annotations

import warnings

import pytest

from tests.conftest import tiny_raw
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import build_spec
from trainer_core.train.own_loop import ddp_options


def test_scaling_ddp_is_refused_with_fsdp(tmp_path):
    raw = tiny_raw(tmp_path, "x", scaling={"strategy": "fsdp", "ddp": {"broadcast_buffers": False}})
    with pytest.raises(SpecError, match="fsdp") as error:
        build_spec(raw)
    assert error.value.field == "scaling.ddp"


def test_scaling_ddp_on_one_worker_says_it_does_nothing(tmp_path):
    raw = tiny_raw(tmp_path, "x", scaling={"num_workers": 1, "ddp": {"static_graph": True}})
    with pytest.warns(UserWarning, match=r"scaling.ddp.static_graph.*do nothing"):
        build_spec(raw)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_spec(tiny_raw(tmp_path, "x", scaling={"ddp": {"static_graph": True}}))


def test_a_ray_loop_is_told_where_its_ddp_options_go(tmp_path):
    raw = tiny_raw(
        tmp_path,
        "x",
        train_loop="examples.ray_train_loop:train_func",
        scaling={"ddp": {"find_unused_parameters": True}},
    )
    for section in ("model", "data", "schedule", "optimizer"):
        del raw[section]
    with pytest.warns(UserWarning, match="parallel_strategy_kwargs"):
        build_spec(raw)


def test_setup_ddp_goes_over_the_specs():
    spec = {"broadcast_buffers": True, "find_unused_parameters": False, "static_graph": False}
    merged = ddp_options(spec, {"find_unused_parameters": True, "bucket_cap_mb": 5})
    assert merged == {
        "broadcast_buffers": True,
        "find_unused_parameters": True,
        "static_graph": False,
        "bucket_cap_mb": 5,
    }
    assert ddp_options(spec, None) == spec
    with pytest.raises(SpecError, match="device_ids"):
        ddp_options(spec, {"device_ids": [0]})
