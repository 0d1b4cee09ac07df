"""Preflight: what the driver checks before an attempt starts any worker, and the dataset the
attempt trains on.

- ``pin_dataset``: the built-in loop's dataset as the attempt must read it: the run's
  snapshot, taken on the first attempt and read first by every later one (which lists the
  dataset only to count the files added since).
- ``pin_ray_datasets``: the same for each of a Ray Train loop's ``datasets``; Ray Data is
  handed the pinned files.
- ``validate_workload``: what the spec imports, the optimizer and LR scheduler, the dataset,
  the model, the loss and the metrics, tried on the driver (a SpecError before any worker
  starts), and the run's total optimizer steps.
- ``preflight``: both, with the plan (``trainer_core.run.plan``), in the order errors name
  themselves.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch

from trainer_core.checkpoint import optimizers
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import arrays as data_mod
from trainer_core.data import (
    dataset_snapshot,
    footers,
    held_out,
    rank_stream,
    row_slices,
    samples,
    stream,
)
from trainer_core.data.table_rows import TableRows
from trainer_core.errors import SpecError
from trainer_core.run.plan import Plan, plan_attempt, run_directory
from trainer_core.spec.imports import import_object
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import sample_checks, workloads
from trainer_core.train.batch_checks import check_batch_workload

logger = logging.getLogger("relaytrain.data")


@dataclass(frozen=True)
class PinnedDataset:
    """The dataset an attempt trains on: the run's snapshot (taken now on the first attempt,
    else read from the run directory and verified), what it holds, and the files added to
    the dataset since the snapshot (counted by path, never opened)."""

    layout: footers.Layout
    info: data_mod.DatasetInfo
    record: dict[str, Any] | None
    added: list[str]
    #: The held-out sets' layouts (``data.validation``, ``data.test`` as Parquet), by name.
    held: dict[str, footers.Layout] = field(default_factory=dict)

    def for_workers(self) -> dict[str, Any] | None:
        """What every rank builds its stream from, with no listing or footer read of its own."""
        if self.record is None:
            return None
        return {"snapshot": self.record, "info": asdict(self.info)}


@dataclass(frozen=True)
class PinnedSamples:
    """The Dataset form's datasets, built once on the driver, and what the run directory keeps
    of them (their lengths: ``samples.lengths_record``), which every attempt must find again."""

    train: Any
    validation: Any
    record: dict[str, Any]
    test: Any = None
    added: tuple[str, ...] = ()

    def for_workers(self) -> dict[str, Any]:
        return self.record


def pin_samples(spec: RunSpec, stored: dict[str, Any] | None) -> PinnedSamples:
    """Build the spec's Dataset(s) (SpecError naming a function that fails, or returns what is
    no map-style Dataset); a later attempt (``stored``: the run's dataset.json) must find the
    lengths the run began with (SpecError naming both)."""
    assert spec.data is not None
    data = spec.data
    train = samples.build_dataset(data.dataset, data.kwargs, "data.dataset")
    validation = (
        samples.build_dataset(data.validation, data.validation_kwargs, "data.validation")
        if data.validation
        else None
    )
    test = samples.build_dataset(data.test, data.test_kwargs, "data.test") if data.test else None
    if stored is not None:
        samples.check_lengths(stored, train, validation)
    record = stored or samples.lengths_record(train, validation)
    return PinnedSamples(train, validation, record, test)


def pin_dataset(
    spec: RunSpec, run_dir: RunDirectory | None = None
) -> PinnedDataset | PinnedSamples | None:
    """The built-in loop's dataset as this attempt must read it. A later attempt of the run
    (``run_dir`` holds its snapshot) reads the snapshot first and the dataset only as far as
    the snapshot's files go: each checked against its pinned size and footer (SpecError naming
    one that changed or vanished), the rest listed by path to count what was added since
    (nothing added is opened, whatever it holds). The first attempt (or no ``run_dir``) reads
    the dataset's footers now. None for a user's own loop."""
    if spec.ray_loop:
        return None
    assert spec.data is not None
    data = spec.data.resolved()
    stored = _snapshot_of_this_run(spec, run_dir) if run_dir is not None else None
    if data.torch_dataset:
        return pin_samples(spec, stored)
    source = dataset_snapshot.Source.of(data)
    layout, added = dataset_snapshot.pin(source, stored, lambda: footers.scan(data))
    held = {}
    for name in held_out.held_names(data):  # data.validation, data.test: pinned alike
        view = held_out.held_view(data, name)
        pinned_then = ((stored or {}).get("held") or {}).get(name)
        held[name], _ = dataset_snapshot.pin(
            held_out.source(data, name), pinned_then, functools.partial(footers.scan, view)
        )
    record = dataset_snapshot.to_json(layout) if layout.files else None
    if record is not None:
        record = dataset_snapshot.with_held(record, held)
    return PinnedDataset(layout, stream.describe(layout, data), record, added, held)


@dataclass(frozen=True)
class PinnedTables:
    """A Ray Train loop's ``datasets`` as the attempt must read them (Ray Data): each one's
    snapshot, by name (taken now on the first attempt, else read from the run directory and
    verified), the record the run directory keeps of them all, and the files added to each
    since (counted by path, never opened)."""

    layouts: dict[str, footers.Layout]
    record: dict[str, Any]
    added: dict[str, list[str]]

    def files(self) -> dict[str, list[str]]:
        """The files each dataset is read from (what Ray Data is handed), in snapshot order."""
        return {name: [f.path for f in layout.files] for name, layout in self.layouts.items()}


def pin_ray_datasets(spec: RunSpec, run_dir: RunDirectory | None = None) -> PinnedTables | None:
    """A Ray Train loop's ``datasets`` as this attempt must read them, each by the rule of
    ``pin_dataset`` (``dataset_snapshot.pin``): a later attempt reads the run's snapshot
    first, checks its files, and only counts the files added since; the first attempt reads
    every footer now (SpecError naming ``datasets.<name>`` and the file for one that is not
    Parquet, or of another schema). None without ``datasets``."""
    if not spec.ray_loop or not spec.datasets:
        return None
    stored = _snapshot_of_this_run(spec, run_dir) if run_dir is not None else None
    layouts: dict[str, footers.Layout] = {}
    added: dict[str, list[str]] = {}
    for name, uri in spec.datasets.items():
        source = dataset_snapshot.Source.of_table(name, uri)
        table = dataset_snapshot.table_record(stored, source) if stored is not None else None
        scan = functools.partial(footers.scan_table, source.location, source.field)
        layouts[name], added[name] = dataset_snapshot.pin(source, table, scan)
    return PinnedTables(layouts, dataset_snapshot.tables_to_json(layouts), added)


def _snapshot_of_this_run(spec: RunSpec, run_dir: RunDirectory) -> dict[str, Any] | None:
    """The run's dataset snapshot when ``spec`` continues the run: its run record has the
    spec's fingerprint (or the first attempt ended before it wrote one), and names this
    snapshot (SpecError otherwise: dataset.json was replaced or edited). None when the run has
    none, or when ``spec`` is not the run's: the plan refuses it (naming what changed) once
    the dataset's own errors have named themselves."""
    stored = run_dir.read_dataset_snapshot()
    if stored is None:
        return None
    run = run_dir.read_run_record()
    if run is not None and run.get("fingerprint") != spec.fingerprint():
        return None
    recorded = run.get("dataset") if run is not None else None
    computed = dataset_snapshot.recorded_fingerprint(stored)
    if computed != stored.get("fingerprint") or recorded not in (None, computed):
        field = "datasets" if spec.ray_loop else "data.dataset"
        raise SpecError(
            f"run {run_dir.uri}: its dataset snapshot (dataset.json, files fingerprint "
            f"{computed[:12]}, stated {str(stored.get('fingerprint'))[:12]}) is not the one "
            f"run.json records ({str(recorded)[:12]}): dataset.json was replaced or edited. "
            f"Restore it, or start a new run.name to train on {field} as it is now.",
            field=field,
        )
    return stored


def validate_workload(
    spec: RunSpec, pinned: PinnedDataset | PinnedSamples | None = None
) -> int | None:
    """Import what the spec names, read the dataset (footers; ``pinned``: already read) and
    build the model: SpecError before any worker starts. Returns the run's total optimizer
    steps (None for a Ray Train loop of the user's own, whose ``datasets`` are checked where
    they are pinned: ``pin_ray_datasets``)."""
    if spec.train_loop is not None:
        workloads.resolve_train_loop(spec.train_loop)
    if spec.ray_loop:
        return None
    assert spec.data is not None and spec.schedule is not None
    if not spec.own_loop:  # a loop of the user's own builds its optimizer and scheduler itself
        optimizers.check_optimizer_and_schedule(spec.optimizer, spec.schedule, total_steps=1)
    data = spec.data.resolved()
    pinned = pinned or pin_dataset(spec)
    assert pinned is not None
    if isinstance(pinned, PinnedSamples):
        batches = sample_checks.check_dataset_form(
            spec, pinned.train, pinned.validation, pinned.test
        )
        return data_mod.steps_per_epoch(batches, spec.optimizer.grad_accumulation) * (
            spec.schedule.epochs
        )
    layout = pinned.layout
    _check_reader_memory(data, layout)
    one = rank_stream.RankStream(layout, data, spec.run.seed, 1, 0)  # row ids only: no rows read
    if one.batches_per_epoch == 0:
        raise SpecError(
            f"dataset {layout.uri} has {one.train_rows} training rows, fewer than one global batch "
            f"(data.batch_size={data.batch_size}): lower data.batch_size or "
            f"data.validation_fraction ({data.validation_fraction})",
            field="data.batch_size",
        )
    if spec.scaling.shard_fn is not None:
        import_object(spec.scaling.shard_fn, "scaling.shard_fn")
    if not spec.own_loop:  # a loop of the user's own builds its model and loss itself
        _check_model_on_rows(spec, pinned, one)
    return (
        data_mod.steps_per_epoch(one.batches_per_epoch, spec.optimizer.grad_accumulation)
        * spec.schedule.epochs
    )


def _check_model_on_rows(spec: RunSpec, pinned: PinnedDataset, one: rank_stream.RankStream) -> None:
    """The built-in loop's model, loss and metrics on a few real training rows."""
    assert spec.model is not None and spec.data is not None
    data = spec.data.resolved()
    layout, info = pinned.layout, pinned.info
    first = next(g for g, count in enumerate(one.train_counts) if count)  # one row group read
    sample = np.arange(min(one.train_counts[first], 4))
    ids, rows = one.reader.take(np.full(len(sample), first), sample)
    if isinstance(rows, TableRows):
        file = layout.row_groups[first].file
        where = layout.uri if layout.uri.endswith(file) else f"file {file!r} of {layout.uri}"
        check_batch_workload(spec, ids, rows, where)
    else:
        workloads.check_loss_and_metrics(
            workloads.build_model(spec.model, info.num_features, info.num_outputs),
            torch.from_numpy(rows.features),
            torch.from_numpy(rows.labels),
            spec.loss,
            spec.metrics,
            data.task or "classification",
        )


def _check_reader_memory(data: Any, layout: footers.Layout) -> None:
    """The live and next shuffle windows of every partition must fit in half of
    data.memory_mb (the row group slices around them take the rest): SpecError naming the
    settings otherwise."""
    windows_mb = 2 * data.partitions * data.shuffle_window * footers.row_bytes(layout) / 2**20
    if windows_mb > data.memory_mb / 2:
        raise SpecError(
            f"data.partitions ({data.partitions}) x 2 x data.shuffle_window "
            f"({data.shuffle_window}) rows (the live window and the next, read ahead) of "
            f"{footers.row_bytes(layout):.0f} bytes hold {windows_mb:.0f} MB, more than "
            f"half of data.memory_mb ({data.memory_mb}): lower data.shuffle_window or "
            "data.partitions, or raise data.memory_mb",
            field="data.shuffle_window",
        )
    # The slices around the windows: wide rows (encoded images) can make even the smallest
    # hold more than the budget, which would then be no bound at all.
    row = footers.row_bytes(layout)
    largest = max((g.rows for g in layout.row_groups), default=0)
    rows = row_slices.slice_rows_for(
        data.memory_mb, row, data.partitions, data.shuffle_window, largest
    )
    held_mb = row_slices.held_bytes(row, data.partitions, data.shuffle_window, rows) / 2**20
    if held_mb > data.memory_mb:
        raise SpecError(
            f"rows of {row / 1e3:.0f} KB (decoded) in slices of at least {rows} rows: a worker "
            f"reading data.partitions ({data.partitions}) with data.shuffle_window "
            f"({data.shuffle_window}) holds about {held_mb:.0f} MB, more than data.memory_mb "
            f"({data.memory_mb}): raise data.memory_mb to at least {int(held_mb) + 1}, or "
            "lower data.partitions or data.shuffle_window",
            field="data.memory_mb",
        )
    if rows < largest:  # held to the bound at a cost the user may rather pay in memory
        whole_mb = row_slices.held_bytes(row, data.partitions, data.shuffle_window, largest)
        logger.warning(
            "row groups of up to %d rows are larger than the %d-row slices data.memory_mb "
            "(%d) leaves room for: they are streamed and spilled to local disk slice by slice, "
            "several times slower than reading them whole on object storage. data.memory_mb "
            "%d reads them whole (or write the files in smaller row groups)",
            largest,
            rows,
            data.memory_mb,
            int(whole_mb / 2**20) + 1,
        )


@dataclass(frozen=True)
class Preflight:
    """What the driver settled before an attempt: its plan, the run directory, the dataset it
    trains on (None for a user's own loop), a Ray loop's ``datasets`` (``tables``; None
    otherwise) and the run's total optimizer steps."""

    plan: Plan
    run_dir: RunDirectory
    pinned: PinnedDataset | PinnedSamples | None
    total_steps: int | None
    tables: PinnedTables | None = None

    @property
    def snapshot(self) -> dict[str, Any] | None:
        """What the run directory keeps as the run's dataset snapshot (dataset.json)."""
        if self.tables is not None:
            return self.tables.record
        return self.pinned.record if self.pinned is not None else None

    def added(self) -> list[tuple[str, list[str]]]:
        """The files added since the run's snapshot, by the dataset's URI (none opened)."""
        if self.tables is not None:
            layouts, added = self.tables.layouts, self.tables.added
            return [(layouts[name].uri, files) for name, files in added.items() if files]
        if isinstance(self.pinned, PinnedDataset) and self.pinned.added:
            return [(self.pinned.layout.uri, self.pinned.added)]
        return []


def preflight(spec: RunSpec, attempt: int | None = None) -> Preflight:
    """Everything the driver checks before an attempt, in the order errors name themselves:
    storage (writable) and the run's name; the dataset the attempt trains on, or a Ray loop's
    ``datasets`` (a later attempt's snapshot, read first; else the footers) and the workload
    on it (what the spec imports, the memory bound, the model, the loss, the total steps);
    then the run directory's record and the plan. The dataset is read and described once."""
    run_dir = run_directory(spec)
    pinned = pin_dataset(spec, run_dir)
    tables = pin_ray_datasets(spec, run_dir)
    total_steps = validate_workload(spec, pinned)
    plan, run_dir = plan_attempt(spec, attempt, run_dir)
    return Preflight(plan, run_dir, pinned, total_steps, tables)
