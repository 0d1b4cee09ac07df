import warnings

import pytest

from tests.conftest import tiny_raw
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import build_spec, load_spec, parse_override


def test_examples_load_and_are_frozen():
    spec = load_spec("examples/digits_cnn.yaml")
    assert spec.scaling.num_workers == 2 and spec.model.name == "cnn"
    with pytest.raises(Exception, match="frozen"):
        spec.scaling.num_workers = 3  # type: ignore[misc]
    load_spec("examples/synthetic_mlp.yaml")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_spec("examples/ray_loop.yaml")
        assert load_spec("examples/ray_data_loop.yaml").datasets == {
            "train": "trainer_core/builtin_data/digits.parquet"
        }


def test_overrides_parse_json_else_string():
    spec = load_spec(
        "examples/digits_cnn.yaml",
        [
            "scaling.num_workers=1",
            "run.name=my-run",
            "checkpoint.best_mode=min",
            'faults=[{"kind": "raise", "at_step": 3}]',
            "model.kwargs.channels=[4, 8]",
        ],
    )
    assert spec.scaling.num_workers == 1
    assert spec.run.name == "my-run"
    assert spec.faults[0].at_step == 3 and spec.faults[0].attempt == 1
    assert spec.model.kwargs["channels"] == [4, 8]
    assert parse_override("a.b=true") == (["a", "b"], True)
    assert parse_override("a=x=y") == (["a"], "x=y")


def test_list_index_override(tmp_path):
    raw = tiny_raw(tmp_path, "x", faults=[{"kind": "raise", "at_step": 3}])
    assert build_spec(raw, ["faults.0.at_step=9"]).faults[0].at_step == 9
    with pytest.raises(SpecError, match="not an index"):
        build_spec(raw, ["faults.4.at_step=9"])


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("scaling.num_workers=0", "scaling.num_workers"),
        ("scaling.num_workers=-2", "scaling.num_workers"),
        ("schedule.epochs=0", "schedule.epochs"),
        ("checkpoint.best_mode=median", "checkpoint.best_mode"),
        ("checkpoint.every=0", "checkpoint.every"),
        ("optimizer.lr=-1", "optimizer.lr"),
        ("scaling.num_worker=2", "scaling.num_worker"),  # typo: extra keys are refused
        ("run.name=../escape", "run.name"),
        ("run.name=a/b", "run.name"),
        ('run.name=""', "run.name"),
        ("run.name=" + "x" * 101, "run.name"),
        ("model.name=not a path", "model.name"),
        ("train_loop=nocolon", "train_loop"),
        ('faults=[{"kind": "explode", "at_step": 1}]', "faults.0.kind"),
        ('faults=[{"kind": "raise", "at_step": 1, "rank": 5}]', "faults"),
    ],
)
def test_bad_values_name_the_field(tmp_path, override, field):
    with pytest.raises(SpecError) as error:
        build_spec(tiny_raw(tmp_path, "x"), [override])
    assert field.split(".")[0] in str(error.value)


def test_builtin_loop_needs_its_sections(tmp_path):
    raw = tiny_raw(tmp_path, "x")
    del raw["model"]
    with pytest.raises(SpecError, match="model"):
        build_spec(raw)


def test_parquet_dataset_needs_columns_and_task(tmp_path):
    with pytest.raises(SpecError, match=r"data\.features"):
        build_spec(tiny_raw(tmp_path, "x", data={"dataset": "s3://b/d.parquet"}))
    data = {"dataset": "s3://b/d.parquet", "features": "x", "label": "y"}
    with pytest.raises(SpecError, match=r"data\.task is required for the built-in loop"):
        build_spec(tiny_raw(tmp_path, "x", data=data))


def test_an_own_loop_computing_its_loss_is_not_asked_for_data_task(tmp_path):
    """Its loss is its own: the integer labels of a Parquet file stay integers."""
    import numpy as np
    import pyarrow as pa

    from trainer_core.data.arrays import table_arrays

    raw = tiny_raw(
        tmp_path, "x", data={"dataset": "s3://b/d.parquet", "features": "x", "label": "y"}
    )
    raw |= {"train_loop": "examples.own_loop:train", "train_loop_api": "relaytrain"}
    raw["schedule"] = {"epochs": 1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = build_spec(raw)
    assert spec.data.task is None
    table = pa.table({"x": pa.array([[1.0, 2.0], [3.0, 4.0]]), "y": pa.array([2, 0])})
    labels = table_arrays(table, spec.data).labels
    assert labels.dtype == np.int64 and labels.tolist() == [2, 0]


def test_train_loop_ignores_builtin_sections_with_a_warning(tmp_path):
    raw = tiny_raw(tmp_path, "x", train_loop="examples.ray_train_loop:train_func")
    with pytest.warns(UserWarning, match="ignored"):
        build_spec(raw)


def test_a_ray_loop_names_the_optimizer_keys_it_ignores(tmp_path):
    raw = tiny_raw(tmp_path, "x", train_loop="examples.ray_train_loop:train_func")
    for section in ("model", "data", "schedule"):
        del raw[section]
    raw["optimizer"] = {"grad_accumulation": 2, "momentum": 0.0}
    ignored = r"\['optimizer.grad_accumulation', 'optimizer.momentum'\] are ignored"
    with pytest.warns(UserWarning, match=ignored):
        build_spec(raw)


def test_train_loop_ignores_precision_with_a_warning(tmp_path):
    raw = tiny_raw(tmp_path, "x", train_loop="examples.ray_train_loop:train_func", precision="bf16")
    for section in ("model", "data", "schedule", "optimizer"):
        del raw[section]
    with pytest.warns(UserWarning, match=r"\['precision=bf16'\] are ignored"):
        build_spec(raw)


def test_missing_and_broken_spec_files(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(SpecError, match="not valid YAML"):
        load_spec(bad)


def test_fingerprint_ignores_what_may_change_between_attempts(tmp_path):
    base = build_spec(tiny_raw(tmp_path, "x"))
    more_epochs = build_spec(tiny_raw(tmp_path, "x"), ["schedule.epochs=9", "retries.code=5"])
    wider = build_spec(tiny_raw(tmp_path, "x"), ["model.kwargs.hidden=[32]"])
    assert base.fingerprint() == more_epochs.fingerprint()
    assert base.fingerprint() != wider.fingerprint()


def test_default_run_name_is_valid():
    spec = load_spec("examples/digits_cnn.yaml")
    assert spec.default_run_name("20261122-030000") == "digits-cnn-20261122-030000"
    assert spec.with_run_name("abc").run.name == "abc"


def test_training_essentials_parse_and_refuse_what_cannot_work(tmp_path):
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "essentials",
            optimizer={"grad_accumulation": 4, "clip_grad_norm": 1.0},
            loss="tests.own_functions:huber",
            metrics=["tests.own_functions:mean_abs_error"],
            schedule={"early_stopping": {"metric": "val_mean_abs_error", "patience": 2}},
            checkpoint={"best_metric": "val_mean_abs_error"},
        )
    )
    assert spec.builtin_metrics() == ["loss", "val_loss", "val_mean_abs_error"]
    assert spec.schedule.early_stopping.mode == "min"
    # Accumulation changes what the cursor counts: it is part of what a resume must share.
    plain = build_spec(tiny_raw(tmp_path, "essentials"))
    assert "grad_accumulation" not in plain.identity()
    assert spec.identity()["grad_accumulation"] == 4
    refused = {
        "optimizer.grad_accumulation": {"optimizer": {"grad_accumulation": 0}},
        "optimizer.clip_grad_norm": {"optimizer": {"clip_grad_norm": -1}},
        "loss": {"loss": "huber"},
        "metrics.0": {"metrics": ["not a path"]},
        "metrics.1": {"metrics": ["a.b:mae", "c.d:mae"]},
        "schedule.early_stopping.metric": {"schedule": {"early_stopping": {"metric": "loss"}}},
        "schedule.early_stopping.patience": {"schedule": {"early_stopping": {"patience": 0}}},
        "schedule.early_stopping.mode": {"schedule": {"early_stopping": {"mode": "down"}}},
    }
    for field, sections in refused.items():
        with pytest.raises(SpecError) as error:
            build_spec(tiny_raw(tmp_path, "bad", **sections))
        assert error.value.field == field, (field, error.value.field, str(error.value))
    with pytest.raises(SpecError, match="'val_loss', which the built-in loop already records"):
        build_spec(tiny_raw(tmp_path, "bad", metrics=["pkg.mod:loss"]))
    with pytest.raises(SpecError, match=r"data\.validation_fraction > 0"):
        build_spec(
            tiny_raw(
                tmp_path,
                "bad",
                data={"validation_fraction": 0},
                schedule={"early_stopping": {"metric": "val_loss"}},
                checkpoint={"best_metric": "loss"},
            )
        )


def test_the_documented_accumulation_example_is_a_valid_spec(tmp_path):
    """The YAML under docs/run-spec.md's "Accumulation, your own loss and metrics, early
    stopping" builds (the imports it names are a user's own: setup checks those)."""
    import re
    from pathlib import Path

    import yaml

    page = Path(__file__).resolve().parents[2] / "docs" / "run-spec.md"
    section = page.read_text().split("## Accumulation, your own loss and metrics", 1)[1]
    block = yaml.safe_load(re.search(r"```yaml\n(.*?)```", section, re.DOTALL).group(1))
    raw = tiny_raw(tmp_path, "readme")
    for key, value in block.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    spec = build_spec(raw)
    assert spec.optimizer.grad_accumulation == 4 and spec.metrics == ["mypkg.metrics:top5"]
    assert spec.schedule.early_stopping.metric == spec.checkpoint.best_metric == "val_top5"


def test_the_worker_count_is_not_part_of_a_builtin_runs_identity(tmp_path):
    """The built-in loop's order and cursor are the global batches': a run resumes on any
    number of workers. Rank-named shards, and a loop of your own, need the same number; the
    data's order settings are part of it, prefetching is not."""
    two = build_spec(tiny_raw(tmp_path, "w"))
    one = build_spec(tiny_raw(tmp_path, "w"), ["scaling.num_workers=1", "data.prefetch=5"])
    assert "num_workers" not in two.identity() and two.fingerprint() == one.fingerprint()
    sharded = build_spec(tiny_raw(tmp_path, "w", checkpoint={"sharded": True}))
    assert sharded.identity()["num_workers"] == 2
    for change in ("data.shuffle_window=64", "data.partitions=3", "data.validation_fraction=0.3"):
        assert build_spec(tiny_raw(tmp_path, "w"), [change]).fingerprint() != two.fingerprint()


def test_a_global_batch_smaller_than_the_workers_is_refused(tmp_path):
    with pytest.raises(SpecError, match=r"data.batch_size=3 is the global batch") as error:
        build_spec(tiny_raw(tmp_path, "b"), ["data.batch_size=3", "scaling.num_workers=4"])
    assert error.value.field == "data.batch_size" and "at least 4" in str(error.value)


def test_an_elastic_worker_count_is_a_range(tmp_path):
    spec = build_spec(tiny_raw(tmp_path, "e"), ["scaling.num_workers=[1, 3]"])
    assert spec.scaling.elastic and (spec.scaling.min_workers, spec.scaling.max_workers) == (1, 3)
    assert spec.model_dump(mode="json")["scaling"]["num_workers"] == [1, 3]
    fixed = build_spec(tiny_raw(tmp_path, "e"))
    assert not fixed.scaling.elastic and fixed.scaling.min_workers == fixed.scaling.max_workers
    assert spec.fingerprint() == fixed.fingerprint()  # resizes resume the same run
    with pytest.raises(SpecError, match=r"MIN above MAX: give \[1, 3\]") as error:
        build_spec(tiny_raw(tmp_path, "e"), ["scaling.num_workers=[3, 1]"])
    assert error.value.field == "scaling.num_workers"
    sharded = tiny_raw(tmp_path, "e", checkpoint={"sharded": True})
    with pytest.raises(SpecError, match=r"checkpoint\.sharded writes one file per rank") as error:
        build_spec(sharded, ["scaling.num_workers=[1,2]"])
    assert error.value.field == "checkpoint.sharded"
    with pytest.raises(SpecError, match="at least 3"):  # every worker of MAX needs a sample
        build_spec(tiny_raw(tmp_path, "e"), ["scaling.num_workers=[1, 3]", "data.batch_size=2"])


def test_fsdp_strategy_and_what_it_refuses(tmp_path):
    spec = build_spec(tiny_raw(tmp_path, "f"), ["scaling.strategy=fsdp"])
    assert spec.scaling.strategy == "fsdp" and spec.scaling.shard_fn is None
    # ddp <-> fsdp resumes the same run (either format loads into either strategy).
    assert spec.fingerprint() == build_spec(tiny_raw(tmp_path, "f")).fingerprint()
    elastic = ["scaling.strategy=fsdp", "scaling.num_workers=[1, 2]"]
    assert build_spec(tiny_raw(tmp_path, "f"), elastic).scaling.elastic  # DCP reshards
    cases = [
        (["checkpoint.sharded=true"], "checkpoint.sharded", r"set checkpoint\.sharded false"),
        (["precision=fp16"], "precision", "use precision bf16"),
        (["train_loop=tests.own_functions:loop"], "scaling.strategy", "shards its model itself"),
    ]
    for overrides, field, fix in cases:
        with pytest.raises(SpecError, match=fix) as error:
            build_spec(tiny_raw(tmp_path, "f"), ["scaling.strategy=fsdp", *overrides])
        assert error.value.field == field
    with pytest.raises(SpecError, match=r"set scaling\.strategy fsdp") as error:
        build_spec(tiny_raw(tmp_path, "f"), ["scaling.shard_fn=tests.own_functions:shard"])
    assert error.value.field == "scaling.shard_fn"


#: The fingerprints run.json recorded for these examples under the release before the Dataset
#: form (08b6a34, computed there): a run made then must resume under this one.
EARLIER_FINGERPRINTS = {
    "digits_cnn": "c92bd2ea398079548d6f44b642ec813bf95fbba39a92dca8dc38189a68ea396c",
    "lm_gpt": "f34b1305dce9f4a8d6d83637514a740a0f20e214d315ceb8d83e11612e883f7c",
    "own_loop": "b421ea1ab3914ba44ebba8d806bee35f68d6e9a316c399fe463b96d14385533c",
}


@pytest.mark.parametrize("example", sorted(EARLIER_FINGERPRINTS))
def test_a_run_made_before_the_dataset_form_keeps_its_identity(example):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        spec = load_spec(f"examples/{example}.yaml")
    assert spec.fingerprint() == EARLIER_FINGERPRINTS[example]
