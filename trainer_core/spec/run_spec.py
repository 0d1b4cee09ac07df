"""The run specification: validated once at the edge (YAML, CLI ``--set``, flow parameters), frozen.

Key names that users, deployments and tests depend on are fixed (see README "The run spec").
Sections that only the built-in loop reads (model, data, optimizer, schedule) are optional when a
user's own Ray Train loop is named with ``train_loop``, and required otherwise.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import posixpath
import re
import warnings
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from trainer_core.errors import SpecError

SCHEMA_VERSION = 1

RUN_NAME_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$")
IMPORT_PATH_PATTERN = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
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
BUILTIN_VALIDATION_METRICS = ("val_loss", "val_accuracy")

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
    #: "mlp", "cnn", or the import path of a builder ``package.module:function``.
    name: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

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
    #: "digits", "synthetic", or a Parquet URI / path (file or directory).
    dataset: str
    #: One list column (e.g. "pixels") or several scalar columns.
    features: str | list[str] | None = None
    label: str | None = None
    task: Literal["classification", "regression"] | None = None
    #: The global batch: samples per micro-batch summed over every worker (each worker takes
    #: a slice; slices differ by one sample when the workers do not divide it, their losses
    #: weighted so the gradient is the whole batch's mean). The same for every worker count.
    batch_size: PositiveInt = 32
    #: Rows whose hash of (run.seed, row id) falls below this are validation rows.
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
        kind = not_parquet_format(value)
        if kind:
            raise ValueError(
                f"data.dataset {value!r} is a {kind} file, not Parquet: "
                f"relaytrain reads {DATASET_FORMATS}. Convert it to Parquet (e.g. "
                "pyarrow.parquet.write_table(pyarrow.csv.read_csv(path), 'data.parquet')) and "
                "point data.dataset at that"
            )
        return value

    @model_validator(mode="after")
    def _builtin_defaults(self) -> DataSection:
        if self.dataset not in BUILTIN_DATASETS and (self.features is None or self.label is None):
            raise ValueError(
                f"data.dataset {self.dataset!r} is a Parquet dataset: name its columns with "
                "data.features (one list column or a list of scalar columns) and data.label"
            )
        if self.dataset not in BUILTIN_DATASETS and self.task is None:
            raise ValueError(
                "data.task is required for a Parquet dataset: 'classification' or 'regression'"
            )
        return self

    def resolved(self) -> DataSection:
        """This section with the built-in datasets' columns and task filled in."""
        defaults: dict[str, Any] = {}
        if self.dataset == "digits":
            defaults = {"features": "pixels", "label": "label", "task": "classification"}
        elif self.dataset == "synthetic":
            defaults = {"features": "x", "label": "y", "task": "regression"}
        update = {k: v for k, v in defaults.items() if getattr(self, k) is None}
        return self.model_copy(update=update)


class OptimizerSection(_Section):
    name: Literal["sgd", "adam", "adamw"] = "adam"
    lr: Annotated[float, Field(gt=0)] = 1e-3
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    momentum: Annotated[float, Field(ge=0, lt=1)] = 0.9
    #: Global batches per optimizer step: gradients add up over them, DDP synchronizing only
    #: on the last. Steps and checkpoints count optimizer steps, so a checkpoint never holds a
    #: half-accumulated gradient.
    grad_accumulation: PositiveInt = 1
    #: Clip the gradients' total norm to this before each optimizer step (after fp16's
    #: unscaling); the norm before clipping is recorded as ``grad_norm``. None: no clipping.
    clip_grad_norm: Annotated[float, Field(gt=0)] | None = None


class EarlyStoppingSection(_Section):
    """Stop when ``metric`` (a validation metric, measured at the end of every epoch) has not
    improved by more than ``min_delta`` for ``patience`` epochs in a row."""

    metric: str = "val_loss"
    mode: Literal["min", "max"] = "min"
    patience: PositiveInt = 3
    min_delta: Annotated[float, Field(ge=0)] = 0.0


class ScheduleSection(_Section):
    epochs: PositiveInt
    lr_schedule: Literal["constant", "cosine", "step"] = "constant"
    warmup_steps: NonNegativeInt = 0
    #: For lr_schedule "step": multiply the rate by ``gamma`` every ``step_size`` steps.
    step_size: PositiveInt = 100
    gamma: Annotated[float, Field(gt=0, le=1)] = 0.5
    #: Stop before ``epochs`` when a validation metric stops improving (its state is
    #: checkpointed, so a retry does not reset the patience). None: train every epoch.
    early_stopping: EarlyStoppingSection | None = None


class ScalingSection(_Section):
    #: Workers in the group: a count, or ``[MIN, MAX]`` for elastic capacity (Ray Train's
    #: elastic scaling). An elastic run starts on as many workers as the cluster holds (at least
    #: MIN), goes on with fewer after a node is lost, without waiting for it, and grows back when
    #: capacity returns; every resize resumes from the newest committed checkpoint.
    num_workers: PositiveInt | tuple[PositiveInt, PositiveInt]
    #: Elastic runs: seconds between Ray's checks whether the cluster holds more workers than the
    #: group has (Ray's ``elastic_resize_monitor_interval_s``); growing restarts the group.
    resize_interval_s: Annotated[float, Field(ge=0)] = 60.0
    use_gpu: bool = False
    resources_per_worker: dict[str, Annotated[float, Field(ge=0)]] | None = None
    #: Ray's placement of the worker group: "PACK" fills nodes in turn, "SPREAD" puts the
    #: workers on as many nodes as it can.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    #: The job server of a remote Ray cluster (e.g. ``http://head:8265``): the train task then
    #: submits each attempt as a Ray job. ``RELAYTRAIN_RAY_JOB_ADDRESS`` sets it from the
    #: environment; unset, the attempt is driven in-process (local Ray or ``RAY_ADDRESS``).
    job_address: str | None = None
    #: How the built-in loop spreads the model: "ddp" keeps a whole replica on every worker;
    #: "fsdp" shards parameters, gradients and optimizer state over the workers (FSDP2's
    #: ``fully_shard``), for a model too big for one worker, and checkpoints them with
    #: ``torch.distributed.checkpoint``, which a group of any size can load.
    strategy: Literal["ddp", "fsdp"] = "ddp"
    #: With "fsdp": ``module:function`` called as ``function(model, mesh)`` to shard the model
    #: your way (``fully_shard(block, mesh=mesh)`` per block). Unset: every layer holding
    #: parameters is a unit.
    shard_fn: str | None = None

    @field_validator("num_workers")
    @classmethod
    def _min_not_above_max(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(value, tuple) and value[0] > value[1]:
            raise ValueError(
                f"[MIN, MAX] = {list(value)} has MIN above MAX: give [{value[1]}, {value[0]}]"
            )
        return value

    @property
    def elastic(self) -> bool:
        """Whether the worker count is a range that Ray may resize within."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers


class CheckpointSection(_Section):
    #: Commit a checkpoint every this many optimizer steps (and always at the end).
    every: PositiveInt = 50
    #: Keep the newest N committed checkpoints; None keeps all.
    keep_last: PositiveInt | None = 3
    #: Also keep the best N by ``best_metric``; 0 disables.
    keep_best: NonNegativeInt = 1
    best_metric: str = "val_loss"
    best_mode: Literal["min", "max"] = "min"
    #: Every rank writes its own model/optimizer shard (rank-named files) instead of rank 0 only.
    sharded: bool = False
    #: Write checkpoints in the background: training waits only for a copy of the state in
    #: memory. Then a checkpoint whose write fails can lose, besides one interval, the steps
    #: run while it was being written; false waits for every write (at most one interval).
    asynchronous: bool = True


class ReportSection(_Section):
    #: Aggregate per-step losses across ranks and stream them to the driver every N steps.
    every: PositiveInt = 10


def tracking_uri_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be a tracking URI, or None. Credentials never go in it."""
    parts = urlsplit(uri)
    if parts.username is not None or parts.password is not None:
        return (
            "it carries a user or password before the host: set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment instead"
        )
    if parts.scheme in ("http", "https") and not parts.hostname:
        return "it names no host: give http://HOST:PORT"
    return None


class TrackingSection(_Section):
    """Experiment trackers the driver reports to. TensorBoard event files are always written
    into the run directory; MLflow is used when a tracking URI is set here or in
    ``MLFLOW_TRACKING_URI``."""

    #: An MLflow tracking URI (``http://host:5000``, ``databricks``, ``sqlite:///mlflow.db``).
    #: Credentials never go in it: MLflow reads MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN
    #: from the environment.
    mlflow_uri: str | None = None
    #: The MLflow experiment the run is logged under (created when missing).
    mlflow_experiment: str = "relaytrain"

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        problem = tracking_uri_problem(value)
        if problem:
            raise ValueError(f"tracking.mlflow_uri cannot be used: {problem}")
        return value

    @field_validator("mlflow_experiment")
    @classmethod
    def _experiment(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("tracking.mlflow_experiment is empty: name an experiment")
        return value


#: Prefect refuses a task with more retry delays than this (prefect/tasks.py).
PREFECT_MAX_RETRY_DELAYS = 50


class RetriesSection(_Section):
    #: Retries after a worker/node death, preemption or transient storage failure.
    infrastructure: NonNegativeInt = 3
    #: Retries after the training code raised (the same error at the same step twice stops).
    code: NonNegativeInt = 1
    #: Seconds before the first retry; each later one waits ``backoff`` times longer.
    delay_s: Annotated[float, Field(ge=0)] = 10.0
    backoff: Annotated[float, Field(ge=1)] = 2.0
    #: Random extra delay, as a fraction of the delay (Prefect's retry_jitter_factor).
    jitter: Annotated[float, Field(ge=0)] = 0.5
    #: Infrastructure failures Ray Train may recover in place, within one attempt, before a
    #: failure ends the attempt: it restarts the worker group, which resumes from the newest
    #: committed checkpoint, without a new fit() or a Prefect retry (the faster path: no new
    #: controller, relay or Prefect state changes). Each restart is recorded on the attempt.
    #: 1 (the default): the first infrastructure failure of an attempt restarts in place, the
    #: next ends the attempt and Prefect retries it; 0: every failure ends the attempt.
    in_place: NonNegativeInt = 1
    #: Restarts after a node is reclaimed for preemption (Ray's preemption budget, counted apart
    #: from ``infrastructure``). Recovered in place, within the attempt, from the newest commit,
    #: which a notice of the drain makes just in time. None (the default): unlimited, as in Ray.
    preemption: NonNegativeInt | None = None

    @property
    def num_retries(self) -> int:
        """Prefect retries of the train task: every budget's (a preemption that ends an attempt
        is one whose budget, or one without limit, is spent in place)."""
        return self.infrastructure + self.code + (self.preemption or 0)

    def delays(self) -> list[float]:
        """The delay before each retry (Prefect's ``retry_delay_seconds``). Prefect takes at
        most 50 and repeats the last for later retries: a longer budget would fail the flow."""
        count = min(self.num_retries, PREFECT_MAX_RETRY_DELAYS)
        return [self.delay_s * self.backoff**i for i in range(count)]


class FaultSection(_Section):
    kind: Literal["raise", "kill"]
    at_step: PositiveInt
    rank: NonNegativeInt = 0
    attempt: PositiveInt = 1


class RunSpec(_Section):
    """The whole, validated, frozen specification of a training run."""

    run: RunSection = Field(default_factory=RunSection)
    model: ModelSection | None = None
    data: DataSection | None = None
    optimizer: OptimizerSection = Field(default_factory=OptimizerSection)
    schedule: ScheduleSection | None = None
    scaling: ScalingSection
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    report: ReportSection = Field(default_factory=ReportSection)
    retries: RetriesSection = Field(default_factory=RetriesSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    #: The built-in loop's arithmetic: fp32, or autocast to bf16 or fp16 (fp16 with a gradient
    #: scaler whose state is checkpointed). Parameters and optimizer state stay fp32.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    #: The built-in loop's loss, ``package.module:function`` called as ``fn(output, target)``
    #: and returning the batch's mean loss as a scalar tensor. None: cross-entropy for
    #: classification, mean squared error for regression.
    loss: str | None = None
    #: Validation metrics, each ``package.module:function`` called as ``fn(output, target)``
    #: and returning the batch's mean (a number or a scalar tensor); recorded as
    #: ``val_<function name>``, averaged over every validation sample of every rank.
    metrics: list[str] = Field(default_factory=list)
    #: Import path of a user's own Ray Train ``train_loop_per_worker``.
    train_loop: str | None = None
    train_loop_config: dict[str, Any] = Field(default_factory=dict)
    #: Parquet datasets for a user's own loop, by name (``{train: URI, validation: URI}``):
    #: Ray Data reads them and Ray Train shards them across the workers, so the loop's
    #: ``ray.train.get_dataset_shard(name)`` works unchanged.
    datasets: dict[str, str] = Field(default_factory=dict)
    faults: list[FaultSection] = Field(default_factory=list)

    @field_validator("train_loop")
    @classmethod
    def _train_loop(cls, value: str | None) -> str | None:
        if value is not None and not IMPORT_PATH_PATTERN.fullmatch(value):
            raise ValueError(
                f"train_loop {value!r} is not an import path: use 'package.module:function'"
            )
        return value

    @field_validator("datasets")
    @classmethod
    def _datasets(cls, value: dict[str, str]) -> dict[str, str]:
        for name, uri in value.items():
            if not re.fullmatch(r"[A-Za-z_][\w-]*", name):
                raise SpecError(
                    f"datasets.{name}: a dataset name is what your loop passes to "
                    "ray.train.get_dataset_shard: use letters, digits, '_' and '-'",
                    field=f"datasets.{name}",
                )
            if not uri.strip() or not_parquet_format(uri):
                raise SpecError(
                    f"datasets.{name} {uri!r} is not a Parquet file or directory: give the URI "
                    "of Parquet data (local or on any run.storage URI); convert other formats "
                    "with pyarrow first",
                    field=f"datasets.{name}",
                )
        return value

    @field_validator("loss")
    @classmethod
    def _loss(cls, value: str | None) -> str | None:
        if value is not None and not IMPORT_PATH_PATTERN.fullmatch(value):
            raise ValueError(
                f"loss {value!r} is not an import path: use 'package.module:function', a "
                "function fn(output, target) returning the batch's mean loss"
            )
        return value

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, value: list[str]) -> list[str]:
        seen: dict[str, str] = {}
        for i, path in enumerate(value):
            if not IMPORT_PATH_PATTERN.fullmatch(path):
                raise SpecError(
                    f"metrics.{i} {path!r} is not an import path: use 'package.module:function', "
                    "a function fn(output, target) returning the batch's mean",
                    field=f"metrics.{i}",
                )
            name = metric_name(path)
            if name in BUILTIN_VALIDATION_METRICS or name in seen:
                other = seen.get(name, "the built-in loop")
                raise SpecError(
                    f"metrics.{i} {path!r} would be recorded as {name!r}, which {other} already "
                    "records: rename the function (the metric is val_<function name>)",
                    field=f"metrics.{i}",
                )
            seen[name] = path
        return value

    @model_validator(mode="after")
    def _consistent(self) -> RunSpec:
        if self.train_loop is None and self.datasets:
            raise SpecError(
                f"datasets {sorted(self.datasets)} feed a Ray Train loop of your own "
                "(ray.train.get_dataset_shard): set train_loop, or give the built-in loop its "
                "data with data.dataset",
                field="datasets",
            )
        if self.train_loop is None:
            missing = [s for s in ("model", "data", "schedule") if getattr(self, s) is None]
            if missing:
                raise ValueError(
                    f"section(s) {missing} are required by the built-in training loop "
                    "(or name your own Ray Train loop with train_loop)"
                )
        else:
            ignored = [s for s in ("model", "data", "schedule") if getattr(self, s) is not None]
            if self.precision != "fp32":
                ignored.append(f"precision={self.precision}")  # your loop autocasts itself
            ignored += [key for key in ("loss", "metrics") if getattr(self, key)]
            if ignored:
                warnings.warn(
                    f"train_loop is set, so {ignored} are ignored: pass what your loop needs "
                    "through train_loop_config",
                    UserWarning,
                    stacklevel=2,
                )
        workers = self.scaling.max_workers
        if self.scaling.elastic and self.checkpoint.sharded:
            raise SpecError(
                f"scaling.num_workers=[{self.scaling.min_workers}, {self.scaling.max_workers}] "
                "is elastic, but checkpoint.sharded writes one file per rank, which a group "
                "of another size cannot load: set checkpoint.sharded false, or a fixed "
                "scaling.num_workers",
                field="checkpoint.sharded",
            )
        self._check_strategy()
        for i, fault in enumerate(self.faults):
            if fault.rank >= workers:
                raise SpecError(
                    f"faults.{i}.rank={fault.rank} does not exist with scaling.num_workers="
                    f"{workers}: use a rank below {workers}",
                    field=f"faults.{i}.rank",
                )
        if self.train_loop is None:
            assert self.data is not None
            if self.data.batch_size < workers:
                raise SpecError(
                    f"data.batch_size={self.data.batch_size} is the global batch, shared by "
                    f"scaling.num_workers={workers} workers: each needs a sample. Raise "
                    f"data.batch_size to at least {workers}, or use fewer workers.",
                    field="data.batch_size",
                )
            metrics = self.builtin_metrics()
            if self.checkpoint.best_metric not in metrics:
                raise SpecError(
                    f"checkpoint.best_metric {self.checkpoint.best_metric!r} is never recorded "
                    f"by the built-in loop for this spec (val_* need data.validation_fraction "
                    f"> 0, val_accuracy needs data.task classification): use one of {metrics}",
                    field="checkpoint.best_metric",
                )
            assert self.schedule is not None
            stopping = self.schedule.early_stopping
            if stopping is not None and stopping.metric not in metrics[1:]:
                raise SpecError(
                    f"schedule.early_stopping.metric {stopping.metric!r} is not a validation "
                    f"metric of this spec (early stopping compares the metrics measured at the "
                    f"end of every epoch; val_* need data.validation_fraction > 0): use one of "
                    f"{metrics[1:]}",
                    field="schedule.early_stopping.metric",
                )
        if self.scaling.use_gpu:
            warnings.warn(
                "scaling.use_gpu is true: the workers will need GPUs (CPU runs use gloo)",
                UserWarning,
                stacklevel=2,
            )
        return self

    # -- derived values --------------------------------------------------------------------

    def builtin_metrics(self) -> list[str]:
        """The metrics the built-in loop records with every checkpoint (best_metric candidates)."""
        assert self.data is not None
        data = self.data.resolved()
        if data.validation_fraction == 0:
            return ["loss"]
        return [
            "loss",
            "val_loss",
            *(["val_accuracy"] if data.task == "classification" else []),
            *(metric_name(path) for path in self.metrics),
        ]

    def with_run_name(self, name: str) -> RunSpec:
        """This spec with ``run.name`` set (validated)."""
        validate_run_name(name)
        return self.model_copy(update={"run": self.run.model_copy(update={"name": name})})

    def for_slot(self, when: Any) -> RunSpec:
        """This spec with ``data.dataset`` templates filled from a schedule slot's time.

        Placeholders: ``{date}`` (YYYY-MM-DD), ``{year}``, ``{month}``, ``{day}``, ``{hour}``,
        ``{datetime}`` (YYYYMMDDTHHMM); e.g. ``s3://lake/digits/date={date}/``.
        """
        if self.data is None or "{" not in self.data.dataset:
            return self
        values = {
            "date": when.strftime("%Y-%m-%d"),
            "year": when.strftime("%Y"),
            "month": when.strftime("%m"),
            "day": when.strftime("%d"),
            "hour": when.strftime("%H"),
            "datetime": when.strftime("%Y%m%dT%H%M"),
        }
        try:
            dataset = self.data.dataset.format(**values)
        except (KeyError, IndexError, ValueError) as e:
            raise SpecError(
                f"data.dataset {self.data.dataset!r} has an unknown placeholder {e}: use "
                f"{sorted('{' + k + '}' for k in values)}",
                field="data.dataset",
            ) from e
        return self.model_copy(update={"data": self.data.model_copy(update={"dataset": dataset})})

    def default_run_name(self, now: str) -> str:
        """A unique-enough default name from the workload and a timestamp string."""
        if self.train_loop is not None:
            workload = self.train_loop.rsplit(":", 1)[1]
        else:
            assert self.model is not None and self.data is not None
            dataset = self.data.dataset if self.data.dataset in BUILTIN_DATASETS else "parquet"
            workload = f"{dataset}-{self.model.name.rsplit(':', 1)[-1]}"
        return validate_run_name(re.sub(r"[^A-Za-z0-9._-]", "-", f"{workload}-{now}")[:100])

    def _check_strategy(self) -> None:
        scaling = self.scaling
        if scaling.shard_fn is not None and scaling.strategy != "fsdp":
            raise SpecError(
                f"scaling.shard_fn={scaling.shard_fn!r} shards the model, but scaling.strategy "
                f"is {scaling.strategy!r}: set scaling.strategy fsdp, or drop scaling.shard_fn",
                field="scaling.shard_fn",
            )
        if scaling.strategy != "fsdp":
            return
        if self.train_loop is not None:
            raise SpecError(
                "scaling.strategy=fsdp is the built-in loop's; train_loop is your own loop, which "
                "shards its model itself: drop scaling.strategy, or train_loop",
                field="scaling.strategy",
            )
        if self.checkpoint.sharded:
            raise SpecError(
                "checkpoint.sharded writes one DDP replica file per rank; scaling.strategy=fsdp "
                "checkpoints every rank's shards with torch.distributed.checkpoint already: "
                "set checkpoint.sharded false",
                field="checkpoint.sharded",
            )
        if self.precision == "fp16":
            raise SpecError(
                "precision=fp16 needs a gradient scaler that agrees across shards, which "
                "scaling.strategy=fsdp does not have: use precision bf16 (or fp32)",
                field="precision",
            )

    def identity(self) -> dict[str, Any]:
        """The parts a resumed run must share with the run that wrote its checkpoints."""
        # How a worker reads (memory, read-ahead) does not change what it reads.
        read = {"prefetch", "memory_mb"}
        data = self.data.resolved().model_dump(exclude=read) if self.data else None
        identity = {
            "model": self.model.model_dump() if self.model else None,
            "data": data,
            "train_loop": self.train_loop,
            "seed": self.run.seed,
            "sharded": self.checkpoint.sharded,
        }
        # The built-in loop's order and cursor do not depend on the worker count: a run may
        # resume on another. Rank-named shards and a loop of your own need the same count.
        if self.checkpoint.sharded or self.train_loop is not None:
            identity["num_workers"] = self.scaling.model_dump(mode="json")["num_workers"]
        if self.datasets:
            identity["datasets"] = dict(self.datasets)
        if self.optimizer.grad_accumulation != 1:  # steps, and so checkpoints, depend on it
            identity["grad_accumulation"] = self.optimizer.grad_accumulation
        return identity

    def fingerprint(self) -> str:
        """sha256 of the spec's identity (what must not change across a run's attempts)."""
        canonical = json.dumps(self.identity(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()


# -- building a spec at the edge -----------------------------------------------------------


def parse_override(text: str) -> tuple[list[str], Any]:
    """Parse ``dotted.key=value``; the value is JSON where it parses, else a plain string."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise SpecError(
            f"--set {text!r} is not of the form dotted.key=value (e.g. scaling.num_workers=2)",
            field="--set",
        )
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return key.strip().split("."), value


def apply_override(raw: dict[str, Any], path: list[str], value: Any) -> None:
    """Set ``value`` at ``path`` inside nested dicts/lists, creating dicts as needed."""
    node: Any = raw
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise SpecError(
                    f"override {'.'.join(path)}: {part!r} is not an index of a list of "
                    f"{len(node)} item(s): use an index below {len(node)}, or set the whole "
                    f"list (e.g. --set {'.'.join(path[:i])}='[...]')",
                    field=".".join(path),
                )
            if last:
                node[int(part)] = value
            else:
                node = node[int(part)]
            continue
        if not isinstance(node, dict):
            raise SpecError(
                f"override {'.'.join(path)}: {'.'.join(path[:i])} is not a section (it holds "
                f"{node!r}): set it whole, e.g. --set {'.'.join(path[:i])}=VALUE",
                field=".".join(path),
            )
        if last:
            node[part] = value
        else:
            if node.get(part) is None:
                if path[i + 1].isdigit():
                    where = ".".join(path[: i + 1])
                    raise SpecError(
                        f"override {'.'.join(path)}: {where} is not set, so it has no item "
                        f"{path[i + 1]}: set the whole list, e.g. --set {where}='[...]'",
                        field=".".join(path),
                    )
                node[part] = {}
            node = node[part]


def format_validation_error(error: ValidationError) -> str:
    lines = []
    for item in error.errors():
        loc = _error_field(item) or "spec"
        given = item.get("input")
        # never echo a credential: user:password@ in a URI is masked
        shown = "" if isinstance(given, dict) else f" (got {_masked(repr(given))})"
        message = item["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc}: {message}{shown}")
    return "invalid run spec:\n" + "\n".join(lines)


def _masked(text: str) -> str:
    return re.sub(r"//[^/@\s]*@", "//***@", text)


def _error_field(item: Any) -> str | None:
    """The dotted field a pydantic error is about (a SpecError raised inside names its own)."""
    loc = ".".join(str(p) for p in item["loc"])
    raised = (item.get("ctx") or {}).get("error")
    named = raised.field if isinstance(raised, SpecError) else None
    if named and loc and named != loc and not named.startswith(f"{loc}."):
        return f"{loc}.{named}"
    return named or loc or None


def build_spec(raw: dict[str, Any], overrides: list[str] | tuple[str, ...] = ()) -> RunSpec:
    """Validate a raw mapping plus ``--set`` overrides into a frozen RunSpec or raise SpecError."""
    if not isinstance(raw, dict):
        raise SpecError(f"a run spec must be a mapping, got {type(raw).__name__}")
    raw = json.loads(json.dumps(raw))  # deep copy, and proves it is plain data
    for text in overrides:
        path, value = parse_override(text)
        apply_override(raw, path, value)
    try:
        return RunSpec.model_validate(raw)
    except ValidationError as e:
        field = _error_field(e.errors()[0]) if e.errors() else None
        raise SpecError(format_validation_error(e), field=field) from e


def load_spec(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> RunSpec:
    """Load a YAML spec file and apply ``--set`` overrides."""
    path = Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as e:
        raise SpecError(f"spec file {str(path)!r} does not exist", field="--config") from e
    except yaml.YAMLError as e:
        raise SpecError(f"spec file {str(path)!r} is not valid YAML: {e}", field="--config") from e
    return build_spec(raw, overrides)
