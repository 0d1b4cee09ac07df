"""The reference a scenario is judged against: its history without faults, damage, reruns or
reads (each ``run`` and ``continue`` as the same command, uninterrupted, on a fixed number of
workers), on local storage, over the scenario's files as written. Computed once per shape (data,
spec knobs and the epochs and worker counts of its commands) and cached by that key, as the
fault matrix caches its uninterrupted runs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tests.adversary.drive import Player
from tests.adversary.scenario import Action, Scenario
from tests.adversary.store import RunFiles
from tests.adversary.world import World

SEGMENT = re.compile(r"segment-a(\d{4})-\d{9}-\d{9}\.jsonl")


@dataclass
class Reference:
    steps_per_epoch: int
    #: The newest committed checkpoint's ``model.pt`` and ``optimizer.pt``.
    model: dict[str, Any]
    optimizer: dict[str, Any]
    #: (step, loss) of every step, as the run directory publishes them.
    losses: list[tuple[int, float]]


def fault_free(scenario: Scenario) -> Scenario:
    history = tuple(
        Action(a.kind, epochs=a.epochs, workers=a.workers)
        for a in scenario.history
        if a.kind in ("run", "continue")
    )
    # An elastic shape's reference is the fixed group's: a group that got every worker it
    # asked for trains the bits a fixed one does.
    shape = dataclasses.replace(scenario.shape, storage="local", elastic=False)
    return dataclasses.replace(scenario, shape=shape, history=history)


def key(scenario: Scenario) -> str:
    plain = fault_free(scenario)
    shape = dataclasses.asdict(plain.shape)
    shape.pop("storage")
    what = {
        "shape": shape,
        "data": dataclasses.asdict(plain.data),
        "history": [(a.kind, a.epochs, a.workers) for a in plain.history],
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def reference(scenario: Scenario, world: World, cache: Path) -> Reference:
    """The scenario's reference, from ``cache`` or run now (its commands' logs beside it)."""
    path = cache / f"{key(scenario)}.pt"
    if path.exists():
        return Reference(**torch.load(path, weights_only=True))
    plain = fault_free(scenario)
    player = Player(plain, world, cache / f"{key(scenario)}-run", lambda: 0, label="ref")
    outcomes = player.play()
    failed = [o for o in outcomes if o.code != 0]
    if failed:
        raise RuntimeError(
            f"the reference of seed {scenario.seed} failed: {failed[0].argv}\n{failed[0].tail()}"
        )
    files = player.files
    first = json.loads(Path(outcomes[0].argv[4]).read_text())
    steps = first["steps_completed"] // max(1, first["epochs_completed"])
    newest = files.committed_steps()[-1]
    made = Reference(
        steps_per_epoch=steps,
        model=files.tensors(newest, "model.pt"),
        optimizer=files.tensors(newest, "optimizer.pt"),
        losses=losses(files),
    )
    cache.mkdir(parents=True, exist_ok=True)
    torch.save(dataclasses.asdict(made), path)
    return made


def losses(files: RunFiles) -> list[tuple[int, float]]:
    """The run's metrics history as the run directory publishes it (one row per step): what
    `relaytrain show`, TensorBoard and MLflow read, merged by relaytrain's own rule."""
    from trainer_core.checkpoint.history import merge_metrics

    segments = []
    for name in files.names("metrics"):
        match = SEGMENT.fullmatch(name)
        if match:
            body = files.read(f"metrics/{name}").decode()
            rows = [json.loads(line) for line in body.splitlines() if line]
            segments.append((int(match.group(1)), rows))
    return [(row["step"], row["loss"]) for row in merge_metrics(segments, files.attempts())]
