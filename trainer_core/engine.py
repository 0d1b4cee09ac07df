"""The Ray seam: start or connect to Ray, run one attempt of a run with TorchTrainer, classify.

``run_attempt(spec)`` is one attempt: preflight checks on the driver (fail fast, no workers),
``TorchTrainer.fit()`` with ``RunConfig(storage_path, name=<run name>)`` so every attempt
addresses the same run directory, metrics relayed to ``on_event`` while fit() runs, the attempt
recorded in ``attempts.jsonl``, and any failure raised as a classified ``RelaytrainError``.
A second call on the same run resumes from the newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import pyarrow
import ray
import torch
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainer_core import __version__, lazyfs, storage, stream, workloads
from trainer_core import data as data_mod
from trainer_core.checkpoints import RunDirectory, open_checkpoint
from trainer_core.classify import classify
from trainer_core.errors import (
    ClusterCapacityError,
    IncompatibleRunError,
    InfrastructureError,
    PreemptedError,
    SpecError,
)
from trainer_core.loop import builtin_train_loop
from trainer_core.spec import RunSpec
from trainer_core.user_loop import user_train_loop
from trainer_core.worker import WorkerConfig

logger = logging.getLogger("relaytrain.engine")

#: Ray Train's controller polls workers this often; a report blocks up to one interval when the
#: previous one was not yet consumed (relaytrain reports asynchronously, at checkpoints only), and
#: worker deaths are noticed within about one interval. Ray propagates the driver's value to the
#: controller and workers; a value set in the environment wins.
RAY_ENV_DEFAULTS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.5"}

EventHandler = Callable[[dict[str, Any]], None]


# -- Ray lifecycle --------------------------------------------------------------------------------


def apply_ray_env_defaults() -> None:
    """Set relaytrain's Ray Train settings in this (driver) process unless the user set them."""
    for key, value in RAY_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def ray_cluster(num_cpus: int | None = None) -> Iterator[bool]:
    """Use the running Ray, or connect to ``RAY_ADDRESS``, or start a local cluster.

    Yields whether this call started (or connected) Ray; only then is it shut down afterwards.
    Whoever starts Ray stops it: a cluster someone else connected to is left alone.
    """
    if ray.is_initialized():
        yield False
        return
    address = os.environ.get("RAY_ADDRESS")
    kwargs: dict[str, Any] = {"log_to_driver": False}
    if address:
        ray.init(address=address, **kwargs)
    else:
        # "local": a new cluster of our own, not whatever `ray start` left on this machine.
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
    try:
        yield True
    finally:
        ray.shutdown()


def check_capacity(spec: RunSpec) -> None:
    """Refuse a worker group the cluster can never hold (Ray would wait forever): the fixed
    count, or an elastic run's MIN."""
    per_worker = dict(spec.scaling.resources_per_worker or {})
    per_worker.setdefault("GPU" if spec.scaling.use_gpu else "CPU", 1.0)
    total = ray.cluster_resources()
    workers = spec.scaling.min_workers
    asked = spec.scaling.num_workers
    shown = f"{list(asked)} (at least {workers})" if isinstance(asked, tuple) else f"{asked}"
    for resource, amount in per_worker.items():
        needed = amount * workers
        available = total.get(resource, 0.0)
        if needed > available:
            raise ClusterCapacityError(
                f"scaling.num_workers={shown} workers need {needed:g} {resource} in all, but "
                f"the Ray cluster has {available:g}: lower scaling.num_workers or "
                "scaling.resources_per_worker, or add nodes",
                field="scaling.num_workers",
            )


# -- preflight ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    """What an attempt will do, decided on the driver before any worker starts."""

    run_name: str
    storage_uri: str
    run_uri: str
    attempt: int
    resume_step: int | None
    candidates: list[int]
    reason: str


def versions() -> dict[str, str]:
    return {
        "relaytrain": __version__,
        "ray": ray.__version__,
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "python": platform.python_version(),
    }


def canonical_storage_uri(uri: str) -> str:
    """The storage URI every process can resolve (local paths made absolute)."""
    location = storage.resolve(uri)
    return location.path if location.is_local else uri


def validate_workload(spec: RunSpec) -> int | None:
    """Import what the spec names, read the dataset and build the model: SpecError before any
    worker starts. Returns the run's total optimizer steps (None for a user's own loop)."""
    if spec.train_loop is not None:
        workloads.resolve_train_loop(spec.train_loop)
        for name, uri in spec.datasets.items():  # footers only: the files are Parquet
            stream.scan_files(storage.resolve(uri), None, None, f"datasets.{name}")
        return None
    assert spec.model is not None and spec.data is not None and spec.schedule is not None
    data = spec.data.resolved()
    layout = stream.scan(data)  # footers only
    info = stream.describe(layout, data)
    one = stream.RankStream(layout, data, spec.run.seed, 1, 0)  # row ids only: no rows read
    if one.batches_per_epoch == 0:
        raise SpecError(
            f"dataset {layout.uri} has {one.train_rows} training rows, fewer than one global batch "
            f"(data.batch_size={data.batch_size}): lower data.batch_size or "
            f"data.validation_fraction ({data.validation_fraction})",
            field="data.batch_size",
        )
    model = workloads.build_model(spec.model, info.num_features, info.num_outputs)
    first = next(g for g, count in enumerate(one.train_counts) if count)  # one row group read
    sample = np.arange(min(one.train_counts[first], 4))
    _, rows = one.reader.take(np.full(len(sample), first), sample)
    workloads.check_loss_and_metrics(
        model,
        torch.from_numpy(rows.features),
        torch.from_numpy(rows.labels),
        spec.loss,
        spec.metrics,
        data.task or "classification",
    )
    return (
        data_mod.steps_per_epoch(one.batches_per_epoch, spec.optimizer.grad_accumulation)
        * spec.schedule.epochs
    )


def plan_attempt(spec: RunSpec, attempt: int | None = None) -> tuple[Plan, RunDirectory]:
    """Validate storage and the run directory, and decide fresh start vs. resume."""
    name = spec.run.name
    if name is None:
        raise SpecError("run.name is not set: give the run a name", field="run.name")
    storage_uri = canonical_storage_uri(spec.run.storage)
    root = storage.resolve(storage_uri)
    if root.uri.startswith("memory://"):
        raise SpecError(
            "run.storage memory:// lives in one process; Ray workers cannot see it. Use a "
            "path shared by every node, or object storage.",
            field="run.storage",
        )
    storage.probe_writable(storage.resolve(storage_uri, fail_fast=True))
    run_dir = RunDirectory(root.child(name))
    record = run_dir.read_run_record()
    if record is not None:
        stored_ray = record.get("versions", {}).get("ray")
        if stored_ray and stored_ray != ray.__version__:
            raise IncompatibleRunError(
                f"run {run_dir.uri} was written by Ray {stored_ray}; this is Ray "
                f"{ray.__version__}, which cannot read its run snapshot. Resume it with Ray "
                f"{stored_ray}, or start a new run.name.",
                field="run.name",
            )
        run_dir.check_compatible(spec.identity(), spec.fingerprint())
    attempts = run_dir.read_attempts()
    number = (
        attempt if attempt is not None else (max((a["attempt"] for a in attempts), default=0) + 1)
    )
    scan = run_dir.scan()
    candidates = [c.step for c in reversed(scan.committed)]
    if candidates:
        reason = f"resume from the newest committed checkpoint (step {candidates[0]})"
        if scan.uncommitted:
            reason += f"; ignoring uncommitted {', '.join(scan.uncommitted)}"
        if scan.damaged:
            reason += f"; skipping damaged {', '.join(scan.damaged)}"
    else:
        reason = "fresh start: no committed checkpoint in the run directory"
        if spec.run.init_from:  # the workers would fail on it only after they start
            open_checkpoint(spec.run.init_from)
            reason += f"; warm start from {spec.run.init_from}"
    plan = Plan(
        name,
        storage_uri,
        run_dir.uri,
        number,
        candidates[0] if candidates else None,
        candidates,
        reason,
    )
    return plan, run_dir


# -- one attempt ----------------------------------------------------------------------------------


@dataclass
class AttemptResult:
    run_name: str
    run_uri: str
    attempt: int
    status: str
    resumed_from_step: int | None
    steps_completed: int
    final_metrics: dict[str, Any]
    latest_checkpoint_uri: str | None
    wall_time_s: float
    plan_reason: str
    #: Seconds rank 0 spent stepping, aggregating metrics and writing checkpoints.
    timings: dict[str, float] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class LiveState:
    """What the driver knows of a running attempt, folded from the relayed events."""

    step: int = 0
    resumed_from: int | None = None
    #: When the workers had loaded their start point (worker clock): training resumes here.
    resumed_at: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    checkpoint_uri: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    #: In-place restarts of the worker group: when, after what, and where each resumed.
    restarts: list[dict[str, Any]] = field(default_factory=list)
    #: Workers in the group, and the largest peak resident memory any of them reported (MB).
    world_size: int | None = None
    peak_worker_rss_mb: float | None = None
    #: The just-in-time checkpoint of a drain's notice, until the preemption's restart.
    notice: dict[str, Any] | None = None

    def outcome(self) -> dict[str, Any]:
        """What an ended attempt's record says of its workers, failed or completed."""
        return {
            "resumed_from_step": self.resumed_from,
            "resumed_at": self.resumed_at,
            "restarts": self.restarts,
            "world_size": self.world_size,
            "peak_worker_rss_mb": self.peak_worker_rss_mb,
        }

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["kind"]
        if event.get("world_size"):
            self.world_size = event["world_size"]
        if kind == "memory":
            self.peak_worker_rss_mb = max(
                self.peak_worker_rss_mb or 0.0, event["peak_worker_rss_mb"]
            )
        if kind == "metrics" and event["rows"]:
            self.step = max(self.step, event["rows"][-1]["step"])
            self.metrics = {**self.metrics, **event["rows"][-1]}
        elif kind == "preemption_notice":
            self.notice = {
                "just_in_time_step": event["step"],
                "seconds_to_deadline": event["seconds_left"],
            }
        elif kind == "restarting":
            notice = self.notice if event.get("error_budget") == "preemption" else None
            self.notice = None if notice else self.notice
            self.restarts.append(
                {
                    **(notice or {}),
                    "restart": len(self.restarts) + 1,
                    "reason": event.get("error_budget", "infrastructure"),
                    "failed_at": event["time"],
                    "last_step": self.step,
                    "world_size_before": self.world_size,
                    "error_budget": event.get("error_budget", "infrastructure"),
                    "error_class": event["error_class"],
                    "error_message": event["error_message"],
                }
            )
        elif kind == "resizing":  # the elastic policy found capacity for another size
            self.restarts.append(
                {
                    "restart": len(self.restarts) + 1,
                    "reason": "capacity",
                    "failed_at": event["time"],
                    "last_step": self.step,
                    "world_size_before": event["world_size"],
                }
            )
        elif kind in ("resumed", "fresh_start") and event.get("group"):
            if not self.restarts or "resumed_at" in self.restarts[-1]:
                self.restarts.append({"restart": len(self.restarts) + 1, "reason": "unknown"})
            self.restarts[-1]["resumed_from_step"] = event.get("step", 0)
            self.restarts[-1]["resumed_at"] = event.get("time")
            self.restarts[-1]["world_size_after"] = event.get("world_size")
        elif kind == "peer_lost":
            # A surviving rank's last completed step, when rank 0 (whose rows say it) died.
            group = event.get("group", 0)
            if group < len(self.restarts):  # that group's restart was heard of first
                last = self.restarts[group].get("last_step") or 0
                self.restarts[group]["last_step"] = max(last, event["last_step"])
            else:
                self.step = max(self.step, event["last_step"])
        elif kind == "resumed":
            self.resumed_from = event.get("step")
            self.resumed_at = event.get("time")
        elif kind == "fresh_start":
            self.resumed_from = 0  # known: from the beginning (None means unknown)
            self.resumed_at = event.get("time")
        elif kind == "checkpoint":
            self.checkpoint_uri = event.get("checkpoint_uri")
        elif kind == "finished":
            self.timings = dict(event.get("timings") or {})


def run_attempt(
    spec: RunSpec,
    *,
    attempt: int | None = None,
    on_event: EventHandler | None = None,
    poll_interval_s: float = 0.5,
) -> AttemptResult:
    """Run one attempt of ``spec`` (resuming if the run has committed checkpoints)."""
    started = time.time()
    validate_workload(spec)
    plan, run_dir = plan_attempt(spec, attempt)
    with ray_cluster() as _:
        check_capacity(spec)
        reclaimed_before = preempted_nodes()
        if run_dir.read_run_record() is None:
            run_dir.write_run_record(
                spec.model_dump(mode="json"), spec.identity(), spec.fingerprint(), versions()
            )
        record = {
            "attempt": plan.attempt,
            "started_at": started,
            "status": "running",
            "resumed_from_step": plan.resume_step,
            "plan": plan.reason,
        }
        _close_abandoned(run_dir, plan.attempt)
        run_dir.record_attempt(record)
        _clean_orphans(run_dir)
        live = LiveState(step=plan.resume_step or 0, resumed_from=plan.resume_step)

        def handle(event: dict[str, Any]) -> None:
            live.apply(event)
            kind = event["kind"]
            if kind in ("restarting", "resizing") or (
                kind in ("resumed", "fresh_start") and event.get("group")
            ):
                run_dir.record_attempt({**record, "restarts": live.restarts})
            if on_event is not None:
                on_event(event)

        try:
            _fit(spec, plan, handle, poll_interval_s)
        except BaseException as error:
            classified = _name_preemption(classify(error), reclaimed_before)
            run_dir.record_attempt(
                {
                    **record,
                    "status": "failed",
                    "ended_at": time.time(),
                    **live.outcome(),
                    "last_step": max(live.step, getattr(classified, "step", None) or 0),
                    "error_class": type(classified).__name__,
                    "error_budget": getattr(classified, "budget", "none"),
                    "error_message": str(classified)[:2000],
                    "error_step": getattr(classified, "step", None),
                    "error_type": getattr(classified, "error_type", None),
                    "deterministic": getattr(classified, "deterministic", False),
                }
            )
            if classified is error:
                raise
            raise classified from error
        newest = run_dir.scan().newest
        result = AttemptResult(
            run_name=plan.run_name,
            run_uri=plan.run_uri,
            attempt=plan.attempt,
            status="completed",
            resumed_from_step=live.resumed_from or None,
            steps_completed=newest.step if newest else live.step,
            final_metrics=newest.metrics if newest else dict(live.metrics),
            latest_checkpoint_uri=newest.uri if newest else live.checkpoint_uri,
            wall_time_s=time.time() - started,
            plan_reason=plan.reason,
            timings=live.timings,
        )
        run_dir.record_attempt(
            {
                **record,
                "status": "completed",
                "ended_at": time.time(),
                **live.outcome(),
                "last_step": result.steps_completed,
            }
        )
        return result


def alive_nodes() -> set[str]:
    """Ids of the cluster's live nodes."""
    return {node["NodeID"] for node in ray.nodes() if node.get("Alive")}


def preempted_nodes() -> set[str]:
    """Ids of the dead nodes Ray records as reclaimed after a drain for preemption."""
    from ray.core.generated.common_pb2 import NodeDeathInfo  # type: ignore[attr-defined]

    return {
        node["NodeID"]
        for node in ray.nodes()
        if not node.get("Alive")
        and node.get("DeathReason") == NodeDeathInfo.AUTOSCALER_DRAIN_PREEMPTED
    }


def draining_nodes() -> set[str]:
    """Ids of the nodes the GCS was told to drain whose drain deadline has come.

    Idle drains (no deadline) and notices that have not yet come due are left out: their
    nodes are not the reason an attempt fails now.
    """
    from ray._private.state import state

    due_ms = time.time() * 1000 + 1000
    return {
        node_id
        for node_id, deadline_ms in state.get_draining_nodes().items()
        if 0 < deadline_ms <= due_ms
    }


def _name_preemption(
    error: BaseException, reclaimed_before: set[str], settle_s: float = 30.0
) -> BaseException:
    """An infrastructure failure during which a node was reclaimed for preemption says so.

    The surviving ranks often fail first (a collective loses its peer), before Ray Train sees
    the preempted rank, and before the GCS has declared the reclaimed node dead: that takes its
    health checks (about 15 s at Ray's defaults). Ray's node table tells once it has. So if a
    node's drain deadline had come when the attempt failed, wait (at most ``settle_s``) until
    each such node is declared dead or back in service, then read the death reasons. Without
    one nothing is waited for.
    """
    if not isinstance(error, InfrastructureError) or isinstance(error, PreemptedError):
        return error
    pending = draining_nodes()
    deadline = time.monotonic() + settle_s
    while pending and time.monotonic() < deadline:
        pending = pending & alive_nodes() & draining_nodes()
        if pending:
            time.sleep(0.5)
    reclaimed = preempted_nodes() - reclaimed_before
    if not reclaimed:
        return error
    named = PreemptedError(
        f"preempted: node(s) {sorted(reclaimed)} were reclaimed during the attempt ({error})",
        step=getattr(error, "step", None),
    )
    named.__cause__ = error
    return named


def _close_abandoned(run_dir: RunDirectory, attempt: int) -> None:
    """Mark earlier attempts still "running" as failed: they ended without a word.

    Only the lease holder starts attempts, so a running record of another attempt belongs to a
    driver whose flow process was killed or lost (its lease expired or was taken over).
    """
    for record in run_dir.read_attempts():
        if record.get("status") == "running" and record["attempt"] != attempt:
            run_dir.record_attempt(
                {
                    **record,
                    "status": "failed",
                    "error_class": "DriverLost",
                    "error_budget": "infrastructure",
                    "error_message": "this attempt ended without recording how: its driver died "
                    "(flow process killed, machine lost) or storage refused the record",
                }
            )


def _clean_orphans(run_dir: RunDirectory) -> None:
    """Before workers start nothing is in flight: drop uncommitted checkpoint directories."""
    uncommitted = run_dir.scan().uncommitted
    if uncommitted:
        logger.info("removing uncommitted checkpoint directories: %s", uncommitted)
        run_dir.delete_checkpoints(uncommitted)


def _abortable_trainer_class() -> type:
    """TorchTrainer that keeps its controller's handle, so an interrupted driver can stop it,
    and starts none of Ray's helper actors that relaytrain has no use for.

    Ray 2.60 keeps the handle local to ``_initialize_and_run_controller``; this mirrors that
    method (Ray is pinned exactly) minus the SIGINT handler, which cannot be installed off the
    main thread anyway. Each helper actor is a process start (about 2 s of CPU on 2 cores,
    contending with the workers' own start), paid again by every attempt and in-place restart.
    What the controller unpickles comes from ``trainer_core.controller``, which imports no torch.
    """
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )

    from trainer_core.controller import (
        CredentialedController,
        CurrentCapacityPolicy,
        InPlacePolicy,
    )

    class AbortableTorchTrainer(TorchTrainer):
        controller: Any = None
        #: The storage credentials as a Ray object, nested so Ray passes it by reference.
        storage_credentials: list[Any] = []
        #: In-place restarts allowed per budget (``restart_limits``), and the relay that hears
        #: of each.
        restart_limits: dict[str, int | None] = {}
        relay: Any = None
        #: Whether Ray's preemption watcher runs (``watches_preemption``).
        watch_preemption: bool = False

        def _create_default_callbacks(self) -> list[Any]:
            # Ray's datasets callback starts a DatasetManager actor for every worker group,
            # datasets or not; relaytrain's loops read their own data and pass none.
            callbacks = super()._create_default_callbacks()  # type: ignore[misc]  # V2 method
            if self.datasets:
                return callbacks
            return [c for c in callbacks if not isinstance(c, DatasetsCallback)]

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            env_vars = get_env_vars_to_propagate()
            env_vars.setdefault(
                RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            )
            env_vars[PREEMPTION_WATCHER_ENV] = "1" if self.watch_preemption else "0"
            controller_class = ray.remote(
                num_cpus=0,
                label_selector={
                    ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()  # type: ignore[attr-defined]
                },
                runtime_env={"env_vars": env_vars},
            )(CredentialedController)
            controller_init_kwargs["scaling_policy"] = CurrentCapacityPolicy.replacing(
                controller_init_kwargs["scaling_policy"]
            )
            controller_init_kwargs["failure_policy"] = InPlacePolicy(
                controller_init_kwargs["failure_policy"].failure_config,
                self.restart_limits,
                self.relay,
            )
            self.controller = controller_class.remote(
                storage_credentials=self.storage_credentials,
                relay=self.relay,
                **controller_init_kwargs,
            )
            ray.get(self.controller.run.remote())
            return ray.get(self.controller.get_result.remote())

        def abort(self, timeout_s: float = 15.0) -> None:
            """Stop the worker group (controller.abort), then the controller itself."""
            if self.controller is None:
                return
            with contextlib.suppress(Exception):
                ray.get(self.controller.abort.remote(), timeout=timeout_s)
            with contextlib.suppress(Exception):
                ray.kill(self.controller)

    return AbortableTorchTrainer


def restart_limits(spec: RunSpec) -> dict[str, int | None]:
    """In-place restarts of the worker group allowed per budget, within one attempt.

    A preemption always restarts in place (``retries.preemption``, None: no limit). An elastic
    run also goes on after a lost node or worker on what the cluster still holds, up to
    ``retries.infrastructure`` times, and sizes a group again when one could not start; a fixed
    one restarts in place only ``retries.in_place`` times, then ends the attempt.
    """
    if spec.scaling.elastic:
        infrastructure = spec.retries.infrastructure
        return {
            "infrastructure": infrastructure,
            "preemption": spec.retries.preemption,
            "startup": infrastructure,
        }
    return {"infrastructure": spec.retries.in_place, "preemption": spec.retries.preemption}


#: Ray Train's switch for its preemption watcher (an actor started with every worker group).
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"


def watches_preemption() -> bool:
    """Whether Ray Train watches the worker group's nodes for drains: as the user set it, else
    on a cluster of several nodes (a drain among the nodes of a one-node cluster ends it)."""
    value = os.environ.get(PREEMPTION_WATCHER_ENV)
    if value is not None:
        return value.strip().lower() in ("1", "true", "yes")
    return not _single_node()


def _single_node() -> bool:
    """Whether the Ray cluster is one node (a local cluster, or a head alone)."""
    return len(alive_nodes()) == 1


def _with_credentials(train_loop: Callable[[Any], None], credentials: list[Any]) -> Any:
    """``train_loop`` that first sets the storage credentials in the worker's environment."""
    from trainer_core.controller import apply_credentials

    def train_loop_with_credentials(config: Any) -> None:
        apply_credentials(credentials)
        train_loop(config)

    return train_loop_with_credentials


def _trainer(spec: RunSpec, plan: Plan, relay: Any) -> Any:
    # Train V2's config classes (what ray.train exports at run time; type checkers see V1's).
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from trainer_core.controller import ProcessGroupConfig

    apply_ray_env_defaults()
    root = storage.resolve(plan.storage_uri)
    worker_config = WorkerConfig(
        spec=spec.model_dump(mode="json"),
        storage_uri=plan.storage_uri,
        run_name=plan.run_name,
        attempt=plan.attempt,
        candidates=plan.candidates,
        relay=relay,
        watch_preemption=watches_preemption(),
    )
    user_loop = spec.train_loop is not None
    # A running Ray cluster does not see this process's environment, so the controller and
    # workers get the storage credentials (environment or run.credentials' block) explicitly:
    # as a Ray object in memory, not a runtime_env, because Ray's runtime env agent logs every
    # runtime env it creates, values included (logs/runtime_env_agent.log), and Ray Train keeps
    # the worker runtime env in its run state (dashboard, export events).
    credentials = [ray.put(storage.credential_env())]
    loop = user_train_loop if user_loop else builtin_train_loop
    trainer = _abortable_trainer_class()(
        datasets=_ray_datasets(spec, credentials),
        train_loop_per_worker=_with_credentials(loop, credentials),
        train_loop_config=worker_config.to_dict(),
        # Ray's TorchConfig, minus its module's torch import in the controller.
        torch_config=ProcessGroupConfig(backend="nccl" if spec.scaling.use_gpu else "gloo"),
        scaling_config=ScalingConfig(
            num_workers=spec.scaling.num_workers,
            elastic_resize_monitor_interval_s=spec.scaling.resize_interval_s,
            use_gpu=spec.scaling.use_gpu,
            resources_per_worker=spec.scaling.resources_per_worker,
            placement_strategy=spec.scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=plan.run_name,
            storage_path=root.path,
            # Built where it is used, after the credentials are set there (lazyfs).
            storage_filesystem=lazyfs.for_ray(plan.storage_uri, root.filesystem),
            # relaytrain's InPlacePolicy decides (restart_limits); a failure it does not
            # restart in place ends the attempt, and Prefect's retry resumes it.
            failure_config=FailureConfig(max_failures=0, max_preemption_failures=0),
            # relaytrain applies retention itself (keep last + best, never the resume point);
            # a user's own loop relies on Ray's checkpoint manager.
            checkpoint_config=CheckpointConfig(
                num_to_keep=spec.checkpoint.keep_last if user_loop else None
            ),
        ),
    )
    trainer.storage_credentials = credentials
    trainer.restart_limits = restart_limits(spec)
    trainer.watch_preemption = worker_config.watch_preemption
    trainer.relay = relay
    return trainer


def _ray_datasets(spec: RunSpec, credentials: list[Any]) -> dict[str, Any]:
    """``spec.datasets`` as Ray Train's ``datasets``: each read by Ray Data when the worker
    group starts (in the controller, which has the credentials), its files through a
    filesystem that sets them in every read task first."""
    from trainer_core.controller import apply_credentials

    found = {}
    for name, uri in spec.datasets.items():
        location = storage.resolve(uri)
        filesystem = lazyfs.for_tasks(
            uri, location.filesystem, functools.partial(apply_credentials, credentials)
        )
        found[name] = functools.partial(_read_parquet, location.path, filesystem)
    return found


def _read_parquet(path: str, filesystem: Any) -> Any:
    import ray.data

    return ray.data.read_parquet(path, filesystem=filesystem)


def _fit(spec: RunSpec, plan: Plan, handle: EventHandler, poll_interval_s: float) -> None:
    """Run fit() in a thread and relay events here; an interrupt stops the worker group.

    Cancellation (Prefect's TerminationSignal, KeyboardInterrupt) arrives in this thread as a
    BaseException: the ``finally`` aborts Ray Train's controller, which stops every worker.
    """
    from trainer_core.controller import MetricsRelay

    # The relay is the driver's mailbox: it lives on the driver's node, never on a worker node
    # that may be the one being lost (a retry right after a node death could land there).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    relay = MetricsRelay.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]
    trainer = _trainer(spec, plan, relay)
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name=f"relaytrain-fit-{plan.run_name}", daemon=True)
    thread.start()
    finished = False
    try:
        while thread.is_alive():
            thread.join(poll_interval_s)
            for event in ray.get(relay.drain.remote()):
                handle(event)
        for event in ray.get(relay.drain.remote()):
            handle(event)
        finished = True
    finally:
        if not finished:
            logger.warning("interrupted: stopping the Ray Train worker group of %s", plan.run_name)
            trainer.abort()
            thread.join(30)
        with contextlib.suppress(Exception):
            ray.kill(relay)
    if "error" in outcome:
        raise outcome["error"]
