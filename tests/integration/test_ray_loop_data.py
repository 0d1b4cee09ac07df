"""A Ray Train loop of a user's own reading a map-style torch Dataset through
``trainer_core.train.ray_loop_data.dataloader`` (issue 64, section 1), on the shared local Ray
cluster: the loop is written as Ray's checkpointing guide writes one, with the loader in place
of ``prepare_data_loader(DataLoader(...))``, and checkpoints mid-epoch.

- 2 workers, a raised fault, a resume from a mid-epoch checkpoint at 2 workers: the final
  weights are ``torch.equal`` to an uninterrupted run's, and every global batch holds the
  samples (and their augmentation draws) the uninterrupted run trained.
- 2 workers, a fault, a resume at 1 worker: the same samples in the same global order, the
  epoch's order as one process computes it with ``samples.IndexOrder``.

Ray workers import this module to run the loop: its top level imports no Prefect.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from tests.torch_datasets import Augmented, RecordingMLP, digest

pytestmark = pytest.mark.integration

#: 96 samples in global batches of 10: 9 batches an epoch (the last 6 of each order left out).
LENGTH, BATCH, EPOCHS = 96, 10, 2
#: A checkpoint every 4 steps (one report a step); the fault at the 11th report: the run
#: resumes from step 8, epoch 0 with one batch left.
CHECKPOINT_EVERY, FAULT_AT, RESUMED_AT = 4, 11, 8


class Numbered(Augmented):
    """``Augmented``'s samples with their index: ``(features, label, index)``."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        features, label = super().__getitem__(index)
        return features, label, index


# -- the loop (run by Ray's workers) ------------------------------------------------------------


def dataset_loop(config: dict[str, Any]) -> None:
    """Ray's guide's loop over a Dataset: model, optimizer, epoch and step in ``model.pt`` on
    rank 0 every ``CHECKPOINT_EVERY`` steps, resumed at the checkpoint's epoch (mid-epoch: the
    loader goes on from its sample). Each rank appends, per step, the indices and digests of
    its slice to ``config["log_dir"]/<pid>.jsonl``; rank 0 saves the final weights to
    ``config["final"]``."""
    import ray.train
    import ray.train.torch

    from trainer_core.train.ray_loop_data import dataloader

    torch.manual_seed(0)
    model: nn.Module = RecordingMLP()  # dropout: draws from torch's RNG
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    start_epoch, step = 0, 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "model.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, step = state["epoch"], state["step"]
    model = ray.train.torch.prepare_model(model)
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    dataset = Numbered(LENGTH)
    log = Path(config["log_dir"]) / f"{os.getpid()}.jsonl"
    for epoch in range(start_epoch, EPOCHS):
        loader = dataloader(
            dataset, batch_size=BATCH, epoch=epoch, num_workers=config["num_workers"]
        )
        for features, labels, indices in loader:
            loss = nn.functional.cross_entropy(model(features), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            line = {
                "rank": rank,
                "world_size": world_size,
                "indices": indices.tolist(),
                "samples": [digest(x) for x in features],
            }
            with open(log, "a") as f:
                f.write(json.dumps(line) + "\n")
            saved = rank == 0 and step % CHECKPOINT_EVERY == 0
            with tempfile.TemporaryDirectory() as tmp:
                if saved:
                    state = {
                        "model": getattr(model, "module", model).state_dict(),
                        "optimizer": optimizer.state_dict(),
                        "epoch": epoch,
                        "step": step,
                    }
                    torch.save(state, os.path.join(tmp, "model.pt"))
                ray.train.report(
                    {"loss": loss.item(), "step": step},
                    checkpoint=ray.train.Checkpoint.from_directory(tmp) if saved else None,
                )
    if rank == 0:
        torch.save(getattr(model, "module", model).state_dict(), config["final"])


# -- the runs -----------------------------------------------------------------------------------


def loop_spec(
    root: Path,
    name: str,
    workers: int | list[int],
    num_workers: int = 0,
    faulted: bool = False,
    cpus: int = 1,
):
    """The loop's run: ``workers`` (a count, or an elastic ``[MIN, MAX]``) of ``cpus`` each,
    ``num_workers`` loader processes, a raise at the ``FAULT_AT``-th report of attempt 1."""
    from trainer_core.spec.overrides import build_spec

    logs = root / f"{name}-logs"
    logs.mkdir(exist_ok=True)
    faults = [{"kind": "raise", "at_step": FAULT_AT, "attempt": 1}] if faulted else []
    return build_spec(
        {
            "run": {"name": name, "storage": str(root), "seed": 7},
            "scaling": {"num_workers": workers, "resources_per_worker": {"CPU": cpus}},
            "train_loop": "tests.integration.test_ray_loop_data:dataset_loop",
            "train_loop_config": {
                "log_dir": str(logs),
                "final": str(root / f"{name}-final.pt"),
                "num_workers": num_workers,
            },
            "checkpoint": {"keep_last": None},
            "retries": {"delay_s": 0, "jitter": 0},
            "faults": faults,
        }
    )


def final_weights(spec: Any) -> dict[str, torch.Tensor]:
    return torch.load(spec.train_loop_config["final"], weights_only=True)


def trained(spec: Any) -> tuple[list[list[int]], list[list[str]]]:
    """The global batches the attempt just run trained, every rank's slice joined in rank
    order: each sample's index, and its digest (``tests.recovery.recorded_batches``, which
    takes the records away)."""
    from tests.recovery import recorded_batches

    logs = Path(spec.train_loop_config["log_dir"])
    copy = logs / "samples"
    copy.mkdir(exist_ok=True)
    for path in logs.glob("*.jsonl"):
        (copy / path.name).write_text(path.read_text())
    return recorded_batches(logs, "indices"), recorded_batches(copy, "samples")


def attempt_and_resume(first: Any, then: Any) -> tuple[list[list[Any]], list[list[Any]]]:
    """``first`` fails at the fault; ``then`` (the same run) resumes from the mid-epoch
    checkpoint and completes. The global batches the run kept: indices, digests."""
    from tests.recovery import run_dir_of
    from trainer_core.errors import TrainingCodeError
    from trainer_core.run.engine import run_attempt

    with pytest.raises(TrainingCodeError):
        run_attempt(first)
    before = trained(first)
    assert len(before[0]) >= FAULT_AT
    result = run_attempt(then)
    assert result.status == "completed" and result.resumed_from_step == RESUMED_AT
    after = trained(then)
    attempts = run_dir_of(then).read_attempts()
    assert [a.get("resumed_from_step") for a in attempts] == [0, RESUMED_AT]
    return before[0][:RESUMED_AT] + after[0], before[1][:RESUMED_AT] + after[1]


@pytest.fixture(scope="module")
def reference(relaytrain_ray, tmp_path_factory):
    """2 workers, uninterrupted: its final weights and the global batches it trained."""
    from trainer_core.run.engine import run_attempt

    spec = loop_spec(tmp_path_factory.mktemp("ray-loop-data"), "reference", workers=2)
    assert run_attempt(spec).status == "completed"
    indices, samples = trained(spec)
    return {"indices": indices, "samples": samples, "weights": final_weights(spec)}


def one_process_order(seed: int) -> list[list[int]]:
    """Each global batch of each epoch as one process reads the epoch's order."""
    from trainer_core.data.samples import IndexOrder
    from trainer_core.spec.sections import DataSection

    data = DataSection(dataset="tests.integration.test_ray_loop_data:Numbered", batch_size=BATCH)
    order = IndexOrder(LENGTH, data, seed, split=False)
    return [
        order.epoch(epoch)[b * BATCH : (b + 1) * BATCH].tolist()
        for epoch in range(EPOCHS)
        for b in range(LENGTH // BATCH)
    ]


def test_a_faulted_ray_loop_resumed_mid_epoch_ends_with_the_uninterrupted_weights(
    reference, tmp_path
):
    spec = loop_spec(tmp_path, "faulted", workers=2, faulted=True)
    indices, samples = attempt_and_resume(spec, spec)
    assert len(indices) == EPOCHS * (LENGTH // BATCH) == len(reference["indices"])
    assert indices == reference["indices"] and samples == reference["samples"]
    weights = final_weights(spec)
    assert sorted(weights) == sorted(reference["weights"])
    for name, tensor in weights.items():
        assert torch.equal(tensor, reference["weights"][name]), name


def test_a_resume_at_one_worker_trains_the_same_samples_in_the_same_global_order(
    reference, tmp_path
):
    """An elastic run (1 to 2 workers, as a Ray loop's run changes its worker count): 2
    workers of 1 CPU fail at the fault; workers of 3 CPUs, of which the 4-CPU cluster holds
    one, resume from the mid-epoch checkpoint, with one loader process each. Every global batch
    holds the samples of the epoch's order one process computes, each with the augmentation
    draw the 2-worker reference trained it with."""
    from tests.recovery import run_dir_of

    first = loop_spec(tmp_path, "shrunk", workers=[1, 2], num_workers=1, faulted=True)
    then = loop_spec(tmp_path, "shrunk", workers=[1, 2], num_workers=1, faulted=True, cpus=3)
    indices, samples = attempt_and_resume(first, then)
    assert [a["world_size"] for a in run_dir_of(then).read_attempts()] == [2, 1]
    expected = one_process_order(first.run.seed)
    assert len(expected) == 18 and indices == expected
    assert reference["indices"] == expected
    assert samples == reference["samples"]
