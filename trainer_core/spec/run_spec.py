"""The run specification: validated once at the edge (YAML, CLI ``--set``, flow parameters), frozen.

Key names that users, deployments and tests depend on are fixed (see docs/run-spec.md).
Sections that only the built-in loop reads (model, data, optimizer, schedule) are optional when a
user's own Ray Train loop is named with ``train_loop``, and required otherwise.
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from typing import Any, Literal

from pydantic import (
    Field,
    field_validator,
    model_validator,
)

from trainer_core.errors import (
    SpecError,
)
from trainer_core.spec import loops
from trainer_core.spec.operations import (
    CheckpointSection,
    FaultSection,
    ReportSection,
    RetriesSection,
    ScalingSection,
    TrackingSection,
)
from trainer_core.spec.optimization import OptimizerSection, ScheduleSection
from trainer_core.spec.sections import (
    BUILTIN_DATASETS,
    BUILTIN_VALIDATION_METRICS,
    IMPORT_PATH_PATTERN,
    DataSection,
    ModelSection,
    RunSection,
    _Section,
    import_path,
    metric_name,
    not_parquet_format,
    validate_run_name,
)


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
    #: The built-in loop's loss, ``package.module:function``. The tabular form calls it as
    #: ``fn(output, target)``, returning the batch's mean loss as a scalar tensor; the columns
    #: form as ``fn(outputs, batch)``, returning ``(summed loss, count of items it covers)``
    #: (or a mean, weighted by samples). None: data.task's (cross-entropy, mean squared error).
    loss: str | None = None
    #: Validation metrics, each ``package.module:function`` called as ``fn(output, target)``
    #: (the columns form: ``fn(outputs, batch)``, which may return ``(sum, count)``) and
    #: returning the batch's mean (a number or a scalar tensor); recorded as
    #: ``val_<function name>``, averaged over every validation sample of every rank.
    metrics: list[str] = Field(default_factory=list)
    #: Import path of a user's own Ray Train ``train_loop_per_worker``.
    train_loop: str | None = None
    train_loop_config: dict[str, Any] = Field(default_factory=dict)
    #: What the loop is written against: ``ray`` (``ray.train.report`` and Ray's checkpoints,
    #: run unchanged) or ``relaytrain`` (``trainer_core.train.own_loop``: the run's data stream
    #: from its cursor, checkpoints in relaytrain's committed format, reports; needs ``data``
    #: and ``schedule``).
    train_loop_api: Literal["ray", "relaytrain"] = "ray"
    #: Parquet datasets for a user's own loop, by name (``{train: URI, validation: URI}``):
    #: Ray Data reads them and Ray Train shards them across the workers, so the loop's
    #: ``ray.train.get_dataset_shard(name)`` works unchanged.
    datasets: dict[str, str] = Field(default_factory=dict)
    faults: list[FaultSection] = Field(default_factory=list)

    @field_validator("train_loop")
    @classmethod
    def _train_loop(cls, value: str | None) -> str | None:
        return import_path(value, "train_loop")

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
        return import_path(
            value, "loss", "a function fn(output, target) returning the batch's mean loss"
        )

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
        loops.check_loop_sections(self)
        self._check_scaling()
        if self.train_loop is None:
            self._check_builtin_loop()
        if self.scaling.use_gpu:
            warnings.warn(
                "scaling.use_gpu is true: the workers will need GPUs (CPU runs use gloo)",
                UserWarning,
                stacklevel=2,
            )
        return self

    @property
    def ray_loop(self) -> bool:
        """A user's own loop written against Ray Train alone: Ray checkpoints it."""
        return self.train_loop is not None and self.train_loop_api == "ray"

    @property
    def own_loop(self) -> bool:
        """A user's own loop on relaytrain's API (``trainer_core.train.own_loop``): it reads the
        run's data stream and checkpoints in the committed format, as the built-in loop does."""
        return self.train_loop is not None and self.train_loop_api == "relaytrain"

    def _check_scaling(self) -> None:
        """What the worker group's size and strategy allow: sharded files, faults' ranks."""
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

    def _check_builtin_loop(self) -> None:
        """The built-in loop's batch against the workers, and the metrics it will record."""
        assert self.data is not None and self.schedule is not None
        loops.check_batch_size(self)
        if not self.data.columns_form and self.data.resolved().task is None:
            raise SpecError(
                "data.task is required for the built-in loop on a Parquet dataset: "
                "'classification' or 'regression' (its loss and metrics follow it)",
                field="data.task",
            )
        if self.data.columns_form and self.data.task is None and self.loss is None:
            raise SpecError(
                "data.columns without data.task needs a loss: set loss to "
                "'package.module:function', called as fn(outputs, batch) and returning the "
                "summed loss and the count of items it covers, or set data.task "
                "(classification, regression, causal_lm) for a built-in one",
                field="loss",
            )
        metrics = self.builtin_metrics()
        if self.checkpoint.best_metric not in metrics:
            raise SpecError(
                f"checkpoint.best_metric {self.checkpoint.best_metric!r} is never recorded "
                f"by the built-in loop for this spec (val_* need data.validation_fraction "
                f"> 0, val_accuracy needs data.task classification): use one of {metrics}",
                field="checkpoint.best_metric",
            )
        self._check_optimizer()
        stopping = self.schedule.early_stopping
        if stopping is not None and stopping.metric not in metrics[1:]:
            raise SpecError(
                f"schedule.early_stopping.metric {stopping.metric!r} is not a validation "
                f"metric of this spec (early stopping compares the metrics measured at the "
                f"end of every epoch; val_* need data.validation_fraction > 0): use one of "
                f"{metrics[1:]}",
                field="schedule.early_stopping.metric",
            )

    # -- derived values --------------------------------------------------------------------

    def builtin_metrics(self) -> list[str]:
        """The metrics the built-in loop records with every checkpoint (best_metric candidates)."""
        assert self.data is not None
        data = self.data.resolved()
        if data.validation is None and data.validation_fraction == 0:
            return ["loss"]
        return [
            "loss",
            "val_loss",
            *(["val_perplexity"] if data.task == "causal_lm" else []),
            *(["val_accuracy"] if data.task in ("classification", "causal_lm") else []),
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
        self._check_ddp_options()
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

    def _check_ddp_options(self) -> None:
        """``scaling.ddp`` configures the DDP wrapper of the built-in loop and of a loop on
        relaytrain's API: refused with FSDP, and said to do nothing where no wrapper is made."""
        changed = self.scaling.ddp.changed()
        if not changed:
            return
        if self.scaling.strategy == "fsdp":
            raise SpecError(
                f"{changed[0]} configures DistributedDataParallel, but scaling.strategy is fsdp "
                "(no DDP wrapper): drop scaling.ddp, or use scaling.strategy ddp",
                field="scaling.ddp",
            )
        if self.ray_loop:
            warnings.warn(
                f"{changed} do nothing for a Ray Train loop of your own, which wraps its model "
                "itself: pass them to ray.train.torch.prepare_model(model, "
                "parallel_strategy_kwargs={...}) in your loop",
                UserWarning,
                stacklevel=4,
            )
        elif self.scaling.max_workers == 1:
            warnings.warn(
                f"{changed} do nothing with scaling.num_workers 1: a single worker's model is "
                "not wrapped in DistributedDataParallel",
                UserWarning,
                stacklevel=4,
            )

    def _check_optimizer(self) -> None:
        """What the built-in loop's optimizer and scheduler need of the rest of the spec
        (an imported optimizer's arguments are checked where it is built: setup imports it)."""
        assert self.schedule is not None
        optimizer = self.optimizer
        if optimizer.momentum is not None and optimizer.name in ("adam", "adamw"):
            raise SpecError(
                f"optimizer.momentum={optimizer.momentum} does nothing for {optimizer.name}, "
                "which has no momentum: its betas play that part (optimizer.kwargs.betas, "
                "default [0.9, 0.999]). Drop optimizer.momentum, or use optimizer.name sgd",
                field="optimizer.momentum",
            )
        metric = self.schedule.scheduler_metric
        validation = self.builtin_metrics()[1:]
        if metric is not None and metric not in validation:
            raise SpecError(
                f"schedule.scheduler_metric {metric!r} is not a validation metric of this spec "
                f"(the scheduler is stepped on the metrics measured at the end of every epoch; "
                f"val_* need data.validation_fraction > 0): use one of {validation}",
                field="schedule.scheduler_metric",
            )

    def identity(self) -> dict[str, Any]:
        """The parts a resumed run must share with the run that wrote its checkpoints."""
        # How a worker reads (memory, read-ahead, loader processes) does not change what it
        # reads; the test set is evaluated after training, on no step of it.
        read = {"prefetch", "memory_mb", "loader_workers", "test", "test_kwargs"}
        data = self.data.resolved().model_dump(exclude=read) if self.data else None
        if data is not None:  # the Dataset form's keys, absent from runs made before it
            for key in DATASET_FORM_KEYS:
                if not data[key]:
                    del data[key]
        identity = {
            "model": self.model.model_dump() if self.model else None,
            "data": data,
            "train_loop": self.train_loop,
            **({"train_loop_api": self.train_loop_api} if self.own_loop else {}),
            "seed": self.run.seed,
            "sharded": self.checkpoint.sharded,
        }
        # The built-in loop's order and cursor do not depend on the worker count: a run may
        # resume on another. Rank-named shards and a loop of your own need the same count.
        if self.checkpoint.sharded or self.ray_loop:
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


#: The Dataset form's keys (2026-12-04) that change what a run trains on: in a run's identity
#: only when given, so a run made before them resumes under this release.
DATASET_FORM_KEYS = ("kwargs", "validation", "validation_kwargs")


# -- building a spec at the edge -----------------------------------------------------------


#: Where each part of a spec's identity lives in the spec (for messages that name the field).
_IDENTITY_FIELDS = {"num_workers": "scaling.num_workers", "seed": "run.seed"}


def identity_changes(
    stored: dict[str, Any], current: dict[str, Any], prefix: str = ""
) -> list[tuple[str, Any, Any]]:
    """The leaves where two spec identities differ: (dotted spec field, stored, current)."""
    changes: list[tuple[str, Any, Any]] = []
    for key in sorted(set(stored) | set(current)):
        old, new = stored.get(key), current.get(key)
        path = f"{prefix}{key}" if prefix else _IDENTITY_FIELDS.get(key, key)
        if isinstance(old, dict) and isinstance(new, dict):
            changes += identity_changes(old, new, f"{path}.")
        elif old != new:
            changes.append((path, old, new))
    return changes
