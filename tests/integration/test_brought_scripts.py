"""A script from outside the project, brought in each way the docs give, resumes bit for bit.

The script is Ray's own Train example, ``torch_fashion_mnist_example.py``, as the ray wheel
relaytrain pins installs it (an MLP with dropout, ``nn.CrossEntropyLoss``, SGD with momentum,
a DataLoader of a torchvision dataset, a test pass after every epoch). Each way is a file a user
would write from it, changing few of its lines (``tests/scripts/changed_lines.py`` counts them;
their imports of torchvision become imports of ``tests/scripts/torchvision_stand_in``: a tiny
set of 28x28 digits, since neither torchvision nor the download is to be had here):

- the built-in loop with the Dataset form (``fashion_mnist_builtin.py`` and its YAML spec);
- a loop on relaytrain's API (``fashion_mnist_own_loop.py``: ``run.setup``, ``run.epochs()``,
  ``run.dataloader(...)``, ``run.report``);
- a loop on Ray's API (``fashion_mnist_ray_loop.py``: the example with the checkpointing of Ray's
  guide added, and no RNG state saved: relaytrain saves and restores it).

Each runs uninterrupted once, and once through the flow with two faults: a raise in the first
attempt (a Prefect retry) and rank 1 SIGKILLed in the second (an in-place restart), each
resuming from a checkpoint in the middle of the run. Both end with the same weights, optimizer
state and history, compared with ``torch.equal``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from flows.training import training
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from tests.scripts import changed_lines
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration

SCRIPTS = Path(changed_lines.__file__).resolve().parent
RETRIES = {"infrastructure": 1, "code": 1, "in_place": 1, "delay_s": 0, "jitter": 0}
#: The built-in loop and the own loop: 256 samples in global batches of 32, 8 optimizer steps
#: an epoch, 2 epochs, a checkpoint every 3 steps. Attempt 1 raises as step 5 begins (it
#: resumes from 3); attempt 2's rank 1 is killed as step 11 begins (it resumes from 9).
STEP_FAULTS = [
    {"kind": "raise", "at_step": 5, "attempt": 1},
    {"kind": "kill", "at_step": 11, "attempt": 2, "rank": 1},
]
#: The Ray loop reports once an epoch, with a checkpoint, over 3 epochs. Attempt 1 raises at
#: its 2nd report (it resumes from the 1st's checkpoint); attempt 2's rank 1 is killed at the
#: run's 3rd report (it resumes from the 2nd's, or the 1st's if Ray had not yet registered it).
REPORT_FAULTS = [
    {"kind": "raise", "at_step": 2, "attempt": 1},
    {"kind": "kill", "at_step": 3, "attempt": 2, "rank": 1},
]


def builtin_spec(storage: Path, name: str, faults: list[dict[str, Any]]) -> Any:
    raw = yaml.safe_load((SCRIPTS / "fashion_mnist_builtin.yaml").read_text())
    raw["run"].update(name=name, storage=str(storage))
    raw["schedule"]["epochs"] = 2
    raw.update(
        checkpoint={"every": 3, "keep_last": None},
        report={"every": 3},
        retries=RETRIES,
        faults=faults,
    )
    return build_spec(raw)


def own_loop_spec(storage: Path, name: str, faults: list[dict[str, Any]]) -> Any:
    module = "tests.scripts.fashion_mnist_own_loop"
    return build_spec(
        {
            "run": {"name": name, "storage": str(storage), "seed": 0},
            "train_loop": f"{module}:train_func_per_worker",
            "train_loop_api": "relaytrain",
            "train_loop_config": {"lr": 1e-3, "batch_size_per_worker": 16},
            "data": {
                "dataset": f"{module}:training_data",
                "batch_size": 32,
                "loader_workers": 0,
                "validation_fraction": 0,  # the script trains on every training sample
            },
            "schedule": {"epochs": 2},
            "scaling": {"num_workers": 2},
            "checkpoint": {"every": 3, "keep_last": None, "best_metric": "loss"},
            "retries": RETRIES,
            "faults": faults,
        }
    )


def ray_loop_spec(storage: Path, name: str, faults: list[dict[str, Any]]) -> Any:
    return build_spec(
        {
            "run": {"name": name, "storage": str(storage)},
            "train_loop": "tests.scripts.fashion_mnist_ray_loop:train_func_per_worker",
            "train_loop_config": {"lr": 1e-3, "epochs": 3, "batch_size_per_worker": 16},
            "scaling": {"num_workers": 2},
            "checkpoint": {"keep_last": None, "best_metric": "loss"},
            "retries": RETRIES,
            "faults": faults,
        }
    )


def relaytrain_state(spec: Any) -> dict[str, Any]:
    """The newest committed checkpoint's model and optimizer state, and the loss history."""
    run_dir = run_dir_of(spec)
    return {"state": final_state(run_dir), "losses": losses(run_dir)}


def ray_state(spec: Any) -> dict[str, Any]:
    """The newest of the Ray checkpoints the loop wrote (its ``model.pt``: model, optimizer,
    epoch), and the report history."""
    run_dir = run_dir_of(spec)
    path = Path(spec.run.storage) / spec.run.name
    folders = [p for p in path.glob("checkpoint_*") if p.is_dir()]
    saved = [torch.load(p / "model.pt", weights_only=True) for p in folders]
    assert saved, f"no Ray checkpoint under {path}"
    return {"state": max(saved, key=lambda state: state["epoch"]), "losses": losses(run_dir)}


WAYS = {
    "builtin": (builtin_spec, STEP_FAULTS, relaytrain_state),
    "own_loop": (own_loop_spec, STEP_FAULTS, relaytrain_state),
    "ray_loop": (ray_loop_spec, REPORT_FAULTS, ray_state),
}


@pytest.mark.parametrize("way", list(WAYS))
def test_a_raise_and_a_kill_resume_bit_identical(way, relaytrain_ray, relaytrain_prefect, tmp_path):
    make_spec, faults, read_state = WAYS[way]
    reference = make_spec(tmp_path, "reference", [])
    assert run_attempt(reference).status == "completed"
    expected = read_state(reference)

    spec = make_spec(tmp_path, "faulted", faults)
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    attempts = run_dir_of(spec).read_attempts()
    # Both faults fired, and each failure resumed from a checkpoint in the middle of the run.
    assert [a["status"] for a in attempts] == ["failed", "completed"], attempts
    assert attempts[0]["error_class"] == "TrainingCodeError", attempts[0]
    restarts = attempts[1].get("restarts") or []
    assert [r["reason"] for r in restarts] == ["infrastructure"], attempts[1]
    resumed = [attempts[1]["resumed_from_step"], restarts[0]["resumed_from_step"]]
    raised_at, killed_at = (fault["at_step"] for fault in faults)
    assert 0 < resumed[0] < raised_at and 0 < resumed[1] < killed_at, resumed

    got = read_state(spec)
    assert differing(got["state"]["model"], expected["state"]["model"]) == {}
    assert_same_tensors(got["state"], expected["state"])  # the optimizer's state too
    assert got["losses"] == expected["losses"]


def differing(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """The parameters that are not ``torch.equal`` to the reference's, each with its largest
    difference: what a failure shows."""
    assert got.keys() == expected.keys()
    return {
        name: float((got[name] - expected[name]).abs().max())
        for name in got
        if not torch.equal(got[name], expected[name])
    }


def test_each_way_keeps_the_scripts_model_as_it_is():
    """The model class is the script's own in every way (not one line changed), and each way's
    diff against the installed original changes lines (a sanity check of the count the note
    reports: ``python -m tests.scripts.changed_lines``)."""
    original = changed_lines.original_path().read_text()
    model = original[original.index("class NeuralNetwork") : original.index("def train_func")]
    for path in changed_lines.WAYS.values():
        assert model in path.read_text(), path.name
        added, removed = changed_lines.changed(path)
        assert added and removed, path.name
