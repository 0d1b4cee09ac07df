"""Ray Train's side of one attempt: the TorchTrainer relaytrain builds (its controller, failure
and scaling policies, the storage credentials), and ``fit``, which runs it in a thread and relays
the workers' events to the caller while it runs."""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from collections.abc import Callable
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from trainer_core import storage
from trainer_core.execution.cluster import (
    PREEMPTION_WATCHER_ENV,
    apply_ray_env_defaults,
    watches_preemption,
)
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage import lazyfs

logger = logging.getLogger("relaytrain.engine")

EventHandler = Callable[[dict[str, Any]], None]
#: A Ray Train ``train_loop_per_worker``: the built-in loop, or the wrapper of a user's own.
TrainLoop = Callable[[dict[str, Any]], None]


def _abortable_trainer_class() -> type:
    """TorchTrainer that keeps its controller's handle, so an interrupted driver can stop it,
    and starts none of Ray's helper actors that relaytrain has no use for.

    Ray 2.60 keeps the handle local to ``_initialize_and_run_controller``; this mirrors that
    method (Ray is pinned exactly) minus the SIGINT handler, which cannot be installed off the
    main thread anyway. Each helper actor is a process start (about 2 s of CPU on 2 cores,
    contending with the workers' own start), paid again by every attempt and in-place restart.
    What the controller unpickles comes from ``trainer_core.execution.controller``, which
    imports no torch.
    Ray's placement-group cleaner (a detached actor per fit) is replaced by the driver's own
    cleanup (``PlacementGroupsToDriver``, ``_remove_left_behind``).
    """
    from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
    from ray.train.torch import TorchTrainer
    from ray.train.v2._internal.callbacks.datasets import DatasetsCallback
    from ray.train.v2._internal.callbacks.placement_group_callback import (
        PlacementGroupCleanerCallback,
    )
    from ray.train.v2._internal.constants import (
        DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
        get_env_vars_to_propagate,
    )

    from trainer_core.execution.controller import (
        CredentialedController,
        CurrentCapacityPolicy,
        InPlacePolicy,
        PlacementGroupsToDriver,
    )

    class AbortableTorchTrainer(TorchTrainer):
        controller: Any = None
        #: The storage credentials as a Ray object, nested so Ray passes it by reference.
        storage_credentials: list[Any] = []
        #: In-place restarts allowed per budget (``restart_limits``), and the relay that hears
        #: of each.
        restart_limits: dict[str, int | None] = {}
        relay: Any = None
        #: Nodes reclaimed for preemption before this attempt (not its failures' cause).
        reclaimed_before: set[str] = set()
        #: Whether Ray's preemption watcher runs (``watches_preemption``).
        watch_preemption: bool = False

        def _create_default_callbacks(self) -> list[Any]:
            # Ray's datasets callback starts a DatasetManager actor for every worker group,
            # datasets or not; relaytrain's loops read their own data and pass none. Its
            # placement-group cleaner is the driver's job here (PlacementGroupsToDriver).
            callbacks = super()._create_default_callbacks()  # type: ignore[misc]  # V2 method
            unused = (PlacementGroupCleanerCallback,) + (
                () if self.datasets else (DatasetsCallback,)
            )
            kept = [c for c in callbacks if not isinstance(c, unused)]
            return [*kept, PlacementGroupsToDriver(self.relay)]

        def _initialize_and_run_controller(self, **controller_init_kwargs: Any) -> Any:
            env_vars = get_env_vars_to_propagate()
            env_vars.setdefault(
                RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR,
                DEFAULT_RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_VALUE,
            )
            env_vars[PREEMPTION_WATCHER_ENV] = "1" if self.watch_preemption else "0"
            # The controller sets these itself (Ray Train reads them when it uses them), not
            # through a runtime_env: an actor with a runtime_env of its own needs a new process,
            # one without takes an idle one of the job's (0.5-1 s sooner to the first step).
            controller_class = ray.remote(
                num_cpus=0,
                label_selector={
                    ray._raylet.RAY_NODE_ID_KEY: ray.get_runtime_context().get_node_id()  # type: ignore[attr-defined]
                },
            )(CredentialedController)
            controller_init_kwargs["scaling_policy"] = CurrentCapacityPolicy.replacing(
                controller_init_kwargs["scaling_policy"]
            )
            controller_init_kwargs["failure_policy"] = InPlacePolicy(
                controller_init_kwargs["failure_policy"].failure_config,
                self.restart_limits,
                self.relay,
                self.reclaimed_before,
            )
            self.controller = controller_class.remote(
                environment=env_vars,
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
    worker_config = WorkerConfig(
        spec=spec.model_dump(mode="json"),
        storage_uri=plan.storage_uri,
        run_name=plan.run_name,
        attempt=plan.attempt,
        candidates=plan.candidates,
        relay=relay,
        watch_preemption=watches_preemption(),
        dataset=plan.dataset,
        lease_owner=plan.lease_owner,
    )
    user_loop = spec.train_loop is not None
    # A running Ray cluster does not see this process's environment, so the controller and
    # workers get the storage credentials (environment or run.credentials' block) explicitly:
    # as a Ray object in memory, not a runtime_env, because Ray's runtime env agent logs every
    # runtime env it creates, values included (logs/runtime_env_agent.log), and Ray Train keeps
    # the worker runtime env in its run state (dashboard, export events).
    credentials = [ray.put(storage.credential_env())]
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
    from trainer_core.execution.controller import apply_credentials

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


def fit(
    spec: RunSpec,
    plan: Any,
    loop: TrainLoop,
    handle: EventHandler,
    poll_interval_s: float,
    reclaimed_before: set[str],
    lost: Callable[[], BaseException | None] | None = None,
) -> None:
    """Run ``loop`` on a worker group for the attempt ``plan`` (an ``engine.Plan``): fit() in a
    thread, the workers' events relayed to ``handle`` here; an interrupt stops the worker group.
    ``reclaimed_before``: the nodes reclaimed for preemption before the attempt (not the cause
    of its failures). ``lost()``: an error once the run's lease is lost; the worker group is
    stopped and it is raised.

    Cancellation (Prefect's TerminationSignal, KeyboardInterrupt) arrives in this thread as a
    BaseException: the ``finally`` aborts Ray Train's controller, which stops every worker.
    """
    from trainer_core.execution.controller import PLACEMENT_GROUP_EVENT, MetricsRelay

    # The relay is the driver's mailbox: it lives on the driver's node, never on a worker node
    # that may be the one being lost (a retry right after a node death could land there).
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    relay = MetricsRelay.options(scheduling_strategy=here).remote()  # type: ignore[attr-defined]
    trainer = _trainer(spec, plan, loop, relay)
    trainer.reclaimed_before = reclaimed_before
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = trainer.fit()
        except BaseException as e:  # re-raised in the caller's thread
            outcome["error"] = e

    thread = threading.Thread(target=target, name=f"relaytrain-fit-{plan.run_name}", daemon=True)
    placement_groups: list[Any] = []

    def relay_events() -> None:
        for event in ray.get(relay.drain.remote()):
            if event["kind"] == PLACEMENT_GROUP_EVENT:
                placement_groups.append(event["placement_group"])
            else:
                handle(event)

    thread.start()
    finished = False
    try:
        while thread.is_alive():
            thread.join(poll_interval_s)
            relay_events()
            error = lost() if lost is not None else None
            if error is not None:
                raise error
        relay_events()
        finished = True
    finally:
        if not finished:
            logger.warning("interrupted: stopping the Ray Train worker group of %s", plan.run_name)
            trainer.abort()
            thread.join(30)
            with contextlib.suppress(Exception):
                relay_events()
        _remove_left_behind(placement_groups)
        with contextlib.suppress(Exception):
            ray.kill(relay)
    if "error" in outcome:
        raise outcome["error"]


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
