"""What a run trains, as spec sections: the run's name and storage, the model, the data, the
optimizer and the schedule; and the rules every section shares."""

from __future__ import annotations

import difflib
import posixpath
import re
import warnings
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
    #: The Dataset form: the validation set, a function like ``data.dataset`` (called with
    #: ``data.validation_kwargs``). None: ``data.validation_fraction`` of the training set's
    #: indices, by hash, as the Parquet forms split their rows.
    validation: str | None = None
    validation_kwargs: dict[str, Any] = Field(default_factory=dict)
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

    @field_validator("validation")
    @classmethod
    def _validation(cls, value: str | None) -> str | None:
        return import_path(
            value, "data.validation", "a function returning the validation set's torch Dataset"
        )

    @model_validator(mode="after")
    def _builtin_defaults(self) -> DataSection:
        if self.torch_dataset:
            self._check_dataset_form()
            return self
        dataset_only = [
            k for k in ("kwargs", "validation", "validation_kwargs") if getattr(self, k)
        ]
        if dataset_only:
            raise SpecError(
                f"data.{dataset_only[0]} belongs to the Dataset form, but data.dataset "
                f"{self.dataset!r} is not a function: name one returning a torch Dataset "
                "('package.module:function')",
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
        if self.dataset not in BUILTIN_DATASETS and self.task is None:
            raise ValueError(
                "data.task is required for a Parquet dataset: 'classification' or 'regression'"
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
        if self.validation_kwargs and self.validation is None:
            raise SpecError(
                "data.validation_kwargs is set but data.validation is not: name the function "
                "that returns the validation set",
                field="data.validation_kwargs",
            )

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


#: ``optimizer.name``'s short names, and the torch optimizer each names.
BUILTIN_OPTIMIZERS = {
    "sgd": "torch.optim:SGD",
    "adam": "torch.optim:Adam",
    "adamw": "torch.optim:AdamW",
}


#: The optimizer's arguments that have keys of their own in the optimizer section.
OPTIMIZER_OWN_KEYS = ("lr", "weight_decay", "momentum")


class OptimizerSection(_Section):
    #: "sgd", "adam", "adamw" (torch's SGD, Adam, AdamW), or the import path of any optimizer
    #: ``package.module:Class`` (``torch.optim:Adadelta``, or a function returning one), called
    #: as ``Class(params, **kwargs)`` with the ``lr``, ``weight_decay`` and ``momentum`` the
    #: spec sets.
    name: str = "adam"
    #: None (unset): the optimizer's own default, for each of these three (sgd, adam, adamw:
    #: lr 1e-3, weight decay 0, AdamW's 0.01; SGD's momentum 0). ``momentum`` is refused for an
    #: optimizer without one (adam's and adamw's is ``kwargs.betas``).
    lr: Annotated[float, Field(gt=0)] | None = None
    weight_decay: Annotated[float, Field(ge=0)] | None = None
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = None
    #: The optimizer's other keyword arguments (adam's ``betas``, Adadelta's ``rho``).
    kwargs: dict[str, Any] = Field(default_factory=dict)
    #: Global batches per optimizer step: gradients add up over them, DDP synchronizing only
    #: on the last (a loop on relaytrain's API: its session says which batch ends a step).
    #: Steps and checkpoints count optimizer steps, so a checkpoint never holds a
    #: half-accumulated gradient.
    grad_accumulation: PositiveInt = 1
    #: Clip the gradients' total norm to this before each optimizer step (after fp16's
    #: unscaling); the norm before clipping is recorded as ``grad_norm``. None: no clipping.
    clip_grad_norm: Annotated[float, Field(gt=0)] | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if value not in BUILTIN_OPTIMIZERS and not IMPORT_PATH_PATTERN.fullmatch(value):
            raise ValueError(
                f"optimizer.name {value!r} is neither 'sgd', 'adam' or 'adamw' nor the import "
                "path of an optimizer 'package.module:Class' (e.g. 'torch.optim:Adadelta')"
            )
        return value

    @field_validator("kwargs")
    @classmethod
    def _kwargs(cls, value: dict[str, Any]) -> dict[str, Any]:
        own = [key for key in OPTIMIZER_OWN_KEYS if key in value]
        if own:
            raise SpecError(
                f"optimizer.kwargs.{own[0]}: set optimizer.{own[0]} instead (kwargs holds the "
                "optimizer's other arguments)",
                field="optimizer.kwargs",
            )
        if "params" in value:
            raise SpecError(
                "optimizer.kwargs.params: the model's parameters are passed by relaytrain; drop it",
                field="optimizer.kwargs",
            )
        return value

    @property
    def import_path(self) -> str:
        """What ``name`` names as ``package.module:Class`` (a short name's torch class)."""
        return BUILTIN_OPTIMIZERS.get(self.name, self.name)

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments the optimizer is called with (besides the parameters): the
        keys of its own the spec sets, and ``kwargs``."""
        own = {key: getattr(self, key) for key in OPTIMIZER_OWN_KEYS}
        return {**{k: v for k, v in own.items() if v is not None}, **self.kwargs}

    def describe(self) -> str:
        """The optimizer in a few words: its name and the arguments the spec sets."""
        arguments = ", ".join(f"{k} {v}" for k, v in self.arguments().items())
        return f"{self.name} ({arguments or 'its defaults'})"


class EarlyStoppingSection(_Section):
    """Stop when ``metric`` (a validation metric, measured at the end of every epoch) has not
    improved by more than ``min_delta`` for ``patience`` epochs in a row."""

    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: PositiveInt = 3
    min_delta: Annotated[float, Field(ge=0)] = 0.0


def _default(section: type[_Section], key: str) -> Any:
    return section.model_fields[key].default


class ScheduleSection(_Section):
    epochs: PositiveInt
    lr_schedule: Literal["constant", "cosine", "step"] = "constant"
    #: Optimizer steps of linear warm-up.
    warmup_steps: NonNegativeInt = 0
    #: For lr_schedule "step": multiply the rate by ``gamma`` every ``step_size`` optimizer
    #: steps.
    step_size: PositiveInt = 100
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.5
    #: Stop before ``epochs`` when a validation metric stops improving (its state is
    #: checkpointed, so a retry does not reset the patience). None: train every epoch.
    early_stopping: EarlyStoppingSection | None = None
    #: Instead of lr_schedule: the import path of any LR scheduler
    #: (``torch.optim.lr_scheduler:StepLR``, or a function returning one), called as
    #: ``Class(optimizer, **scheduler_kwargs)``; its state is in every checkpoint.
    scheduler: str | None = None
    scheduler_kwargs: dict[str, Any] = Field(default_factory=dict)
    #: When ``scheduler.step()`` is called: after every optimizer step ("step"), or once at
    #: each epoch's end, after its validation ("epoch"). So the scheduler's own counts
    #: (StepLR's ``step_size``, CosineAnnealingLR's ``T_max``) are in these units. None:
    #: "epoch" with ``scheduler_metric``, else "step".
    scheduler_interval: Literal["step", "epoch"] | None = None
    #: A validation metric (``val_loss``) measured at each epoch's end and passed to
    #: ``scheduler.step(value)`` (ReduceLROnPlateau).
    scheduler_metric: str | None = None

    @field_validator("scheduler")
    @classmethod
    def _scheduler(cls, value: str | None) -> str | None:
        return import_path(
            value,
            "schedule.scheduler",
            "e.g. 'torch.optim.lr_scheduler:StepLR', called as Class(optimizer, **kwargs)",
        )

    @model_validator(mode="after")
    def _one_schedule(self) -> ScheduleSection:
        if self.scheduler is None:
            self._say_if_step_keys_do_nothing()
            alone = [
                key
                for key in ("scheduler_kwargs", "scheduler_interval", "scheduler_metric")
                if getattr(self, key)
            ]
            if alone:
                raise SpecError(
                    f"schedule.{alone[0]} configures schedule.scheduler, which is not set: set "
                    f"schedule.scheduler (e.g. 'torch.optim.lr_scheduler:StepLR'), or drop "
                    f"schedule.{alone[0]}",
                    field=f"schedule.{alone[0]}",
                )
            return self
        lr_schedule = [
            (key, value)
            for key, value in (
                ("lr_schedule", self.lr_schedule != "constant"),
                ("warmup_steps", self.warmup_steps > 0),
                # not model_fields_set: a worker validates the spec's dump, every key set
                ("step_size", self.step_size != _default(ScheduleSection, "step_size")),
                ("gamma", self.gamma != _default(ScheduleSection, "gamma")),
            )
            if value
        ]
        if lr_schedule:
            key = lr_schedule[0][0]
            raise SpecError(
                f"schedule.{key}={getattr(self, key)!r} is the built-in lr_schedule's, and "
                f"schedule.scheduler {self.scheduler!r} sets the rate instead: drop schedule."
                f"{key} (lr_schedule constant, warmup_steps 0), or schedule.scheduler. To warm "
                "up before your scheduler, name a function returning torch's SequentialLR of "
                "LinearLR and it",
                field=f"schedule.{key}",
            )
        if self.scheduler_metric is not None and self.scheduler_interval == "step":
            raise SpecError(
                f"schedule.scheduler_metric {self.scheduler_metric!r} is measured at each "
                "epoch's end, so the scheduler steps then: set schedule.scheduler_interval "
                "epoch (or drop it)",
                field="schedule.scheduler_interval",
            )
        return self

    def _say_if_step_keys_do_nothing(self) -> None:
        """``step_size`` and ``gamma`` are lr_schedule step's: with another, a warning."""
        changed = [
            key
            for key in ("step_size", "gamma")
            if getattr(self, key) != _default(ScheduleSection, key)
        ]
        if changed and self.lr_schedule != "step":
            warnings.warn(
                f"schedule.{changed[0]} does nothing with lr_schedule {self.lr_schedule!r}: it "
                "is lr_schedule step's (the rate times gamma every step_size optimizer steps). "
                "Set lr_schedule step, or drop it",
                UserWarning,
                stacklevel=2,
            )

    @property
    def stepped_per(self) -> Literal["step", "epoch"]:
        """When ``scheduler`` steps: after every optimizer step, or at each epoch's end."""
        if self.scheduler_interval is not None:
            return self.scheduler_interval
        return "epoch" if self.scheduler_metric is not None else "step"

    def describe(self) -> str:
        """The schedule in a few words."""
        if self.scheduler is None:
            return self.lr_schedule
        metric = f" on {self.scheduler_metric}" if self.scheduler_metric else ""
        return f"{self.scheduler} per {self.stepped_per}{metric}"
