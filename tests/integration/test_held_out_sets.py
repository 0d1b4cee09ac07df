"""Parquet validation and test sets of their own (``data.validation``, ``data.test``), as a
dataset with a fixed test split ships them (MNIST's, wikitext's files): the training file is
trained whole, each validated checkpoint records what its weights score on the validation files,
and the test file is scored once, on the best checkpoint. The validation directory is pinned: a
half-written file landing in it between attempts is neither read nor a reason to stop."""

from __future__ import annotations

import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.data.arrays import digits_uri
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import finalize_run
from trainer_core.spec.overrides import build_spec
from trainer_core.train import workloads

pytestmark = pytest.mark.integration


def write_splits(root) -> dict[str, str]:
    """The bundled digits as a training file (600 rows), a validation directory of two files
    (200 rows) and a test file (200 rows), metadata (feature scaling) kept."""
    table = pq.read_table(digits_uri())
    (root / "validation").mkdir()
    pq.write_table(table.slice(0, 600), root / "train.parquet")
    pq.write_table(table.slice(600, 100), root / "validation" / "part-0.parquet")
    pq.write_table(table.slice(700, 100), root / "validation" / "part-1.parquet")
    pq.write_table(table.slice(800, 200), root / "test.parquet")
    return {
        "train": str(root / "train.parquet"),
        "validation": str(root / "validation"),
        "test": str(root / "test.parquet"),
    }


def raw(root, files: dict[str, str], name: str, **sections) -> dict:
    spec = {
        "run": {"name": name, "storage": str(root), "seed": 1},
        "model": {"name": "mlp", "kwargs": {"hidden": [32], "dropout": 0.1}},
        "data": {
            "dataset": files["train"],
            "validation": files["validation"],
            "test": files["test"],
            "features": "pixels",
            "label": "label",
            "task": "classification",
            "batch_size": 50,
            "shuffle_window": 256,
            "partitions": 2,
        },
        "optimizer": {"name": "adam", "lr": 0.01},
        "schedule": {"epochs": 2},
        "scaling": {"num_workers": 2},
        "checkpoint": {"every": 5, "keep_last": None},
        "retries": {"delay_s": 0, "jitter": 0},
    }
    spec.update(sections)
    return spec


def scored(weights: dict, path: str) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``weights`` on every row under ``path``, in plain
    torch (the files' feature scaling, 1/16, applied by hand)."""
    model = workloads.MLP(64, 10, hidden=(32,), dropout=0.1)
    model.load_state_dict(weights)
    model.eval()
    table = pq.read_table(path)
    features = torch.from_numpy(np.stack(table.column("pixels").to_numpy(zero_copy_only=False)))
    labels = torch.from_numpy(table.column("label").to_numpy())
    with torch.no_grad():
        logits = model(features.float() * 0.0625)
    loss = nn.functional.cross_entropy(logits, labels).item()
    return loss, (logits.argmax(dim=1) == labels).sum().item() / len(labels)


def test_validation_and_test_files_of_their_own_through_a_retry(relaytrain_ray, tmp_path):
    files = write_splits(tmp_path)
    reference = build_spec(raw(tmp_path, files, "reference"))
    assert run_attempt(reference).status == "completed"
    spec = build_spec(
        raw(tmp_path, files, "faulted", faults=[{"kind": "raise", "at_step": 19, "attempt": 1}])
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    # A writer starts a third validation file: half of a Parquet file, no footer yet.
    whole = (tmp_path / "validation" / "part-0.parquet").read_bytes()
    (tmp_path / "validation" / "part-2.parquet").write_bytes(whole[: len(whole) // 2])
    second = run_attempt(spec)
    assert second.status == "completed" and second.resumed_from_step == 15
    run_dir = run_dir_of(spec)
    # Every training row trains: 600 rows in global batches of 50, 12 steps an epoch.
    assert run_dir.scan().newest.step == 24
    assert_same_tensors(final_state(run_dir), final_state(run_dir_of(reference)))
    assert losses(run_dir) == losses(run_dir_of(reference))
    validated = [c for c in run_dir.scan().committed if "val_loss" in c.metrics]
    assert [c.step for c in validated] == [12, 24]
    for checkpoint in validated:  # the weights it holds, scored on the 200 validation rows
        weights = torch.load(f"{checkpoint.uri}/model.pt", weights_only=True)
        loss, accuracy = scored(weights, files["validation"] + "/part-0.parquet")
        loss_b, accuracy_b = scored(weights, files["validation"] + "/part-1.parquet")
        assert math.isclose(checkpoint.metrics["val_loss"], (loss + loss_b) / 2, rel_tol=1e-5)
        assert math.isclose(
            checkpoint.metrics["val_accuracy"], (accuracy + accuracy_b) / 2, rel_tol=1e-9
        )
    result = finalize_run(spec, run_dir, str(tmp_path), "completed")
    best = torch.load(result.best_model_uri, weights_only=True)
    loss, accuracy = scored(best, files["test"])
    assert math.isclose(result.test_metrics["test_loss"], loss, rel_tol=1e-5)
    assert math.isclose(result.test_metrics["test_accuracy"], accuracy, rel_tol=1e-9)
