import json

import pytest

from trainer_core import storage
from trainer_core.checkpoint.files import CheckpointInfo
from trainer_core.checkpoint.history import (
    merge_metrics,
    read_metrics_history,
    write_metrics_segment,
)
from trainer_core.checkpoint.retention import plan_retention
from trainer_core.checkpoint.run_directory import MARKER_FILE, RunDirectory
from trainer_core.errors import CheckpointCorruptError, IncompatibleRunError


@pytest.fixture(params=["local", "memory"])
def run_dir(request, tmp_path):
    uri = str(tmp_path / "run") if request.param == "local" else f"memory://{tmp_path.name}/run"
    return RunDirectory(storage.resolve(uri))


def commit(run_dir, step, metrics=None, payload=b"weights"):
    entries = [run_dir.write_checkpoint_file(step, "model.pt", payload + str(step).encode())]
    return run_dir.commit_checkpoint(step, entries, {"metrics": metrics or {}, "cursor": {}})


def test_commit_then_scan_newest_first(run_dir):
    for step in (10, 20, 30):
        commit(run_dir, step)
    scan = run_dir.scan()
    assert [c.step for c in scan.committed] == [10, 20, 30]
    assert scan.newest.step == 30
    assert run_dir.read_verified(scan.newest, "model.pt") == b"weights30"


def test_missing_marker_is_not_a_checkpoint(run_dir):
    commit(run_dir, 10)
    commit(run_dir, 20)
    assert run_dir.scan().newest.step == 20  # seen committed once: it is not taken on trust
    run_dir.checkpoint_location(20).child(MARKER_FILE).delete_file()
    scan = run_dir.scan()
    assert scan.newest.step == 10
    assert scan.uncommitted == ["checkpoint-000000020"]


def test_files_without_manifest_are_not_a_checkpoint(run_dir):
    commit(run_dir, 10)
    run_dir.write_checkpoint_file(20, "model.pt", b"partial upload")
    assert run_dir.scan().newest.step == 10


def test_truncated_or_lost_file_is_damaged(run_dir):
    commit(run_dir, 10)
    commit(run_dir, 20)
    commit(run_dir, 30)
    assert run_dir.scan().newest.step == 30  # seen committed once: it is not taken on trust
    run_dir.checkpoint_location(20).child("model.pt").write_bytes(b"wei")
    run_dir.checkpoint_location(30).child("model.pt").delete_file()
    scan = run_dir.scan()
    assert scan.newest.step == 10
    assert scan.damaged == ["checkpoint-000000020", "checkpoint-000000030"]


def test_a_checkpoint_committed_again_elsewhere_is_read_again(run_dir):
    """A later attempt (another directory object) replaces an uncommitted-then-recommitted
    step: a scan by the first object reads the new manifest, not the one it saw."""
    commit(run_dir, 10)
    assert run_dir.scan().newest.files["model.pt"]["size"] == len(b"weights10")
    other = RunDirectory(run_dir.location)
    other.prepare_checkpoint_dir(10)
    commit(other, 10, payload=b"longer weights")
    newest = run_dir.scan().newest
    assert newest.files["model.pt"]["size"] == len(b"longer weights10")
    assert run_dir.read_verified(newest, "model.pt") == b"longer weights10"


def test_flipped_byte_is_caught_when_read(run_dir):
    info = commit(run_dir, 10)
    path = run_dir.checkpoint_location(10).child("model.pt")
    data = bytearray(path.read_bytes())
    data[0] ^= 0x01
    path.write_bytes(bytes(data))
    assert run_dir.scan().newest.step == 10  # same size: the cheap scan cannot tell
    with pytest.raises(CheckpointCorruptError, match="does not match its manifest"):
        run_dir.read_verified(info, "model.pt")


def test_marker_must_match_the_manifest(run_dir):
    commit(run_dir, 10)
    commit(run_dir, 20)
    manifest = run_dir.checkpoint_location(20).child("manifest.json")
    edited = json.loads(manifest.read_bytes())
    edited["step"] = 99
    manifest.write_json(edited)
    assert run_dir.scan().newest.step == 10


def test_prepare_removes_a_stale_directory(run_dir):
    run_dir.write_checkpoint_file(20, "stale.pt", b"old")
    run_dir.prepare_checkpoint_dir(20)
    assert not run_dir.checkpoint_location(20).exists()


def test_newer_schema_is_refused(run_dir):
    run_dir.location.child("run.json").write_json({"schema": 99})
    with pytest.raises(IncompatibleRunError, match="schema 99"):
        run_dir.read_run_record()


def test_changed_identity_is_refused(run_dir):
    run_dir.write_run_record({}, {"model": "a"}, "f1", {})
    run_dir.check_compatible({"model": "a"}, "f1")
    with pytest.raises(IncompatibleRunError, match="changed: model"):
        run_dir.check_compatible({"model": "b"}, "f2")


def test_attempt_records_upsert(run_dir):
    run_dir.record_attempt({"attempt": 1, "status": "running"})
    run_dir.record_attempt({"attempt": 1, "status": "failed"})
    run_dir.record_attempt({"attempt": 2, "status": "completed"})
    assert [(a["attempt"], a["status"]) for a in run_dir.read_attempts()] == [
        (1, "failed"),
        (2, "completed"),
    ]


def test_metrics_history_merges_attempts(run_dir):
    write_metrics_segment(run_dir, 1, [{"step": s, "loss": 1.0} for s in range(1, 21)])
    run_dir.record_attempt({"attempt": 1, "resumed_from_step": 0})
    run_dir.record_attempt({"attempt": 2, "resumed_from_step": 10})
    write_metrics_segment(run_dir, 2, [{"step": s, "loss": 2.0} for s in range(11, 31)])
    rows = read_metrics_history(run_dir)
    assert [r["step"] for r in rows] == list(range(1, 31))
    assert {r["loss"] for r in rows if r["step"] <= 10} == {1.0}
    assert {r["loss"] for r in rows if r["step"] > 10} == {2.0}


def test_rewound_rows_are_dropped_until_rewritten():
    segments = [(1, [{"step": s} for s in range(1, 16)])]
    attempts = [{"attempt": 1, "resumed_from_step": 0}, {"attempt": 2, "resumed_from_step": 10}]
    assert [r["step"] for r in merge_metrics(segments, attempts)] == list(range(1, 11))
    unknown = [{"attempt": 1, "resumed_from_step": 0}, {"attempt": 2, "resumed_from_step": None}]
    assert len(merge_metrics(segments, unknown)) == 15


def info(step, **metrics):
    return CheckpointInfo(
        step, f"checkpoint-{step:09d}", f"/r/{step}", {"metrics": metrics, "files": {}}
    )


def test_retention_keeps_last_and_best_together():
    committed = [
        info(10, val_loss=0.5),
        info(20, val_loss=0.2),
        info(30, val_loss=0.4),
        info(40, val_loss=0.6),
        info(50, val_loss=0.7),
    ]
    plan = plan_retention(
        committed, keep_last=2, keep_best=1, best_metric="val_loss", best_mode="min"
    )
    assert plan.keep == ["checkpoint-000000020", "checkpoint-000000040", "checkpoint-000000050"]
    assert plan.reasons["checkpoint-000000020"] == "best"
    maxed = plan_retention(
        committed, keep_last=1, keep_best=2, best_metric="val_loss", best_mode="max"
    )
    assert maxed.keep == ["checkpoint-000000040", "checkpoint-000000050"]


def test_retention_protects_resume_point_and_in_flight():
    committed = [info(10), info(20), info(30)]
    plan = plan_retention(
        committed,
        keep_last=1,
        keep_best=0,
        best_metric="val_loss",
        best_mode="min",
        protected_steps={10},
        uncommitted=["checkpoint-000000005", "checkpoint-000000040"],
        in_flight_from_step=31,
    )
    assert plan.delete == ["checkpoint-000000020", "checkpoint-000000005"]
    assert plan.reasons["checkpoint-000000010"] == "protected"
    assert plan.reasons["checkpoint-000000040"] == "in flight"


def test_retention_never_drops_the_newest_and_ignores_nan():
    committed = [info(10, val_loss=0.1), info(20, val_loss=float("nan"))]
    plan = plan_retention(
        committed, keep_last=1, keep_best=1, best_metric="val_loss", best_mode="min"
    )
    assert plan.delete == []
    empty = plan_retention([], keep_last=1, keep_best=1, best_metric="x", best_mode="min")
    assert empty.delete == [] and empty.keep == []


def test_delete_checkpoints_refuses_other_directories(run_dir):
    with pytest.raises(ValueError, match="not a checkpoint"):
        run_dir.delete_checkpoints(["metrics"])
