"""The built-in loop's checkpoints of an FSDP model (DCP) in a real gloo group of 2 processes,
against a run of the same steps that never checkpointed: when no candidate loads, training
starts as if no load had been tried; when an older one does, as if it had never stopped."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.unit.gloo_group import run_ranks
from trainer_core.checkpoint.manager import CheckpointManager, TrainingState


def _build() -> TrainingState:
    """A sharded model, its Adam and schedule, the same in every call (fixed seed)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return TrainingState(model, optimizer, scheduler)


def _step(state: TrainingState, rank: int, step: int) -> list[torch.Tensor]:
    """Optimizer step ``step`` on its fixed batch; this rank's shard of every parameter after."""
    generator = torch.Generator().manual_seed(step * 10 + rank)
    state.model(torch.randn(8, 16, generator=generator)).sum().backward()
    state.optimizer.step()
    state.optimizer.zero_grad()
    return [p.to_local().detach().clone() for p in state.model.parameters()]


def _adam_steps(state: TrainingState) -> dict[int, float]:
    """Adam's step count by parameter (none before the first step)."""
    return {i: float(value["step"]) for i, value in state.optimizer.state_dict()["state"].items()}


def _manager(root: str, state: TrainingState, rank: int, world: int) -> CheckpointManager:
    from trainer_core import storage
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.execution.worker_group import Relay, Timings
    from trainer_core.spec.operations import CheckpointSection

    return CheckpointManager(
        RunDirectory(storage.resolve(root)),
        CheckpointSection(every=1, keep_last=None, asynchronous=False),
        state,
        rank=rank,
        world_size=world,
        attempt=0,
        relay=Relay(None, rank),
        timings=Timings(),
        dcp=True,
    )


def _save_two_and_damage_the_newest(rank: int, world: int, root: str) -> None:
    """Checkpoints at steps 1 and 2, then rank 1's shard of step 2 damaged; every rank keeps
    its parameters after step 3 (``after-3-{rank}.pt``), trained on from step 2."""
    state = _build()
    manager = _manager(root, state, rank, world)
    for step in (1, 2):
        _step(state, rank, step)
        manager.save(step, {"metrics": {}, "cursor": {}}, [])
    manager.close()
    torch.save(_step(state, rank, 3), Path(root, f"after-3-{rank}.pt"))
    if rank == 0:
        shard = Path(root, "checkpoint-000000002", "__1_0.distcp")
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 1
        shard.write_bytes(bytes(data))
    dist.barrier()


def _load(root: str, state: TrainingState, rank: int, world: int, candidates: list[int]) -> Any:
    manager = _manager(root, state, rank, world)
    try:
        return manager.load(candidates)
    finally:
        manager.close()


def _fresh_start_after_failed_loads(rank: int, world: int, root: str) -> None:
    state = _build()
    loaded = _load(root, state, rank, world, [2])
    reasons = [skip["reason"] for skip in loaded.skipped]
    assert loaded.checkpoint is None, loaded
    # Refused by DCP's own read (on every rank), so the optimizer went through the load.
    assert len(reasons) == 1 and "DCP cannot load" in reasons[0], reasons

    never_loaded = _build()
    got, want = state.optimizer.state_dict(), never_loaded.optimizer.state_dict()
    untouched = got["state"] == {} and got == want
    counts = _adam_steps(state)
    stepped, reference = _step(state, rank, 1), _step(never_loaded, rank, 1)
    same = all(torch.equal(a, b) for a, b in zip(stepped, reference, strict=True))
    assert untouched and same, (
        f"after every candidate failed to load: Adam's step count by parameter {counts} (a "
        f"fresh optimizer has none); the first step equals a run's that never tried: {same}"
    )


def _resume_from_the_older_one(rank: int, world: int, root: str) -> None:
    state = _build()
    loaded = _load(root, state, rank, world, [2, 1])
    assert loaded.checkpoint is not None and loaded.checkpoint.step == 1, loaded
    assert [skip["step"] for skip in loaded.skipped] == [2], loaded.skipped
    assert "__1_0.distcp" in loaded.skipped[0]["reason"]  # names the damaged shard
    assert set(_adam_steps(state).values()) == {1.0}, _adam_steps(state)
    _step(state, rank, 2)
    after = _step(state, rank, 3)
    want = torch.load(Path(root, f"after-3-{rank}.pt"))
    assert all(torch.equal(a, b) for a, b in zip(after, want, strict=True)), (
        "steps 2 and 3 resumed from checkpoint 1 differ from the run that never stopped"
    )


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    root = str(tmp_path_factory.mktemp("manager") / "run")
    run_ranks(_save_two_and_damage_the_newest, 2, root)
    return root


def test_a_fresh_start_after_every_candidate_failed_begins_from_an_untouched_optimizer(
    run_dir: str,
) -> None:
    run_ranks(_fresh_start_after_failed_loads, 2, run_dir)


def test_a_damaged_newest_checkpoint_resumes_exactly_from_the_one_before(run_dir: str) -> None:
    run_ranks(_resume_from_the_older_one, 2, run_dir)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))
