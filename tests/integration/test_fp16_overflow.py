"""fp16 on CPU, 2 gloo workers: a loss that overflows fp16 is the gradient scaler's to handle.
Its step is skipped and the scale lowered, and training goes on; only an overflow that
persists stops the run with NonFiniteLoss. The oracle is each step's checkpoint: the weights,
optimizer state and scaler state the workers committed after it."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_raw
from tests.recovery import assert_same_tensors, run_dir_of
from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
AT = 7  # rank 0's 7th training forward pass, so step 7's


def overflowing(tmp_path, name: str, times: int) -> dict:
    """One epoch (13 steps) in fp16, a checkpoint after every step (all kept), and a model
    whose output overflows fp16 on rank 0 for ``times`` steps from step 7."""
    return tiny_raw(
        tmp_path,
        name,
        precision="fp16",
        model={
            "name": "tests.helpers:overflowing_mlp",
            "kwargs": {"hidden": [16, 16], "dropout": 0.1, "at_forward": AT, "times": times},
        },
        schedule={"epochs": 1},
        checkpoint={"every": 1, "keep_last": None},
    )


def committed(run_dir, step: int, name: str):
    info = next(c for c in run_dir.scan().committed if c.step == step)
    return training_state.from_bytes(run_dir.read_verified(info, name))


def test_an_fp16_overflow_skips_its_step_and_lowers_the_scale(ray_cluster, tmp_path):
    spec = build_spec(overflowing(tmp_path, "fp16-once", times=1))
    result = run_attempt(spec)
    assert result.status == "completed" and result.steps_completed == 13  # it went on
    run_dir = run_dir_of(spec)
    losses = {row["step"]: row["loss"] for row in read_metrics_history(run_dir)}
    assert math.isinf(losses[AT])
    assert all(math.isfinite(loss) for step, loss in losses.items() if step != AT)
    before, at, after = (committed(run_dir, s, "scaler.pt") for s in (AT - 1, AT, AT + 1))
    assert at["scale"] == before["scale"] / 2  # GradScaler's backoff (0.5)
    assert after["scale"] == at["scale"]  # the next step's gradients fit: no more backoff
    # Step 7 was skipped: the weights and Adam's state (moments, step count) after it are
    # those after step 6 (the schedule moved on, as GradScaler's recipe has it); step 8 trained.
    assert_same_tensors(committed(run_dir, AT, "model.pt"), committed(run_dir, AT - 1, "model.pt"))
    assert_same_tensors(
        committed(run_dir, AT, "optimizer.pt")["state"],
        committed(run_dir, AT - 1, "optimizer.pt")["state"],
    )
    moved = committed(run_dir, AT + 1, "model.pt")
    assert any(
        not torch.equal(value, committed(run_dir, AT, "model.pt")[key])
        for key, value in moved.items()
    )


def test_an_overflow_that_persists_is_a_non_finite_loss(ray_cluster, tmp_path):
    """Overflowing on every step from 7: the scaler cannot fix a forward pass; the third
    overflowing step in a row stops the run."""
    spec = build_spec(overflowing(tmp_path, "fp16-always", times=100))
    with pytest.raises(TrainingCodeError) as failure:
        run_attempt(spec)
    assert failure.value.error_type == "NonFiniteLoss"
    assert failure.value.step == AT + 2
    assert "bf16" in str(failure.value)
    assert run_dir_of(spec).scan().newest.step == AT + 1  # the skipped steps were committed
