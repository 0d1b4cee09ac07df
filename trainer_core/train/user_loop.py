"""Run a user's own Ray Train loop unchanged, with relaytrain's faults, metrics and history."""

from __future__ import annotations

import logging
import posixpath
import time
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from trainer_core.checkpoint.history import write_metrics_segment
from trainer_core.checkpoint.ray_checkpoints import (
    REPORT_FILE,
    add_file,
    read_report_record,
    report_record,
)
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import (
    InjectedFault,
    RelaytrainError,
    SpecError,
    TrainingCodeError,
)
from trainer_core.execution import worker_api
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.execution.worker_group import Relay, all_reduce, peak_rss_mb
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import workloads
from trainer_core.train.failure import worker_error
from trainer_core.train.faults import Faults
from trainer_core.train.loop_rng import LoopRng
from trainer_core.train.rank_output import rank_output
from trainer_core.train.ray_loop_data import LoopData, bound

logger = logging.getLogger("relaytrain.user_loop")


class ReportHook:
    """Wraps ``ray.train.report`` around a user's loop: faults, relayed and persisted metrics.

    Reports are numbered across the run's attempts: a resumed attempt goes on from the number
    its checkpoint's report record holds (``resume``). Each report's history key (``step``) is
    its ``step`` metric, else that number; a checkpoint the loop passes gets the record
    (``ray_checkpoints.REPORT_FILE``) before Ray uploads it, and the lowest such rank's gets
    every rank's RNG states (``loop_rng``). Faults fire at the run's N-th report.
    """

    def __init__(self, config: WorkerConfig, original: Callable[..., Any]):
        self.rank, _ = worker_api.rank_and_world_size()
        self.original = original
        self.config = config
        self.spec = RunSpec.model_validate(config.spec)
        self.faults = Faults(list(self.spec.faults), config.attempt, self.rank)
        self.relay = Relay(config.relay, self.rank, config.marks, config.earlier_marks)
        self.run_dir = RunDirectory.of(config.storage_uri, config.run_name)
        #: The run's reports so far, and the history key of the last one (known once reported,
        #: or resumed from a report record).
        self.reports = 0
        self.step = 0
        self.step_known = False
        self.unsaved: list[dict[str, Any]] = []
        world_size = worker_api.rank_and_world_size()[1]
        self.rng = LoopRng(self.rank, world_size, self._tell_rng)
        #: Where the loop's ``ray_loop_data.dataloader`` stands, saved beside the RNG states.
        self.data = LoopData(self.spec.run.seed, self.rank, world_size, worker_api.device())

    def _tell_rng(self, exact: bool, note: str | None) -> None:
        self.relay.send("resume_rng", exact=exact, note=note, group=self.faults.group)

    def read_back(self, checkpoint: Any) -> None:
        """The loop read ``checkpoint`` (``ray.train.get_checkpoint()``)."""
        self.data.restore(checkpoint)
        self.rng.restore(checkpoint)

    def resume(self, record: dict[str, Any] | None) -> None:
        """Go on counting from the report record of the checkpoint Ray resumed the loop from."""
        if record is not None:
            self.reports, self.step = int(record["report"]), int(record["step"])
            self.step_known = True

    def __call__(self, metrics: dict[str, Any], *args: Any, **kwargs: Any) -> Any:
        self.reports += 1
        self.faults.check(self.reports)
        step = user_step(metrics, self.reports)
        if self.step_known and step <= self.step:
            raise SpecError(
                f"the train_loop reported step {step} after step {self.step} (report "
                f"{self.reports}): relaytrain keeps one history row per 'step', so a 'step' that "
                "does not grow would merge reports into one without a word. Report a counter "
                "that grows with every report (the optimizer step), or leave 'step' out of the "
                "metrics to number the reports",
                field="train_loop",
            )
        row = {k: v for k, v in (metrics or {}).items() if isinstance(v, int | float | str)}
        row.update(step=step, attempt=self.config.attempt, time=time.time())
        self.unsaved.append(row)
        checkpoint = kwargs.get("checkpoint") or (args[0] if args else None)
        if self.rng.save(checkpoint):  # every rank: a collective
            self.data.save(checkpoint)
        if checkpoint is not None:
            self._add_record(checkpoint, step, row)
            self.flush()  # the rows up to this report, before Ray registers its checkpoint
        self.relay.send("metrics", rows=[row])
        result = self.original(metrics, *args, **kwargs)
        self.step, self.step_known = step, True
        self.relay.completed(step)
        if self.rank == 0 and checkpoint is not None:
            self.relay.send("checkpoint", step=step, metrics=row)
            self.relay.send("memory", peak_worker_rss_mb=round(peak_rss_mb(), 1))  # rank 0's
        return result

    def flush(self) -> None:
        if self.rank == 0 and self.unsaved:
            write_metrics_segment(self.run_dir, self.config.attempt, self.unsaved)
        self.unsaved = []

    def _add_record(self, checkpoint: Any, step: int, row: dict[str, Any]) -> None:
        """Put the report record into the directory the loop hands Ray (its own filesystem's)."""
        metrics = {k: v for k, v in row.items() if k not in ("attempt", "time")}
        data = report_record(step, self.reports, self.config.attempt, metrics)
        add_file(
            checkpoint,
            REPORT_FILE,
            data,
            f"a resume from report {self.reports} restarts the report count, and the result "
            "does not list it",
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
    with (
        worker_api.reports_through(lambda report: ReportHook(worker_config, report)) as hook,
        worker_api.checkpoint_reads_through(hook.read_back),
        rank_output(hook.relay),  # what the loop prints, to the driver's log
        bound(hook.data),  # what ray_loop_data.dataloader() reads for
    ):
        fn = workloads.resolve_train_loop(spec.train_loop)
        group = _start(hook)
        # The loop's own reads of its checkpoint restore its RNG and its loader's position
        hook.rng.armed = hook.data.armed = True
        try:
            workloads.call_train_loop(fn, spec.train_loop_config)
        except Exception as e:
            error = loop_error(e, hook.reports, hook.rank)
            _tell_driver(hook, error, group)
            if error is e:
                raise
            raise error from e
        hook.flush()
        hook.relay.send("memory", peak_worker_rss_mb=round(peak_rss_mb(), 1))
        hook.relay.finished(step=hook.step, metrics={})


def loop_error(error: Exception, report: int, rank: int) -> Exception:
    """What an exception out of a user's loop means to the orchestrator: relaytrain's own errors
    stay as they are; a collective that lost a peer (``is_peer_failure``: another rank died,
    hung or was cut off) is the infrastructure's; anything else, an injected fault included, is
    the loop's code's. ``report``: the run's report the loop was at."""
    if isinstance(error, RelaytrainError):
        return error
    if isinstance(error, InjectedFault):
        return TrainingCodeError(str(error), error_type="InjectedFault", step=report, rank=rank)
    return worker_error(error, where=f"after report {report}", step=report, rank=rank)


def _start(hook: ReportHook) -> int:
    """Which worker group of the attempt this is (0: the first; n after the n-th in-place
    restart: rank 0 asks the driver, the others learn it from rank 0), where it starts from
    (Ray's newest checkpoint and its report record), told to the driver. Returns the group."""
    group = float(hook.relay.begin_group())
    if dist.is_available() and dist.is_initialized():
        group = all_reduce([group])[0]  # the other ranks add 0
    hook.relay.joined(int(group))
    hook.faults.group = int(group)
    world_size = worker_api.rank_and_world_size()[1]
    resumed = worker_api.latest_checkpoint_path()
    if resumed is None:
        hook.relay.send("fresh_start", skipped=[], world_size=world_size, group=int(group))
        return int(group)
    record = read_report_record(hook.run_dir, posixpath.basename(resumed.rstrip("/")))
    hook.resume(record)
    hook.rng.resumed_from = resumed
    hook.data.pending = True
    hook.relay.send(
        "resumed",
        checkpoint_uri=resumed,
        # None: unknown (a checkpoint without a record), so nothing is rewound.
        step=hook.step if record is not None else None,
        skipped=[],
        world_size=world_size,
        group=int(group),
    )
    return int(group)


def _tell_driver(hook: ReportHook, error: Exception, group: int) -> None:
    """Before a failure ends the worker: the rows rank 0 holds back, and the last report this
    rank completed (rank 0's rows lag it, and say nothing when rank 0 is the one that died)."""
    try:
        hook.relay.flush()
        if hook.reports:
            hook.relay.tell_last_step(hook.step, group)
    except Exception:  # the relay is best effort; the error being raised matters more
        logger.debug("relay flush failed", exc_info=True)
