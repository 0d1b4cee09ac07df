"""A loop of the user's own on relaytrain's API (``train_loop_api: relaytrain``): what its spec
needs and refuses, and what the API says when it is used outside a run or out of order."""

import re

import pytest

from tests.conftest import tiny_raw
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import build_spec
from trainer_core.train import metric_rows, own_loop
from trainer_core.train.own_loop_data import place_of
from trainer_core.train.steps import optimizer_steps

LOOP = {"train_loop": "examples.own_loop:train", "train_loop_api": "relaytrain"}


def own_raw(tmp_path, **sections):
    raw = tiny_raw(tmp_path, "own", **LOOP, **sections)
    del raw["model"]
    if "schedule" not in sections:  # the built-in loop's learning-rate schedule: not an own loop's
        raw["schedule"] = {"epochs": raw["schedule"]["epochs"]}
    return raw


def test_an_own_loop_reads_data_and_schedule_and_is_not_pinned_to_its_worker_count(tmp_path):
    spec = build_spec(own_raw(tmp_path))
    assert spec.own_loop and not spec.ray_loop
    # The stream's order does not depend on the worker count: like the built-in loop's.
    assert "num_workers" not in spec.identity() and spec.identity()["train_loop_api"]
    ray_spec = build_spec(
        {k: v for k, v in own_raw(tmp_path).items() if k not in ("data", "schedule")}
        | {"train_loop_api": "ray"}
    )
    assert ray_spec.ray_loop and "num_workers" in ray_spec.identity()
    # Another API is another run: it does not resume the other's checkpoints.
    assert spec.fingerprint() != build_spec(tiny_raw(tmp_path, "own")).fingerprint()


@pytest.mark.parametrize(
    ("change", "field", "fix"),
    [
        ({"drop": "data"}, "data", "set train_loop_api ray"),
        ({"drop": "schedule"}, "schedule", "data.dataset and schedule.epochs"),
        ({"drop": "train_loop"}, "train_loop_api", "set train_loop, or drop train_loop_api"),
        (
            {"schedule": {"epochs": 2, "early_stopping": {"metric": "val_loss", "patience": 1}}},
            "schedule.early_stopping",
            "your loop decides when to stop",
        ),
        ({"data": {"batch_size": 1}}, "data.batch_size", "Raise data.batch_size to at least 2"),
        # the built-in loop's learning-rate schedule, which an own loop's scheduler replaces
        (
            {"schedule": {"epochs": 2, "lr_schedule": "cosine"}},
            "schedule.lr_schedule",
            re.escape("setup(model, optimizer, scheduler)"),
        ),
        (
            {"schedule": {"epochs": 2, "warmup_steps": 5}},
            "schedule.warmup_steps",
            re.escape("setup(model, optimizer, scheduler)"),
        ),
    ],
)
def test_what_an_own_loop_spec_refuses(tmp_path, change, field, fix):
    raw = own_raw(tmp_path)
    if "drop" in change:
        del raw[change.pop("drop")]
    for key, value in change.items():
        raw[key] = {**raw.get(key, {}), **value}
    with pytest.raises(SpecError, match=fix) as error:
        build_spec(raw)
    assert error.value.field == field


@pytest.mark.parametrize(("batches", "accumulation"), [(21, 1), (21, 2), (21, 3), (7, 4), (3, 5)])
def test_each_batch_lies_in_the_optimizer_step_the_built_in_loop_gives_it(batches, accumulation):
    """The own loop's steps with ``optimizer.grad_accumulation`` are the built-in loop's: the
    batches ``steps.optimizer_steps`` groups into each step, the last of an epoch what is left;
    a checkpoint after a step points at the next step's first batch."""
    epoch = [(index, None, index) for index in range(batches)]
    for step_in_epoch, (end, group) in enumerate(optimizer_steps(epoch, accumulation)):
        for position, index in enumerate(group):
            place = place_of(1, index, batches, accumulation)
            assert place.step_in_epoch == step_in_epoch
            assert place.step_batches == len(group)
            assert place.ends_step == (position == len(group) - 1)
            assert place.end_of_epoch == (index == batches - 1)
        cursor = place_of(1, end - 1, batches, accumulation).cursor_after(batch_size=8)
        assert (cursor.epoch, cursor.samples) == ((2, 0) if end == batches else (1, end * 8))


def test_an_own_loop_reads_the_accumulation_into_its_identity(tmp_path):
    """An own loop accumulates gradients over ``optimizer.grad_accumulation`` batches: its
    steps, and so its checkpoints, depend on it, so another value is another run."""
    spec = build_spec(own_raw(tmp_path, optimizer={"grad_accumulation": 3}))
    assert spec.optimizer.grad_accumulation == 3
    assert spec.fingerprint() != build_spec(own_raw(tmp_path)).fingerprint()


def test_what_an_own_loop_ignores_it_says(tmp_path):
    """tiny_raw's spec sets optimizer.name and .lr: an own loop builds its own optimizer, so
    they are named; grad_accumulation, which the session reads, is not."""
    raw = own_raw(tmp_path, precision="bf16")
    raw["model"] = tiny_raw(tmp_path, "own")["model"]
    raw["optimizer"]["grad_accumulation"] = 2
    ignored = "['model', 'optimizer.lr', 'optimizer.name', 'precision=bf16'] are ignored"
    with pytest.warns(UserWarning, match=re.escape(ignored)):
        build_spec(raw)


def test_the_api_outside_a_run_says_how_to_get_one():
    with pytest.raises(RuntimeError, match="train_loop_api: relaytrain"):
        own_loop.session()


def test_a_report_of_something_not_a_number_names_it():
    import torch

    assert metric_rows.report_row({"loss": torch.tensor(0.5), "note": "x", "n": 3}) == {
        "loss": 0.5,
        "note": "x",
        "n": 3,
    }
    with pytest.raises(TypeError, match="metric 'logits' is a Tensor"):
        metric_rows.report_row({"logits": torch.zeros(3)})
