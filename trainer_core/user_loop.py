"""Run a user's own Ray Train loop unchanged, with relaytrain's faults, metrics and history."""

from __future__ import annotations

import inspect
import time
import traceback
from collections.abc import Callable
from typing import Any

from trainer_core import workloads
from trainer_core.checkpoints import RunDirectory
from trainer_core.errors import (
    InjectedFault,
    RelaytrainError,
    TrainingCodeError,
)
from trainer_core.execution import worker_api
from trainer_core.spec import RunSpec
from trainer_core.worker import Faults, Relay, peak_rss_mb
from trainer_core.worker_config import WorkerConfig


class ReportHook:
    """Wraps ``ray.train.report`` around a user's loop: faults, relayed and persisted metrics.

    Fault steps count ``report`` calls in this attempt; history rows are keyed by ``user_step``.
    """

    def __init__(self, config: WorkerConfig, original: Callable[..., Any]):
        self.rank, _ = worker_api.rank_and_world_size()
        self.original = original
        self.config = config
        self.spec = RunSpec.model_validate(config.spec)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.relay = Relay(config.relay, self.rank)
        self.run_dir = RunDirectory.of(config.storage_uri, config.run_name)
        self.calls = 0
        self.unsaved: list[dict[str, Any]] = []

    def __call__(self, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        self.faults.check(self.calls)
        step = user_step(metrics, self.calls)
        row = {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float | str)}
        row.update(step=step, attempt=self.config.attempt, time=time.time())
        self.unsaved.append(row)
        self.relay.send("metrics", rows=[row])
        result = self.original(metrics, *args, **kwargs)
        checkpoint = kwargs.get("checkpoint") or (args[0] if args else None)
        if self.rank == 0 and checkpoint is not None:
            self.flush()
            self.relay.send("checkpoint", step=step, metrics=row)
            self.relay.send("memory", peak_worker_rss_mb=round(peak_rss_mb(), 1))  # rank 0's
        return result

    def flush(self) -> None:
        if self.rank == 0 and self.unsaved:
            self.run_dir.write_metrics_segment(self.config.attempt, self.unsaved)
        self.unsaved = []


def user_step(metrics: Any, calls: int) -> int:
    """The history key of a user loop's report: its ``step`` metric, else ``epoch + 1`` (epochs
    done), else the report count in this attempt (which restarts after a resume)."""
    if isinstance(metrics, dict):
        if isinstance(metrics.get("step"), int | float):
            return int(metrics["step"])
        if isinstance(metrics.get("epoch"), int | float):
            return int(metrics["epoch"]) + 1
    return calls


def user_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` that runs a user's own loop unchanged."""
    worker_config = WorkerConfig.from_dict(config)
    spec = RunSpec.model_validate(worker_config.spec)
    assert spec.train_loop is not None
    with worker_api.reports_through(lambda report: ReportHook(worker_config, report)) as hook:
        fn = workloads.resolve_train_loop(spec.train_loop)
        resumed = worker_api.latest_checkpoint_path()
        hook.relay.send(
            "resumed" if resumed else "fresh_start",
            checkpoint_uri=resumed,
            skipped=[],
            world_size=worker_api.rank_and_world_size()[1],
        )
        try:
            if _takes_config(fn):
                fn(dict(spec.train_loop_config))
            else:
                fn()
        except (RelaytrainError, InjectedFault) as e:
            if isinstance(e, InjectedFault):
                raise TrainingCodeError(
                    str(e), error_type="InjectedFault", step=hook.calls, rank=hook.rank
                ) from e
            raise
        except Exception as e:
            raise TrainingCodeError(
                f"{type(e).__name__}: {e}",
                error_type=type(e).__name__,
                step=hook.calls,
                rank=hook.rank,
                traceback="".join(traceback.format_exception(e)),
            ) from e
        hook.flush()
        hook.relay.send("memory", peak_worker_rss_mb=round(peak_rss_mb(), 1))
        hook.relay.send("finished", step=hook.calls, metrics={})


def _takes_config(fn: Callable[..., Any]) -> bool:
    return len(inspect.signature(fn).parameters) >= 1
