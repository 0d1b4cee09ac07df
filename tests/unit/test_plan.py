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


def test_an_attempt_describes_its_dataset_once(tmp_path, monkeypatch):
    """preflight reads and describes the dataset once per attempt, first and resumed (its scan
    is the snapshot then), and again only for a snapshot whose files changed since; the workers
    get what it described (PinnedDataset.for_workers), so no rank describes it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer_core.data import stream
    from trainer_core.run import preflight

    directory = tmp_path / "table"
    directory.mkdir()
    rng = np.random.default_rng(0)
    for i in range(2):
        pq.write_table(
            pa.table({"x": rng.random(64, dtype=np.float32), "y": rng.integers(0, 3, 64)}),
            directory / f"part-{i}.parquet",
        )
    spec = build_spec(
        tiny_raw(
            tmp_path,
            "described",
            data={
                "dataset": str(directory),
                "features": ["x"],
                "label": "y",
                "task": "classification",
                "batch_size": 8,
            },
        )
    )
    calls = []
    describe = stream.describe
    monkeypatch.setattr(stream, "describe", lambda *a, **k: calls.append(1) or describe(*a, **k))

    first = preflight.preflight(spec)
    assert len(calls) == 1 and first.pinned is not None and first.pinned.record is not None
    first.run_dir.write_dataset_snapshot(first.pinned.record)  # as the first attempt does
    resumed = preflight.preflight(spec, attempt=2)
    assert len(calls) == 2 and resumed.pinned == first.pinned
    assert resumed.pinned.for_workers() == first.pinned.for_workers()

    pq.write_table(
        pa.table({"x": rng.random(8, dtype=np.float32), "y": rng.integers(0, 3, 8)}),
        directory / "part-2.parquet",
    )
    grown = preflight.preflight(spec, attempt=3)
    assert len(calls) == 4  # this attempt's scan, then the snapshot's own description
    assert grown.pinned is not None and grown.pinned.added == [str(directory / "part-2.parquet")]
    assert grown.pinned.layout == first.pinned.layout
