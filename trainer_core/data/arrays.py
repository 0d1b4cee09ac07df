"""What the built-in loop's data is made of: typed arrays from Arrow tables, the built-in
sets, and the cursor a checkpoint records.

Which rows a rank trains on, and when, is ``trainer_core.data.sample_order``'s; reading them is
``trainer_core.data.stream``'s. A ``Cursor`` counts an epoch's global samples trained; restoring
it replays exactly the batches an uninterrupted run would have trained, on any number of workers.
"""

from __future__ import annotations

import importlib.resources
import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from trainer_core.errors import SpecError
from trainer_core.numbers import is_finite_number
from trainer_core.spec.sections import DataSection

#: The synthetic regression set does not depend on the run's seed: one dataset for every run.
SYNTHETIC_DATA_SEED = 20240607

#: The key of a Parquet file's key-value metadata that says how the loop scales the file's
#: features: JSON ``{"schema": 1, "scale": s, "offset": o}`` (by default 1 and 0), and the loop
#: trains on ``(x - offset) * scale``. Scaling follows the file, whatever name or path it is given
#: by: the bundled digits file records ``"scale": 0.0625`` (its pixels 0..16 become 0..1).
FEATURE_SCALING_KEY = "relaytrain.features"


#: Rows gathered at a time by ``Arrays.take_parts``: what it holds beside its result (about
#: 2 MB at 64 features).
TAKE_CHUNK = 8192


@dataclass(frozen=True)
class Arrays:
    """Rows of the tabular form: a feature matrix and a label vector."""

    features: np.ndarray  # float32 [n, num_features]
    labels: np.ndarray  # int64 [n] (classification) or float32 [n] (regression)

    def __len__(self) -> int:
        return len(self.labels)

    def take(self, index: np.ndarray) -> Arrays:
        return Arrays(self.features[index], self.labels[index])

    def slice(self, start: int, stop: int) -> Arrays:
        """Rows ``start..stop - 1`` (views, no copy)."""
        return Arrays(self.features[start:stop], self.labels[start:stop])

    @staticmethod
    def join(parts: list[Arrays]) -> Arrays:
        """The parts' rows one after another, in one copy."""
        if len(parts) == 1:
            return Arrays(parts[0].features.copy(), parts[0].labels.copy())
        return Arrays(
            np.concatenate([p.features for p in parts]), np.concatenate([p.labels for p in parts])
        )

    @staticmethod
    def take_parts(
        parts: list[tuple[np.ndarray, Arrays, np.ndarray]], count: int, into: Any = None
    ) -> Arrays:
        """``count`` rows from ``(positions, rows, index)`` parts: rows ``index`` of each part's
        rows go to its positions (``take`` gathers rows faster than fancy indexing does).
        ``into``: rows no longer used whose arrays are written over when their shapes fit (a
        window's arrays are tens of MB: new ones cost page faults, each time)."""
        if not parts:
            return Arrays(np.zeros((0, 0), np.float32), np.zeros(0, np.float32))
        first = parts[0][1]
        shape = (count, first.features.shape[1])
        if (
            isinstance(into, Arrays)
            and into.features.shape == shape
            and into.labels.dtype == first.labels.dtype
            and into.features.flags.writeable
            and into.labels.flags.writeable
        ):
            features, labels = into.features, into.labels
        else:
            features = np.empty(shape, np.float32)
            labels = np.empty(count, first.labels.dtype)
        for where, rows, index in parts:
            for start in range(0, len(index), TAKE_CHUNK):  # a window's part: in pieces
                at, chosen = where[start : start + TAKE_CHUNK], index[start : start + TAKE_CHUNK]
                features[at] = rows.features.take(chosen, axis=0)
                labels[at] = rows.labels.take(chosen)
        return Arrays(features, labels)

    @staticmethod
    def save(rows: Arrays, stem: str) -> None:
        np.save(f"{stem}-features.npy", rows.features)
        np.save(f"{stem}-labels.npy", rows.labels)

    @staticmethod
    def load(stem: str) -> Arrays:
        return Arrays(np.load(f"{stem}-features.npy"), np.load(f"{stem}-labels.npy"))


@dataclass(frozen=True)
class DatasetInfo:
    """What setup learns about a dataset before any worker starts."""

    num_rows: int
    num_features: int
    num_outputs: int  # classes for classification, 1 for regression


@dataclass(frozen=True)
class Cursor:
    """Where an epoch's training resumes: ``samples`` global samples of ``epoch`` were trained
    (a whole number of global batches: a checkpoint is taken only between steps)."""

    epoch: int
    samples: int

    def batch(self, batch_size: int) -> int:
        """The next global batch of ``epoch``."""
        return self.samples // batch_size

    def to_json(self) -> dict[str, int]:
        return {"epoch": self.epoch, "samples": self.samples}

    @classmethod
    def from_json(cls, value: dict[str, int]) -> Cursor:
        return cls(int(value["epoch"]), int(value["samples"]))


def digits_uri() -> str:
    return str(importlib.resources.files("trainer_core") / "builtin_data" / "digits.parquet")


def synthetic_arrays(num_samples: int, num_features: int, noise: float) -> Arrays:
    """A deterministic linear regression problem with a little non-linearity and noise."""
    rng = np.random.default_rng(SYNTHETIC_DATA_SEED)
    x = rng.standard_normal((num_samples, num_features)).astype(np.float32)
    weights = rng.standard_normal(num_features).astype(np.float32)
    y = x @ weights + 0.5 * np.sin(x[:, 0]) + noise * rng.standard_normal(num_samples)
    return Arrays(x, y.astype(np.float32))


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


def feature_scaling(schema: pa.Schema) -> tuple[float, float]:
    """The ``(offset, scale)`` a file's metadata records under ``FEATURE_SCALING_KEY``
    (``(0.0, 1.0)`` without it); SpecError naming the key when it holds something else."""
    raw = (schema.metadata or {}).get(FEATURE_SCALING_KEY.encode())
    if raw is None:
        return 0.0, 1.0
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if isinstance(value, dict) and value.get("schema") == 1 and set(value) <= _SCALING_FIELDS:
        offset, scale = value.get("offset", 0.0), value.get("scale", 1.0)
        if is_finite_number(offset) and is_finite_number(scale) and scale != 0:
            return float(offset), float(scale)
    raise SpecError(
        f"the Parquet metadata {FEATURE_SCALING_KEY!r} of data.dataset is "
        f"{raw.decode(errors='replace')!r}: write JSON "
        '{"schema": 1, "scale": S, "offset": O} (finite numbers, S not 0; scale and offset '
        "optional) or remove the key",
        field="data.dataset",
    )


_SCALING_FIELDS = {"schema", "scale", "offset"}


def _features_matrix(table: pa.Table, features: str | list[str]) -> np.ndarray:
    if isinstance(features, str):
        chunked = table.column(features)
        # One chunk (a row group read whole) is used as it is, not copied.
        column = chunked.chunk(0) if chunked.num_chunks == 1 else chunked.combine_chunks()
        if pa.types.is_fixed_size_list(column.type) or pa.types.is_list(column.type):
            flat = column.flatten()
            # Without nulls, the values' own buffer (read-only): asking for a copy-if-needed
            # copies through a slow path whenever a validity bitmap is present, even empty.
            values = flat.to_numpy(zero_copy_only=flat.null_count == 0)
            width = len(values) // max(len(column), 1)
            if width * len(column) != len(values):
                raise SpecError(
                    f"data.features column {features!r} holds lists of different lengths: "
                    "every row needs the same number of features",
                    field="data.features",
                )
            return values.reshape(len(column), width).astype(np.float32, copy=False)
        features = [features]
    try:
        return np.stack(
            [table.column(c).to_numpy(zero_copy_only=False) for c in features], axis=1
        ).astype(np.float32, copy=False)
    except (ValueError, TypeError, pa.ArrowInvalid) as e:
        raise SpecError(
            f"data.features {features} are not numeric scalar columns: {e}",
            field="data.features",
        ) from e


def table_arrays(table: pa.Table, data: DataSection) -> Arrays:
    """The features and labels of a table holding ``data``'s (resolved) columns."""
    assert data.features is not None and data.label is not None
    features = _features_matrix(table, data.features)
    offset, scale = feature_scaling(table.schema)
    if offset:
        features = features - np.float32(offset)
    if scale != 1.0:
        features = features * np.float32(scale)
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
                f"data.label column {data.label!r} has negative classes (down to "
                f"{labels.min()}): classes must be 0..K-1. Fix data.label.",
                field="data.label",
            )
        labels = labels.astype(np.int64)
    elif data.task is None and np.issubdtype(labels.dtype, np.integer):
        labels = labels.astype(np.int64)  # a loop of the user's own: integers stay integers
    else:
        if not np.issubdtype(labels.dtype, np.number):
            raise SpecError(
                f"data.label column {data.label!r} has type {label_column.type}: a regression "
                "label must be numeric",
                field="data.label",
            )
        labels = labels.astype(np.float32)
    return Arrays(features.astype(np.float32, copy=False), labels)


def steps_per_epoch(batches: int, accumulation: int) -> int:
    """Optimizer steps in an epoch of ``batches`` global batches, ``accumulation`` a step (the
    last step takes what is left)."""
    return -(-batches // accumulation)
