"""The columns form's batches (``data.columns``): every row through ``data.transform`` with a
generator of its own, in a pool off the training thread, then collated into a dict of tensors.

The generator is counter-based (numpy's Philox), keyed by (run.seed, epoch, row id), as Grain's
``RandomMap`` keys its per-element Philox by (seed, op, index). A row so gets the same draw on
any worker count, in any transform worker, after any resume, and another one each epoch.
Validation rows are keyed by (run.seed, row id) alone: the same draw every epoch.

A transform is ``fn(row, rng) -> dict of arrays/tensors``, ``row`` a dict of the row's columns
as Python values (binary as ``bytes``, lists as lists); batched (``data.transform_batched``),
``fn(rows, rngs)`` with a dict of columns (lists) and one generator per row, returning batched
arrays. Without a transform, number and list-of-number columns become tensors as they are.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import multiprocessing
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import torch
from torch.utils.data import default_collate

from trainer_core.data.table_rows import TableRows
from trainer_core.errors import SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.sections import DataSection

#: The epoch validation rows are keyed with (no training epoch reaches it).
VALIDATION = 2**32 - 1

Batch = dict[str, torch.Tensor]
T = TypeVar("T")
U = TypeVar("U")


def row_rng(seed: int, epoch: int, row_id: int) -> np.random.Generator:
    """The generator of row ``row_id`` in ``epoch`` (``VALIDATION`` for validation rows)."""
    key = np.array([(epoch << 32) | seed, row_id], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key))


_FUNCTIONS: dict[tuple[str, str], Callable[..., Any]] = {}


def _function(path: str, field: str) -> Callable[..., Any]:
    """``path`` imported once per process (a transform process resolves it by name)."""
    found = _FUNCTIONS.get((path, field))
    if found is None:
        found = _FUNCTIONS[(path, field)] = import_object(path, field)
    return found


def _import(paths: list[tuple[str, str]]) -> None:
    """Import the transforms at ``paths`` in this (transform) process; return nothing, which
    the pool sends back as is (a transform's own object need not pickle)."""
    for path, field in paths:
        _function(path, field)


def transform_rows(
    path: str,
    field: str,
    batched: bool,
    seed: int,
    epoch: int,
    ids: np.ndarray,
    columns: dict[str, list[Any]],
) -> Any:
    """Rows ``ids`` (given as columns) through the transform at ``path``: a list of samples, or
    the batched transform's dict. Module-level, so a transform process can run it."""
    fn = _function(path, field)
    rngs = [row_rng(seed, epoch, int(i)) for i in ids]
    if batched:
        return fn(columns, rngs)
    names = list(columns)
    return [fn({name: columns[name][k] for name in names}, rng) for k, rng in enumerate(rngs)]


class TransformPool:
    """The transform workers of one rank (``data.transform_workers``), shared by its training
    and validation batches: threads, or spawned processes (``data.transform_pool:
    processes``). ``warm`` starts them now, so that a process's start (it imports the
    transform, and torch) overlaps the model's build rather than a step or a validation."""

    def __init__(self, data: DataSection):
        self.data = data
        self.paths = [
            (path, field)
            for path, field in [
                (data.transform, "data.transform"),
                (data.eval_transform, "data.eval_transform"),
            ]
            if path is not None
        ]
        self.workers = data.transform_workers if self.paths else 0
        self._executor: concurrent.futures.Executor | None = None

    def executor(self) -> concurrent.futures.Executor | None:
        if self.workers == 0:
            return None
        if self._executor is None:
            if self.data.transform_pool == "processes":
                # spawn: a Ray worker's threads make fork unsafe.
                self._executor = concurrent.futures.ProcessPoolExecutor(
                    self.workers, mp_context=multiprocessing.get_context("spawn")
                )
            else:
                self._executor = concurrent.futures.ThreadPoolExecutor(
                    self.workers, "relaytrain-transform"
                )
        return self._executor

    def warm(self) -> TransformPool:
        """Start the workers, each importing the transforms (processes only: threads start
        at once); returns this pool."""
        if self.data.transform_pool == "processes" and self.workers:
            pool = self.executor()
            assert pool is not None
            for _ in range(self.workers):
                pool.submit(_import, self.paths)
        return self

    def close(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None


class Batches:
    """Makes one rank's batches of the columns form: ``start(epoch, ids, rows)`` starts one
    and returns what finishes it (the read-ahead thread keeps several started), ``each`` makes
    a run of them that way (validation), ``batches(epoch, ids, rows)`` makes one at once.

    The rows are split into as many chunks as the pool has workers, transformed side by side,
    and collated (``data.collate``, else ``torch.utils.data.default_collate``); a batched
    transform's chunks are concatenated instead. ``training=False``: the validation rows'
    transform (``data.eval_transform``, else ``data.transform``), keyed by row id alone.
    ``pool``: the workers to share (their owner closes them); None: a pool of its own.
    """

    def __init__(
        self,
        data: DataSection,
        seed: int,
        training: bool = True,
        pool: TransformPool | None = None,
    ):
        self.data, self.seed, self.training = data, seed, training
        if training or data.eval_transform is None:
            path, self.field = data.transform, "data.transform"
        else:
            path, self.field = data.eval_transform, "data.eval_transform"
        self.path = path
        if path is not None:
            _function(path, self.field)  # a bad path fails here, not in the pool
        self.collate: Callable[[list[Any]], Any] = (
            import_object(data.collate, "data.collate") if data.collate else default_collate
        )
        self._owned = pool is None
        self.pool = TransformPool(data) if pool is None else pool
        self.workers = self.pool.workers if path is not None else 0

    def __call__(self, epoch: int, ids: np.ndarray, rows: TableRows) -> Batch:
        return self.start(epoch, ids, rows)()

    def start(self, epoch: int, ids: np.ndarray, rows: TableRows) -> Callable[[], Batch]:
        """Start the batch of ``rows`` (their values are read now; the pool transforms them
        while the caller goes on): a function that waits for it and collates it."""
        if self.path is None:
            batch = column_tensors(rows.table)
            return lambda: batch
        key = epoch if self.training else VALIDATION
        columns = rows.columns()
        chunks = _chunks(len(ids), max(self.workers, 1))
        pool = self.pool.executor() if self.workers else None
        args = [
            (
                self.path,
                self.field,
                self.data.transform_batched,
                self.seed,
                key,
                ids[a:b],
                {name: values[a:b] for name, values in columns.items()},
            )
            for a, b in chunks
        ]
        if pool is None:
            parts = [transform_rows(*a) for a in args]
            return lambda: self._collated(parts)
        futures = [pool.submit(transform_rows, *a) for a in args]
        return lambda: self._collated([future.result() for future in futures])

    def each(
        self, epoch: int, parts: Iterable[tuple[np.ndarray, TableRows]], ahead: int
    ) -> Iterator[Batch]:
        """``parts`` (row ids and rows) as batches, in order, with up to ``ahead`` more started
        behind the one handed out: the pool transforms the next while the caller uses it."""
        started = ((self.start(epoch, ids, rows), None) for ids, rows in parts)
        for batch, _ in finished_in_order(started, ahead):
            yield batch

    def _collated(self, parts: list[Any]) -> Batch:
        if self.data.transform_batched:
            return concatenate([as_tensors(part, self.field) for part in parts])
        samples = [sample for part in parts for sample in part]
        return self.collate(samples)

    def close(self) -> None:
        if self._owned:
            self.pool.close()


def finished_in_order(
    started: Iterable[tuple[Callable[[], T], U]], ahead: int
) -> Iterator[tuple[T, U]]:
    """Each started item's result (``finish()``) with what came with it, in order, finished
    once ``ahead`` more have been started behind it (or the items have run out). An error
    starting an item is raised where that item would have been, after those before it."""
    pending: collections.deque[tuple[Callable[[], T], U]] = collections.deque()
    items = iter(started)
    while True:
        try:
            item = next(items)
        except StopIteration:
            break
        except BaseException:
            while pending:
                finish, extra = pending.popleft()
                yield finish(), extra
            raise
        pending.append(item)
        if len(pending) > ahead:
            finish, extra = pending.popleft()
            yield finish(), extra
    while pending:
        finish, extra = pending.popleft()
        yield finish(), extra


def _chunks(count: int, parts: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of ``parts`` near-equal chunks of ``count`` items (none empty)."""
    parts = max(1, min(parts, count))
    bounds = [count * k // parts for k in range(parts + 1)]
    return list(itertools.pairwise(bounds))


def as_tensors(part: Any, field: str) -> Batch:
    """A batched transform's dict of arrays as tensors."""
    if not isinstance(part, Mapping):
        raise SpecError(
            f"{field} returned {type(part).__name__}: a batched transform returns a dict of "
            "arrays or tensors, one row per input row",
            field=field,
        )
    return {str(k): torch.as_tensor(v) for k, v in part.items()}


def concatenate(parts: list[Batch]) -> Batch:
    """Batches of the same keys joined along the first dimension."""
    if len(parts) == 1:
        return parts[0]
    return {key: torch.cat([part[key] for part in parts]) for key in parts[0]}


def column_tensors(table: pa.Table) -> Batch:
    """Number and list-of-number columns as tensors (no transform): SpecError naming a column
    that needs one (binary, strings, lists of uneven length)."""
    batch: Batch = {}
    for name in table.column_names:
        column = table.column(name).combine_chunks()
        kind = column.type
        try:
            if pa.types.is_integer(kind) or pa.types.is_floating(kind):
                batch[name] = torch.from_numpy(column.to_numpy(zero_copy_only=False).copy())
            elif pa.types.is_list(kind) or pa.types.is_fixed_size_list(kind):
                batch[name] = torch.as_tensor(np.array(column.to_pylist()))
            else:
                raise TypeError(f"type {kind}")
            if batch[name].dtype == torch.float64:
                batch[name] = batch[name].float()
        except (TypeError, ValueError, pa.ArrowInvalid) as e:
            raise SpecError(
                f"data.columns column {name!r} ({kind}) cannot become a tensor as it is ({e}): "
                "decode or pad it with data.transform, fn(row, rng) -> dict of arrays",
                field="data.transform",
            ) from e
    return batch
