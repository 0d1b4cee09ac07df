"""The Dataset form's workload checked in setup on the driver, before any worker starts: the
datasets are built once, their lengths tried against the batch, a few samples drawn twice under
the seeding the loaders use (an augmentation that does not draw from the seeded generators gives
another sample each time, and no resume could be exact), collated into a batch, and the model,
loss and metrics run on it. Each failure is a SpecError naming the function and the fix."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from trainer_core.data import samples
from trainer_core.data.sample_loader import loader_context
from trainer_core.errors import SpecError
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads
from trainer_core.train.batch_checks import check_batch, describe, equal
from trainer_core.train.batch_workload import BatchWorkload

#: Samples drawn (each twice) to try the augmentation's reproducibility and the collate.
TRIED = 4


def check_dataset_form(spec: RunSpec, train: Any, validation: Any, test: Any = None) -> int:
    """Try the spec's datasets, collate, model, loss and metrics as the loop will use them (a
    loop of the user's own: the datasets and the collate); returns the global batches of an
    epoch."""
    assert spec.data is not None
    data = spec.data
    order = samples.IndexOrder(len(train), data, spec.run.seed, split=validation is None)
    if order.batches_per_epoch == 0:
        where = "" if validation is not None else " (less data.validation_fraction's share)"
        raise SpecError(
            f"data.dataset {data.dataset!r} has {len(order.train_ids)} training samples"
            f"{where}, fewer than one global batch (data.batch_size={data.batch_size}): lower "
            "data.batch_size, or give a larger dataset",
            field="data.batch_size",
        )
    batches = [(_batch(spec, train, order.epoch(0)[:TRIED], 0, "data.dataset"), "data.dataset")]
    held = order.validation_ids if validation is None else range(len(validation))
    if len(held):
        source = train if validation is None else validation
        field = "data.dataset" if validation is None else "data.validation"
        evaluated = _batch(spec, source, list(held)[:TRIED], samples.VALIDATION, field)
        batches.append((evaluated, field))
    if test is not None and len(test):
        tried = range(min(len(test), TRIED))
        batches.append((_batch(spec, test, tried, samples.VALIDATION, "data.test"), "data.test"))
    if spec.model is not None and not spec.own_loop:  # an own loop calls its model itself
        model = workloads.build_model(spec.model, 0, 0, columns_form=True)
        workload = BatchWorkload(spec)
        for batch, field in batches:
            check_batch(spec, batch, workload, model, field)
    return order.batches_per_epoch


def _batch(spec: RunSpec, dataset: Any, ids: Any, epoch: int, field: str) -> dict[str, Any]:
    """The batch the loaders make of samples ``ids`` of ``epoch``, each drawn twice in a loader
    process, as the loop's are (this process's other threads may draw from the global
    generators at any moment: Prefect's and Ray's do), started as theirs are."""
    assert spec.data is not None
    seeded = samples.SeededSamples(dataset, spec.run.seed)
    path = getattr(spec.data, field.removeprefix("data."))
    keys = [(epoch, int(index)) for index in ids for _ in range(2)]
    loader = DataLoader(
        _Keys(seeded, keys),
        batch_size=None,
        num_workers=1,
        collate_fn=_as_drawn,
        generator=torch.Generator().manual_seed(0),
        multiprocessing_context=loader_context(),
    )
    drawn: list[Any] = []
    found = iter(loader)
    for index in ids:
        first = _sample(found, int(index), field, path)
        again = _sample(found, int(index), field, path)
        if not equal(first, again):
            raise SpecError(
                f"{field} {path!r}: sample {int(index)} came out different when drawn twice "
                "with the generators seeded alike. Draw the augmentation's randomness from "
                "torch's, numpy's or Python's global generator (relaytrain seeds them from "
                "run.seed, the epoch and the index before each sample, as torchvision's "
                "transforms draw), not from a generator of the dataset's own or the clock",
                field=field,
            )
        drawn.append(first)
    collate = samples.collate_function(spec.data)
    try:
        collated = collate(drawn)
    except Exception as e:
        fix = "fix data.collate" if spec.data.collate else "give data.collate to pad or stack them"
        raise SpecError(
            f"{field} {path!r}'s samples cannot be batched ({describe(drawn[0])}, ...): "
            f"{type(e).__name__}: {e}. Return tensors of the same shape for every sample, or "
            f"{fix}",
            field="data.collate" if spec.data.collate else field,
        ) from e
    return samples.as_batch(collated, field)


class _Keys(Dataset):
    """``keys`` of a ``SeededSamples``, in order."""

    def __init__(self, seeded: samples.SeededSamples, keys: list[tuple[int, int]]):
        self.seeded, self.keys = seeded, keys

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, position: int) -> Any:
        return self.seeded[self.keys[position]]


def _as_drawn(sample: Any) -> Any:
    return sample


def _sample(found: Any, index: int, field: str, path: str) -> Any:
    try:
        return next(found)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(
            f"{field} {path!r} raised {type(e).__name__} reading sample {index}: {e}. Fix the "
            "Dataset's __getitem__",
            field=field,
        ) from e
