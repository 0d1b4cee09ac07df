"""Datasets read with pyarrow, split and sharded deterministically, resumable mid-epoch.

Every rank reads the (small) table, splits off the same validation rows, and takes its own
share of a per-epoch permutation that depends only on (seed, epoch). A ``Cursor`` names the
next batch; restoring it replays exactly the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core import storage
from trainer_core.errors import SpecError, StorageError
from trainer_core.spec import DATASET_FORMATS, DataSection

#: The synthetic regression set does not depend on the run's seed: one dataset for every run.
SYNTHETIC_DATA_SEED = 20240607


@dataclass(frozen=True)
class Arrays:
    features: np.ndarray  # float32 [n, num_features]
    labels: np.ndarray  # int64 [n] (classification) or float32 [n] (regression)

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray) -> Arrays:
        return Arrays(self.features[index], self.labels[index])


@dataclass(frozen=True)
class DatasetInfo:
    """What setup learns about a dataset before any worker starts."""

    num_rows: int
    num_features: int
    num_outputs: int  # classes for classification, 1 for regression


@dataclass(frozen=True)
class Cursor:
    """The next batch to train: ``batch`` within ``epoch``."""

    epoch: int
    batch: int

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch}

    @classmethod
    def from_json(cls, value: dict[str, int]) -> Cursor:
        return cls(int(value["epoch"]), int(value["batch"]))


def digits_uri() -> str:
    return str(importlib.resources.files("trainer_core") / "builtin_data" / "digits.parquet")


def synthetic_arrays(num_samples: int, num_features: int, noise: float) -> Arrays:
    """A deterministic linear regression problem with a little non-linearity and noise."""
    rng = np.random.default_rng(SYNTHETIC_DATA_SEED)
    x = rng.standard_normal((num_samples, num_features)).astype(np.float32)
    weights = rng.standard_normal(num_features).astype(np.float32)
    y = x @ weights + 0.5 * np.sin(x[:, 0]) + noise * rng.standard_normal(num_samples)
    return Arrays(x, y.astype(np.float32))


def _read_table(data: DataSection) -> pa.Table:
    uri = digits_uri() if data.dataset == "digits" else data.dataset
    location = storage.resolve(uri)
    columns = [*([data.features] if isinstance(data.features, str) else data.features or [])]
    if data.label:
        columns.append(data.label)
    try:
        dataset = pq.ParquetDataset(location.path, filesystem=location.filesystem)
        names = dataset.schema.names
        missing = [c for c in columns if c not in names]
        if missing:
            field = "data.label" if data.label in missing else "data.features"
            raise SpecError(
                f"dataset {location.uri} has no column(s) {missing}, named by {field}; it has "
                f"{names}. Fix data.features / data.label.",
                field=field,
            )
        check_column_types(dataset.schema, data, location.uri)  # before reading any rows
        return dataset.read(columns=columns)
    except FileNotFoundError as e:
        raise SpecError(
            f"dataset {location.uri} does not exist: fix data.dataset ({DATASET_FORMATS})",
            field="data.dataset",
        ) from e
    except (pa.ArrowInvalid, StorageError) as e:
        what = "is not Parquet" if "magic bytes" in str(e) else "could not be read as Parquet"
        raise SpecError(
            f"dataset {location.uri} {what}: {str(e).rstrip('.')}. Fix data.dataset: "
            f"relaytrain reads {DATASET_FORMATS}.",
            field="data.dataset",
        ) from e


def _is_number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def check_column_types(schema: pa.Schema, data: DataSection, uri: str) -> None:
    """Refuse label and feature columns of the wrong type from the schema alone (no rows read)."""
    assert data.label is not None and data.features is not None
    label = schema.field(data.label).type
    if data.task == "classification" and not pa.types.is_integer(label):
        raise SpecError(
            f"data.label column {data.label!r} of {uri} has type {label}, but data.task is "
            "'classification': labels must be integers 0..K-1. Fix data.label, or set "
            "data.task: regression",
            field="data.label",
        )
    if data.task == "regression" and not _is_number(label):
        raise SpecError(
            f"data.label column {data.label!r} of {uri} has type {label}: a regression label "
            "must be numeric. Fix data.label (a numeric column), or set data.task: "
            "classification for integer classes",
            field="data.label",
        )
    names = [data.features] if isinstance(data.features, str) else data.features
    for name in names:
        kind = schema.field(name).type
        is_list = pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind)
        if isinstance(data.features, str) and is_list:
            kind = kind.value_type
        if not _is_number(kind):
            raise SpecError(
                f"data.features column {name!r} of {uri} has type {schema.field(name).type}: "
                "features must be numeric (one list column of numbers, or numeric scalar "
                "columns). Fix data.features.",
                field="data.features",
            )


def _features_matrix(table: pa.Table, features: str | list[str]) -> np.ndarray:
    if isinstance(features, str):
        column = table.column(features).combine_chunks()
        if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
            values = column.flatten().to_numpy(zero_copy_only=False)
            width = len(values) // max(len(column), 1)
            if width * len(column) != len(values):
                raise SpecError(
                    f"data.features column {features!r} holds lists of different lengths: "
                    "every row needs the same number of features",
                    field="data.features",
                )
            return values.reshape(len(column), width).astype(np.float32)
        features = [features]
    try:
        return np.stack(
            [table.column(c).to_numpy(zero_copy_only=False) for c in features], axis=1
        ).astype(np.float32)
    except (ValueError, TypeError, pa.ArrowInvalid) as e:
        raise SpecError(
            f"data.features {features} are not numeric scalar columns: {e}",
            field="data.features",
        ) from e


def load_arrays(data: DataSection) -> Arrays:
    """Read the whole dataset named by ``data`` into arrays (features float32, labels typed)."""
    data = data.resolved()
    if data.dataset == "synthetic":
        s = data.synthetic
        return synthetic_arrays(s.num_samples, s.num_features, s.noise)
    return table_arrays(_read_table(data), data)


def table_arrays(table: pa.Table, data: DataSection) -> Arrays:
    """The features and labels of a table holding ``data``'s (resolved) columns."""
    assert data.features is not None and data.label is not None
    features = _features_matrix(table, data.features)
    if data.dataset == "digits":
        features = features / 16.0
    label_column = table.column(data.label)
    if label_column.null_count:
        raise SpecError(f"data.label column {data.label!r} has null values", field="data.label")
    labels = label_column.to_numpy(zero_copy_only=False)
    if data.task == "classification":
        if not np.issubdtype(labels.dtype, np.integer):
            raise SpecError(
                f"data.label column {data.label!r} has type {label_column.type}, but "
                "data.task is 'classification': labels must be integers 0..K-1 "
                "(or set data.task: regression)",
                field="data.label",
            )
        if len(labels) and labels.min() < 0:
            raise SpecError(
                f"data.label column {data.label!r} has negative classes", field="data.label"
            )
        labels = labels.astype(np.int64)
    else:
        if not np.issubdtype(labels.dtype, np.number):
            raise SpecError(
                f"data.label column {data.label!r} has type {label_column.type}: a regression "
                "label must be numeric",
                field="data.label",
            )
        labels = labels.astype(np.float32)
    return Arrays(features.astype(np.float32), labels)


def describe(data: DataSection, arrays: Arrays | None = None) -> DatasetInfo:
    """Validate the dataset and report its shape; raises SpecError naming the field to fix."""
    arrays = arrays if arrays is not None else load_arrays(data)
    resolved = data.resolved()
    if len(arrays) == 0:
        raise SpecError(f"dataset {data.dataset!r} has no rows", field="data.dataset")
    outputs = int(arrays.labels.max()) + 1 if resolved.task == "classification" else 1
    return DatasetInfo(len(arrays), int(arrays.features.shape[1]), outputs)


def split(arrays: Arrays, validation_fraction: float, seed: int) -> tuple[Arrays, Arrays]:
    """Deterministic train/validation split (the same on every rank and every attempt)."""
    order = np.random.default_rng([seed, 7]).permutation(len(arrays))
    num_val = round(len(arrays) * validation_fraction)
    return arrays.take(np.sort(order[num_val:])), arrays.take(np.sort(order[:num_val]))


def batches_per_epoch(num_samples: int, batch_size: int, world_size: int) -> int:
    per_rank = num_samples // world_size
    return -(-per_rank // batch_size)


def steps_per_epoch(num_samples: int, batch_size: int, world_size: int, accumulation: int) -> int:
    """Optimizer steps per epoch: each takes ``accumulation`` of a rank's batches (the last
    step of an epoch takes what is left)."""
    return -(-batches_per_epoch(num_samples, batch_size, world_size) // accumulation)


def group_steps(batches: list[np.ndarray], accumulation: int) -> list[list[np.ndarray]]:
    """An epoch's batches grouped into the micro-batches of each optimizer step."""
    return [batches[i : i + accumulation] for i in range(0, len(batches), accumulation)]


def epoch_batches(
    num_samples: int, batch_size: int, seed: int, epoch: int, rank: int, world_size: int
) -> list[np.ndarray]:
    """This rank's batches for ``epoch``: equal counts and sizes on every rank (DDP stays in step).

    The permutation depends only on (seed, epoch); rows beyond a multiple of world_size are
    dropped for that epoch (they come back in other epochs' permutations).
    """
    per_rank = num_samples // world_size
    if per_rank == 0:
        raise SpecError(
            f"{num_samples} training rows cannot be shared by {world_size} workers: lower "
            "scaling.num_workers or data.validation_fraction",
            field="scaling.num_workers",
        )
    order = np.random.default_rng([seed, epoch]).permutation(num_samples)
    mine = order[: per_rank * world_size][rank::world_size]
    return [mine[i : i + batch_size] for i in range(0, per_rank, batch_size)]


def shard(num_samples: int, rank: int, world_size: int) -> np.ndarray:
    """This rank's share of a dataset evaluated once (validation): every row, exactly once."""
    return np.arange(num_samples)[rank::world_size]
