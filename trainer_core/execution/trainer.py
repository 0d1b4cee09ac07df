"""Ray Train's side of one attempt: the TorchTrainer relaytrain builds (its controller, failure
and scaling policies, the storage credentials), and ``fit``, which runs it in a thread and relays
the workers' events to the caller while it runs."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainer_core import storage
from trainer_core.errors import ClusterBusyError, InfrastructureError
from trainer_core.execution import ray_head
from trainer_core.execution.capacity import Fits
from trainer_core.execution.classify import group_never_started
from trainer_core.execution.cluster import (
    apply_ray_env_defaults,
    capacity,
    group_needs,
    held_by_other_work,
    short_of,
    watches_preemption,
)
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage import lazyfs

logger = logging.getLogger("relaytrain.engine")

EventHandler = Callable[[dict[str, Any]], None]
#: A Ray Train ``train_loop_per_worker``: the built-in loop, or the wrapper of a user's own.
TrainLoop = Callable[[dict[str, Any]], None]


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


def _with_credentials(train_loop: Callable[[Any], None], credentials: list[Any]) -> Any:
    """``train_loop`` that first sets the storage credentials in the worker's environment."""
    from trainer_core.execution.controller import apply_credentials

    def train_loop_with_credentials(config: Any) -> None:
        apply_credentials(credentials)
        train_loop(config)

    return train_loop_with_credentials


def _trainer(spec: RunSpec, plan: Any, loop: TrainLoop, relay: Any) -> Any:
    # Train V2's config classes (what ray.train exports at run time; type checkers see V1's).
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from trainer_core.execution.controller import ProcessGroupConfig

    apply_ray_env_defaults()
    root = storage.resolve(plan.storage_uri)
    worker_config = _worker_config(spec, plan, relay)
    user_loop = spec.ray_loop  # Ray checkpoints it
    # A running Ray cluster does not see this process's environment, so the controller and
    # workers get the storage credentials (environment or run.credentials' block) explicitly:
    # as a Ray object in memory, not a runtime_env, because Ray's runtime env agent logs every
    # runtime env it creates, values included (logs/runtime_env_agent.log), and Ray Train keeps
    # the worker runtime env in its run state (dashboard, export events).
    credentials = [ray.put(storage.credential_env())]
    from trainer_core.execution.ray_trainer import AbortableTorchTrainer

    # Typed as Ray's V1 TorchTrainer (type checkers see V1's config classes, not V2's).
    trainer_class: Any = AbortableTorchTrainer
    trainer = trainer_class(
        datasets=_ray_datasets(spec, plan.ray_datasets, credentials),
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


def _worker_config(spec: RunSpec, plan: Any, relay: Any) -> WorkerConfig:
    """What every worker of the attempt ``plan`` is handed."""
    return WorkerConfig(
        spec=spec.model_dump(mode="json"),
        storage_uri=plan.storage_uri,
        run_name=plan.run_name,
        attempt=plan.attempt,
        candidates=plan.candidates,
        relay=relay,
        watch_preemption=watches_preemption(),
        dataset=plan.dataset,
        lease_owner=plan.lease_owner,
        marks=plan.marks,
        earlier_marks=plan.earlier_marks,
        until_epoch=plan.until_epoch,
    )


def _ray_datasets(
    spec: RunSpec, pinned_files: dict[str, list[str]] | None, credentials: list[Any]
) -> dict[str, Any]:
    """``spec.datasets`` as Ray Train's ``datasets``: each read by Ray Data when the worker
    group starts (in the controller, which has the credentials) from the files the run's
    snapshot pinned (``pinned_files``, by name: ``run.preflight.PinnedTables.files``), through
    a filesystem that sets the credentials in every read task first."""
    from trainer_core.execution.controller import apply_credentials

    if not spec.datasets:
        return {}
    assert pinned_files is not None, "an attempt's preflight pins its datasets"
    found = {}
    for name, uri in spec.datasets.items():
        location = storage.resolve(uri)
        filesystem = lazyfs.for_tasks(
            uri, location.filesystem, functools.partial(apply_credentials, credentials)
        )
        found[name] = functools.partial(_read_parquet, pinned_files[name], filesystem)
    return found


def _read_parquet(files: list[str], filesystem: Any) -> Any:
    """Exactly ``files``: no listing (a file added to the table since its snapshot is not
    read) and no filter by suffix (the snapshot checked that every one is Parquet)."""
    import ray.data

    return ray.data.read_parquet(files, filesystem=filesystem, file_extensions=None)


def fit(
    spec: RunSpec,
    plan: Any,
    loop: TrainLoop,
    handle: EventHandler,
    poll_interval_s: float,
    reclaimed_before: set[str],
    lost: Callable[[], BaseException | None] | None = None,
) -> None:
    """Run ``loop`` on a worker group for the attempt ``plan`` (a ``run.plan.Plan``): fit() in a
    thread, the workers' events relayed to ``handle`` here; an interrupt stops the worker group.
    ``reclaimed_before``: the nodes reclaimed for preemption before the attempt (not the cause
    of its failures). ``lost()``: an error once the run's lease is lost; the worker group is
    stopped and it is raised.

    Cancellation (Prefect's TerminationSignal, KeyboardInterrupt) arrives in this thread as a
    BaseException: the ``finally`` aborts Ray Train's controller, which stops every worker.
    """
    from trainer_core.execution.controller import MetricsRelay

    _say_if_busy(spec, handle)
    # The relay is the driver's mailbox: it lives on the driver's node, never on a worker node
    # that may be the one being lost (a retry right after a node death could land there).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    relay = MetricsRelay.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]
    trainer = _trainer(spec, plan, loop, relay)
    trainer.reclaimed_before = reclaimed_before
    # An elastic run sizes its group to what the cluster has free, again when one cannot start.
    wait_s = 0.0 if spec.scaling.elastic else spec.scaling.wait_for_resources_s
    trainer.first_group_wait_s = wait_s or None
    fitting = _Fitting(trainer, relay, handle, plan.run_name)
    began = time.monotonic()
    try:
        fitting.run(poll_interval_s, lost)
    except Exception as error:
        # Only a wait that ran to its bound on a cluster still busy: a group the cluster has
        # room for, or lacks the nodes for, failed at Ray's start timeout as any failure of
        # the cluster (a wait_for_resources_s under Ray's timeout must not rename that).
        waited_out = wait_s and time.monotonic() - began >= wait_s
        never_started = not fitting.group_began and group_never_started(error)
        short_now = capacity(spec) if waited_out and never_started else Fits()
        if not isinstance(short_now, Fits):  # nodes, not other runs: the cluster failed
            raise InfrastructureError(
                f"the Ray cluster stayed short of nodes: the worker group could not start "
                f"within scaling.wait_for_resources_s={wait_s:g} s ({short_now.reason}). Add "
                "nodes (or let its autoscaler add them), or raise the wait; retried on the "
                "infrastructure budget, the run resumes from its newest checkpoint"
            ) from error
        if waited_out and never_started and held_by_other_work(group_needs(spec)):
            raise ClusterBusyError(
                f"the Ray cluster stayed busy: the worker group could not start within "
                f"scaling.wait_for_resources_s={wait_s:g} s (now {short_of(spec)}). Raise it, "
                "run fewer runs at once on this cluster, or add nodes; started again, the run "
                "resumes from its newest checkpoint"
            ) from error
        raise


def _say_if_busy(spec: RunSpec, handle: EventHandler) -> None:
    """When the group does not fit now, say why and how long it waits
    (``scaling.wait_for_resources_s``): for nodes, where the live ones cannot hold it (a node
    lost, an autoscaling cluster that starts its workers when asked), or for other work to free
    what it holds (a busy cluster, Ray's queue). With a wait of 0, fail at once: short of nodes
    on the infrastructure budget, busy not retried. Not for an elastic run, which sizes its
    group to what the cluster has free."""
    if spec.scaling.elastic:
        return
    wait_s = spec.scaling.wait_for_resources_s
    decision = capacity(spec)
    if not isinstance(decision, Fits):
        if wait_s == 0:
            raise InfrastructureError(
                f"the Ray cluster is short of nodes ({decision.reason}) and "
                "scaling.wait_for_resources_s=0 says not to wait: raise it, or add nodes"
            )
        logger.warning(
            "waiting for nodes: %s; the worker group waits up to %g s "
            "(scaling.wait_for_resources_s) for the cluster to add them",
            decision.reason,
            wait_s,
        )
        event = {"kind": "waiting_for_nodes", "time": time.time(), "short": decision.reason}
        handle({**event, "wait_s": wait_s})
        return
    short = short_of(spec)
    if short is None:
        return
    if wait_s == 0:
        raise ClusterBusyError(
            f"the Ray cluster is busy ({short}) and scaling.wait_for_resources_s=0 says not to "
            "wait: raise it, run fewer runs at once on this cluster, or add nodes"
        )
    logger.warning(
        "the Ray cluster is busy (%s): waiting up to %g s (scaling.wait_for_resources_s) for "
        "other work to free it",
        short,
        wait_s,
    )
    handle({"kind": "waiting_for_resources", "time": time.time(), "short": short, "wait_s": wait_s})


class _Fitting:
    """``trainer.fit()`` in a thread, and the relay's events handed to ``handle`` while it
    runs (the placement groups its worker groups report are kept, to remove what is left)."""

    def __init__(self, trainer: Any, relay: Any, handle: EventHandler, run_name: str):
        self.trainer = trainer
        self.relay = relay
        self.handle = handle
        self.run_name = run_name
        self.outcome: dict[str, Any] = {}
        self.placement_groups: list[Any] = []
        #: Whether a worker group of the attempt began (an event of its start came).
        self.group_began = False
        self.thread = threading.Thread(
            target=self._fit, name=f"relaytrain-fit-{run_name}", daemon=True
        )

    def _fit(self) -> None:
        try:
            self.outcome["result"] = self.trainer.fit()
        except BaseException as e:  # re-raised in the caller's thread
            self.outcome["error"] = e

    def _relay_events(self) -> None:
        from trainer_core.execution.controller import PLACEMENT_GROUP_EVENT

        head_lost = ray_head.lost()
        if head_lost is not None:  # Ray was left: a call would start it anew
            raise InfrastructureError(head_lost)
        for event in ray.get(self.relay.drain.remote()):
            if event["kind"] == PLACEMENT_GROUP_EVENT:
                self.placement_groups.append(event["placement_group"])
            else:
                self.group_began = self.group_began or event["kind"] in ("fresh_start", "resumed")
                self.handle(event)

    def run(self, poll_interval_s: float, lost: Callable[[], BaseException | None] | None) -> None:
        """Fit, relaying events every ``poll_interval_s``; raise fit's error, or ``lost()``'s."""
        self.thread.start()
        finished = False
        try:
            while self.thread.is_alive():
                self.thread.join(poll_interval_s)
                self._relay_events()
                error = lost() if lost is not None else None
                if error is not None:
                    raise error
            self._relay_events()
            finished = True
        finally:
            self._end(finished)
        if "error" in self.outcome:
            raise self.outcome["error"]

    def _end(self, finished: bool) -> None:
        """Leave a lost head's cluster, else stop the group and remove what it left.

        The head is asked now even when fit() ended on its own: its group may have ended with
        the head, the watch not yet sure, and the clean-up's Ray calls would block on the silent
        GCS (they have no timeout of their own)."""
        ray_head.check_now()
        if ray_head.lost() is not None:
            # The cluster is gone and Ray left: nothing to stop, and a call would start Ray
            # anew. The fit thread's calls returned when Ray was left.
            self.thread.join(30)
        else:
            self._clean_up(finished)

    def _clean_up(self, finished: bool) -> None:
        """Stop the worker group unless fit() ended on its own; remove what it left."""
        if not finished:
            logger.warning("interrupted: stopping the Ray Train worker group of %s", self.run_name)
            self.trainer.abort()
            self.thread.join(30)
            with contextlib.suppress(Exception):
                self._relay_events()
        _remove_left_behind(self.placement_groups)
        with contextlib.suppress(Exception):
            ray.kill(self.relay)


def _remove_left_behind(placement_groups: list[Any]) -> None:
    """Remove the placement groups of this fit's worker groups that are still there: a controller
    that ends as it should removes its own, one that died (killed, out of memory) leaves it, and
    its CPUs would stay reserved until the driver exits, so a retry could never start."""
    from ray.util.placement_group import placement_group_table, remove_placement_group

    for group in placement_groups:
        try:
            if placement_group_table(group).get("state") in ("REMOVED", None):
                continue
            logger.warning("removing placement group %s that its controller left", group.id)
            remove_placement_group(group)
        except Exception as e:  # the cluster is going away too: nothing to hold a retry back
            logger.warning("could not remove placement group %s: %s", group.id, e)
