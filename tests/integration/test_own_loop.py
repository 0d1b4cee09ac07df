"""A loop of the user's own on relaytrain's API (examples/own_loop.py, ``train_loop_api:
relaytrain``) on the shared local Ray cluster, 2 gloo DDP workers: an uninterrupted run is the
oracle; a run that fails mid-epoch and is retried by the flow ends bit for bit where it does,
and each checkpoint records what its weights score when evaluated on the driver."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml

from flows.training import training
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import build_result
from trainer_core.spec.overrides import build_spec
from trainer_core.step_time import PARTS
from trainer_core.train import evaluate

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def own_raw(root: Path, name: str, **sections) -> dict:
    """examples/own_loop.yaml as a user runs it, 2 epochs, a checkpoint every 5 steps."""
    raw = yaml.safe_load((REPO / "examples" / "own_loop.yaml").read_text())
    raw["run"] = {"name": name, "storage": str(root), "seed": 3}
    raw["schedule"]["epochs"] = 2
    raw["checkpoint"] |= {"every": 5, "keep_last": None}
    raw["retries"] = {"code": 1, "delay_s": 0, "jitter": 0}
    raw.update(sections)
    return raw


@pytest.fixture(scope="module")
def own_reference(relaytrain_ray, tmp_path_factory):
    spec = build_spec(own_raw(tmp_path_factory.mktemp("own-reference"), "reference"))
    result = run_attempt(spec)
    run_dir = run_dir_of(spec)
    return {
        "spec": spec,
        "result": result,
        "state": final_state(run_dir),
        "losses": losses(run_dir),
    }


def test_an_own_loop_trains_and_checkpoints_in_the_committed_format(own_reference):
    spec, result = own_reference["spec"], own_reference["result"]
    # 1,797 digits, about 20% held out: 21 global batches of 64 per epoch.
    assert result.status == "completed" and result.steps_completed == 42
    run_dir = run_dir_of(spec)
    committed = [c.step for c in run_dir.scan().committed]
    assert committed == [5, 10, 15, 20, 21, 25, 30, 35, 40, 42]
    trained = own_reference["losses"]
    assert [s for s, _ in trained] == list(range(1, 43))
    assert trained[-1][1] < trained[0][1] * 0.6
    # The oracle: each validated checkpoint's weights, rebuilt from the example and evaluated
    # on the driver over the holdout, score what the loop recorded (summed over both ranks).
    measured = measure(spec)
    assert sorted(c.step for c, _, _ in measured.values()) == [21, 42]
    for checkpoint, loss, accuracy in measured.values():
        assert math.isclose(checkpoint.metrics["val_loss"], loss, rel_tol=1e-5), checkpoint.step
        assert math.isclose(checkpoint.metrics["val_accuracy"], accuracy), checkpoint.step


def test_an_own_loop_reports_where_each_step_went_on_every_rank(own_reference):
    """The breakdown of a loop of the user's own: every report window (each checkpoint, every 5
    steps here, and each epoch's end, 21 and 42) has both ranks' figures; validation time shows
    exactly where the example validates (the epoch ends), the optimizer's hooks time its step,
    ``batches()`` its data wait, and what they leave (the loop's own forward and backward) is
    positive on every rank: the timed parts never overcount a window."""
    spec = own_reference["spec"]
    windows = [r for r in read_metrics_history(run_dir_of(spec)) if "step_time" in r]
    assert [w["step"] for w in windows] == [5, 10, 15, 20, 21, 25, 30, 35, 40, 42]
    for window in windows:
        ranks = window["step_time"]["ranks"]
        assert len(ranks) == 2
        for wall, *parts in ranks:
            named = dict(zip(PARTS, parts, strict=True))
            # No wait counted twice: the parts never sum past the window (each figure is
            # rounded to the microsecond, so within half a microsecond each).
            assert sum(parts) <= wall + 0.5e-6 * (len(parts) + 1), (wall, named)
            assert (named["validation"] > 0) == (window["step"] in (21, 42)), window
            assert named["optimizer"] > 0 and named["data_wait"] > 0
            # What the timed parts leave of the window: 11-49% of it in this tiny example.
            assert named["forward_backward"] > 0
    assert own_reference["result"].status == "completed"


def measure(spec) -> dict[str, tuple]:
    """Each validated checkpoint by URI: itself, and the loss and accuracy its weights score
    on the holdout, evaluated on the driver with the example's model."""
    from examples.own_loop import build

    run_dir = run_dir_of(spec)
    rows = evaluate.holdout(spec)
    features, labels = torch.from_numpy(rows.features), torch.from_numpy(rows.labels)
    found = {}
    for checkpoint in run_dir.scan().committed:
        if "val_loss" not in checkpoint.metrics:
            continue
        model = build(64)
        state = training_state.from_bytes(run_dir.read_verified(checkpoint, "model.pt"))
        model.load_state_dict(state)
        model.eval()
        with torch.no_grad():
            logits = model(features)
        loss = torch.nn.functional.cross_entropy(logits, labels).item()
        accuracy = (logits.argmax(dim=1) == labels).double().mean().item()
        found[checkpoint.uri] = (checkpoint, loss, accuracy)
    return found


def test_an_own_loop_that_returns_early_then_fails_mid_epoch_resumes_bit_for_bit(
    own_reference, relaytrain_prefect, tmp_path
):
    """One run, two ways to stop short:
    - The example's loop returns after step 12 (not a checkpoint step), holding a 13th batch it
      never reports: the attempt completes with step 12 checkpointed.
    - Run again through the flow, it goes on from step 12 and meets a code fault at step 28
      (epoch 1); a Prefect retry resumes from the checkpoint of step 25.
    The same batches, dropout and schedule throughout: the same bits as the uninterrupted run."""
    raw = own_raw(tmp_path, "returns", faults=[{"kind": "raise", "at_step": 28, "attempt": 2}])
    raw["train_loop"] = "tests.helpers:own_loop_that_returns_at"
    raw["train_loop_config"] |= {"stop_at": 12, "marker": str(tmp_path / "returned")}
    spec = build_spec(raw)
    first = run_attempt(spec)
    assert first.status == "completed" and first.steps_completed == 12
    assert run_dir_of(spec).scan().newest.step == 12
    state = training(spec, return_state=True)
    assert state.is_completed()
    result = state.result()
    assert [a.status for a in result.attempts] == ["completed", "failed", "completed"]
    assert [a.resumed_from_step for a in result.attempts[1:]] == [12, 25]
    assert result.steps_completed == 42
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), own_reference["state"])
    assert losses(run_dir) == own_reference["losses"]
    # The best checkpoint (best_metric val_accuracy, max) is one whose weights score best, and
    # the result gives its model file.
    measured = measure(spec)
    assert measured[result.best_checkpoint_uri][2] == max(a for _, _, a in measured.values())
    assert result.best_model_uri is not None


def test_an_own_loop_on_the_columns_form_resumes_on_the_same_crops(relaytrain_ray, tmp_path):
    """tests.columns_workloads:own_lm_loop on the LM's token rows, random-cropped by
    data.transform, 2 workers: a fault at step 6 and a resume from step 4 train, step for step,
    the global batches (each sample and its crop) one process reads for the run."""
    from tests.columns_workloads import sample_digest, write_lm_dataset
    from tests.recovery import recorded_batches
    from trainer_core.data import footers, rank_stream
    from trainer_core.data.transform import Batches
    from trainer_core.errors import TrainingCodeError

    logs = tmp_path / "logs"
    logs.mkdir()
    raw = {
        "run": {"name": "own-lm", "storage": str(tmp_path), "seed": 2},
        "train_loop": "tests.columns_workloads:own_lm_loop",
        "train_loop_api": "relaytrain",
        "train_loop_config": {"log_dir": str(logs)},
        "data": {
            "dataset": write_lm_dataset(tmp_path / "lm.parquet", count=120, group=40),
            "columns": ["tokens"],
            "transform": "examples.lm_gpt:crop",
            "batch_size": 16,
            "validation_fraction": 0,
        },
        "schedule": {"epochs": 1},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every": 4, "best_metric": "loss"},
        "retries": {"delay_s": 0, "jitter": 0},
        "faults": [{"kind": "raise", "at_step": 6, "attempt": 1}],
    }
    spec = build_spec(raw)
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    kept = recorded_batches(logs, "rows")[:4]
    assert run_attempt(spec).resumed_from_step == 4
    kept += recorded_batches(logs, "rows")
    data = spec.data.resolved()
    one = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    batches = Batches(data, spec.run.seed)
    ahead = one.epoch(0, make_batch=batches.start)
    expected = [[sample_digest(row) for row in b["input_ids"]] for _, _, b in ahead]
    ahead.close()
    batches.close()
    assert len(expected) == 7 and kept == expected


def test_a_second_pass_over_batches_is_refused_and_spends_no_retry(relaytrain_ray, tmp_path):
    """An own loop that goes over batches() again after the run's last epoch would train the
    run again without a word: refused as the loop's misuse of the API (no retry: a retry runs
    the same code), after the first pass was trained and committed whole."""
    from tests.conftest import tiny_raw
    from trainer_core.errors import SpecError
    from trainer_core.run.engine import run_attempt
    from trainer_core.spec.overrides import build_spec

    raw = tiny_raw(
        tmp_path,
        "twice",
        train_loop="tests.own_functions:trains_twice",
        train_loop_api="relaytrain",
        scaling={"num_workers": 1},
        schedule={"epochs": 1, "lr_schedule": "constant", "warmup_steps": 0},
        data={"task": "regression"},
    )
    del raw["model"]
    spec = build_spec(raw)
    with pytest.raises(
        SpecError, match=r"batches\(\) was called after batches\(\) or epochs\(\) began a pass"
    ) as raised:
        run_attempt(spec)
    assert raised.value.field == "train_loop"
    run_dir = run_dir_of(spec)
    (attempt,) = run_dir.read_attempts()
    assert attempt["error_budget"] == "none"
    history = read_metrics_history(run_dir)
    assert [row["step"] for row in history] == list(range(1, 14))  # the one pass, once
    assert {row["loss_weight"] for row in history} == {1.0}  # one worker: its whole batch


def test_an_own_loop_that_accumulates_gradients_resumes_bit_for_bit(relaytrain_ray, tmp_path):
    """tests.own_functions:accumulates sums each optimizer step's gradients over 2 global
    batches (``optimizer.grad_accumulation: 2``) on 2 workers, a checkpoint every 5 steps (were
    a step a batch, every 5 batches would fall mid-step). A fault on rank 1 at step 17 of 22
    (epoch 1; the 21 batches of an epoch make 11 steps, the last of one batch) and a resume from
    the checkpoint of step 15 end with the same weights and optimizer state, to the bit, as an
    uninterrupted run: no checkpoint holds half a step's gradients. In every step of two
    batches, DDP left the first batch's gradients apart on the ranks (``no_sync``)."""
    from trainer_core.errors import TrainingCodeError

    def accumulating(name: str, **sections) -> dict:
        raw = own_raw(tmp_path / name, name, **sections)
        raw["train_loop"] = "tests.own_functions:accumulates"
        raw["optimizer"] = {"grad_accumulation": 2}
        raw["checkpoint"]["every"] = 5
        return raw

    reference = build_spec(accumulating("reference"))
    assert run_attempt(reference).steps_completed == 22
    fault = {"kind": "raise", "at_step": 17, "rank": 1, "attempt": 1}
    spec = build_spec(accumulating("faulted", faults=[fault]))
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    resumed = run_attempt(spec)
    assert resumed.resumed_from_step == 15 and resumed.steps_completed == 22
    run_dir, reference_dir = run_dir_of(spec), run_dir_of(reference)
    # The fault fired as step 17 began: step 16 was the last trained, one step lost.
    summary = build_result(spec, run_dir, spec.run.storage, "completed")
    assert summary.attempts[0].steps_lost == 17 - 1 - 15
    assert summary.steps_computed == 22 + 1
    assert_same_tensors(final_state(run_dir), final_state(reference_dir))
    assert losses(run_dir) == losses(reference_dir)
    history = read_metrics_history(run_dir)
    assert [row["step"] for row in history] == list(range(1, 23))
    # Steps 11 and 22 are their epoch's last batch alone: nothing to keep apart.
    assert [r["step"] for r in history if r.get("kept_apart")] == [
        s for s in range(1, 23) if s not in (11, 22)
    ]
