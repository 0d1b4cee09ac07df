"""What a run trains, as spec sections: the run's name and storage, the model, the data; and the
rules every section shares. How it is optimized (optimizer, schedule) is ``optimization``'s."""

from __future__ import annotations

import difflib
import posixpath
import re
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from trainer_core.errors import SpecError

SCHEMA_VERSION = 1


RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")


IMPORT_PATH_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


def import_path(value: str | None, field: str, called_as: str = "") -> str | None:
    """``value`` when it is an import path ``package.module:function`` (or None); otherwise a
    ValueError naming ``field`` and, in ``called_as``, how the function is called."""
    if value is not None and not IMPORT_PATH_PATTERN.fullmatch(value):
        raise ValueError(
            f"{field} {value!r} is not an import path: use 'package.module:function'"
            + (f", {called_as}" if called_as else "")
        )
    return value


BUILTIN_MODELS = ("mlp", "cnn")


BUILTIN_DATASETS = ("digits", "synthetic")


#: What ``data.dataset`` may name, for messages that refuse something else.
DATASET_FORMATS = (
    "a Parquet file or a directory of Parquet files (local or on any run.storage URI), or a "
    "built-in: 'digits', 'synthetic'"
)


#: Suffixes of tabular formats relaytrain does not read: refused before anything is opened.
NOT_PARQUET_SUFFIXES = {
    ".csv": "CSV",
    ".tsv": "TSV",
    ".txt": "text",
    ".json": "JSON",
    ".jsonl": "JSON lines",
    ".ndjson": "JSON lines",
    ".arrow": "Arrow IPC",
    ".feather": "Feather",
    ".orc": "ORC",
    ".xlsx": "Excel",
    ".npy": "NumPy",
    ".npz": "NumPy",
    ".h5": "HDF5",
    ".hdf5": "HDF5",
    ".pkl": "pickle",
    ".pt": "PyTorch",
}


#: ``run.seed`` seeds numpy, whose seeds are 32-bit.
MAX_SEED = 2**32 - 1


#: What the built-in loop measures on the validation split itself.
BUILTIN_VALIDATION_METRICS = ("val_loss", "val_accuracy", "val_perplexity")


PositiveInt = Annotated[int, Field(gt=0)]


NonNegativeInt = Annotated[int, Field(ge=0)]


class _Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _known_keys(cls, value: Any) -> Any:
        """Refuse an unknown key (a typo like ``schedul``) naming the closest known one."""
        if isinstance(value, dict):
            known = list(cls.model_fields)
            for key in value:
                if key not in cls.model_fields:
                    close = difflib.get_close_matches(str(key), known, n=1)
                    hint = f"did you mean {close[0]!r}? " if close else ""
                    raise SpecError(
                        f"unknown key {key!r}: {hint}the keys here are {known}",
                        field=str(key),
                    )
        return value


def is_dataset_function(value: str) -> bool:
    """Whether ``data.dataset`` names a function (``package.module:function``) rather than a
    Parquet path or URI (which has a ``/`` or a ``://``, or is a built-in's name)."""
    return bool(IMPORT_PATH_PATTERN.fullmatch(value))


def not_parquet_format(uri: str) -> str | None:
    """The tabular format a URI's suffix names when it is not Parquet (``.csv``: "CSV")."""
    suffix = posixpath.splitext(uri.split("?", 1)[0].rstrip("/"))[1].lower()
    return NOT_PARQUET_SUFFIXES.get(suffix)


def metric_name(path: str) -> str:
    """The name a validation metric ``package.module:function`` is recorded under."""
    return "val_" + path.rsplit(":", 1)[1]


def validate_run_name(name: str) -> str:
    """Return ``name`` if it is a safe run name, else raise SpecError naming the rule."""
    if not RUN_NAME_PATTERN.fullmatch(name) or ".." in name:
        raise SpecError(
            f"run.name {name!r} is not a valid run name: use 1-100 characters from "
            "letters, digits, '.', '_' and '-', starting with a letter or digit, and no '..' "
            "(a run name is a directory under run.storage and must not escape it).",
            field="run.name",
        )
    return name


class RunSection(_Section):
    name: str | None = None
    storage: str = "./runs"
    seed: int = 0
    #: A committed checkpoint URI whose model weights start a fresh run (warm start). Ignored
    #: once the run has checkpoints of its own.
    init_from: str | None = None
    #: A Prefect block holding the storage credentials, as ``<block-type-slug>/<block-name>``
    #: (e.g. ``aws-credentials/lake``, ``minio-credentials/dev``, ``secret/lake-keys``). Only
    #: the block's name travels in the spec; without it, credentials come from the environment.
    credentials: str | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return None if value is None else validate_run_name(value)

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int) -> int:
        if not 0 <= value <= MAX_SEED:
            raise ValueError(
                f"run.seed {value} is out of range: give an integer from 0 to {MAX_SEED} "
                "(2**32 - 1, numpy's seed range)"
            )
        return value

    @field_validator("storage")
    @classmethod
    def _storage(cls, value: str) -> str:
        if not value.strip():
            raise ValueError(
                "run.storage is empty: give a path or a URI such as s3://bucket/prefix"
            )
        return value


class ModelSection(_Section):
    #: "mlp", "cnn", or the import path of a builder ``package.module:function``: called as
    #: ``fn(num_inputs, num_outputs, **kwargs)`` for the tabular form (data.features), as
    #: ``fn(**kwargs)`` returning any ``nn.Module`` for the columns form (data.columns).
    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)
    #: The columns form: which keys of a batch the model takes. A key: passed positionally
    #: (``model(batch[key])``); a list: as keyword arguments. None: every key but ``labels``,
    #: as keyword arguments.
    inputs: str | list[str] | None = None
    #: The columns form: ``package.module:function`` called as ``fn(model, batch)`` instead of
    #: the ``inputs`` rule, returning the model's outputs.
    forward: str | None = None

    @field_validator("forward")
    @classmethod
    def _forward(cls, value: str | None) -> str | None:
        return import_path(
            value, "model.forward", "a function fn(model, batch) returning the model's outputs"
        )

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value not in BUILTIN_MODELS and not IMPORT_PATH_PATTERN.fullmatch(value):
            raise ValueError(
                f"model.name {value!r} is neither a built-in model {BUILTIN_MODELS} nor an "
                "import path 'package.module:function'"
            )
        return value


class SyntheticSection(_Section):
    num_samples: PositiveInt = 2048
    num_features: PositiveInt = 16
    noise: Annotated[float, Field(ge=0)] = 0.1


class DataSection(_Section):
    #: "digits", "synthetic", a Parquet URI / path (file or directory), or the Dataset form:
    #: the import path ``package.module:function`` of a function returning a map-style torch
    #: ``Dataset`` (``__len__`` and ``__getitem__``; a HuggingFace ``datasets.Dataset`` too),
    #: called as ``fn(**data.kwargs)``.
    dataset: str
    #: The Dataset form: keyword arguments of ``data.dataset``'s function.
    kwargs: dict[str, Any] = Field(default_factory=dict)
    #: The validation set: a Parquet path or URI (the Parquet forms: every row of it, in the
    #: training set's columns), or for the Dataset form a function like ``data.dataset``
    #: (called with ``data.validation_kwargs``). None: ``data.validation_fraction`` of the
    #: training set's rows (indices), by hash.
    validation: str | None = None
    validation_kwargs: dict[str, Any] = Field(default_factory=dict)
    #: The test set, as ``data.validation`` is given, evaluated once, when the run completes,
    #: on the best checkpoint: its figures are the result's ``test_metrics`` (``test_loss``,
    #: ...).
    test: str | None = None
    test_kwargs: dict[str, Any] = Field(default_factory=dict)
    #: The Dataset form: torch ``DataLoader`` worker processes per training worker (0: in the
    #: training process). Each sample is the same whatever this is.
    loader_workers: NonNegativeInt = 2
    #: The tabular form: one list column (e.g. "pixels") or several scalar columns of numbers,
    #: and the label column.
    features: str | list[str] | None = None
    label: str | None = None
    #: The columns form (instead of features/label): Arrow columns of any type (binary,
    #: string, lists, structs, numbers) read as they are and handed to ``transform``.
    columns: list[str] | None = None
    #: The columns form: ``package.module:function`` called as ``fn(row, rng)`` on every
    #: training row (a dict of its columns as Python values), returning a dict of arrays or
    #: tensors (decode, tokenize, augment). ``rng`` is a numpy Generator keyed by (run.seed,
    #: epoch, row id): the same row gets the same draw on any worker count and after any
    #: resume, another one each epoch. None: the columns as they are (numbers, lists).
    transform: str | None = None
    #: ``transform`` takes a batch: ``fn(rows, rngs)`` with a dict of columns (lists) and one
    #: generator per row, returning a dict of batched arrays (no collate).
    transform_batched: bool = False
    #: The transform of the validation rows (e.g. without augmentation); None: ``transform``.
    #: Its rng is keyed by (run.seed, row id): the same every epoch.
    eval_transform: str | None = None
    #: ``package.module:function`` that makes a batch (a dict of tensors) of a list of
    #: transformed rows (stack, pad). None: ``torch.utils.data.default_collate``.
    collate: str | None = None
    #: Transform workers per training worker, off the training thread (0: in the read-ahead
    #: thread itself), as threads or, for transforms that hold the GIL, processes.
    transform_workers: NonNegativeInt = 2
    transform_pool: Literal["threads", "processes"] = "threads"
    #: What the built-in loss and metrics are: classification (logits [B, C], ``labels`` [B]),
    #: regression, or causal_lm (logits [B, T, V], ``labels`` [B, T]: each position predicts
    #: the next token; -100 carries no label). None with the columns form: the spec's ``loss``.
    task: Literal["classification", "regression", "causal_lm"] | None = None
    #: The global batch: samples per micro-batch summed over every worker (each worker takes
    #: a slice; slices differ by one sample when the workers do not divide it, their losses
    #: weighted so the gradient is the whole batch's mean). The same for every worker count.
    batch_size: PositiveInt = 32
    #: Rows whose hash of (run.seed, row id) falls below this are validation rows (the Dataset
    #: form: indices; not used when data.validation names the validation set).
    validation_fraction: Annotated[float, Field(ge=0, lt=1)] = 0.2
    #: Rows shuffled together: each of the ``partitions`` parts of an epoch is shuffled within
    #: consecutive windows of this many samples. A worker holds about one window (plus a row
    #: group each side) per partition it reads.
    shuffle_window: PositiveInt = 8192
    #: An epoch is read as this many contiguous parts side by side: every global batch draws
    #: from each. A worker reads only the parts its slice overlaps (about partitions/workers).
    partitions: PositiveInt = 8
    #: Micro-batches each worker reads ahead in a background thread.
    prefetch: PositiveInt = 2
    #: What a worker's reader may hold, in MB: the live shuffle windows (at most half of it)
    #: and the row group slices around them. Row groups bigger than a slice are read in parts
    #: (streamed once, spilled to local disk), so this holds whatever the files' row groups.
    memory_mb: Annotated[int, Field(ge=64)] = 512
    synthetic: SyntheticSection = Field(default_factory=SyntheticSection)

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, value: str) -> str:
        if is_dataset_function(value):
            return value
        kind = not_parquet_format(value)
        if kind:
            raise ValueError(
                f"data.dataset {value!r} is a {kind} file, not Parquet: "
                f"relaytrain reads {DATASET_FORMATS}. Convert it to Parquet (e.g. "
                "pyarrow.parquet.write_table(pyarrow.csv.read_csv(path), 'data.parquet')) and "
                "point data.dataset at that"
            )
        return value

    @field_validator("transform", "eval_transform", "collate")
    @classmethod
    def _import_paths(cls, value: str | None, info: Any) -> str | None:
        return import_path(value, f"data.{info.field_name}")

    @field_validator("validation", "test")
    @classmethod
    def _held_sets(cls, value: str | None, info: Any) -> str | None:
        """A function (the Dataset form) or a Parquet path or URI (the Parquet forms)."""
        if value is None or is_dataset_function(value):
            return value
        kind = not_parquet_format(value)
        if kind:
            raise ValueError(
                f"data.{info.field_name} {value!r} is a {kind} file, not Parquet: name a "
                "Parquet file or directory (or, with a torch Dataset, a function returning one)"
            )
        return value

    @model_validator(mode="after")
    def _builtin_defaults(self) -> DataSection:
        if self.torch_dataset:
            self._check_dataset_form()
            return self
        dataset_only = [
            k for k in ("kwargs", "validation_kwargs", "test_kwargs") if getattr(self, k)
        ]
        dataset_only += [
            k for k in ("validation", "test") if is_dataset_function(getattr(self, k) or "")
        ]
        if dataset_only:
            raise SpecError(
                f"data.{dataset_only[0]} belongs to the Dataset form, but data.dataset "
                f"{self.dataset!r} is not a function: name one returning a torch Dataset "
                "('package.module:function'), or give data.validation and data.test as Parquet "
                "paths",
                field=f"data.{dataset_only[0]}",
            )
        if self.columns is not None:
            self._check_columns_form()
            return self
        hooks = [k for k in ("transform", "eval_transform", "collate") if getattr(self, k)]
        if hooks:
            raise SpecError(
                f"data.{hooks[0]} transforms the rows of the columns form: name the columns it "
                "reads with data.columns (instead of data.features and data.label)",
                field=f"data.{hooks[0]}",
            )
        if self.task == "causal_lm":
            raise SpecError(
                "data.task causal_lm trains on token sequences: name the columns with "
                "data.columns and make input_ids and labels with data.transform",
                field="data.task",
            )
        if self.dataset not in BUILTIN_DATASETS and (self.features is None or self.label is None):
            raise ValueError(
                f"data.dataset {self.dataset!r} is a Parquet dataset: name its columns with "
                "data.features (one list column or a list of scalar columns) and data.label, "
                "or with data.columns (any columns, handed to data.transform)"
            )
        return self

    def _check_columns_form(self) -> None:
        both = [k for k in ("features", "label") if getattr(self, k) is not None]
        if both:
            raise SpecError(
                f"data.columns and data.{both[0]} are two forms of data: data.columns hands "
                "any columns to data.transform, data.features/data.label read numbers only. "
                "Use one of them",
                field="data.columns",
            )
        if not self.columns or len(set(self.columns)) != len(self.columns):
            raise SpecError(
                f"data.columns {self.columns} must name one or more distinct columns",
                field="data.columns",
            )
        if self.transform_batched and self.transform is None:
            raise SpecError(
                "data.transform_batched is true but there is no data.transform: name the "
                "batched transform, fn(rows, rngs)",
                field="data.transform_batched",
            )

    def _check_dataset_form(self) -> None:
        """The Dataset form reads samples from the user's Dataset: none of the Parquet forms'
        column keys or row transforms apply."""
        other = [
            k
            for k in ("features", "label", "columns", "transform", "eval_transform")
            if getattr(self, k) is not None
        ]
        if other:
            raise SpecError(
                f"data.{other[0]} reads Parquet columns, but data.dataset {self.dataset!r} is "
                "a function returning a torch Dataset, whose __getitem__ makes each sample "
                "(augmentation included): remove data." + other[0],
                field=f"data.{other[0]}",
            )
        for held in ("validation", "test"):
            given = getattr(self, held)
            if given is not None and not is_dataset_function(given):
                raise SpecError(
                    f"data.{held} {given!r} is a Parquet path, but data.dataset "
                    f"{self.dataset!r} is a torch Dataset's function: name a function "
                    f"returning the {held} set's Dataset ('package.module:function')",
                    field=f"data.{held}",
                )
            if getattr(self, f"{held}_kwargs") and getattr(self, held) is None:
                raise SpecError(
                    f"data.{held}_kwargs is set but data.{held} is not: name the function "
                    f"that returns the {held} set",
                    field=f"data.{held}_kwargs",
                )

    @property
    def split_fraction(self) -> float:
        """The share of the training set's rows (indices) held out by hash for validation: none
        when data.validation names a validation set of its own."""
        return 0.0 if self.validation is not None else self.validation_fraction

    @property
    def torch_dataset(self) -> bool:
        """The Dataset form: ``data.dataset`` names a function returning a torch Dataset."""
        return is_dataset_function(self.dataset)

    @property
    def columns_form(self) -> bool:
        """Whether a batch is a dict of tensors for any model (Arrow columns made into batches
        by the transform, or a torch Dataset's samples collated)."""
        return self.columns is not None or self.torch_dataset

    def resolved(self) -> DataSection:
        """This section with the built-in datasets' columns and task filled in."""
        if self.columns_form:
            return self
        defaults: dict[str, Any] = {}
        if self.dataset == "digits":
            defaults = {"features": "pixels", "label": "label", "task": "classification"}
        elif self.dataset == "synthetic":
            defaults = {"features": "x", "label": "y", "task": "regression"}
        update = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return self.model_copy(update=update)
