"""setup: validate, probe storage and Ray, take the run lease, decide fresh start or resume."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from tasks import credentials
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError
from trainer_core.execution import cluster
from trainer_core.run import jobs, lease, preflight
from trainer_core.run.summary import (
    TrainingResult,
    damaged_since,
    read_stored_result,
    sync_tracking,
)
from trainer_core.spec.run_spec import RunSpec
from trainer_core.tracking import mlflow_state


class Prepared(BaseModel):
    """What setup hands to train and finalize (small and serializable)."""

    model_config = ConfigDict(frozen=True)

    run_name: str
    storage_uri: str
    run_uri: str
    lease_owner: str
    plan_reason: str
    #: Optimizer steps of the whole run (None for a user's own loop): the progress denominator.
    total_steps: int | None
    resume_step: int | None
    #: Set when the run already finished with at least the epochs asked for.
    stored_result: TrainingResult | None = None
    #: This flow run's first attempt: retry budgets count the failures from it on, as Prefect
    #: counts a task's retries per flow run (a relaunched run starts with whole budgets).
    first_attempt: int = 1
    #: summary.json as setup found it (``lease.summary_version``): a finalize whose lease
    #: lapsed meanwhile writes nothing over a summary another flow wrote since. None: unchecked.
    summary_seen: str | None = None
    #: The epoch the run pauses after (``training``'s ``until_epoch``); None: its last.
    until_epoch: int | None = None


@contextmanager
def holding(prepared: Prepared) -> Iterator[lease.LeaseKeeper]:
    """Renew the lease setup took until finalize, across train's retry delays (Prefect sleeps
    between attempts in the flow's process): no other flow can take the run meanwhile."""
    location = RunDirectory.of(prepared.storage_uri, prepared.run_name).location
    with lease.LeaseKeeper.of(location, prepared.lease_owner) as keeper:
        yield keeper


def is_finished(
    spec: RunSpec, stored: TrainingResult | None, until_epoch: int | None = None
) -> bool:
    """A completed run is done unless the spec asks for more: more epochs than it trained (an
    early-stopped run is done: its metric stopped improving), or, for a user's own loop, another
    ``train_loop_config`` than the one it completed with (the loop runs again, Ray resumes it
    from its newest checkpoint, and the loop's code decides what is left). A paused run (or one
    a sweep pruned) is done only for a call that pauses it at its epoch or before
    (``until_epoch``)."""
    if stored is not None and stored.status in ("paused", "pruned"):
        return until_epoch is not None and stored.epochs_completed >= until_epoch
    if stored is None or stored.status != "completed":
        return False
    if spec.ray_loop:  # a summary from before configs were recorded: done
        config = stored.train_loop_config
        return config is None or config == dict(spec.train_loop_config)
    if spec.schedule is None or stored.stop_reason:
        return True
    return stored.epochs_completed >= spec.schedule.epochs


def check_until_epoch(spec: RunSpec, until_epoch: int | None) -> None:
    """A pause point the run can keep: an epoch from 1, of the built-in loop (which stops
    after it with its checkpoint committed; a loop of one's own decides its own stops)."""
    if until_epoch is None:
        return
    if spec.train_loop is not None:
        raise SpecError(
            f"until_epoch {until_epoch}: a loop of one's own (train_loop) cannot be paused at "
            "an epoch; run it whole (leave until_epoch unset)",
            field="until_epoch",
        )
    if until_epoch < 1:
        raise SpecError(
            f"until_epoch {until_epoch}: epochs count from 1; pause after epoch 1 or later",
            field="until_epoch",
        )


def refuse_bad_input(
    spec: RunSpec, say: Callable[[str], None] | None = None
) -> preflight.Preflight:
    """Every check of bad input setup makes before it takes the lease: ``preflight.preflight``
    (storage; the dataset, a rerun's pinned snapshot first; what the spec imports, the model,
    the loss; then the run directory), then the cluster: its capacity, or for a job on a remote
    cluster that its address answers (the job checks that cluster's capacity; a run that has
    attempts already waits for an address that answered it before, its head restarting).
    Raises a SpecError that names the field and the fix; touches nothing in storage."""
    mlflow_state.tracking_uri(spec)  # MLFLOW_TRACKING_URI's too: no credential in it
    checked = preflight.preflight(spec)
    address = jobs.job_address(spec)
    if address and checked.plan.attempt > 1:
        jobs.client_waiting(address, say)
    elif address:
        jobs.client(address)
    else:
        cluster.check_capacity(spec)
    return checked


@task(name="setup", cache_policy=NO_CACHE)
def setup(spec: RunSpec, lease_owner: str, until_epoch: int | None = None) -> Prepared:
    """Refuse bad input before any worker starts; plan the attempt; hold the run.
    ``until_epoch``: the epoch the run pauses after (refused for a loop of the user's own)."""
    logger = get_run_logger()
    check_until_epoch(spec, until_epoch)
    # Storage credentials from run.credentials' block, for this process and (through
    # storage.credential_env) Ray's workers; the flow restores the environment when it ends.
    names = credentials.apply(spec.run.credentials)
    if names:
        logger.info("storage credentials from block %s: %s", spec.run.credentials, names)
    checked = refuse_bad_input(spec, logger.warning)  # bad input first, as it names itself
    plan, run_dir = checked.plan, checked.run_dir
    for uri, added in checked.added():
        logger.info(
            "%s file(s) added to %s since this run took its dataset snapshot are ignored",
            len(added),
            uri,
        )
    lease.acquire(run_dir.location, owner=lease_owner)
    summary_seen = lease.summary_version(run_dir.location)  # under the lease: nobody writes it
    stored = read_stored_result(run_dir)
    if is_finished(spec, stored, until_epoch) and (rotten := damaged_since(spec, run_dir, stored)):
        logger.warning(
            "run %s finished, but %s: it trains on from its newest sound checkpoint, and its "
            "result is written again without them",
            plan.run_name,
            "; ".join(rotten),
        )
        stored = None
    if is_finished(spec, stored, until_epoch):
        logger.info(
            "run %s already finished (%s steps): returning its stored result",
            plan.run_name,
            stored.steps_completed if stored else "?",
        )
        if stored is not None and stored.mlflow is not None and stored.mlflow.pending:
            stored = sync_tracking(spec, run_dir, stored)[0] or stored
            logger.info("%s", stored.mlflow.describe() if stored.mlflow else "")
        lease.release(run_dir.location, lease_owner)
    else:
        logger.info("run %s at %s: %s", plan.run_name, plan.run_uri, plan.reason)
        stored = None
    return Prepared(
        run_name=plan.run_name,
        storage_uri=plan.storage_uri,
        run_uri=plan.run_uri,
        lease_owner=lease_owner,
        plan_reason=plan.reason,
        total_steps=checked.total_steps,
        resume_step=plan.resume_step,
        stored_result=stored,
        first_attempt=plan.attempt,
        summary_seen=summary_seen,
        until_epoch=until_epoch,
    )
