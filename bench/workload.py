"""The workloads every variant trains: one spec, and the same model, data, seeds and steps
outside relaytrain (for the bare Ray Train loop and the plain PyTorch script).

``Workload`` rebuilds what ``trainer_core.train.loop.BuiltinLoop`` sets up, with relaytrain's own
helpers (the rank's stream of its slices of the global batches, model builders, optimizer, LR
schedule, seeding), so a step of every variant does the same arithmetic on the same rows.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from bench.common import REPO
from trainer_core.checkpoint import optimizers, schedules, training_state
from trainer_core.data import arrays as data_mod
from trainer_core.data import footers, rank_stream, stream
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads

#: ``mlp_spec``'s sizes under ``--quick``: a smoke test of the harness, not a figure.
QUICK_MLP: dict[str, Any] = {"num_samples": 2048, "hidden": (64, 64)}


def mlp_spec(
    storage: str | Path,
    name: str,
    *,
    epochs: int,
    num_workers: int = 2,
    num_samples: int = 32768,
    num_features: int = 64,
    hidden: tuple[int, ...] = (512, 512, 512),
    batch_size: int = 128,
    checkpoint_every: int = 50,
    **sections: Any,
) -> RunSpec:
    """A compute-bound synthetic regression MLP (about 12 ms a step on one EPYC core at the
    defaults), relaytrain's default checkpoint and report cadence. ``batch_size`` is each
    worker's share: the global batch is ``batch_size * num_workers``. ``sections`` replace or
    extend whole spec sections."""
    raw: dict[str, Any] = {
        "run": {"name": name, "storage": str(storage), "seed": 0},
        "model": {"name": "mlp", "kwargs": {"hidden": list(hidden)}},
        "data": {
            "dataset": "synthetic",
            "batch_size": batch_size * num_workers,
            "validation_fraction": 0.1,
            "synthetic": {"num_samples": num_samples, "num_features": num_features},
        },
        "optimizer": {"name": "adam", "lr": 1e-3},
        "schedule": {"epochs": epochs},
        "scaling": {"num_workers": num_workers},
        "checkpoint": {"every": checkpoint_every, "keep_last": 3, "keep_best": 1},
        "report": {"every": 10},
        "retries": {"delay_s": 0, "jitter": 0},
    }
    return build_spec(_with_sections(raw, sections))


def mlp_label(quick: bool) -> str:
    """``mlp_spec``'s model at its default size, or at ``QUICK_MLP``'s, as settings name it."""
    return "synthetic MLP" + (" 64-64-64-1 (quick)" if quick else " 64-512x3-1")


def digits_spec(storage: str | Path, name: str, *, epochs: int, **sections: Any) -> RunSpec:
    """The default example (``examples/digits_cnn.yaml``: small CNN, 2 workers)."""
    import yaml

    raw = yaml.safe_load((REPO / "examples" / "digits_cnn.yaml").read_text())
    raw["run"].update({"name": name, "storage": str(storage)})
    raw["schedule"]["epochs"] = epochs
    raw["retries"].update({"delay_s": 0, "jitter": 0})
    return build_spec(_with_sections(raw, sections))


def _with_sections(raw: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """``raw`` with each of ``sections`` merged into its section (a dict) or replacing it."""
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    return raw


def steps_per_epoch(spec: RunSpec) -> int:
    """Optimizer steps per epoch (the same for every worker count)."""
    assert spec.data is not None
    data = spec.data.resolved()
    one = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    return data_mod.steps_per_epoch(one.batches_per_epoch, spec.optimizer.grad_accumulation)


class Workload:
    """One rank's model, optimizer, schedule and data, built as relaytrain's loop builds them."""

    def __init__(self, spec: RunSpec, rank: int, world_size: int):
        assert spec.model and spec.data and spec.schedule
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        self.data = spec.data.resolved()
        layout = footers.scan(self.data)
        info = stream.describe(layout, self.data)
        self.stream = rank_stream.RankStream(layout, self.data, spec.run.seed, world_size, rank)
        self.num_batches = self.stream.batches_per_epoch
        self.total_steps = self.num_batches * spec.schedule.epochs
        training_state.seed_everything(spec.run.seed)  # identical initial weights on every rank
        self.model = workloads.build_model(spec.model, info.num_features, info.num_outputs)
        self.optimizer = optimizers.make_optimizer(self.model.parameters(), spec.optimizer)
        self.scheduler = schedules.make_scheduler(self.optimizer, spec.schedule, self.total_steps)
        self.loss_fn = workloads.loss_function(self.data.task or "classification")
        #: relaytrain's ``precision`` as plain autocast (fp16 with a gradient scaler).
        self.autocast_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(spec.precision)
        self.scaler = torch.amp.GradScaler("cpu") if spec.precision == "fp16" else None
        training_state.seed_everything(spec.run.seed * 1009 + rank + 1)

    def batches(self, epoch: int) -> list[data_mod.Arrays]:
        """This rank's slices of the epoch's global batches, read before the epoch trains (the
        baselines' data costs nothing while they step)."""
        ahead = self.stream.epoch(epoch)
        try:
            return [rows for _, _, rows in ahead]
        finally:
            ahead.close()

    def step(self, model: torch.nn.Module, batch: data_mod.Arrays) -> float:
        """One optimizer step on ``batch``; the loss as a float (a sync, as in relaytrain's
        loop)."""
        features = torch.from_numpy(batch.features)
        labels = torch.from_numpy(batch.labels)
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(
            "cpu",
            dtype=self.autocast_dtype or torch.float32,
            enabled=self.autocast_dtype is not None,
        ):
            loss = self.loss_fn(model(features), labels) * self.stream.weight
        if self.scaler is None:
            loss.backward()
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            self.scaler.step(self.optimizer)
            self.scaler.update()
        self.scheduler.step()
        return loss.item()

    @torch.no_grad()
    def evaluate(self) -> float:
        """Validation loss over every rank's share (one all-reduce, as relaytrain's loop)."""
        self.model.eval()
        total, count = 0.0, 0
        for part in self.stream.validation():
            output = self.model(torch.from_numpy(part.features))
            total += float(self.loss_fn(output, torch.from_numpy(part.labels))) * len(part)
            count += len(part)
        sums = torch.tensor([total, float(count)], dtype=torch.float64)
        if self.world_size > 1:
            dist.all_reduce(sums)
        self.model.train()
        return float(sums[0]) / max(float(sums[1]), 1.0)

    def state(self, step: int) -> dict[str, Any]:
        """What a checkpoint of this rank holds (rank 0: model, optimizer, schedule too)."""
        state: dict[str, Any] = {"step": step, "rng": training_state.capture_rng()}
        if self.rank == 0:
            state.update(
                model=self.model.state_dict(),
                optimizer=self.optimizer.state_dict(),
                scheduler=self.scheduler.state_dict(),
            )
        return state

    def load(self, state: dict[str, Any]) -> int:
        """Restore a rank-0 state (model, optimizer, schedule); returns its step."""
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        return int(state["step"])


class BallastMLP(torch.nn.Module):
    """A small MLP carrying ``megabytes`` of random float32 state in a frozen parameter (as in
    fine-tuning): checkpoints of a chosen size at almost no cost per step (no gradient, no
    optimizer update, no DDP traffic).
    ``step_s`` stands in for a real model's compute: each training forward sleeps that long,
    so a checkpoint interval lasts as long as a real one would."""

    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        megabytes: float,
        hidden: int = 16,
        step_s: float = 0.0,
    ):
        super().__init__()
        self.net = workloads.MLP(num_inputs, num_outputs, hidden=(hidden,))
        generator = torch.Generator().manual_seed(0)
        numel = int(megabytes * 2**20) // 4
        ballast = torch.rand(numel, generator=generator)
        self.ballast = torch.nn.Parameter(ballast, requires_grad=False)
        self.step_s = step_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.step_s:
            time.sleep(self.step_s)
        return self.net(x)


def ballast_model(num_inputs: int, num_outputs: int, **kwargs: Any) -> torch.nn.Module:
    """``model.name: bench.workload:ballast_model`` (kwargs ``megabytes``, ``hidden``)."""
    return BallastMLP(num_inputs, num_outputs, **kwargs)


def random_state(megabytes: float, tensor_mb: float = 16.0) -> dict[str, torch.Tensor]:
    """A state dict of ``megabytes`` of random float32 tensors, ``tensor_mb`` each at most."""
    generator = torch.Generator().manual_seed(0)
    total = int(megabytes * 2**20) // 4
    per_tensor = int(tensor_mb * 2**20) // 4
    state = {}
    for index, start in enumerate(range(0, total, per_tensor)):
        numel = min(per_tensor, total - start)
        state[f"layer{index:03d}.weight"] = torch.rand(numel, generator=generator)
    return state
