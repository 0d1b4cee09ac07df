"""The pure checks behind tests/integration/test_bad_input.py: each names its field and the fix."""

from __future__ import annotations

import argparse

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from deployments.serve import cron_expression, positive_seconds
from tests.conftest import tiny_raw
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.data import footers
from trainer_core.errors import IncompatibleRunError, SpecError
from trainer_core.spec.imports import import_object
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import identity_changes
from trainer_core.spec.sections import DataSection, ModelSection
from trainer_core.storage.uris import resolve
from trainer_core.train.workloads import build_model


def refused(raw, overrides=()) -> SpecError:
    with pytest.raises(SpecError) as error:
        build_spec(raw, overrides)
    return error.value


def test_unknown_keys_name_the_closest_known_one(tmp_path):
    raw = tiny_raw(tmp_path, "x")
    raw["schedul"] = raw.pop("schedule")
    error = refused(raw)
    assert error.field == "schedul" and "did you mean 'schedule'?" in str(error)
    error = refused(tiny_raw(tmp_path, "x"), ["optimizer.learning_rate=0.1"])
    assert error.field == "optimizer.learning_rate"
    assert "unknown key 'learning_rate'" in str(error) and "'lr'" in str(error)


def test_a_fault_on_a_missing_rank_names_the_fault(tmp_path):
    raw = tiny_raw(tmp_path, "x", faults=[{"kind": "raise", "at_step": 2, "rank": 3}])
    error = refused(raw)
    assert error.field == "faults.0.rank" and "use a rank below 2" in str(error)


def test_best_metric_must_be_one_the_builtin_loop_records(tmp_path):
    assert build_spec(tiny_raw(tmp_path, "x")).builtin_metrics() == ["loss", "val_loss"]
    error = refused(tiny_raw(tmp_path, "x", checkpoint={"best_metric": "val_accuracy"}))
    assert error.field == "checkpoint.best_metric" and "['loss', 'val_loss']" in str(error)
    digits = tiny_raw(tmp_path, "x", data={"dataset": "digits"})
    digits["data"].pop("synthetic")
    digits["checkpoint"]["best_metric"] = "val_accuracy"
    assert build_spec(digits).checkpoint.best_metric == "val_accuracy"
    no_holdout = tiny_raw(tmp_path, "x", data={"validation_fraction": 0})
    assert "use one of ['loss']" in str(refused(no_holdout))
    no_holdout["checkpoint"]["best_metric"] = "loss"
    assert build_spec(no_holdout).checkpoint.best_metric == "loss"
    own_loop = tiny_raw(tmp_path, "x", checkpoint={"best_metric": "anything"})
    own_loop["train_loop"] = "examples.ray_train_loop:train_func"
    for section in ("model", "data", "schedule"):
        del own_loop[section]
    assert build_spec(own_loop).checkpoint.best_metric == "anything"  # the user's loop decides


def test_malformed_overrides_say_how_to_write_them(tmp_path):
    raw = tiny_raw(tmp_path, "x")
    assert refused(raw, ["scaling.num_workers"]).field == "--set"
    error = refused(raw, ["scaling.num_workers.max=3"])
    assert "set it whole, e.g. --set scaling.num_workers=VALUE" in str(error)
    assert "set the whole list" in str(refused(raw, ["faults.0.at_step=4"]))


def test_identity_changes_are_dotted_spec_fields():
    stored = {"model": {"name": "mlp", "kwargs": {"hidden": [16]}}, "num_workers": 2, "seed": 0}
    current = {"model": {"name": "mlp", "kwargs": {"hidden": [32]}}, "num_workers": 3, "seed": 0}
    assert identity_changes(stored, current) == [
        ("model.kwargs.hidden", [16], [32]),
        ("scaling.num_workers", 2, 3),
    ]


@pytest.mark.parametrize("schema", [0, 2, "1", None])
def test_a_run_json_of_another_schema_is_refused(tmp_path, schema):
    run_dir = RunDirectory(resolve(str(tmp_path)).child("run"))
    run_dir.write_run_record({}, {}, "f", {})
    assert run_dir.read_run_record() is not None
    run_dir.location.child("run.json").write_json({"schema": schema})
    with pytest.raises(IncompatibleRunError, match="upgrade relaytrain") as error:
        run_dir.read_run_record()
    assert error.value.field == "run.name"


@pytest.fixture
def table_path(tmp_path):
    path = tmp_path / "t.parquet"
    rows = 8
    pq.write_table(
        pa.table(
            {
                "x": pa.array([[0.5, 1.5]] * rows),
                "y": pa.array(np.linspace(0, 1, rows)),
                "name": pa.array([f"r{i}" for i in range(rows)]),
            }
        ),
        path,
    )
    return str(path)


@pytest.mark.parametrize(
    ("columns", "field", "fix"),
    [
        ({"label": "name", "task": "regression"}, "data.label", "must be numeric"),
        ({"label": "y", "task": "classification"}, "data.label", "set data.task: regression"),
        ({"features": ["name"]}, "data.features", "features must be numeric"),
        ({"label": "target"}, "data.label", "fix data.features / data.label"),
    ],
)
def test_column_types_are_refused_before_any_row_is_read(
    table_path, monkeypatch, columns, field, fix
):
    section = DataSection(
        **{"dataset": table_path, "features": "x", "label": "y", "task": "regression", **columns}
    )
    valid = {"features": "x", "label": "y", "task": "regression"}
    assert footers.scan(section.model_copy(update=valid)).num_rows == 8

    def no_reading(*args, **kwargs):
        raise AssertionError("rows were read before the columns were checked")

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", no_reading)
    monkeypatch.setattr(pq.ParquetFile, "read", no_reading)
    with pytest.raises(SpecError) as error:
        footers.scan(section)
    assert error.value.field == field and fix.lower() in str(error.value).lower()


def test_builders_that_fail_name_model_fields():
    with pytest.raises(SpecError, match=r"(?i)fix the builder") as error:
        build_model(ModelSection(name="tests.bad_workloads:raising_builder"), 4, 1)
    assert error.value.field == "model.name"
    with pytest.raises(SpecError, match="make the builder return the model"):
        build_model(ModelSection(name="tests.bad_workloads:not_a_module"), 4, 1)
    with pytest.raises(SpecError, match=r"parameters \['hidden', 'dropout'\]") as error:
        build_model(ModelSection(name="mlp", kwargs={"hidden_sizes": [4]}), 4, 1)
    assert error.value.field == "model.kwargs"
    with pytest.raises(SpecError, match="'nan_after'"):
        import_object("tests.bad_workloads:nan_aftr", "model.name")
    with pytest.raises(SpecError, match=r"point model\.name at a function"):
        import_object("tests.bad_workloads:NOT_CALLABLE", "model.name")
    with pytest.raises(SpecError, match="Fix that module"):
        import_object("tests.broken_on_import:build", "model.name")


def test_serve_options_are_validated_by_prefects_cron_schedule():
    assert cron_expression("0 3 * * 1-5") == "0 3 * * 1-5"
    for bad in ("61 2 * * *", "nightly", "H 2 * * *"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"e\.g\. --cron '0 2 \* \* \*'"):
            cron_expression(bad)
    assert positive_seconds("2.5") == 2.5
    for bad in ("0", "-3", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="seconds > 0"):
            positive_seconds(bad)
