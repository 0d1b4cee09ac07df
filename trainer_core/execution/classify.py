"""Turn what ``TorchTrainer.fit()`` raised into an error that says what the orchestrator must do."""

from __future__ import annotations

import logging
import re
import time

import ray

from trainer_core.errors import (
    IncompatibleRunError,
    InfrastructureError,
    PreemptedError,
    RelaytrainError,
    SpecError,
    StorageError,
    TrainingCodeError,
)
from trainer_core.execution import ray_head
from trainer_core.execution.cluster import alive_nodes, draining_nodes, preempted_nodes

logger = logging.getLogger("relaytrain.engine")

#: torch.distributed's root error, by name (Ray Train's controller imports this module and must
#: not import torch; where one is raised, torch is loaded). torch raises it and its subclasses
#: for a collective, its communicator or the rendezvous store failing: ``DistBackendError`` for
#: NCCL's watchdog timeout ("Watchdog caught collective operation timeout: WorkNCCL(...) ran for N
#: milliseconds before timing out"), for a communicator the watchdog or an abort tore down ("NCCL
#: communicator was aborted on rank N") and for NCCL's errors (ncclRemoteError: a peer exited);
#: ``DistStoreError`` for a store's wait timing out; ``DistNetworkError`` for the store's socket.
TORCH_DIST_ERROR = "torch.distributed.DistError"

#: gloo raises its TCP transport's I/O failures as a plain RuntimeError (gloo::IoException: no
#: torch type), the message led by gloo's source location: "[.../gloo/transport/tcp/pair.cc:598]
#: Connection closed by peer [10.0.0.2]:4301", "[.../gloo/transport/tcp/unbound_buffer.cc:78]
#: Timed out waiting 1800000ms for recv operation to complete" (a peer silent past the timeout).
#: gloo's failed checks ("[enforce fail at .../pair.cc:456] ...": a collective mismatch, a bug)
#: are not among them.
GLOO_IO_FAILURE = re.compile(
    r"\[[^\]\s]*gloo/transport/[^\]\s]*:\d+\] "
    r"(Timed out waiting \d+ms for (recv|send) operation to complete|Connection closed by peer"
    r"|Read error|Read timeout|Write timeout|writev|Connect timeout|Socket closed"
    r"|Socket unexpectedly closed)"
)
#: What the other operations of a gloo context raise once one of them timed out (no location).
GLOO_PAIR_CLOSED = "Application timeout caused pair closure"


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` is a collective failing because another rank went away, hung or was
    cut off (an infrastructure failure, not this rank's code): a ``torch.distributed.DistError``
    of any kind, by its type; gloo's transport failures, which have no type, by their message."""
    if any(f"{c.__module__}.{c.__qualname__}" == TORCH_DIST_ERROR for c in type(error).__mro__):
        return True
    if not isinstance(error, RuntimeError):
        return False
    text = str(error)
    return text == GLOO_PAIR_CLOSED or GLOO_IO_FAILURE.search(text) is not None


def _unwrap(error: BaseException) -> BaseException:
    seen = 0
    while seen < 10:
        seen += 1
        inner = (
            getattr(error, "_base_exc", None)
            or getattr(error, "health_check_failure", None)
            or getattr(error, "cause", None)
        )
        if isinstance(error, ray.exceptions.RayTaskError):
            inner = error.as_instanceof_cause() if inner is None else inner
        if inner is None or inner is error or not isinstance(inner, BaseException):
            return error
        error = inner
    return error


def _was_preempted(error: BaseException) -> bool:
    """True when ``error`` (or what it wraps) is an actor death caused by node preemption."""
    for candidate in (error, _unwrap(error)):
        if isinstance(candidate, ray.exceptions.RayActorError) and candidate.preempted:
            return True
    return False


def classify(error: BaseException) -> BaseException:
    """Map what fit() raised to a RelaytrainError that says what the orchestrator must do.

    Non-Exception BaseExceptions (cancellation, KeyboardInterrupt) pass through unchanged.
    """
    from ray.train import ControllerError, PreemptionError, WorkerGroupError

    if isinstance(error, RelaytrainError) or not isinstance(error, Exception):
        return error
    if isinstance(error, PreemptionError):
        return PreemptedError(f"preempted: {error}")
    if isinstance(error, WorkerGroupError):
        return _worker_group_failure(error, dict(sorted(error.worker_failures.items())))
    if isinstance(error, ControllerError):
        cause = _unwrap(error.controller_failure)
        if isinstance(cause, ray.exceptions.ActorDiedError):
            return IncompatibleRunError(
                f"Ray Train's controller died while starting ({cause}); the usual cause is a "
                "run snapshot written by another Ray version. Start a new run.name, or resume "
                "with the Ray version that wrote it."
            )
        return InfrastructureError(f"Ray Train's controller failed: {cause}")
    if isinstance(error, ray.exceptions.RayError):
        return InfrastructureError(f"Ray failed: {type(error).__name__}: {error}"[:4000])
    if isinstance(error, OSError):
        return InfrastructureError(f"storage or system error: {error}")
    if is_peer_failure(error):
        return InfrastructureError(f"a collective lost its peers: {type(error).__name__}: {error}")
    return TrainingCodeError(f"{type(error).__name__}: {error}", error_type=type(error).__name__)


def group_never_started(error: BaseException) -> bool:
    """Whether fit() failed because its worker group's resources never came free (Ray's start
    timeout: the placement group was still pending)."""
    from ray.train import ControllerError
    from ray.train.v2._internal.exceptions import WorkerGroupStartupTimeoutError

    if not isinstance(error, ControllerError):
        return False
    failure = error.controller_failure
    return isinstance(failure, WorkerGroupStartupTimeoutError) or isinstance(
        _unwrap(failure), WorkerGroupStartupTimeoutError
    )


def _worker_group_failure(error: Exception, raw: dict[int, BaseException]) -> Exception:
    """What the failures of a worker group's ranks (rank -> error) mean, taken together."""
    from ray.train.v2._internal.exceptions import (
        WorkerGroupStartupTimeoutError,
        WorkerHealthCheckFailedError,
        WorkerHealthCheckTimeoutError,
    )

    # Ray Train's own verdicts on a worker's health: the worker, not the code, failed.
    unhealthy = (
        WorkerHealthCheckFailedError,
        WorkerHealthCheckTimeoutError,
        WorkerGroupStartupTimeoutError,
    )
    # A rank lost to a preempted node explains its peers' collateral errors too (Ray's own
    # failure policy makes the same call).
    preempted = [r for r, e in raw.items() if _was_preempted(e)]
    if preempted:
        return PreemptedError(
            f"preempted: the node of rank(s) {preempted} was reclaimed ({raw[preempted[0]]})"[:4000]
        )
    if any(isinstance(e, unhealthy) for e in raw.values()) and not any(
        isinstance(_unwrap(e), SpecError | TrainingCodeError) for e in raw.values()
    ):
        detail = "; ".join(f"rank {r}: {e}" for r, e in raw.items())
        return InfrastructureError(f"a training worker died or hung: {detail}"[:4000])
    failures = {rank: _unwrap(e) for rank, e in raw.items()}
    # Precedence: a spec error anywhere (never retry), then a genuine training-code error,
    # then storage; peers that only saw a dead rank's collective fail as infrastructure.
    for kind in (SpecError, TrainingCodeError, StorageError, InfrastructureError):
        for failure in failures.values():
            if isinstance(failure, kind):
                return failure
    detail = "; ".join(f"rank {r}: {type(e).__name__}: {e}" for r, e in failures.items())
    died = (
        ray.exceptions.RayActorError,
        ray.exceptions.NodeDiedError,
        ray.exceptions.WorkerCrashedError,
    )
    if any(isinstance(e, died) for e in failures.values()):
        return InfrastructureError(f"a training worker died: {detail}"[:4000])
    # A rank's own error explains its peers' lost collectives; lost collectives alone are
    # the infrastructure's.
    own = [e for e in failures.values() if not is_peer_failure(e)]
    if failures and not own:
        return InfrastructureError(f"a collective lost its peers: {detail}"[:4000])
    first = next(iter(own), error)
    return TrainingCodeError(
        f"{type(first).__name__}: {first}"[:4000], error_type=type(first).__name__
    )


def name_preemption(
    error: BaseException, reclaimed_before: set[str], settle_s: float = 30.0
) -> BaseException:
    """An infrastructure failure during which a node was reclaimed for preemption says so.

    The surviving ranks often fail first (a collective loses its peer), before Ray Train sees
    the preempted rank, and before the GCS has declared the reclaimed node dead: that takes its
    health checks (about 15 s at Ray's defaults). Ray's node table tells once it has. So if a
    node's drain deadline had come when the attempt failed, wait (at most ``settle_s``) until
    each such node is declared dead or back in service, then read the death reasons. Without
    one nothing is waited for. A lost head (``ray_head``) is the cause: Ray is left,
    nothing to ask.
    """
    if not isinstance(error, InfrastructureError) or isinstance(error, PreemptedError):
        return error
    if ray_head.lost() is not None:
        return error
    pending = draining_nodes() - reclaimed_before
    deadline = time.monotonic() + settle_s
    while pending and time.monotonic() < deadline:
        pending = pending & alive_nodes() & draining_nodes()
        if pending:
            time.sleep(0.5)
    reclaimed = preempted_nodes() - reclaimed_before
    if not reclaimed:
        return error
    return _preempted(error, f"node(s) {sorted(reclaimed)} were reclaimed during the attempt")


def name_preemption_now(
    error: BaseException, reclaimed_before: set[str]
) -> tuple[BaseException, set[str]]:
    """``name_preemption`` for a failure being decided now (Ray Train's failure policy, which
    cannot wait): an infrastructure failure while a node drains for preemption, due or not, or
    after one was reclaimed, is that preemption. Ray says so of the lost worker only once the GCS
    has the node's death reason, which relaytrain does not wait for
    (``RAY_timeout_ms_task_wait_for_death_info``), and the survivors fail first anyway.

    Nodes in ``reclaimed_before`` (reclaimed before the attempt, or a preemption an earlier
    restart already answered) are no one's cause now. Returns the error and the nodes blamed:
    for a preemption Ray named itself (its watcher's ``PreemptionError``, a rank lost with
    Ray's preempted flag) too, so that a later failure is not blamed on the same drain."""
    if not isinstance(error, InfrastructureError):
        return error, set()
    try:
        underway = (draining_nodes(due_only=False) | preempted_nodes()) - reclaimed_before
    except Exception:  # the GCS's node table is a hint here; the failure is still handled
        logger.debug("could not read the cluster's drains", exc_info=True)
        return error, set()
    if isinstance(error, PreemptedError) or not underway:
        return error, underway if isinstance(error, PreemptedError) else set()
    return _preempted(
        error, f"node(s) {sorted(underway)} drain for preemption or were reclaimed"
    ), underway


def _preempted(error: BaseException, why: str) -> PreemptedError:
    named = PreemptedError(f"preempted: {why} ({error})", step=getattr(error, "step", None))
    named.__cause__ = error
    return named
