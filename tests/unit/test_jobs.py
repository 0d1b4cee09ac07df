"""The pure parts of the Ray Jobs path: which job to attach to, submission ids, outcomes."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from trainer_core import errors
from trainer_core.errors import ClusterCapacityError, InfrastructureError, TrainingCodeError
from trainer_core.run import job_entry, jobs
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


def test_a_job_server_that_answered_the_run_before_is_waited_for(monkeypatch, tmp_path):
    """A new run whose job server does not answer is refused at once (a SpecError: fix the
    address). A run that already has an attempt saw it answer: its head may be restarting, so
    setup and the attempt wait up to RELAYTRAIN_RAY_HEAD_WAIT_S, then fail on the
    infrastructure budget naming the address (before, the rerun was refused as bad input)."""
    import time

    import pytest

    from flows.pytest_plugin import tiny_spec_dict
    from tasks.setup import refuse_bad_input
    from tests.net import free_port
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.errors import SpecError
    from trainer_core.run import attempts

    address = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spec = build_spec(tiny_spec_dict(tmp_path, "a", scaling={"job_address": address}))
    monkeypatch.setenv(jobs.HEAD_WAIT_ENV, "3")
    with pytest.raises(SpecError, match=r"scaling\.job_address"):
        refuse_bad_input(spec)
    run_dir = RunDirectory.of(str(tmp_path), "a")
    attempts.write(run_dir, attempts.AttemptRecord.opened(1, "fresh start", 0))
    for call in (lambda: refuse_bad_input(spec), lambda: jobs.client_waiting(address)):
        started = time.monotonic()
        with pytest.raises(InfrastructureError) as raised:
            call()
        assert time.monotonic() - started >= 3
        assert address in str(raised.value) and jobs.HEAD_WAIT_ENV in str(raised.value)
        assert raised.value.budget == "infrastructure"


class _JobServer:
    """A stand-in for a Ray job server that runs each submitted job's entrypoint in this
    process (``job_entry.main``) and serves its printed log back."""

    def __init__(self, capsys):
        self.capsys, self.log, self.submitted = capsys, "", []

    def list_jobs(self):
        return []

    def submit_job(self, *, entrypoint, submission_id, metadata):
        import shlex

        self.submitted.append(SimpleNamespace(entrypoint=entrypoint, metadata=metadata))
        argv = shlex.split(entrypoint)
        assert argv[:3] == ["python", "-m", "trainer_core.run.job_entry"], argv
        self.capsys.readouterr()
        job_entry.main(argv[3:])
        self.log = self.capsys.readouterr().out

    async def tail_job_logs(self, job_id):
        yield self.log

    def get_job_status(self, job_id):
        return "FAILED"

    def get_job_logs(self, job_id):
        return self.log

    def get_job_info(self, job_id):
        return SimpleNamespace(status="FAILED", message="")


def test_a_job_commits_under_the_flows_lease_fence(monkeypatch, tmp_path, capsys):
    """Through ``scaling.job_address`` the attempt runs as a Ray job whose driver calls
    ``engine.run_attempt`` in the cluster. Its workers' checkpoint commits are fenced by the
    flow's lease as in-process ones are: while this flow holds the run the job commits step
    5; then another flow takes the run over (rewrites lock.json), and the job's commit of step
    10 does not land (no COMMITTED marker) and the attempt fails with LeaseLostError. The job
    server and the workers are stand-ins (the workers commit as ``train.loop`` does, through a
    RunDirectory of the plan's lease owner); the fence is real."""
    import time

    import pytest

    from flows.pytest_plugin import tiny_spec_dict
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.errors import LeaseLostError
    from trainer_core.run import lease

    spec = build_spec(tiny_spec_dict(tmp_path, "a", scaling={"job_address": "http://head:8265"}))
    run_dir = RunDirectory.of(str(tmp_path), "a")
    lease.acquire(run_dir.location, owner="flow-run-1", settle_s=0)
    server = _JobServer(capsys)
    monkeypatch.setattr(jobs, "client_waiting", lambda address, say=None: server)

    def workers(spec, *, attempt=None, on_event=None, lease_owner=None, **_):
        fenced = RunDirectory.of(str(tmp_path), "a", lease_owner=lease_owner)
        fenced.commit_checkpoint(5, [], {})
        now = time.time()
        taken = {"owner": "another-flow", "host": "elsewhere", "pid": 1, "acquired_at": now}
        run_dir.lease_file.write_json({"schema": 1, **taken, "expires_at": now + 3600})
        fenced.commit_checkpoint(10, [], {})
        raise AssertionError("the commit after the takeover landed")

    monkeypatch.setattr(jobs.engine, "run_attempt", workers)
    with pytest.raises(LeaseLostError, match="held by another-flow"):
        jobs.run_attempt(spec, lease_owner="flow-run-1")
    assert run_dir.checkpoint_location(5).child("COMMITTED").exists()
    assert not run_dir.checkpoint_location(10).child("COMMITTED").exists()


def test_a_rerun_re_attaching_to_its_predecessors_job_names_it_in_the_lease(tmp_path):
    """A new flow took over the run of a killed one whose job still runs: until the new flow
    re-attaches, the job's commits are refused (the takeover's lease names no job); once it
    has said it re-attaches, the lease names the job and its commits land again."""
    import pytest

    from flows.pytest_plugin import tiny_spec_dict
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.errors import LeaseLostError
    from trainer_core.run import lease

    spec = build_spec(tiny_spec_dict(tmp_path, "a", scaling={"job_address": "http://head:8265"}))
    run_dir = RunDirectory.of(str(tmp_path), "a")
    lease.acquire(run_dir.location, owner="flow-run-2", settle_s=0)  # the rerun's setup
    running = job(jobs.submission_id("a", 1), "RUNNING", run=run_dir.uri)
    server = SimpleNamespace(list_jobs=lambda: [running])
    the_job = RunDirectory.of(str(tmp_path), "a", lease_owner=running.submission_id)
    with pytest.raises(LeaseLostError):
        the_job.commit_checkpoint(5, [], {})
    said: list[str] = []

    def say(line: str) -> None:
        the_job.check_lease(running.submission_id)  # named before it is said
        said.append(line)

    plan = jobs.Submission("a", run_dir.uri, 2)
    fence = jobs._LeaseFence(run_dir, "flow-run-2")
    assert jobs._attach_or_submit(server, spec, plan, say, fence) == running.submission_id
    assert said and "re-attaching" in said[0]
    the_job.commit_checkpoint(10, [], {})
    assert run_dir.checkpoint_location(10).child("COMMITTED").exists()
