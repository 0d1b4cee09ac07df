"""The attempt record: its verbs, and JSON that an older or newer release can read."""

from __future__ import annotations

import threading
import time

import pytest

from trainer_core import storage
from trainer_core.checkpoint.history import write_metrics_segment
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import PreemptedError, TrainingCodeError
from trainer_core.run import attempts
from trainer_core.run.attempts import AttemptRecord


def test_an_attempt_opens_fails_and_is_decided(tmp_path):
    run_dir = RunDirectory(storage.resolve(str(tmp_path / "run")))
    record = AttemptRecord.opened(1, "fresh start", None)
    attempts.write(run_dir, record)
    error = TrainingCodeError("boom", error_type="ValueError", step=7, deterministic=True)
    outcome = {"resumed_from_step": 0, "world_size": 2, "restarts": [{"reason": "preemption"}]}
    attempts.write(run_dir, record.failed(error, outcome, last_step=9))
    (stored,) = attempts.read(run_dir)
    assert (stored.status, stored.error_class, stored.error_budget) == (
        "failed",
        "TrainingCodeError",
        "code",
    )
    assert (stored.last_step, stored.error_step, stored.deterministic) == (9, 7, True)
    assert stored.world_size == 2 and stored.restarts == [{"reason": "preemption"}]
    assert stored.ended_at and stored.started_at and stored.ended_at >= stored.started_at
    attempts.write(run_dir, stored.decided("code retry budget spent"))
    assert attempts.read(run_dir)[0].retry_decision == "code retry budget spent"
    assert attempts.next_number(attempts.read(run_dir)) == 2
    # Preempted while running step 3, when the driver had heard of step 1 only: steps 1 and 2
    # completed. A user's Ray loop fails in its 3rd report, after the epoch it reports trained.
    preempted = record.failed(PreemptedError("preempted: node gone", step=3), {}, last_step=1)
    assert preempted.error_budget == "preemption" and preempted.last_step == 2
    in_report = record.failed(error, {}, last_step=1, error_step_ran=True)
    assert in_report.last_step == 7


def test_a_running_record_of_another_attempt_is_closed_as_driver_lost(tmp_path):
    run_dir = RunDirectory(storage.resolve(str(tmp_path / "run")))
    attempts.write(run_dir, AttemptRecord.opened(1, "fresh start", 0))
    # what attempt 1 committed before its driver died: its metric rows up to step 20
    write_metrics_segment(run_dir, 1, [{"step": s, "loss": 1.0} for s in range(1, 11)])
    write_metrics_segment(run_dir, 1, [{"step": s, "loss": 1.0} for s in range(11, 21)])
    write_metrics_segment(run_dir, 2, [{"step": 21, "loss": 1.0}])
    attempts.write(run_dir, AttemptRecord.opened(2, "resume", 10))
    attempts.close_abandoned(run_dir, 2)
    first, second = attempts.read(run_dir)
    assert (first.status, first.error_class, first.error_budget) == (
        "failed",
        "DriverLost",
        "infrastructure",
    )
    assert first.last_step == 20  # at least as far as its segments go (goodput counts it)
    assert second.status == "running"
    attempts.write(run_dir, AttemptRecord.opened(3, "resume", 20))
    attempts.close_abandoned(run_dir, 3)
    assert attempts.read(run_dir)[1].last_step == 21


def test_records_of_other_releases_read_with_defaults():
    old = AttemptRecord.from_json({"schema": 1, "attempt": 3, "status": "completed"})
    assert old.restarts == [] and old.error_budget == "none" and old.last_step is None
    newer = AttemptRecord.from_json({"attempt": 4, "status": "failed", "a_later_field": 1})
    assert newer.attempt == 4 and not hasattr(newer, "a_later_field")
    assert AttemptRecord.from_json(old.to_json()) == old


@pytest.mark.parametrize("reattached", [False, True])
def test_an_attempt_the_engine_could_not_close_is_closed_by_the_train_task(tmp_path, reattached):
    """The store was full when the engine recorded how attempt 1 ended (the chaos campaign's
    ``disk_full``): the record stayed "running", the flow failed with StorageFullError, and the
    next launch closed it as DriverLost on the infrastructure budget, a retry charged to a
    failure that is not retried. The train task, which holds the error, closes it instead; also
    when it re-attached to the attempt's Ray job after its flow was killed (it took the next
    number, 2, for its own: the attempt comes with the error across the job's log)."""
    from tasks.train import _decide
    from tests.conftest import tiny_raw
    from trainer_core import errors
    from trainer_core.errors import StorageFullError
    from trainer_core.spec.overrides import build_spec

    spec = build_spec(tiny_raw(tmp_path, "r"))
    run_dir = RunDirectory(storage.resolve(str(tmp_path / "run")))
    # planned from step 5; the workers found it damaged and resumed from 3 (the engine's update)
    record = AttemptRecord.opened(1, "resume from 5", 5).running({"resumed_from_step": 3})
    attempts.write(run_dir, record)
    write_metrics_segment(run_dir, 1, [{"step": s, "loss": 1.0} for s in range(4, 16)])
    full = StorageFullError("storage is full: could not write attempts.jsonl", field="run.storage")
    refused = RunDirectory(storage.resolve(str(tmp_path / "file")))
    (tmp_path / "file").write_text("a file where the run directory should be")
    assert not attempts.write_quietly(refused, record.failed(full, {}, 15))  # refused, quietly
    full.attempt = 1  # type: ignore[attr-defined]  # as engine.run_attempt tags what it raises
    raised = errors.from_json(errors.to_json(full))  # as a Ray job's outcome carries it
    decision = _decide(spec, run_dir, raised, 2 if reattached else 1)
    assert not decision.retry and "not retryable" in decision.reason
    (record,) = attempts.read(run_dir)
    assert (record.status, record.error_class, record.error_budget) == (
        "failed",
        "StorageFullError",
        "none",
    )
    assert record.last_step == 15 and record.ended_at and "not retryable" in record.retry_decision
    assert (record.status, record.resumed_from_step) == ("failed", 3)  # the workers' step, kept
    attempts.write(run_dir, AttemptRecord.opened(2, "resume", 10))
    attempts.close_abandoned(run_dir, 2)  # the next launch: nothing left to close
    assert attempts.read(run_dir)[0].error_class == "StorageFullError"


def test_attempt_records_read_mid_write_are_read_again(tmp_path):
    """attempts.jsonl is rewritten whole at each attempt's end, and read meanwhile by the
    retry decision, the catalog, and the lease tests' own polling (which saw it torn on the
    moto server in a full-suite run of d679fd6): a torn read is read again until it parses."""
    run_location = storage.resolve(str(tmp_path / "run"))
    run_dir = RunDirectory(run_location)
    run_dir.record_attempt({"attempt": 1, "status": "failed"})
    path = run_location.child("attempts.jsonl")
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])

    def heal_later() -> None:
        time.sleep(0.3)
        path.write_bytes(whole)

    healer = threading.Thread(target=heal_later)
    healer.start()
    assert [r["status"] for r in run_dir.read_attempts()] == ["failed"]
    healer.join()
