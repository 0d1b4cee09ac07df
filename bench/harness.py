"""How a benchmark runs a spec: one shared local Ray cluster and Prefect API per benchmark
process, the stores it writes to (a local directory, a moto S3 server), and the ways to train
(the full flow, one engine attempt, a bare ``TorchTrainer.fit()``).

Every relaytrain variant runs ``bench.probe.probed_builtin_loop`` (the built-in loop with step
timestamps): ``probed`` swaps it in for the engine's loop while a flow or attempt runs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from unittest import mock

from bench.probe import PROBE_DIR_ENV, probed_builtin_loop
from trainer_core.spec.run_spec import RunSpec

#: Logical CPUs of the benchmark's Ray cluster: two 1-CPU workers plus room (as the tests use).
RAY_NUM_CPUS = 4


@contextlib.contextmanager
def local_ray(num_cpus: int = RAY_NUM_CPUS, dashboard: bool = False) -> Iterator[dict[str, Any]]:
    """A new local Ray cluster for this process, with relaytrain's Ray Train settings and the
    probe directory in the environment (workers inherit both). Yields what it set up.
    ``dashboard``: with Ray's dashboard, whose State API Ray Train V2's placement group cleaner
    asks whether a controller still lives (without it, a controller killed from outside, as
    Ray Tune kills a stopped trial's, leaves its worker group's placement group behind)."""
    import ray

    from trainer_core.execution.cluster import apply_ray_env_defaults

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    apply_ray_env_defaults()  # the same Ray settings for every variant, relaytrain's or not
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-probe-") as probe_dir:
        os.environ[PROBE_DIR_ENV] = probe_dir
        started = time.perf_counter()
        ray.init(
            address="local", num_cpus=num_cpus, include_dashboard=dashboard, log_to_driver=False
        )
        try:
            yield {
                "ray_num_cpus": num_cpus,
                "ray_dashboard": dashboard,
                "ray_start_s": round(time.perf_counter() - started, 2),
                "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ[
                    "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
                ],
            }
        finally:
            ray.shutdown()
            os.environ.pop(PROBE_DIR_ENV, None)


@contextlib.contextmanager
def prefect_api() -> Iterator[dict[str, Any]]:
    """``PREFECT_API_URL`` when set (a real server), else Prefect's temporary local API (the
    test harness: a subprocess server on a throwaway SQLite database, as the embedded API is)."""
    if os.environ.get("PREFECT_API_URL"):
        yield {"prefect_api": "server at PREFECT_API_URL"}
        return
    from prefect.testing.utilities import prefect_test_harness

    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    started = time.perf_counter()
    with prefect_test_harness(server_startup_timeout=120):
        yield {
            "prefect_api": "temporary local API (prefect_test_harness)",
            "prefect_api_start_s": round(time.perf_counter() - started, 2),
        }


@contextlib.contextmanager
def session(
    *, prefect: bool = False, prefix: str = "relaytrain-bench-"
) -> Iterator[tuple[Path, dict[str, Any]]]:
    """A local Ray cluster (``local_ray``), with ``prefect`` a Prefect API (``prefect_api``),
    and a scratch directory; yields the directory and what was set up, for the settings."""
    api = prefect_api() if prefect else contextlib.nullcontext({})
    with (
        local_ray() as ray_info,
        api as api_info,
        tempfile.TemporaryDirectory(prefix=prefix) as tmp,
    ):
        yield Path(tmp), {**ray_info, **api_info}


@contextlib.contextmanager
def stores(
    names: list[str], scratch: Path, *, s3_prefix: str, local_dir: str = "local"
) -> Iterator[dict[str, str]]:
    """The URI under which each store asked for keeps its files: ``local``, ``scratch /
    local_dir``; ``s3``, ``s3_prefix`` on a moto server started for the benchmark (its
    credentials in the environment while inside, for this process and those it starts)."""
    with contextlib.ExitStack() as stack:
        found = {}
        for name in names:
            if name == "local":
                found[name] = str(scratch / local_dir)
            elif name == "s3":
                from tests.s3 import moto_s3

                server = stack.enter_context(moto_s3(scratch))
                stack.enter_context(env(**server.credential_env()))
                found[name] = server.uri(s3_prefix)
            else:
                raise SystemExit(f"unknown store {name!r}: use local and/or s3")
        yield found


@contextlib.contextmanager
def probed() -> Iterator[None]:
    """While inside, the engine trains with the probed built-in loop."""
    from trainer_core.run import engine

    with mock.patch.object(engine, "builtin_train_loop", probed_builtin_loop):
        yield


def run_flow(spec: RunSpec) -> Any:
    """The full ``training`` flow (setup -> train -> finalize); its TrainingResult."""
    from flows.training import training

    with probed():
        state = training(spec, return_state=True)
    if not state.is_completed():
        raise RuntimeError(f"flow of {spec.run.name} ended {state.type.value}: {state.message}")
    return state.result()


def run_engine(spec: RunSpec, **kwargs: Any) -> tuple[Any, list[dict[str, Any]]]:
    """One ``engine.run_attempt`` (no Prefect); its result and the events it relayed."""
    from trainer_core.run import engine

    events: list[dict[str, Any]] = []
    with probed():
        result = engine.run_attempt(spec, on_event=events.append, **kwargs)
    return result, events


def finished_timings(events: list[dict[str, Any]]) -> dict[str, float]:
    """Rank 0's phase timings from the ``finished`` event of an attempt."""
    for event in reversed(events):
        if event["kind"] == "finished":
            return dict(event.get("timings") or {})
    return {}


def checkpoint_timings(spec: RunSpec) -> tuple[dict[str, float], int]:
    """One engine attempt of ``spec``: rank 0's timings and how many checkpoints they cover."""
    _, events = run_engine(spec)
    timings = finished_timings(events)
    count = int(timings.get("num_checkpoints") or 0)
    if not count:
        raise RuntimeError(f"{spec.run.name}: the loop reported no checkpoint timings")
    return timings, count


def bare_trainer(
    spec: RunSpec,
    *,
    loop: Callable[[dict[str, Any]], None] = probed_builtin_loop,
    loop_config: dict[str, Any] | None = None,
    max_failures: int = 0,
    num_to_keep: int | None = None,
) -> Any:
    """A plain ``ray.train.torch.TorchTrainer`` built as ``engine._trainer`` builds it, minus
    the flow, the preflight, the metrics relay, the attempt records and the abortable
    controller. By default it runs relaytrain's built-in loop (``WorkerConfig`` of attempt 1,
    fresh start); ``loop``/``loop_config`` run another one."""
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.train.v2.api.config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig

    from trainer_core import storage
    from trainer_core.execution.worker_config import WorkerConfig
    from trainer_core.run.plan import canonical_storage_uri

    assert spec.run.name is not None
    storage_uri = canonical_storage_uri(spec.run.storage)
    root = storage.resolve(storage_uri)
    if loop_config is None:
        loop_config = WorkerConfig(
            spec=spec.model_dump(mode="json"),
            storage_uri=storage_uri,
            run_name=spec.run.name,
            attempt=1,
            candidates=[],
            relay=None,
        ).to_dict()
    # Train V2's config classes (what ray.train exports at run time; type checkers see V1's).
    trainer_class: Any = TorchTrainer
    return trainer_class(
        train_loop_per_worker=loop,
        train_loop_config=loop_config,
        torch_config=TorchConfig(backend="gloo"),
        scaling_config=ScalingConfig(
            num_workers=spec.scaling.num_workers,
            use_gpu=False,
            resources_per_worker=spec.scaling.resources_per_worker,
            placement_strategy=spec.scaling.placement_strategy,
        ),
        run_config=RunConfig(
            name=spec.run.name,
            storage_path=root.path,
            storage_filesystem=root.filesystem,
            failure_config=FailureConfig(max_failures=max_failures, max_preemption_failures=0),
            checkpoint_config=CheckpointConfig(num_to_keep=num_to_keep),
        ),
    )


def remove_run(spec: RunSpec) -> None:
    """Delete the run directory of ``spec`` on local storage (keeps /tmp small)."""
    assert spec.run.name is not None
    shutil.rmtree(Path(spec.run.storage) / spec.run.name, ignore_errors=True)


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    """Set environment variables while inside (restored after)."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
