"""The training options a spec turns on resume exactly, on the local Ray cluster: mixed precision,
early stopping, and an imported optimizer with ReduceLROnPlateau on one worker (nothing they
check depends on the ranks: fp16's scaler across DDP ranks is test_fp16_overflow's and
test_columns' half-precision test's), gradient accumulation with clipping and the user's own
loss and metrics on 2 gloo DDP workers."""

from __future__ import annotations

import pytest
import torch

from tasks.setup import is_finished
from tests import own_functions
from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import build_result
from trainer_core.spec.overrides import build_spec
from trainer_core.train import evaluate, workloads

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_resumes_exactly(uninterrupted_one_worker, tmp_path, precision):
    """Autocast (and fp16's gradient scaler, checkpointed) on CPU: a run interrupted and resumed
    ends bit-identical to an uninterrupted run of the same precision."""
    uninterrupted = build_spec(
        tiny_raw(tmp_path, f"{precision}-whole", precision=precision, scaling=ONE_WORKER)
    )
    assert run_attempt(uninterrupted).status == "completed"
    spec = build_spec(
        tiny_raw(
            tmp_path,
            f"{precision}-resumed",
            precision=precision,
            faults=[{"kind": "raise", "at_step": 17}],
            scaling=ONE_WORKER,
        )
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    assert run_attempt(spec).resumed_from_step == 13
    whole, resumed = run_dir_of(uninterrupted), run_dir_of(spec)
    assert_same_tensors(final_state(resumed), final_state(whole))
    assert losses(resumed) == losses(whole)
    assert losses(whole) != uninterrupted_one_worker["losses"]  # autocast changed the arithmetic
    files = set(resumed.scan().newest.files)
    assert ("scaler.pt" in files) == (precision == "fp16")


def test_accumulation_clipping_own_loss_and_metrics_resume_exactly(uninterrupted, tmp_path):
    """Two global batches of 16 per optimizer step (DDP all-reduces once per step), gradients
    clipped, a Huber loss and two validation metrics of the user's own. The cursor counts
    optimizer steps, so a checkpoint never holds half a step: the run interrupted at step 17
    resumes from step 13 (epoch 0's validated checkpoint) and ends bit-identical to the
    uninterrupted one."""
    essentials = {
        "data": {"batch_size": 16},
        "optimizer": {"grad_accumulation": 2, "clip_grad_norm": 0.5},
        "loss": "tests.own_functions:huber",
        "metrics": ["tests.own_functions:mean_abs_error", "tests.own_functions:within_half"],
        "checkpoint": {"best_metric": "val_mean_abs_error"},
    }
    whole_spec = build_spec(tiny_raw(tmp_path, "accumulate-whole", **essentials))
    whole = run_attempt(whole_spec)
    # 429 training rows: 26 global batches of 16, 13 optimizer steps an epoch.
    assert whole.steps_completed == 39
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "accumulate-resumed",
            faults=[{"kind": "raise", "at_step": 17}],
            **essentials,
        )
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    assert run_attempt(spec).resumed_from_step == 13
    whole_dir, resumed_dir = run_dir_of(whole_spec), run_dir_of(spec)
    final = final_state(resumed_dir)
    assert_same_tensors(final, final_state(whole_dir))
    assert losses(resumed_dir) == losses(whole_dir)
    assert losses(whole_dir) != uninterrupted["losses"]  # the Huber loss was used
    history = read_metrics_history(resumed_dir)
    assert [row["step"] for row in history] == list(range(1, 40))
    assert all(row["grad_norm"] > 0 for row in history)  # the norm before clipping
    # The metrics, all-reduced over both ranks' validation rows, equal the final model's
    # measured here on the whole validation split.
    metrics = resumed_dir.scan().newest.metrics
    assert {"val_loss", "val_mean_abs_error", "val_within_half"} <= metrics.keys()
    model = workloads.build_model(spec.model, 6, 1)
    model.load_state_dict(final["model"])
    model.eval()
    val = evaluate.holdout(spec)  # the validation rows, as the loop's hash split picks them
    with torch.no_grad():
        output = model(torch.from_numpy(val.features))
    target = torch.from_numpy(val.labels)
    expected = {
        "val_mean_abs_error": float(own_functions.mean_abs_error(output, target)),
        "val_within_half": own_functions.within_half(output, target),
        "val_loss": float(own_functions.huber(output, target)),
    }
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=1e-5), name
    # Retraining's champion/challenger comparison measures the same metrics.
    measured = evaluate.evaluate(spec, resumed_dir.scan().newest.uri, val)
    assert measured == pytest.approx(expected, rel=1e-5)


def test_early_stopping_keeps_its_patience_across_a_retry(uninterrupted_one_worker, tmp_path):
    """val_loss never improves by min_delta after epoch 1, and patience is 1: training stops
    after epoch 2 (step 26), a completed run with its reason. The first attempt fails at
    step 23, after epoch 1's verdict was checkpointed at step 20; the retry restores it. (A
    retry that reset the patience would take epoch 2's loss as a new best and train on.)"""
    stopping = {"early_stopping": {"metric": "val_loss", "patience": 1, "min_delta": 1e6}}
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "early-stop",
            schedule=stopping,
            faults=[{"kind": "raise", "at_step": 23}],
            scaling=ONE_WORKER,
        )
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    events: list = []
    second = run_attempt(spec, on_event=events.append)
    assert second.status == "completed" and second.resumed_from_step == 20
    assert second.steps_completed == 26
    (finished,) = [e for e in events if e["kind"] == "finished"]
    assert "early stopping after epoch 2: val_loss has not improved" in finished["stopped"]
    run_dir = run_dir_of(spec)
    newest = run_dir.scan().newest
    assert newest.step == 26
    assert newest.manifest["cursor"] == {"epoch": 2, "samples": 0}
    assert newest.manifest["early_stopping"]["bad_epochs"] == 1
    # Until it stopped, the run is the reference run, step for step, across the retry.
    assert losses(run_dir) == uninterrupted_one_worker["losses"][:26]
    result = build_result(spec, run_dir, str(tmp_path), "completed")
    assert result.stop_reason == finished["stopped"] and result.epochs_completed == 2
    assert [a.world_size for a in result.attempts] == [1, 1]
    assert all(a.peak_worker_rss_mb > 100 for a in result.attempts)
    assert is_finished(spec, result)  # the flow returns it as it is
    # Run again, it trains nothing: the newest checkpoint says the run stopped.
    third = run_attempt(spec, on_event=events.append)
    assert third.steps_completed == 26
    assert [e["step"] for e in events if e["kind"] == "already_complete"] == [26]


def test_an_imported_optimizer_and_reduce_on_plateau_resume_exactly(tmp_path):
    """torch's RMSprop with momentum, by import path, and ReduceLROnPlateau stepped on val_loss
    at each epoch's end. Its threshold (1e6, absolute) makes every epoch after the first a
    plateau and patience is 0, so the rate halves after epoch 2 (step 26), whatever the
    losses. The run fails at step 17 and resumes from epoch 1's checkpoint (step 13), which
    must carry the scheduler's best so far: a fresh scheduler would take epoch 2's loss as a
    new best, not halve the rate, and train on at 0.01."""
    sections = {
        "optimizer": {"name": "torch.optim:RMSprop", "lr": 0.01, "momentum": 0.5},
        "schedule": {
            "lr_schedule": "constant",
            "warmup_steps": 0,
            "scheduler": "torch.optim.lr_scheduler:ReduceLROnPlateau",
            "scheduler_kwargs": {
                "factor": 0.5,
                "patience": 0,
                "threshold": 1e6,
                "threshold_mode": "abs",
            },
            "scheduler_metric": "val_loss",
        },
        "scaling": ONE_WORKER,
    }
    whole_spec = build_spec(tiny_raw(tmp_path, "plateau-whole", **sections))
    assert run_attempt(whole_spec).steps_completed == 39
    spec = build_spec(
        tiny_raw(tmp_path, "plateau-resumed", faults=[{"kind": "raise", "at_step": 17}], **sections)
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    assert run_attempt(spec).resumed_from_step == 13
    whole_dir, resumed_dir = run_dir_of(whole_spec), run_dir_of(spec)
    expected_lr = {step: 0.01 if step <= 26 else 0.005 for step in range(1, 40)}
    for run_dir in (whole_dir, resumed_dir):
        lrs = {row["step"]: row["lr"] for row in read_metrics_history(run_dir)}
        assert lrs == pytest.approx(expected_lr, rel=1e-12)
    final = final_state(resumed_dir)
    assert_same_tensors(final, final_state(whole_dir))
    assert losses(resumed_dir) == losses(whole_dir)
    # RMSprop's own state, with its momentum buffer: the optimizer the spec named
    assert {"square_avg", "momentum_buffer"} <= set(final["optimizer"]["state"][0])
