"""The pure parts of the Ray Jobs path: which job to attach to, submission ids, outcomes."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from trainer_core import errors
from trainer_core.errors import ClusterCapacityError, InfrastructureError, TrainingCodeError
from trainer_core.run import jobs
from trainer_core.spec.overrides import build_spec


def job(sid, status, run="s3://b/runs/a", start=0):
    return SimpleNamespace(
        submission_id=sid, status=status, metadata={jobs.RUN_KEY: run}, start_time=start
    )


def test_attaches_only_to_a_live_job_of_the_same_run():
    listed = [
        job("relaytrain-a-1", "FAILED"),
        job("relaytrain-b-1", "RUNNING", run="s3://b/runs/b"),
        job("relaytrain-a-2", "RUNNING", start=5),
    ]
    assert jobs.find_live_job(listed, "s3://b/runs/a").submission_id == "relaytrain-a-2"
    assert jobs.find_live_job(listed[:2], "s3://b/runs/a") is None


def test_submission_ids_are_deterministic_and_never_reused():
    assert jobs.free_submission_id(set(), "a", 3) == "relaytrain-a-3"
    taken = {"relaytrain-a-3", "relaytrain-a-3-1"}
    assert jobs.free_submission_id(taken, "a", 3) == "relaytrain-a-3-2"


def test_job_address_from_spec_or_environment(monkeypatch, tmp_path):
    raw = {"run": {"name": "a", "storage": str(tmp_path)}, "scaling": {"num_workers": 1}}
    raw |= {"train_loop": "m:f"}
    monkeypatch.delenv(jobs.JOB_ADDRESS_ENV, raising=False)
    assert jobs.job_address(build_spec(raw)) is None
    monkeypatch.setenv(jobs.JOB_ADDRESS_ENV, "http://head:8265")
    assert jobs.job_address(build_spec(raw)) == "http://head:8265"
    raw["scaling"]["job_address"] = "http://other:8265"
    assert jobs.job_address(build_spec(raw)) == "http://other:8265"


def test_errors_cross_the_job_log_as_json_with_their_retry_budget():
    for error in (
        TrainingCodeError("boom", error_type="ValueError", step=7, deterministic=True),
        ClusterCapacityError("too many workers", field="scaling.num_workers"),
        InfrastructureError("node died", step=3),
    ):
        rebuilt = errors.from_json(pickle.loads(pickle.dumps(errors.to_json(error))))
        assert type(rebuilt) is type(error) and str(rebuilt) == str(error)
        assert rebuilt.__dict__ == error.__dict__ and rebuilt.budget == error.budget
    unknown = errors.from_json({"class": "Mystery", "message": "?"})
    assert isinstance(unknown, InfrastructureError)
