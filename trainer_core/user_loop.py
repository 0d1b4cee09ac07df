"""Run a user's own Ray Train loop unchanged, with relaytrain's faults, metrics and history."""

from __future__ import annotations

import inspect
import logging
import posixpath
import time
import traceback
from collections.abc import Callable
from typing import Any

from trainer_core import workloads
from trainer_core.checkpoints import REPORT_FILE, RunDirectory, report_record
from trainer_core.errors import (
    InjectedFault,
    RelaytrainError,
    TrainingCodeError,
)
from trainer_core.execution import worker_api
from trainer_core.spec import RunSpec
from trainer_core.worker import Faults, Relay, peak_rss_mb
from trainer_core.worker_config import WorkerConfig

logger = logging.getLogger("relaytrain.user_loop")


class ReportHook:
    """Wraps ``ray.train.report`` around a user's loop: faults, relayed and persisted metrics.

    Reports are numbered across the run's attempts: a resumed attempt goes on from the number
    its checkpoint's report record holds (``resume``). Each report's history key (``step``) is
    its ``step`` metric, else that number; a checkpoint the loop passes gets the record
    (``checkpoints.REPORT_FILE``) before Ray uploads it. Faults fire at the run's N-th report.
    """

    def __init__(self, config: WorkerConfig, original: Callable[..., Any]):
        self.rank, _ = worker_api.rank_and_world_size()
        self.original = original
        self.config = config
        self.spec = RunSpec.model_validate(config.spec)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.relay = Relay(config.relay, self.rank)
        self.run_dir = RunDirectory.of(config.storage_uri, config.run_name)
        #: The run's reports so far, and the history key of the last one.
        self.reports = 0
        self.step = 0
        self.unsaved: list[dict[str, Any]] = []

    def resume(self, record: dict[str, Any] | None) -> None:
        """Go on counting from the report record of the checkpoint Ray resumed the loop from."""
        if record is not None:
            self.reports, self.step = int(record["report"]), int(record["step"])

    def __call__(self, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.reports += 1
        self.faults.check(self.reports)
        step = user_step(metrics, self.reports)
        row = {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float | str)}
        row.update(step=step, attempt=self.config.attempt, time=time.time())
        self.unsaved.append(row)
        checkpoint = kwargs.get("checkpoint") or (args[0] if args else None)
        if checkpoint is not None:
            self._add_record(checkpoint, step, row)
            self.flush()  # the rows up to this report, before Ray registers its checkpoint
        self.relay.send("metrics", rows=[row])
        result = self.original(metrics, *args, **kwargs)
        self.step = step
        if self.rank == 0 and checkpoint is not None:
            self.relay.send("checkpoint", step=step, metrics=row)
            self.relay.send("memory", peak_worker_rss_mb=round(peak_rss_mb(), 1))  # rank 0's
        return result

    def flush(self) -> None:
        if self.rank == 0 and self.unsaved:
            self.run_dir.write_metrics_segment(self.config.attempt, self.unsaved)
        self.unsaved = []

    def _add_record(self, checkpoint: Any, step: int, row: dict[str, Any]) -> None:
        """Put the report record into the directory the loop hands Ray (its own filesystem's)."""
        metrics = {k: v for k, v in row.items() if k not in ("attempt", "time")}
        data = report_record(step, self.reports, self.config.attempt, metrics)
        try:
            path = posixpath.join(str(checkpoint.path), REPORT_FILE)
            with checkpoint.filesystem.open_output_stream(path) as stream:
                stream.write(data)
        except (OSError, AttributeError) as e:  # the checkpoint still goes to Ray
            logger.warning(
                "could not add %s to the checkpoint of report %d (%s): a resume from it "
                "restarts the report count, and the result does not list it",
                REPORT_FILE,
                self.reports,
                e,
            )


def user_step(metrics: Any, report: int) -> int:
    """The history key of a user loop's report: its ``step`` metric, else its number in the
    run (``report``, counted across attempts)."""
    if isinstance(metrics, dict) and isinstance(metrics.get("step"), int | float):
        return int(metrics["step"])
    return report


def user_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` that runs a user's own loop unchanged."""
    worker_config = WorkerConfig.from_dict(config)
    spec = RunSpec.model_validate(worker_config.spec)
    assert spec.train_loop is not None
    with worker_api.reports_through(lambda report: ReportHook(worker_config, report)) as hook:
        fn = workloads.resolve_train_loop(spec.train_loop)
        world_size = worker_api.rank_and_world_size()[1]
        resumed = worker_api.latest_checkpoint_path()
        if resumed is None:
            hook.relay.send("fresh_start", skipped=[], world_size=world_size)
        else:
            record = hook.run_dir.read_report_record(posixpath.basename(resumed.rstrip("/")))
            hook.resume(record)
            hook.relay.send(
                "resumed",
                checkpoint_uri=resumed,
                # None: unknown (a checkpoint without a record), so nothing is rewound.
                step=hook.step if record is not None else None,
                skipped=[],
                world_size=world_size,
            )
        try:
            if _takes_config(fn):
                fn(dict(spec.train_loop_config))
            else:
                fn()
        except (RelaytrainError, InjectedFault) as e:
            if isinstance(e, InjectedFault):
                raise TrainingCodeError(
                    str(e), error_type="InjectedFault", step=hook.reports, rank=hook.rank
                ) from e
            raise
        except Exception as e:
            raise TrainingCodeError(
                f"{type(e).__name__}: {e}",
                error_type=type(e).__name__,
                step=hook.reports,
                rank=hook.rank,
                traceback="".join(traceback.format_exception(e)),
            ) from e
        hook.flush()
        hook.relay.send("memory", peak_worker_rss_mb=round(peak_rss_mb(), 1))
        hook.relay.send("finished", step=hook.step, metrics={})


def _takes_config(fn: Callable[..., Any]) -> bool:
    return len(inspect.signature(fn).parameters) >= 1
