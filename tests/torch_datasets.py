"""Map-style torch Datasets for the Dataset form's tests: one whose augmentation draws from
torch's, numpy's and Python's global generators (as a script's transforms do), ones that break
each rule setup checks, and a model that records what each training forward pass saw."""

from __future__ import annotations

import hashlib
import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

WIDTH = 12


class Augmented(Dataset):
    """``length`` samples ``(features [WIDTH], label)``: sample i's base vector, rolled by a
    torch draw, plus numpy noise, scaled by a Python draw (when ``augment``)."""

    def __init__(self, length: int = 96, augment: bool = True, classes: int = 3):
        self.length, self.augment, self.classes = length, augment, classes

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.length:
            raise IndexError(index)
        base = torch.sin(torch.arange(WIDTH, dtype=torch.float32) * (index + 1) / 7)
        label = index % self.classes
        base[label] += 1.0  # learnable
        if self.augment:
            base = torch.roll(base, int(torch.randint(0, 3, (1,)).item()) - 1)
            base = base + torch.from_numpy(np.random.normal(0, 0.05, WIDTH).astype(np.float32))
            base = base * (0.9 + 0.2 * random.random())
        return base, label


def augmented(length: int = 96, augment: bool = True) -> Augmented:
    return Augmented(length, augment)


class DictSamples(Dataset):
    """Samples as dicts, HuggingFace style: ``{"features", "labels"}``."""

    def __init__(self, length: int = 40):
        self.inner = Augmented(length)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, index: int) -> dict[str, Any]:
        features, label = self.inner[index]
        return {"features": features, "labels": label}


def dict_samples(length: int = 40) -> DictSamples:
    return DictSamples(length)


def hf_samples(length: int = 60) -> Any:
    """A HuggingFace ``datasets.Dataset`` of ``{"features", "labels"}`` rows, augmented on the
    fly (``with_transform``: noise from torch's global generator), as HF's docs do it."""
    import datasets

    rows = [Augmented(length, augment=False)[i] for i in range(length)]
    table = datasets.Dataset.from_dict(
        {"features": [r[0].tolist() for r in rows], "labels": [r[1] for r in rows]}
    )
    return table.with_transform(hf_augment)


def hf_augment(batch: dict[str, list[Any]]) -> dict[str, Any]:
    """``hf_samples``' transform (at module level: the loader processes are spawned, and
    unpickle it by name)."""
    features = torch.tensor(batch["features"])
    return {
        "features": features + 0.05 * torch.randn(features.shape),
        "labels": torch.tensor(batch["labels"]),
    }


class Stream(IterableDataset):
    def __iter__(self):
        yield from (Augmented()[i] for i in range(4))


def iterable() -> Stream:
    return Stream()


class NoLength:
    def __getitem__(self, index: int) -> Any:
        return Augmented()[index]


def no_length() -> NoLength:
    return NoLength()


class OwnGenerator(Augmented):
    """Augments from a generator of its own, seeded by nothing relaytrain controls."""

    def __init__(self) -> None:
        super().__init__(augment=False)
        self.rng = np.random.default_rng()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        features, label = super().__getitem__(index)
        return features + float(self.rng.normal()), label


def own_generator() -> OwnGenerator:
    return OwnGenerator()


class Ragged(Augmented):
    """Samples of uneven lengths: default_collate cannot stack them."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        features, label = super().__getitem__(index)
        return features[: 4 + index % 3], label


def ragged() -> Ragged:
    return Ragged(augment=False)


def digest(features: torch.Tensor) -> str:
    """A sample's features in a few bytes: which sample, and which draw of its augmentation."""
    return hashlib.blake2b(features.detach().numpy().tobytes(), digest_size=8).hexdigest()


class RecordingMLP(nn.Module):
    """An MLP with dropout that records each training forward pass's samples in a worker:
    ``{"rank", "world_size", "samples"}`` JSON lines in ``log_dir/<pid>.jsonl``."""

    def __init__(self, log_dir: str | None = None, hidden: int = 16, classes: int = 3):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(WIDTH, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes)
        )
        self.log_dir = log_dir

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if self.log_dir and self.training and dist.is_initialized():
            line = {
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "samples": [digest(row) for row in features],
            }
            with open(Path(self.log_dir) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return self.net(features)


def recording_mlp(**kwargs: Any) -> nn.Module:
    return RecordingMLP(**kwargs)


def own_loop(config: dict[str, Any]) -> None:
    """A script's per-epoch loop on relaytrain's API over a torch Dataset of its own making:
    ``run.dataloader(...)`` in place of ``DataLoader(...)``; each rank's slice comes as
    ``{"input", "labels"}``; ``RecordingMLP`` records the samples it sees (in
    ``config["log_dir"]``)."""
    from torch.utils.data import default_collate

    from trainer_core.train import own_loop as api

    run = api.session()
    model = RecordingMLP(config["log_dir"])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model = run.setup(model, optimizer)
    dataset = Augmented(config["length"])
    print(f"own loop on rank {run.rank} starts at step {run.step}")
    for _epoch in run.epochs():
        loader = run.dataloader(dataset, batch_size=10, num_workers=2, collate_fn=default_collate)
        for inputs, labels in loader:  # as the DataLoader it replaces hands them out
            loss = nn.functional.cross_entropy(model(inputs), labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.report({"loss": loss.item()})
