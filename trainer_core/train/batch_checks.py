"""The columns form's workload checked in setup on a few real rows, before any worker starts:
the transform (it raises, it is not deterministic in its ``rng``, its rows cannot be batched),
the model against the batch's keys, and the loss and metrics against the contract. Each
failure is a SpecError naming the function, the row and the fix; nothing is written."""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate

from trainer_core.data.table_rows import TableRows
from trainer_core.data.transform import as_tensors, column_tensors, concatenate, transform_rows
from trainer_core.errors import SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.run_spec import RunSpec
from trainer_core.spec.sections import metric_name
from trainer_core.train import validate, workloads
from trainer_core.train.batch_workload import LABELS, BatchWorkload, as_sum, logits_of


def check_batch_workload(spec: RunSpec, ids: np.ndarray, rows: TableRows, where: str) -> None:
    """Run the spec's transform, collate, model, loss and metrics on ``rows`` (row ids
    ``ids``, read from ``where``) as the loop will: SpecError for what the loop cannot use."""
    assert spec.data is not None and spec.model is not None
    batch = _batch(spec, ids, rows, where)
    model = workloads.build_model(spec.model, 0, 0, columns_form=True)
    workload = BatchWorkload(spec)
    if spec.data.eval_transform is not None:  # validation's batches: now, not after an epoch
        evaluated = _batch(spec, ids, rows, where, "data.eval_transform")
        try:
            _check_loss(workload, _forward(workload, model, evaluated, spec), evaluated, spec)
        except SpecError as e:
            raise SpecError(
                f"validation's batch, made by data.eval_transform "
                f"{spec.data.eval_transform!r}: {e}",
                field="data.eval_transform",
            ) from e
    check_batch(spec, batch, workload, model, "data.transform")


def check_batch(
    spec: RunSpec,
    batch: dict[str, Any],
    workload: BatchWorkload,
    model: torch.nn.Module,
    maker: str,
) -> None:
    """The model, loss and metrics on one training ``batch`` (made by ``maker``, the spec
    field named when the batch lacks the labels a built-in loss reads)."""
    assert spec.data is not None
    if spec.data.task is not None and spec.loss is None and LABELS not in batch:
        raise SpecError(
            f"data.task {spec.data.task} reads the batch's {LABELS!r}, but the batch has only "
            f"{sorted(batch)}: have {maker} return {LABELS!r}, or set loss",
            field=maker,
        )
    outputs = _forward(workload, model, batch, spec)
    _check_loss(workload, outputs, batch, spec)
    with torch.no_grad():
        for i, path in enumerate(spec.metrics):
            name = metric_name(path)
            if name in workload.stateful:
                _check_stateful_metric(workload.stateful[name], i, path, outputs, batch)
                continue
            try:
                as_sum(workload.metric_fns[name](outputs, batch), batch)
            except Exception as e:
                raise SpecError(
                    f"metrics.{i} {path!r} raised {type(e).__name__} on the first rows' batch "
                    f"({_shapes(batch)}): {e}. It is called as fn(outputs, batch) and returns "
                    "(sum, count) or the batch's mean",
                    field=f"metrics.{i}",
                ) from e


def _check_stateful_metric(
    cls: type, i: int, path: str, outputs: Any, batch: dict[str, Any]
) -> None:
    """A stateful metric as validation uses it: a new instance updated with a batch, folded
    with another rank's (``merge``, unless it syncs itself), computed to one number."""
    try:
        metric = cls()
        metric.update(outputs, batch)
        if not validate.syncs_itself(metric):
            other = copy.deepcopy(metric)
            metric.merge(other)
        value = metric.compute()
        number = float(value)
    except Exception as e:
        raise SpecError(
            f"metrics.{i} {path!r} is a class, a stateful metric, and raised "
            f"{type(e).__name__} on the first rows' batch ({_shapes(batch)}): {e}. relaytrain "
            "makes one per validation pass with no arguments, calls update(outputs, batch) on "
            "each batch, merge(other) with every other rank's, then compute(), which returns "
            "a number",
            field=f"metrics.{i}",
        ) from e
    if not math.isfinite(number):
        raise SpecError(
            f"metrics.{i} {path!r} computed {number} on the first rows' batch: compute() must "
            "return a finite number",
            field=f"metrics.{i}",
        )


def _batch(
    spec: RunSpec, ids: np.ndarray, rows: TableRows, where: str, field: str = "data.transform"
) -> dict[str, Any]:
    """The batch the loop makes of ``rows`` with the transform ``field`` names (training's
    ``data.transform``, or validation's ``data.eval_transform``)."""
    data = spec.data
    assert data is not None
    path = getattr(data, field.removeprefix("data."))
    if path is None:
        return column_tensors(rows.table)
    columns = rows.columns()
    samples: list[Any] = []
    for k, row_id in enumerate(ids):
        one = {name: values[k : k + 1] for name, values in columns.items()}
        first = _transform(spec, row_id, one, where, field)
        again = _transform(spec, row_id, one, where, field)
        if not equal(first, again):
            raise SpecError(
                f"{field} {path!r} returned different values for row {row_id} of {where}, "
                "called twice with the same rng: draw every random number from the rng it is "
                "given (numpy Generator keyed by run.seed, epoch and row id), so a resumed or "
                "rescaled run gets the same samples",
                field=field,
            )
        samples.append(first)
    if data.transform_batched:
        try:
            return concatenate([as_tensors(part, field) for part in samples])
        except (RuntimeError, TypeError, ValueError) as e:
            raise SpecError(
                f"{field} {path!r} (batched) returned rows that cannot be joined into a "
                f"batch: {e}. Return arrays of the same shape for every row",
                field=field,
            ) from e
    rows_out = [sample for part in samples for sample in part]
    collate = import_object(data.collate, "data.collate") if data.collate else default_collate
    try:
        batch = collate(rows_out)
    except Exception as e:
        fix = "fix data.collate" if data.collate else "give data.collate to pad or stack them"
        raise SpecError(
            f"{field} {path!r} returned rows that cannot be batched "
            f"({describe(rows_out[0])}, ...): {type(e).__name__}: {e}. Return arrays of the "
            f"same shape and type for every row, or {fix}",
            field="data.collate" if data.collate else field,
        ) from e
    if not isinstance(batch, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in batch.values()
    ):
        raise SpecError(
            f"a batch of data.transform {data.transform!r}'s rows is {describe(batch)}, not a "
            "dict of tensors: return a dict of arrays or tensors from the transform",
            field="data.collate" if data.collate else "data.transform",
        )
    return dict(batch)


def _transform(
    spec: RunSpec, row_id: Any, columns: dict[str, list[Any]], where: str, field: str
) -> Any:
    data = spec.data
    assert data is not None
    path = getattr(data, field.removeprefix("data."))
    try:
        out = transform_rows(
            path,
            field,
            data.transform_batched,
            spec.run.seed,
            0,
            np.array([row_id]),
            columns,
        )
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(
            f"{field} {path!r} raised {type(e).__name__} on row {row_id} of {where}: {e}. Fix "
            "the transform (it is called as fn(row, rng) with the row's columns as Python "
            "values: binary as bytes, lists as lists)",
            field=field,
        ) from e
    if not data.transform_batched and not isinstance(out[0], Mapping):
        raise SpecError(
            f"{field} {path!r} returned {describe(out[0])} for row {row_id} of {where}: "
            "return a dict of arrays or tensors (e.g. {'image': ..., 'labels': ...})",
            field=field,
        )
    return out


def _forward(workload: BatchWorkload, model: torch.nn.Module, batch: Any, spec: RunSpec) -> Any:
    assert spec.model is not None
    try:
        return workload.forward(model, batch)
    except Exception as e:
        how = (
            f"model.forward {spec.model.forward!r}"
            if spec.model.forward
            else f"model.inputs {spec.model.inputs!r}"
        )
        raise SpecError(
            f"model {spec.model.name!r} rejected the batch ({_shapes(batch)}), called by "
            f"{how}: {type(e).__name__}: {e}. Name the keys it takes with model.inputs (one "
            "key: passed positionally; a list: as keyword arguments), or call it your way "
            "with model.forward",
            field="model.forward" if spec.model.forward else "model.inputs",
        ) from e


def _check_loss(workload: BatchWorkload, outputs: Any, batch: Any, spec: RunSpec) -> None:
    path = spec.loss
    if path is None:
        try:
            workload.loss(outputs, batch)
        except Exception as e:
            raise SpecError(
                f"data.task {spec.data.task if spec.data else None}'s loss cannot use the "
                f"model's outputs ({describe(outputs)}) with the batch ({_shapes(batch)}): "
                f"{type(e).__name__}: {e}. Return logits shaped for the task, or set loss",
                field="data.task",
            ) from e
        return
    try:
        value = workload.user_loss(outputs, batch)  # type: ignore[misc]
    except Exception as e:
        raise SpecError(
            f"loss {path!r} raised {type(e).__name__} on the model's outputs "
            f"({describe(outputs)}) and the batch ({_shapes(batch)}): {e}. It is called as "
            "fn(outputs, batch)",
            field="loss",
        ) from e
    pair = isinstance(value, tuple | list) and len(value) == 2
    total = value[0] if pair else value
    if not isinstance(total, torch.Tensor) or total.numel() != 1:
        raise SpecError(
            f"loss {path!r} returned {describe(value)}: return (the summed loss as a scalar "
            "tensor, the count of items it covers), e.g. (losses.sum(), len(losses)), or the "
            "batch's mean as a scalar tensor",
            field="loss",
        )
    if not total.requires_grad:
        raise SpecError(
            f"loss {path!r} returned a tensor that does not depend on the model's outputs (no "
            "gradient flows back): compute it from `outputs` with torch operations",
            field="loss",
        )
    if pair:
        count = value[1]
        number = float(count) if isinstance(count, int | float | torch.Tensor) else None
        if number is None or (isinstance(count, torch.Tensor) and count.numel() != 1):
            raise SpecError(
                f"loss {path!r} returned a count {describe(count)}: the second item is the "
                "number of items the summed loss covers (samples, or labelled tokens)",
                field="loss",
            )


def equal(a: Any, b: Any) -> bool:
    """Whether two samples (tensors, arrays, dicts and sequences of them) hold the same values."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return bool(np.array_equal(np.asarray(a), np.asarray(b)))
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, Sequence) and isinstance(b, Sequence) and not isinstance(a, str | bytes):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _shapes(batch: Any) -> str:
    if isinstance(batch, Mapping):
        return ", ".join(f"{k}: {describe(v)}" for k, v in batch.items())
    return describe(batch)


def describe(value: Any) -> str:
    if isinstance(value, torch.Tensor | np.ndarray):
        return f"{type(value).__name__} {list(value.shape)} {value.dtype}"
    if isinstance(value, Mapping):
        return "dict of " + ", ".join(f"{k}: {describe(v)}" for k, v in value.items())
    logits = logits_of_safe(value)
    if logits is not None:
        return f"{type(value).__name__} with logits {list(logits.shape)}"
    return f"{type(value).__name__} {value!r}"[:80]


def logits_of_safe(value: Any) -> torch.Tensor | None:
    try:
        return logits_of(value)
    except TypeError:
        return None
