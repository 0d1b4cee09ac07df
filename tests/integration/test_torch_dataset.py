"""The Dataset form on the shared local Ray cluster: a map-style torch Dataset whose augmentation
draws from torch's, numpy's and Python's global generators, read through torch's DataLoader in
loader processes of each worker, an MLP with dropout, gloo DDP.

- 2 workers -> fault -> 1 worker -> fault -> 2 workers: every global batch the run kept holds
  the samples, each with the augmentation draw, that one process with no loader process reads.
- A Prefect retry (a code fault) and an in-place restart (a worker SIGKILLed) in one run end
  bit-identical to the uninterrupted run: weights, optimizer and every step's loss; the test
  set is evaluated once, on the best checkpoint.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.utils.data import default_collate

from flows.training import training
from tests.conftest import reference_of
from tests.recovery import assert_same_tensors, final_state, losses, recorded_batches, run_dir_of
from tests.torch_datasets import Augmented, RecordingMLP, digest
from trainer_core.data.sample_loader import RankSamples
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration

#: 96 samples, about a fifth held out by hash: 7 global batches of 10 an epoch.
LENGTH = 96


def raw(root, name: str, **sections) -> dict:
    spec = {
        "run": {"name": name, "storage": str(root), "seed": 7},
        "model": {"name": "tests.torch_datasets:recording_mlp"},
        "data": {
            "dataset": "tests.torch_datasets:augmented",
            "kwargs": {"length": LENGTH},
            "task": "classification",
            "batch_size": 10,
            "loader_workers": 1,
            "test": "tests.torch_datasets:augmented",
            "test_kwargs": {"length": 30, "augment": False},
        },
        "optimizer": {"name": "sgd", "lr": 0.05, "momentum": 0.9},
        "schedule": {"epochs": 3},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every": 3, "keep_last": None},
        "report": {"every": 3},
        "retries": {"infrastructure": 1, "code": 1, "delay_s": 0, "jitter": 0},
    }
    spec.update(sections)
    return spec


@pytest.fixture(scope="module")
def reference(relaytrain_ray, tmp_path_factory):
    return reference_of(build_spec(raw(tmp_path_factory.mktemp("samples-ref"), "reference")))


def test_a_retry_and_an_in_place_restart_end_bit_identical(reference, relaytrain_prefect, tmp_path):
    """Attempt 1 raises at step 5 (Prefect retries; it resumes from step 3); attempt 2's rank 1
    is SIGKILLed at step 14 (Ray restarts the group in place; it resumes from step 12)."""
    faults = [
        {"kind": "raise", "at_step": 5, "attempt": 1},
        {"kind": "kill", "at_step": 14, "attempt": 2, "rank": 1},
    ]
    spec = build_spec(raw(tmp_path, "faulted", faults=faults))
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    run_dir = run_dir_of(spec)
    attempts = run_dir.read_attempts()
    assert [a.get("resumed_from_step") for a in attempts] == [0, 3]
    assert [r["resumed_from_step"] for r in attempts[1]["restarts"]] == [12]
    assert reference["result"].steps_completed == 21
    assert_same_tensors(final_state(run_dir), reference["state"])
    assert losses(run_dir) == reference["losses"]
    # The test set, evaluated once on the best checkpoint: what its weights score on the 30
    # test samples, computed here with plain torch.
    result = state.result()
    model = RecordingMLP()
    model.load_state_dict(torch.load(result.best_model_uri, weights_only=True))
    model.eval()
    features, labels = default_collate([Augmented(30, augment=False)[i] for i in range(30)])
    with torch.no_grad():
        logits = model(features)
    expected_loss = nn.functional.cross_entropy(logits, labels).item()
    accuracy = (logits.argmax(dim=1) == labels).sum().item() / len(labels)
    assert math.isclose(result.test_metrics["test_loss"], expected_loss, rel_tol=1e-5)
    assert math.isclose(result.test_metrics["test_accuracy"], accuracy, rel_tol=1e-9)


def test_samples_and_their_draws_survive_two_workers_then_one_then_two(relaytrain_ray, tmp_path):
    """2 workers fail at step 5 (resume from 3), 1 worker fails at step 11 (resume from 9), 2
    workers finish: every kept global batch is what one process reads for it (the oracle: the
    Dataset through RankSamples in this process, 1 rank, no loader process)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    plan = [(2, 5), (1, 11), (2, None)]
    faults = [
        {"kind": "raise", "at_step": at, "attempt": n + 1} for n, (_, at) in enumerate(plan) if at
    ]
    model = {"name": "tests.torch_datasets:recording_mlp", "kwargs": {"log_dir": str(logs)}}
    kept: list[list[str]] = []
    resumed = 0
    for workers, fails_at in plan:
        spec = build_spec(
            raw(tmp_path, "elastic", model=model, faults=faults),
            [f"scaling.num_workers={workers}"],
        )
        if fails_at is not None:
            with pytest.raises(TrainingCodeError):
                run_attempt(spec)
        else:
            assert run_attempt(spec).status == "completed"
        kept = kept[:resumed] + recorded_batches(logs, "samples")
        resumed = run_dir_of(spec).scan().newest.step
    attempts = run_dir_of(spec).read_attempts()
    assert [a["world_size"] for a in attempts] == [2, 1, 2]
    assert [a.get("resumed_from_step") for a in attempts] == [0, 3, 9]
    data = spec.data.model_copy(update={"loader_workers": 0})
    one = RankSamples(Augmented(LENGTH), None, data, spec.run.seed, 1, 0)
    expected = [[digest(x) for x in b["input"]] for e in range(3) for _, _, b in one.epoch(e)]
    assert len(expected) == 21 and kept == expected


def test_an_own_loop_per_epoch_on_its_own_dataset_resumes_on_the_same_samples(
    relaytrain_ray, tmp_path
):
    """tests.torch_datasets:own_loop (``for epoch in run.epochs(): for batch in
    run.dataloader(dataset, ...)``, its own Dataset object, 2 loader processes), 2 workers, 2
    epochs of 7 batches: a fault at step 13 and a resume from step 12 (epoch 1, batch 5) train
    the global batches (each sample and its draw) one process reads."""
    logs = tmp_path / "logs"
    logs.mkdir()
    spec = build_spec(
        {
            "run": {"name": "own-samples", "storage": str(tmp_path), "seed": 4},
            "train_loop": "tests.torch_datasets:own_loop",
            "train_loop_api": "relaytrain",
            "train_loop_config": {"log_dir": str(logs), "length": LENGTH},
            "data": {"dataset": "tests.torch_datasets:augmented", "batch_size": 10},
            "schedule": {"epochs": 2},
            "scaling": {"num_workers": 2},
            "checkpoint": {"every": 4, "best_metric": "loss"},
            "retries": {"delay_s": 0, "jitter": 0},
            "faults": [{"kind": "raise", "at_step": 13, "attempt": 1}],
        }
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    kept = recorded_batches(logs, "samples")[:12]
    events: list[dict] = []
    assert run_attempt(spec, on_event=events.append).resumed_from_step == 12
    printed = {(e["rank"], line) for e in events if e["kind"] == "output" for line in e["lines"]}
    assert printed == {(r, f"own loop on rank {r} starts at step 12") for r in (0, 1)}
    kept += recorded_batches(logs, "samples")
    data = spec.data.model_copy(update={"loader_workers": 0})
    one = RankSamples(Augmented(LENGTH), None, data, spec.run.seed, 1, 0)
    expected = [[digest(x) for x in b["input"]] for e in range(2) for _, _, b in one.epoch(e)]
    assert len(expected) == 14 and kept == expected
