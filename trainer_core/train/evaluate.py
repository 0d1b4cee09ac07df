"""Evaluate committed checkpoints on a holdout, on the driver (no Ray: small models, one process).

Used by retraining to compare a challenger with the champion on the same rows, and to check
that a champion's weights fit the challenger's model before warm-starting from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from trainer_core.checkpoint.exports import read_model_weights
from trainer_core.data import arrays as data_mod
from trainer_core.data import footers, held_out, rank_stream, samples, stream
from trainer_core.data.sample_loader import RankSamples, held_batches
from trainer_core.data.transform import Batches
from trainer_core.errors import SpecError
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import validate, workloads
from trainer_core.train.batch_workload import BatchWorkload


def check_holdout(spec: RunSpec) -> None:
    """SpecError unless the spec holds rows out for validation: a comparison of models needs
    rows that none of them trained on."""
    assert spec.data is not None
    if spec.data.validation_fraction == 0 and spec.data.validation is None:
        raise SpecError(
            "data.validation_fraction is 0: the loop holds out no rows, and comparing a "
            "challenger with the champion needs rows neither trained on. Set "
            "data.validation_fraction above 0 (e.g. 0.1)",
            field="data.validation_fraction",
        )


def holdout(spec: RunSpec) -> Any:
    """The rows the loop validates on (``data.validation_fraction`` of them, by row id): the
    same rows for every model evaluated, none of them trained on (SpecError if there are
    none). The tabular form's as one ``Arrays``; the columns form's as the loop's validation
    batches (``data.eval_transform``), a list."""
    assert spec.data is not None
    check_holdout(spec)
    data = spec.data.resolved()
    if data.torch_dataset:
        return _held_samples(spec)
    if data.validation is not None:  # a validation set of its own: every row of it
        data = held_out.held_view(data, "validation")
    return _held_rows(spec, data)


def _held_rows(spec: RunSpec, data: Any) -> Any:
    """The held-out rows of ``data`` (a held-out set's view: all of them), as ``holdout``
    gives them."""
    layout = footers.scan(data)
    stream_ = rank_stream.RankStream(layout, data, spec.run.seed, 1, 0)
    parts: list[Any]
    if data.columns_form:
        batches = Batches(data, spec.run.seed, training=False)
        try:
            parts = list(batches.each(0, stream_.validation_with_ids(), ahead=data.prefetch))
        finally:
            batches.close()
    else:
        parts = list(stream_.validation())
    if not parts:
        raise SpecError(
            f"data.validation_fraction {data.validation_fraction} holds out none of the "
            f"{layout.num_rows} rows of {layout.uri}, and comparing a challenger with the "
            "champion needs rows neither trained on: raise data.validation_fraction",
            field="data.validation_fraction",
        )
    if data.columns_form:
        return parts
    return data_mod.Arrays(
        np.concatenate([p.features for p in parts]), np.concatenate([p.labels for p in parts])
    )


def _held_samples(spec: RunSpec) -> list[Any]:
    """The Dataset form's validation batches, as the loop reads them (one rank, in this
    process): the validation set, or the indices data.validation_fraction holds out."""
    assert spec.data is not None
    data = spec.data.model_copy(update={"loader_workers": 0})
    train = samples.build_dataset(data.dataset, data.kwargs, "data.dataset")
    held = (
        samples.build_dataset(data.validation, data.validation_kwargs, "data.validation")
        if data.validation
        else None
    )
    found = list(RankSamples(train, held, data, spec.run.seed, 1, 0).validation())
    if not found:
        raise SpecError(
            f"data.validation_fraction {data.validation_fraction} holds out none of the "
            f"{len(train)} samples of data.dataset {data.dataset!r}, and comparing a "
            "challenger with the champion needs samples neither trained on: raise "
            "data.validation_fraction, or name a validation set (data.validation)",
            field="data.validation_fraction",
        )
    return found


def test_metrics(spec: RunSpec, checkpoint_uri: str) -> dict[str, float]:
    """``data.test``'s figures for a checkpoint (the best, once the run completes): what
    validation measures (``test_loss``, ``test_accuracy``, the spec's metrics as
    ``test_<name>``), over every test sample, in this process."""
    assert spec.data is not None and spec.data.test is not None
    if not spec.data.torch_dataset:  # a Parquet test set: every row of it
        rows = _held_rows(spec, held_out.held_view(spec.data, "test"))
        measured = evaluate(spec, checkpoint_uri, rows)
        return {"test_" + name.removeprefix("val_"): value for name, value in measured.items()}
    data = spec.data.model_copy(update={"loader_workers": 0})
    dataset = samples.build_dataset(spec.data.test, data.test_kwargs, "data.test")
    batches = held_batches(
        samples.SeededSamples(dataset, spec.run.seed),
        np.arange(len(dataset)),
        data,
        samples.collate_function(data),
        field="data.test",
    )
    measured = evaluate(spec, checkpoint_uri, batches)
    return {"test_" + name.removeprefix("val_"): value for name, value in measured.items()}


def describe(spec: RunSpec) -> data_mod.DatasetInfo:
    assert spec.data is not None
    if spec.data.torch_dataset:  # a model of the Dataset form is built from its kwargs alone
        return data_mod.DatasetInfo(num_rows=0, num_features=0, num_outputs=0)
    return stream.describe(footers.scan(spec.data), spec.data)


def load_model(spec: RunSpec, checkpoint_uri: str, num_inputs: int, num_outputs: int) -> nn.Module:
    """The spec's model with the weights of ``checkpoint_uri`` (SpecError if they do not fit)."""
    assert spec.model is not None and spec.data is not None
    model = workloads.build_model(spec.model, num_inputs, num_outputs, spec.data.columns_form)
    state = read_model_weights(checkpoint_uri)
    try:
        model.load_state_dict(state)
    except RuntimeError as e:
        raise SpecError(
            f"checkpoint {checkpoint_uri} does not fit model {spec.model.name} "
            f"{spec.model.kwargs}: {str(e).splitlines()[0]}",
            field="model",
        ) from e
    return model.eval()


def compatible(spec: RunSpec, checkpoint_uri: str) -> tuple[bool, str]:
    """Whether ``checkpoint_uri``'s weights load into the spec's model, and why not."""
    assert spec.data is not None
    info = describe(spec)
    try:
        load_model(spec, checkpoint_uri, info.num_features, info.num_outputs)
    except SpecError as e:
        return False, str(e)
    return True, "weights fit the model"


@torch.no_grad()
def evaluate(spec: RunSpec, checkpoint_uri: str, rows: Any) -> dict[str, float]:
    """What the loop measures on validation, for a checkpoint on ``rows`` (``holdout``'s):
    val_loss (the spec's ``loss``), val_accuracy for classification, and the spec's own
    ``metrics``; the columns form's from their sums and counts (``BatchWorkload``)."""
    assert spec.data is not None
    if spec.data.columns_form:
        model = load_model(spec, checkpoint_uri, 0, 0)
        workload = BatchWorkload(spec)
        totals: dict[str, tuple[float, float]] = {}
        states = workload.new_states()
        for batch in rows:
            outputs = workload.forward(model, batch)
            found = workload.metric_sums(outputs, batch)
            for name, (total, count) in found.items():
                before = totals.get(name, (0.0, 0.0))
                totals[name] = (before[0] + total, before[1] + count)
            workload.update_states(states, outputs, batch)
        return workload.finish(totals, validate.compute_states(states, 1))
    task = spec.data.resolved().task or "classification"
    outputs = int(rows.labels.max()) + 1 if task == "classification" else 1
    info = describe(spec)
    model = load_model(spec, checkpoint_uri, rows.features.shape[1], max(outputs, info.num_outputs))
    features = torch.from_numpy(rows.features)
    labels = torch.from_numpy(rows.labels)
    output = model(features)
    loss = workloads.loss_function(task, spec.loss)(output, labels)
    metric_fns = workloads.metric_functions(list(spec.metrics))
    sums = validate.part_sums(output, labels, loss, task == "classification", metric_fns)
    return {name: total / len(labels) for name, total in sums.items()}
