"""Attempts as Ray jobs: drive a remote Ray cluster through its Jobs API instead of in-process.

When ``scaling.job_address`` (or ``RELAYTRAIN_RAY_JOB_ADDRESS``) names a cluster's job server,
the train task submits each attempt as a Ray job whose driver runs ``engine.run_attempt``
inside the cluster (``job_entry``). The job prints its relayed events and its outcome as
tagged JSON lines; the caller follows the job's log, streams the events to ``on_event``,
relays every other line to its logger, and rebuilds the outcome: an ``AttemptResult`` or the
classified error the job raised.

The job uses the cluster's own storage credentials (its nodes' environment or IAM role): the
caller's, from its environment or ``run.credentials``, never travel in a job's runtime env,
which Ray logs. Submission ids are deterministic (``relaytrain-<run>-<attempt>``) and every
job carries the run in its metadata, so a caller that died while its job ran re-attaches to
that job instead of starting a second one. A cancelled caller stops its job; a killed one
leaves it running.

The job's checkpoint commits are fenced as an attempt's in-process ones are: before the job
is submitted (or re-attached to) the flow names it in the run's lease (``lease.name_job``), and
the job's workers commit only while the lease still names it. A flow that takes the run over
(after its holder's lease lapsed) fences out a job it does not drive.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import os
import queue
import shlex
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from trainer_core import errors
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import InfrastructureError, LeaseLostError, RelaytrainError, SpecError
from trainer_core.execution import cluster, ray_address
from trainer_core.run import attempts, engine, job_entry, lease
from trainer_core.run.plan import canonical_storage_uri
from trainer_core.spec.run_spec import RunSpec

logger = logging.getLogger("relaytrain.jobs")

JOB_ADDRESS_ENV = "RELAYTRAIN_RAY_JOB_ADDRESS"
#: How long an attempt waits for a job server that answered this run before (a head node
#: restarting, a network cut) to answer again, then fails on the infrastructure budget: the
#: bound a driver's lost head is waited for too.
HEAD_WAIT_ENV = ray_address.HEAD_WAIT_ENV
EVENT_TAG = job_entry.EVENT_TAG
OUTCOME_TAG = job_entry.OUTCOME_TAG
RUN_KEY = "relaytrain_run_uri"
ATTEMPT_KEY = "relaytrain_attempt"
LIVE = ("PENDING", "RUNNING")

LineHandler = Callable[[str], None]


def job_address(spec: RunSpec) -> str | None:
    """The job server to submit attempts to, or None to drive them in this process."""
    return spec.scaling.job_address or os.environ.get(JOB_ADDRESS_ENV) or None


def driver_cluster(spec: RunSpec) -> contextlib.AbstractContextManager[Any]:
    """The Ray this process needs: none when attempts run as jobs, else local or RAY_ADDRESS."""
    return contextlib.nullcontext() if job_address(spec) else cluster.ray_cluster()


def client(address: str) -> Any:
    """A JobSubmissionClient for ``address``; SpecError naming the knob when unreachable."""
    try:
        return cluster.job_submission_client(address)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise SpecError(
            f"the Ray job server at {address!r} did not answer ({e}): fix scaling.job_address "
            f"(or {JOB_ADDRESS_ENV}), e.g. http://<head-node>:8265, or unset it to run locally",
            field="scaling.job_address",
        ) from e


def client_waiting(address: str, say: LineHandler | None = None) -> Any:
    """A client of the job server at ``address``, which answered this run before: while it does
    not answer (its head restarting), wait for it (``_while_restarting``). An address that is
    not one at all is refused at once, as a first contact's."""

    def refused(e: BaseException) -> BaseException | None:
        return e if isinstance(e.__cause__, ValueError) else None

    return _while_restarting(lambda: client(address), address, refused, say or logger.warning)


def _while_restarting(
    call: Callable[[], Any],
    address: str,
    final: Callable[[BaseException], BaseException | None],
    say: LineHandler,
) -> Any:
    """``call()``, called again every 2 s while the job server at ``address`` does not answer,
    up to ``RELAYTRAIN_RAY_HEAD_WAIT_S`` (said once through ``say``); then an InfrastructureError
    that names the address (retried, where a first contact's SpecError is not). ``final(e)``:
    the error to raise at once instead of waiting (None: wait)."""
    deadline: float | None = None
    wait_s = ray_address.head_wait_s()
    while True:
        try:
            return call()
        except (SpecError, OSError, RuntimeError) as e:
            now_error = final(e)
            if now_error is e:
                raise
            if now_error is not None:
                raise now_error from e
            if deadline is None:
                deadline = time.monotonic() + wait_s
                say(
                    f"the Ray job server at {address} does not answer (its head restarting?): "
                    f"waiting up to {wait_s:.0f} s ({HEAD_WAIT_ENV})"
                )
            elif time.monotonic() >= deadline:
                raise InfrastructureError(
                    f"the Ray job server at {address} did not answer for {wait_s:.0f} s "
                    f"({e.__cause__ or e}). The retry resumes from the newest committed "
                    f"checkpoint; set {HEAD_WAIT_ENV} to wait longer."
                ) from e
            time.sleep(2.0)


def submission_id(run_name: str, attempt: int, suffix: int = 0) -> str:
    base = f"relaytrain-{run_name}-{attempt}"
    return base if suffix == 0 else f"{base}-{suffix}"


def find_live_job(jobs: list[Any], run_uri: str) -> Any | None:
    """The pending or running job of this run, if one is still going (pure)."""
    live = [
        j
        for j in jobs
        if (j.metadata or {}).get(RUN_KEY) == run_uri and str(j.status) in LIVE and j.submission_id
    ]
    return max(live, key=lambda j: j.start_time or 0) if live else None


def free_submission_id(taken: set[str], run_name: str, attempt: int) -> str:
    """The attempt's deterministic id, or the next free variant if a dead job already used it."""
    suffix = 0
    while submission_id(run_name, attempt, suffix) in taken:
        suffix += 1
    return submission_id(run_name, attempt, suffix)


def entrypoint(
    spec: RunSpec, attempt: int, fence: str | None = None, until_epoch: int | None = None
) -> str:
    """The job's command line; ``fence``: the id its commits are fenced by (its own);
    ``until_epoch``: the epoch the run pauses after."""
    payload = base64.b64encode(spec.model_dump_json().encode()).decode()
    fenced = f" --lease-fence {shlex.quote(fence)}" if fence else ""
    until = f" --until-epoch {int(until_epoch)}" if until_epoch is not None else ""
    return (
        f"python -m trainer_core.run.job_entry --attempt {attempt}{fenced}{until} "
        f"--spec {shlex.quote(payload)}"
    )


# -- the caller's side ------------------------------------------------------------------------


def run_attempt(
    spec: RunSpec,
    *,
    on_event: engine.EventHandler | None = None,
    on_log: LineHandler | None = None,
    address: str | None = None,
    lease_owner: str | None = None,
    until_epoch: int | None = None,
) -> engine.AttemptResult:
    """Run (or re-attach to) this run's attempt as a Ray job and follow it to its end.
    ``lease_owner``: the flow's lease, which names the job so that its commits are fenced."""
    address = address or job_address(spec)
    assert address, "run_attempt needs a job address"
    # The job plans the attempt (and checks storage) itself; here only its number and run.
    assert spec.run.name, "the flow names the run before any attempt"
    run_dir = RunDirectory.of(canonical_storage_uri(spec.run.storage), spec.run.name)
    plan = Submission(
        spec.run.name, run_dir.uri, attempts.next_number(attempts.read(run_dir)), until_epoch
    )
    fence = _LeaseFence(run_dir, lease_owner) if lease_owner else None
    say = on_log or logger.info
    jobs_client = client_waiting(address, say)  # setup saw it answer: a restart is waited for
    try:
        job_id = _attach_or_submit(jobs_client, spec, plan, say, fence)
        outcome = follow(jobs_client, job_id, on_event, on_log)
        info = jobs_client.get_job_info(job_id)
        say(f"Ray job {job_id} ended {info.status}: {info.message}")
        return _result_of(job_id, info, outcome)
    except LeaseLostError as e:
        if fence is None or not fence.still_held():
            raise  # the run is another flow's now
        raise InfrastructureError(
            f"a commit of the Ray job of run {plan.run_name} was refused while the lease did "
            f"not name it yet ({e}): this flow took the run over while the job ran unattended. "
            "The retry submits the attempt again and resumes from the newest committed "
            "checkpoint."
        ) from e
    except RelaytrainError:
        raise
    except (RuntimeError, OSError) as e:  # the job server failed us, not the training
        raise InfrastructureError(f"the Ray Jobs API at {address} failed: {e}") from e


@dataclass(frozen=True)
class Submission:
    """The run and attempt a job is for."""

    run_name: str
    run_uri: str
    attempt: int
    #: The epoch the run pauses after (``Plan.until_epoch``); None: the last.
    until_epoch: int | None = None


@dataclass(frozen=True)
class _LeaseFence:
    """The flow's lease, which names the job it drives: the job's commits are fenced by it."""

    run_dir: RunDirectory
    owner: str

    def name(self, job_id: str) -> str:
        lease.name_job(self.run_dir.location, self.owner, job_id)
        return job_id

    def still_held(self) -> bool:
        try:
            lease.check_held(self.run_dir.location, self.owner)
        except LeaseLostError:
            return False
        return True


def _attach_or_submit(
    jobs_client: Any,
    spec: RunSpec,
    plan: Submission,
    say: LineHandler,
    fence: _LeaseFence | None = None,
) -> str:
    """The id of this run's live job, or of the job just submitted for ``plan.attempt``; named
    in the lease (``fence``) first, so that its commits are the flow's."""
    jobs = jobs_client.list_jobs()
    live = find_live_job(jobs, plan.run_uri)
    if live is not None:
        job_id = fence.name(str(live.submission_id)) if fence else str(live.submission_id)
        say(f"re-attaching to the running Ray job {job_id} of run {plan.run_name}")
        return job_id
    taken = {j.submission_id for j in jobs if j.submission_id}
    job_id = free_submission_id(taken, plan.run_name, plan.attempt)
    if fence is not None:
        fence.name(job_id)
    _submit(
        jobs_client,
        entrypoint=entrypoint(spec, plan.attempt, job_id if fence else None, plan.until_epoch),
        submission_id=job_id,
        metadata={RUN_KEY: plan.run_uri, ATTEMPT_KEY: str(plan.attempt)},
        # No runtime_env: Ray logs runtime envs whole, so no credential may travel in one. The
        # cluster's nodes reach storage with their own credentials (environment, IAM role).
    )
    say(f"submitted attempt {plan.attempt} of {plan.run_name} as Ray job {job_id}")
    return job_id


def _submit(jobs_client: Any, timeout_s: float = 60.0, **job: Any) -> None:
    """Submit, retrying while the job server says it is not ready yet (a node agent starting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            jobs_client.submit_job(**job)
            return
        except (RuntimeError, ConnectionError) as e:
            if "already" in str(e) or time.monotonic() > deadline:
                raise InfrastructureError(
                    f"the Ray job server did not take job {job['submission_id']}: {e}"
                ) from e
            logger.info("job server not ready (%s); retrying", e)
            time.sleep(2.0)


def follow(
    jobs_client: Any,
    job_id: str,
    on_event: engine.EventHandler | None,
    on_log: LineHandler | None,
) -> dict[str, Any] | None:
    """Stream the job's log until it ends; returns its outcome line's payload, if it printed one.

    A cancellation of the caller (a BaseException) stops the job.
    """
    outcome: dict[str, Any] | None = None
    finished = False
    try:
        for line in _log_lines(jobs_client, job_id):
            if line.startswith(EVENT_TAG):
                if on_event is not None:
                    on_event(json.loads(line[len(EVENT_TAG) :]))
            elif line.startswith(OUTCOME_TAG):
                outcome = json.loads(line[len(OUTCOME_TAG) :])
            elif on_log is not None and line.strip():
                on_log(line)
        finished = True
    finally:
        if not finished:
            logger.warning("interrupted: stopping Ray job %s", job_id)
            with contextlib.suppress(Exception):
                jobs_client.stop_job(job_id)
    return outcome


def _log_lines(jobs_client: Any, job_id: str, poll_s: float = 1.0) -> Iterator[str]:
    """Every line of the job's log, in order, until the job is over.

    Follows ``tail_job_logs`` (a websocket) in a thread; if the stream breaks while the job
    still runs, it reconnects and skips the lines already seen.
    """
    seen = 0
    while True:
        for index, line in enumerate(_tail(jobs_client, job_id), start=1):
            if index > seen:
                seen = index
                yield line
        status = _status(jobs_client, job_id)
        if status not in LIVE:
            # The tail may end a moment before the last lines are flushed: read them whole.
            lines = jobs_client.get_job_logs(job_id).splitlines()
            yield from lines[seen:]
            return
        time.sleep(poll_s)


def _status(jobs_client: Any, job_id: str) -> str:
    """The job's status, waiting for its server while it does not answer (its head restarting:
    ``_while_restarting``). A server that comes back without the job (a new head: jobs live in
    its GCS) lost it: an InfrastructureError, retried."""
    address = getattr(jobs_client, "_address", "the job server")

    def lost(e: BaseException) -> BaseException | None:
        if "does not exist" not in str(e):
            return None
        return InfrastructureError(
            f"the Ray job server at {address} no longer knows job {job_id}: its head node "
            "restarted and the job went with it. The retry submits the attempt again and "
            "resumes from the newest committed checkpoint."
        )

    return str(
        _while_restarting(lambda: jobs_client.get_job_status(job_id), address, lost, logger.warning)
    )


def _tail(jobs_client: Any, job_id: str) -> Iterator[str]:
    lines: queue.Queue[str | None] = queue.Queue()

    async def pump() -> None:
        buffer = ""
        try:
            async for chunk in jobs_client.tail_job_logs(job_id):
                buffer += chunk
                *complete, buffer = buffer.split("\n")
                for line in complete:
                    lines.put(line)
            if buffer:
                lines.put(buffer)
        except Exception as e:  # the stream broke: the caller checks status and reconnects
            logger.info("log stream of Ray job %s ended: %s", job_id, e)
        finally:
            lines.put(None)

    thread = threading.Thread(target=lambda: asyncio.run(pump()), daemon=True)
    thread.start()
    while (line := lines.get()) is not None:
        yield line


def _result_of(job_id: str, info: Any, outcome: dict[str, Any] | None) -> engine.AttemptResult:
    if outcome is not None and "result" in outcome:
        return engine.AttemptResult(**outcome["result"])
    if outcome is not None and "error" in outcome:
        raise errors.from_json(outcome["error"])
    raise InfrastructureError(
        f"Ray job {job_id} ended {info.status} without reporting an outcome: {info.message}. "
        "Its driver or node died; the next attempt resumes from the newest committed checkpoint."
    )
