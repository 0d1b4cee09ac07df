"""Driver-side planning: no Ray cluster needed."""

import pytest

from tests.conftest import tiny_raw
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import IncompatibleRunError, SpecError
from trainer_core.run.plan import plan_attempt
from trainer_core.run.preflight import validate_workload
from trainer_core.spec.overrides import build_spec


def make(tmp_path, *overrides, name="planned"):
    return build_spec(tiny_raw(tmp_path, name), list(overrides))


def test_fresh_then_resume_plan(tmp_path):
    spec = make(tmp_path)
    plan, run_dir = plan_attempt(spec)
    assert plan.attempt == 1 and plan.resume_step is None and "fresh start" in plan.reason
    for step in (10, 20):
        entries = [run_dir.write_checkpoint_file(step, "model.pt", b"x")]
        run_dir.commit_checkpoint(step, entries, {"metrics": {}, "cursor": {}})
    run_dir.write_checkpoint_file(30, "model.pt", b"partial")
    run_dir.record_attempt({"attempt": 1, "status": "failed"})
    plan, _ = plan_attempt(spec)
    assert plan.attempt == 2 and plan.candidates == [20, 10]
    assert "step 20" in plan.reason and "checkpoint-000000030" in plan.reason


def test_run_written_by_another_ray_version_is_refused(tmp_path):
    spec = make(tmp_path)
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child("planned"))
    run_dir.write_run_record({}, spec.identity(), spec.fingerprint(), {"ray": "2.40.0"})
    with pytest.raises(IncompatibleRunError, match=r"Ray 2\.40\.0"):
        plan_attempt(spec)


def test_changed_model_shape_is_refused(tmp_path):
    spec = make(tmp_path)
    _, run_dir = plan_attempt(spec)
    import ray

    run_dir.write_run_record({}, spec.identity(), spec.fingerprint(), {"ray": ray.__version__})
    plan_attempt(make(tmp_path, "schedule.epochs=7"))  # more epochs: same run
    with pytest.raises(IncompatibleRunError, match="changed: model"):
        plan_attempt(make(tmp_path, "model.kwargs.hidden=[64]"))


def test_process_local_storage_is_refused(tmp_path):
    with pytest.raises(SpecError, match="memory://"):
        plan_attempt(make(tmp_path, "run.storage=memory://x"))


def test_unwritable_storage_is_refused_before_anything(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(Exception, match="not writable"):
        plan_attempt(make(tmp_path, f"run.storage={blocker}/runs"))


def test_workload_is_checked_on_the_driver(tmp_path):
    validate_workload(make(tmp_path))
    with pytest.raises(SpecError, match=r"model\.kwargs"):
        validate_workload(make(tmp_path, "model.kwargs.width=3"))
    with pytest.raises(SpecError, match="train_loop"):
        validate_workload(
            build_spec(
                {"scaling": {"num_workers": 1}, "train_loop": "examples.ray_train_loop:missing"}
            )
        )


def test_the_resume_plan_is_a_function_of_the_listing():
    from trainer_core.checkpoint.files import CheckpointInfo, Scan
    from trainer_core.run.plan import resume_plan

    def info(step):
        return CheckpointInfo(step, f"checkpoint-{step:09d}", f"s3://b/r/c{step}", {})

    found = Scan([info(10), info(20)], ["checkpoint-000000030"], ["checkpoint-000000025"])
    plan = resume_plan("r", "s3://b", "s3://b/r", 3, found)
    assert (plan.attempt, plan.resume_step, plan.candidates) == (3, 20, [20, 10])
    assert "step 20" in plan.reason and "checkpoint-000000030" in plan.reason
    assert "skipping damaged checkpoint-000000025" in plan.reason
    empty = resume_plan("r", "s3://b", "s3://b/r", 1, Scan([], [], []), init_from="s3://b/x/c")
    assert empty.resume_step is None and empty.candidates == []
    assert empty.reason.startswith("fresh start") and "warm start from s3://b/x/c" in empty.reason


def _parquet_spec(tmp_path, name="described", dataset=None):
    """Two Parquet files of 64 rows (x, y) in ``tmp_path/table``, and a spec that reads them
    (or ``dataset``, as given)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path / "table"
    directory.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(2):
        pq.write_table(
            pa.table({"x": rng.random(64, dtype=np.float32), "y": rng.integers(0, 3, 64)}),
            directory / f"part-{i}.parquet",
        )
    data = {
        "dataset": dataset or str(directory),
        "features": ["x"],
        "label": "y",
        "task": "classification",
        "batch_size": 8,
    }
    return directory, build_spec(tiny_raw(tmp_path, name, data=data))


def _first_attempt(spec):
    """The first attempt's preflight, and what it stores before its workers start."""
    from trainer_core.run import preflight
    from trainer_core.run.engine import versions

    first = preflight.preflight(spec)
    assert first.pinned is not None and first.pinned.record is not None
    first.run_dir.write_dataset_snapshot(first.pinned.record)
    first.run_dir.write_run_record(
        {}, spec.identity(), spec.fingerprint(), versions(), first.pinned.record["fingerprint"]
    )
    return first


def test_a_later_attempt_reads_its_snapshot_not_the_dataset(tmp_path, monkeypatch):
    """preflight describes the dataset once per attempt. A later attempt starts from the run's
    snapshot: no footer of the dataset is read again (its files kept their modification
    times), and files that land in the table (a cut-off Parquet file, another schema, a text
    file) are counted by path, never opened; the total steps are the snapshot's. The workers
    get what the driver described (PinnedDataset.for_workers), so no rank describes it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer_core.data import footers, stream
    from trainer_core.run import preflight

    directory, spec = _parquet_spec(tmp_path)
    described, footers_read = [], []
    describe, read_footer = stream.describe, footers.read_footer
    monkeypatch.setattr(stream, "describe", lambda *a: described.append(1) or describe(*a))
    monkeypatch.setattr(
        footers, "read_footer", lambda *a: footers_read.append(a[1]) or read_footer(*a)
    )

    first = _first_attempt(spec)
    assert len(described) == 1 and len(footers_read) == 2
    resumed = preflight.preflight(spec, attempt=2)
    assert len(described) == 2 and len(footers_read) == 2  # the snapshot's: no footer read
    assert resumed.pinned == first.pinned and resumed.total_steps == first.total_steps
    assert resumed.pinned.for_workers() == first.pinned.for_workers()

    rng = np.random.default_rng(1)
    extra = pa.table({"x": rng.random(64, dtype=np.float32), "y": rng.integers(0, 3, 64)})
    pq.write_table(extra, directory / "part-2.parquet")  # more steps, were it read
    whole = (directory / "part-2.parquet").read_bytes()
    (directory / "part-3.parquet").write_bytes(whole[: len(whole) // 2])
    pq.write_table(pa.table({"user": ["a", "b"]}), directory / "part-4.parquet")
    (directory / "README.txt").write_text("hourly clicks\n")
    grown = preflight.preflight(spec, attempt=3)
    assert len(described) == 3 and len(footers_read) == 2
    assert grown.pinned is not None and sorted(grown.pinned.added) == sorted(
        str(directory / n)
        for n in ("part-2.parquet", "part-3.parquet", "part-4.parquet", "README.txt")
    )
    assert grown.pinned.layout == first.pinned.layout
    assert grown.total_steps == first.total_steps
    # A new run takes the table as it is now, and meets what it cannot read.
    with pytest.raises(SpecError, match=r"README\.txt.*is not Parquet"):
        preflight.preflight(spec.with_run_name("fresh"))


def test_a_relative_dataset_resolved_elsewhere_is_refused_naming_both(tmp_path, monkeypatch):
    """``data.dataset: table`` pinned from one directory, planned again from another that has a
    ``table`` of its own: SpecError naming both places and the fix. From the first directory
    the run reads its snapshot again."""
    from trainer_core.run import preflight

    first, other = tmp_path / "a", tmp_path / "b"
    _, spec = _parquet_spec(first, dataset="table")
    _parquet_spec(other)  # a table of its own at the same relative path
    monkeypatch.chdir(first)
    _first_attempt(spec)
    monkeypatch.chdir(other)
    with pytest.raises(SpecError) as refused:
        preflight.preflight(spec, attempt=2)
    message = str(refused.value)
    assert refused.value.field == "data.dataset"
    assert str(first / "table") in message and str(other / "table") in message
    assert "working directory" in message and "run.name" in message
    monkeypatch.chdir(first)
    assert preflight.preflight(spec, attempt=2).pinned is not None


def test_a_snapshot_that_is_not_the_run_records_is_refused(tmp_path):
    """dataset.json replaced by another run's (or its file list edited): its fingerprint is not
    the one run.json recorded at the first attempt."""
    import json

    from trainer_core.run import preflight

    _, spec = _parquet_spec(tmp_path)
    first = _first_attempt(spec)
    assert first.pinned is not None and first.pinned.record is not None
    snapshot_file = first.run_dir.location.child("dataset.json")
    edited = json.loads(json.dumps(first.pinned.record))
    edited["files"] = edited["files"][:1]
    edited["row_groups"] = [
        g for g in edited["row_groups"] if g["file"] == edited["files"][0]["path"]
    ]
    snapshot_file.write_json(edited)
    with pytest.raises(SpecError, match=r"dataset\.json.*run\.json.*Restore it"):
        preflight.preflight(spec, attempt=2)
    _, other = _parquet_spec(tmp_path / "other", "other")  # another run's snapshot, consistent
    snapshot_file.write_json(_first_attempt(other).pinned.record)
    with pytest.raises(SpecError, match=r"not the one run\.json records"):
        preflight.preflight(spec, attempt=2)


def _ray_data_spec(tmp_path, name="ray-data"):
    """A Ray Train loop of the user's own (examples/ray_data_loop.py) fed ``datasets.train``,
    a directory of two Parquet files."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    directory = tmp_path / "table"
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(2):
        pixels = np.full((16, 64), i, dtype=np.float32)
        table = pa.table({"pixels": list(pixels), "label": np.arange(16) % 10})
        pq.write_table(table, directory / f"part-{i}.parquet")
    raw = {
        "run": {"name": name, "storage": str(tmp_path / "runs")},
        "scaling": {"num_workers": 1},
        "train_loop": "examples.ray_data_loop:train_func",
        "datasets": {"train": str(directory)},
    }
    return directory, build_spec(raw)


def _first_ray_attempt(spec):
    """The first attempt's preflight, and what it stores before its workers start."""
    from trainer_core.run import preflight
    from trainer_core.run.engine import versions

    first = preflight.preflight(spec)
    assert first.tables is not None and first.snapshot is not None
    first.run_dir.write_dataset_snapshot(first.snapshot)
    first.run_dir.write_run_record(
        {}, spec.identity(), spec.fingerprint(), versions(), first.snapshot["fingerprint"]
    )
    return first


def test_a_ray_loops_datasets_are_read_from_the_runs_snapshot(tmp_path, monkeypatch):
    """A Ray loop's ``datasets`` follow the built-in loop's rule: a later attempt reads no
    footer again, counts what landed in the table (a cut-off Parquet file, another schema, a
    text file) by path, and hands Ray Data the snapshot's files; a new run meets them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer_core.data import footers
    from trainer_core.run import preflight

    directory, spec = _ray_data_spec(tmp_path)
    footers_read = []
    read_footer = footers.read_footer
    monkeypatch.setattr(
        footers, "read_footer", lambda *a: footers_read.append(a[1]) or read_footer(*a)
    )
    first = _first_ray_attempt(spec)
    pinned = [str(directory / f"part-{i}.parquet") for i in range(2)]
    assert first.tables is not None and first.tables.files() == {"train": pinned}
    assert len(footers_read) == 2

    whole = (directory / "part-1.parquet").read_bytes()
    (directory / "part-2.parquet").write_bytes(whole[: len(whole) // 2])
    pq.write_table(pa.table({"user": ["a", "b"]}), directory / "part-3.parquet")
    (directory / "README.txt").write_text("hourly clicks\n")
    grown = preflight.preflight(spec, attempt=2)
    assert len(footers_read) == 2  # the snapshot's files kept their times: nothing read
    assert grown.tables is not None and grown.tables.files() == {"train": pinned}
    landed = [str(directory / n) for n in ("README.txt", "part-2.parquet", "part-3.parquet")]
    assert grown.added() == [(str(directory), landed)]
    assert grown.snapshot == first.snapshot
    with pytest.raises(SpecError, match=r"datasets\.train .*README\.txt.*is not Parquet"):
        preflight.preflight(spec.with_run_name("fresh"))


def test_a_ray_loops_snapshot_with_an_edited_file_list_is_refused(tmp_path):
    """dataset.json of a Ray loop's run with a file dropped from a table: its fingerprint is
    not the one run.json recorded, and the error names ``datasets``."""
    import json

    from trainer_core.run import preflight

    _, spec = _ray_data_spec(tmp_path)
    first = _first_ray_attempt(spec)
    edited = json.loads(json.dumps(first.snapshot))
    table = edited["datasets"]["train"]
    table["files"] = table["files"][:1]
    first.run_dir.location.child("dataset.json").write_json(edited)
    with pytest.raises(SpecError, match=r"dataset\.json.*run\.json.*Restore it") as refused:
        preflight.preflight(spec, attempt=2)
    assert refused.value.field == "datasets"
