"""The oracle that scores weights: a scenario with a validation file of its own has each verified
checkpoint's recorded val_loss recomputed from its ``model.pt`` in plain torch, and its best
checkpoint scoring no worse than any other. Nothing of relaytrain's: the network is read from the
state dict's layer names (the built-in MLP's and the user's own, ``adversary_user.Net``, alike).

Under bf16 the weights are scored as autocast computes them (the linear layers in bf16, the
error in fp32), to bf16's precision: the rows' order in a batch moves the last bits."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from tests.adversary.drive import Player
from tests.adversary.spec import validation_directory
from tests.adversary.verdict import Violation


def scores(player: Player) -> list[Violation]:
    """With a validation file of its own: each verified checkpoint's recorded val_loss is its
    weights' mean squared error over every row of the file, computed here (plain torch, the
    network read from the state dict's layer names), and the best checkpoint's weights score
    no worse than any other verified checkpoint's."""
    if not player.scenario.shape.validation_file:
        return []
    files = player.files
    path = validation_directory(player.dataset) / "part-00000.parquet"
    table = pq.read_table(path)
    features = torch.from_numpy(
        np.stack(table.column("x").to_numpy(zero_copy_only=False)).astype(np.float32)
    )
    labels = torch.from_numpy(table.column("y").to_numpy().astype(np.float32))
    bf16 = player.scenario.shape.precision == "bf16"
    tolerance = 2e-2 if bf16 else 1e-4  # relative: bf16 keeps 8 bits of mantissa
    found, measured = [], {}
    for step in files.committed_steps():
        if not files.verified(step):
            continue
        recorded = files.manifest(step).get("metrics", {}).get("val_loss")
        if recorded is None:  # a checkpoint between validations
            continue
        weights = files.tensors(step, "model.pt")
        measured[step] = mean_squared_error(weights, features, labels, bf16)
        if not math.isclose(recorded, measured[step], rel_tol=tolerance, abs_tol=1e-7):
            found.append(
                Violation(
                    "scores",
                    f"checkpoint {step} records val_loss {recorded}, its weights score "
                    f"{measured[step]} on the validation file",
                )
            )
    summary = files.summary() or {}
    uri = (summary.get("best_checkpoint_uri") or "").split("?")[0].rstrip("/")
    if uri and measured:
        step = int(uri.rsplit("checkpoint-", 1)[-1])
        bar = measured.get(step, math.inf)
        better = {s: v for s, v in measured.items() if v < bar - max(1e-6, tolerance * bar)}
        if step in measured and better:
            found.append(
                Violation(
                    "scores",
                    f"the best checkpoint {step} scores {measured[step]}, checkpoints "
                    f"{sorted(better)} score better",
                )
            )
    return found


def mean_squared_error(
    state: dict[str, Any], x: torch.Tensor, y: torch.Tensor, bf16: bool = False
) -> float:
    """The MLP of ``state`` (``net.<i>.weight`` and ``.bias`` of its linear layers, ReLU
    between them; dropout is off in evaluation) on ``x``, against ``y``; under CPU autocast to
    bf16 with ``bf16``."""
    layers = sorted(
        {int(k.split(".")[1]) for k in state if k.startswith("net.") and k.endswith(".weight")}
    )
    out = x
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        for n, i in enumerate(layers):
            out = torch.nn.functional.linear(out, state[f"net.{i}.weight"], state[f"net.{i}.bias"])
            if n < len(layers) - 1:
                out = torch.relu(out)
    return float(torch.mean((out.float().squeeze(-1) - y) ** 2))
