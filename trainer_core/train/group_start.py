"""Where a worker group starts: which group of the attempt it is, the checkpoints to resume
from, where its training stands, and this rank's stream of the run's pinned dataset (or of its
torch Dataset: ``rank_samples``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data import dataset_snapshot, footers, held_out, rank_stream, samples, stream
from trainer_core.data.sample_loader import RankSamples
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import Relay, all_reduce


def resume_candidates(
    config: WorkerConfig, relay: Relay, run_dir: RunDirectory
) -> tuple[int, list[int]]:
    """Which worker group of the attempt this is (0: the first; n after the n-th in-place
    restart), and the committed steps to try, newest first: the driver's scan for the first
    group; after an in-place restart (the same attempt, no new plan) rank 0 scans again, for
    what the lost group committed, and tells the others."""
    group = int(all_reduce([float(relay.begin_group())])[0])
    relay.joined(group)
    if group == 0:
        return group, list(config.candidates)
    found = [[c.step for c in reversed(run_dir.scan().committed)]]
    dist.broadcast_object_list(found, src=0)
    return group, list(found[0])


@dataclass
class Progress:
    """Where a worker's training stands: its step, the data cursor, the step resumed from."""

    step: int = 0
    cursor: data_mod.Cursor = field(default_factory=lambda: data_mod.Cursor(0, 0))
    resumed_from: int | None = None


def rank_data(
    config: WorkerConfig, data_spec: Any, seed: int, world_size: int, rank: int
) -> tuple[rank_stream.RankStream, data_mod.DatasetInfo]:
    """This rank's stream of the run's dataset snapshot (``seed``: the run's), as the driver
    pinned it (no rank lists the dataset), and the dataset's info."""
    snapshot = config.dataset["snapshot"] if config.dataset is not None else None
    if snapshot is not None:
        layout = dataset_snapshot.from_json(snapshot, data_spec)
        info = data_mod.DatasetInfo(**config.dataset["info"])  # type: ignore[index]
    else:  # generated data
        layout = footers.scan(data_spec)
        info = stream.describe(layout, data_spec)
    ranks = rank_stream.RankStream(layout, data_spec, seed, world_size, rank)
    if data_spec.validation is not None:  # a validation set of its own, pinned alike
        view = held_out.held_view(data_spec, "validation")
        pinned = ((snapshot or {}).get("held") or {}).get("validation")
        held = (
            dataset_snapshot.from_json(pinned, held_out.source(data_spec, "validation"))
            if pinned is not None
            else footers.scan(view)
        )
        ranks.held = rank_stream.RankStream(held, view, seed, world_size, rank)
    return ranks, info


def rank_samples(
    config: WorkerConfig, data_spec: Any, seed: int, world_size: int, rank: int, pin_memory: bool
) -> RankSamples:
    """This rank's side of a Dataset-form run: the spec's datasets built in this worker, their
    lengths checked against what the driver pinned (SpecError naming both)."""
    train = samples.build_dataset(data_spec.dataset, data_spec.kwargs, "data.dataset")
    held = (
        samples.build_dataset(data_spec.validation, data_spec.validation_kwargs, "data.validation")
        if data_spec.validation
        else None
    )
    samples.check_lengths(config.dataset, train, held)
    return RankSamples(
        train, held, data_spec, seed, world_size, rank, pin_memory=pin_memory, forked=True
    )
