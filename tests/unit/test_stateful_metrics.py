"""Stateful metrics (``metrics`` naming a class: update/merge/compute) on a real gloo group: F1
over validation rows split unevenly across 2 ranks and many batches is the F1 of all of them
(scikit-learn's, on the rows in one piece), on every rank; what setup says of one that breaks
the contract."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from examples.vision_resnet import MacroF1
from tests.unit.gloo_group import run_ranks
from trainer_core.errors import SpecError
from trainer_core.train import batch_checks
from trainer_core.train.validate import compute_states

#: Batch sizes of each rank's validation rows: uneven across ranks and within them.
SIZES = {0: [16, 16, 7], 1: [16, 3, 16, 16, 9]}


def rows(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``rank``'s batches of (logits, labels): skewed classes, a model right about half the time."""
    generator = torch.Generator().manual_seed(100 + rank)
    found = []
    for size in SIZES[rank]:
        labels = torch.multinomial(torch.linspace(1, 3, 10), size, True, generator=generator)
        logits = torch.randn(size, 10, generator=generator)
        logits[torch.arange(size), labels] += 1.2
        found.append((logits, labels))
    return found


def _rank(rank: int, world: int, out: str) -> None:
    metric = MacroF1()
    for logits, labels in rows(rank):
        metric.update(SimpleNamespace(logits=logits), {"labels": labels})
    value = compute_states({"val_MacroF1": metric}, world)["val_MacroF1"]
    torch.save(value, f"{out}/rank{rank}.pt")


def test_f1_over_ranks_is_the_f1_of_every_row(tmp_path):
    from sklearn.metrics import f1_score

    run_ranks(_rank, 2, str(tmp_path))
    every = [batch for rank in (0, 1) for batch in rows(rank)]
    labels = np.concatenate([b[1].numpy() for b in every])
    predicted = np.concatenate([b[0].argmax(dim=1).numpy() for b in every])
    expected = f1_score(labels, predicted, average="macro")
    found = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    assert found[0] == found[1]  # the same figure on every rank
    assert math.isclose(found[0], expected, rel_tol=1e-12)
    # What the mean of per-batch figures would have been is another number.
    per_batch = [f1_score(b[1].numpy(), b[0].argmax(dim=1).numpy(), average="macro") for b in every]
    assert abs(float(np.mean(per_batch)) - expected) > 1e-3


class NoMerge:
    def __init__(self) -> None:
        self.n = 0

    def update(self, outputs, batch) -> None:
        self.n += 1

    def compute(self) -> float:
        return float(self.n)


class NotANumber(NoMerge):
    def merge(self, other) -> None:
        self.n += other.n

    def compute(self) -> float:
        return float("nan")


@pytest.mark.parametrize(
    ("cls", "says"),
    [(NoMerge, "has no attribute 'merge'"), (NotANumber, "must return a finite number")],
)
def test_a_stateful_metric_that_breaks_the_contract_is_named_in_setup(cls, says):
    outputs = SimpleNamespace(logits=torch.zeros(2, 10))
    with pytest.raises(SpecError, match=says) as error:
        batch_checks._check_stateful_metric(
            cls, 1, f"tests.x:{cls.__name__}", outputs, {"labels": torch.zeros(2)}
        )
    assert error.value.field == "metrics.1"
