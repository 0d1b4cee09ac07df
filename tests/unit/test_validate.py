"""The validation metrics' one definition, against plain torch and numpy on the whole set: sums
over uneven parts, divided by the rows, are the per-sample means."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional

from trainer_core.train import validate


def test_means_over_uneven_parts_are_the_means_over_every_row() -> None:
    generator = torch.Generator().manual_seed(0)
    output = torch.randn(37, 5, generator=generator)
    labels = torch.randint(0, 5, (37,), generator=generator)
    metric_fns = {"mean_abs_logit": lambda out, _: out.abs().mean()}
    names = validate.metric_names(True, metric_fns)
    assert names == ["val_loss", "val_accuracy", "mean_abs_logit"]
    sums = dict.fromkeys(names, 0.0)
    for part in (slice(0, 10), slice(10, 11), slice(11, 37)):
        loss = functional.cross_entropy(output[part], labels[part])
        found = validate.part_sums(output[part], labels[part], loss, True, metric_fns)
        for name, value in found.items():
            sums[name] += value
    means = {name: total / 37 for name, total in sums.items()}
    predicted = np.argmax(output.numpy(), axis=1)
    assert means["val_accuracy"] == pytest.approx(float(np.mean(predicted == labels.numpy())))
    assert means["val_loss"] == pytest.approx(float(functional.cross_entropy(output, labels)))
    assert means["mean_abs_logit"] == pytest.approx(float(np.abs(output.numpy()).mean()))


def test_regression_records_no_accuracy() -> None:
    output = torch.tensor([[1.0], [3.0]])
    labels = torch.tensor([[2.0], [2.0]])
    loss = functional.mse_loss(output, labels)
    assert validate.part_sums(output, labels, loss, False, {}) == {"val_loss": 2.0}
    assert validate.metric_names(False, {}) == ["val_loss"]
