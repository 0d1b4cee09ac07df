"""The Dataset form (``data.dataset: package.module:function``): a map-style torch ``Dataset``
the user already has, read in an order that does not depend on the worker count, each sample's
randomness a function of (run.seed, epoch, index).

- **Indices.** The training set's indices are ``0..len-1`` (less those ``data.validation_fraction``
  takes by hash when there is no ``data.validation``: ``sample_order.is_validation``, the rule
  the Parquet forms split rows by). Epoch e's order is a permutation of them keyed by
  (run.seed, e) alone; global batch b is its positions ``[b*B, (b+1)*B)``, rank r of W takes
  ``sample_order.rank_slice`` of it. The cursor counts global samples, so a resume at any worker
  count continues the same epoch from the same sample. The epoch's last ``len % B`` are left
  out (other epochs' orders train them).
- **Seeding.** Before each ``__getitem__(i)``, in whichever process runs it, torch's (CPU),
  numpy's and Python's global generators are seeded from (run.seed, epoch, i): an augmentation
  written against them (torchvision's transforms draw from torch's) gives a sample the same draw
  on any worker count, any number of loader processes and after any resume. In the training
  process itself (``data.loader_workers: 0``) the generators' states are put back after the
  sample, so the training's own draws (dropout) do not depend on how samples were loaded.
  Validation samples are keyed by (run.seed, ``VALIDATION``, i): the same every epoch.

Pure torch and numpy (no Ray): ``sample_loader`` reads it through torch's ``DataLoader``.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info

from trainer_core.data import sample_order
from trainer_core.errors import SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.sections import DataSection

#: The epoch validation samples are keyed with (no training epoch reaches it).
VALIDATION = 2**32 - 1

#: The batch keys of a sample that is a pair ``(input, target)``: the model is called as
#: ``model(batch["input"])`` (``batch_workload``), the built-in losses read ``labels``.
INPUT, LABELS = "input", "labels"

Batch = dict[str, Any]


def build_dataset(path: str, kwargs: Mapping[str, Any], field: str) -> Any:
    """The map-style Dataset ``path``'s function returns for ``kwargs``: SpecError naming the
    field and the fix for a function that raises, an iterable dataset, or one without
    ``__len__`` or ``__getitem__``."""
    fn = import_object(path, field)
    try:
        dataset = fn(**kwargs)
    except (SpecError, OSError):  # an OSError (a mount, a download) may be transient
        raise
    except Exception as e:
        raise SpecError(
            f"{field} {path!r} raised {type(e).__name__} when called with "
            f"{dict(kwargs)}: {e}. Fix the function, or its kwargs",
            field=field,
        ) from e
    check_map_style(
        dataset,
        f"{field} {path!r} returned",
        field,
        "Return one, or write the data to Parquet and name it in data.dataset",
    )
    return dataset


def check_map_style(dataset: Any, source: str, field: str, stream_fix: str) -> None:
    """SpecError naming ``dataset`` (``source``: what gave it, as "data.dataset 'x:y'
    returned") and the fix when it is an iterable dataset (``stream_fix``: what to do with a
    stream), or has no ``__len__`` or ``__getitem__``."""
    name = type(dataset).__name__
    if isinstance(dataset, IterableDataset):
        raise SpecError(
            f"{source} an IterableDataset ({name}): relaytrain resumes by index, so it needs "
            f"a map-style Dataset (__len__ and __getitem__). {stream_fix}",
            field=field,
        )
    missing = [m for m in ("__len__", "__getitem__") if not hasattr(dataset, m)]
    if missing:
        raise SpecError(
            f"{source} {name}, which has no {' or '.join(missing)}: return a "
            "map-style torch Dataset (or anything with __len__ and __getitem__, such as a "
            "HuggingFace datasets.Dataset)",
            field=field,
        )


_MASK64 = 0xFFFFFFFFFFFFFFFF


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """The seed of sample ``index`` in ``epoch``: a 63-bit hash of the three (splitmix64,
    ``sample_order.splitmix64``'s, on Python ints: it runs before every sample, and numpy's
    one-element arrays took 30 times as long)."""
    value = seed
    for part in (epoch, index):
        value = _splitmix64(value ^ _splitmix64(part))
    return value >> 1


def _splitmix64(value: int) -> int:
    z = (value + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def seed_globals(value: int) -> None:
    """Seed the generators an augmentation draws from: torch's CPU generator (not CUDA's,
    which the training's own draws use), numpy's global one (32 bits) and Python's."""
    torch.random.default_generator.manual_seed(value)
    np.random.seed(value & 0xFFFFFFFF)
    random.seed(value)


class SeededSamples(Dataset):
    """``dataset`` indexed by ``(epoch, index)``: each sample drawn with the global generators
    seeded by ``sample_seed(seed, epoch, index)``. In the training process (no loader worker)
    the generators' states are restored afterwards."""

    def __init__(self, dataset: Any, seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        if get_worker_info() is not None:  # a loader process: its generators are its own
            seed_globals(sample_seed(self.seed, epoch, index))
            return self.dataset[index]
        saved = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
        try:
            seed_globals(sample_seed(self.seed, epoch, index))
            return self.dataset[index]
        finally:
            torch.random.set_rng_state(saved[0])
            np.random.set_state(saved[1])
            random.setstate(saved[2])


class IndexOrder:
    """The training indices of a Dataset of ``length`` samples and each epoch's order of them
    (see the module docstring). ``split``: ``data.validation_fraction`` of the indices are
    validation samples (no separate validation set)."""

    def __init__(self, length: int, data: DataSection, seed: int, split: bool):
        self.length, self.seed, self.batch_size = length, seed, data.batch_size
        ids = np.arange(length, dtype=np.int64)
        held = sample_order.is_validation(ids, seed, data.validation_fraction) if split else None
        #: Training indices in index order, and (with ``split``) the validation ones.
        self.train_ids = ids if held is None else ids[~held]
        self.validation_ids = ids[:0] if held is None else ids[held]
        self.batches_per_epoch = len(self.train_ids) // self.batch_size

    def epoch(self, epoch: int) -> np.ndarray:
        """The training indices in ``epoch``'s order."""
        order = np.random.default_rng([self.seed, epoch, 17]).permutation(len(self.train_ids))
        return self.train_ids[order]

    def rank_batches(
        self, epoch: int, first: int, world_size: int, rank: int
    ) -> Iterator[tuple[int, np.ndarray]]:
        """``(global batch index, indices rank trains on)`` for the batches ``first..`` of
        ``epoch``."""
        order = self.epoch(epoch)
        start, stop = sample_order.rank_slice(self.batch_size, world_size, rank)
        for index in range(first, self.batches_per_epoch):
            base = index * self.batch_size
            yield index, order[base + start : base + stop]


def rank_part(ids: Sequence[int] | np.ndarray, world_size: int, rank: int) -> np.ndarray:
    """Rank ``rank``'s contiguous share of ``ids`` (validation: every sample once)."""
    ids = np.asarray(ids, dtype=np.int64)
    total = len(ids)
    return ids[total * rank // world_size : total * (rank + 1) // world_size]


def collate_function(data: DataSection) -> Callable[[list[Any]], Any]:
    """``data.collate`` (a list of samples to a batch), else torch's ``default_collate``."""
    return import_object(data.collate, "data.collate") if data.collate else default_collate


def as_batch(collated: Any, field: str = "data.dataset") -> Batch:
    """A collated batch as the dict the columns form's model call and losses read: a dict as
    it is; a pair ``(input, target)`` as ``{"input": ..., "labels": ...}``. SpecError naming
    what else a Dataset's samples were."""
    if isinstance(collated, Mapping):
        return dict(collated)
    if isinstance(collated, tuple | list) and len(collated) == 2:
        return {INPUT: collated[0], LABELS: collated[1]}
    raise SpecError(
        f"{field}'s samples collate into {type(collated).__name__}"
        f"{f' of {len(collated)} items' if isinstance(collated, tuple | list) else ''}: "
        "return each sample as a pair (input, target) or a dict of tensors (with 'labels' "
        "for the built-in losses), or make the batch with data.collate",
        field=field,
    )


def lengths_record(train: Any, validation: Any) -> dict[str, Any]:
    """What the run directory keeps of a Dataset-form run's data (dataset.json): the sets'
    lengths, which every later attempt must find again (the order is a function of them)."""
    lengths = {"train": len(train)}
    if validation is not None:
        lengths["validation"] = len(validation)
    body = {"schema": 1, "kind": "torch_dataset", "lengths": lengths}
    return {**body, "fingerprint": lengths_record_fingerprint(body)}


def lengths_record_fingerprint(record: Mapping[str, Any]) -> str:
    """The fingerprint of a ``lengths_record`` (computed from its lengths, not the one it
    states: an edited record has another)."""
    body = {"schema": 1, "kind": "torch_dataset", "lengths": dict(record["lengths"])}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def check_lengths(pinned: Mapping[str, Any] | None, train: Any, validation: Any) -> None:
    """SpecError naming both lengths when a set's length is not the one the run pinned
    (``pinned``: ``lengths_record``'s, None: nothing pinned yet)."""
    if pinned is None:
        return
    found = lengths_record(train, validation)["lengths"]
    for name, length in dict(pinned.get("lengths") or {}).items():
        if found.get(name) != length:
            field = "data.dataset" if name == "train" else "data.validation"
            raise SpecError(
                f"{field}'s {name} set has {found.get(name)} samples, but this run began "
                f"with {length}: the order of every epoch, and so the resume, depends on the "
                f"length. Give the run the dataset it began with, or start a new run.name to "
                f"train on the dataset as it is now",
                field=field,
            )
