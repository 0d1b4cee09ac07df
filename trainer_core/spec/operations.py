"""How a run is carried out, as spec sections: the worker group (scaling), checkpoints, reports,
tracking, retries and injected faults."""

from __future__ import annotations

import warnings
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import (
    Field,
    PositiveFloat,
    field_validator,
    model_validator,
)

from trainer_core.spec.sections import (
    NonNegativeInt,
    PositiveInt,
    _Section,
)


class DDPSection(_Section):
    """Options of torch's ``DistributedDataParallel`` wrapper (``scaling.strategy: ddp``),
    passed to it as they are; each default is DDP's own."""

    #: Copy rank 0's buffers (batch norm's running statistics) to every rank before each
    #: forward. False for a model whose buffers differ by rank on purpose, or whose buffer
    #: broadcast fails (a buffer updated in place during the forward).
    broadcast_buffers: bool = True
    #: Find, after each forward, the parameters it did not use (a branch taken by some
    #: batches only), so their gradients do not hold up the all-reduce. Costs a graph walk.
    find_unused_parameters: bool = False
    #: The model's graph (which parameters are used, how often) is the same every step: DDP
    #: may then handle unused parameters and reentrant checkpointing itself.
    static_graph: bool = False

    def kwargs(self) -> dict[str, bool]:
        """What ``DistributedDataParallel`` is given: the options set otherwise than its
        defaults (torch 2.13 warns, on every rank, when ``broadcast_buffers`` is passed at
        all)."""
        default = DDPSection()
        return {
            key: getattr(self, key)
            for key in type(self).model_fields
            if getattr(self, key) != getattr(default, key)
        }

    def changed(self) -> list[str]:
        """The options that differ from DDP's defaults, as ``scaling.ddp.<key>``."""
        default = DDPSection()
        return [
            f"scaling.ddp.{key}"
            for key in type(self).model_fields
            if getattr(self, key) != getattr(default, key)
        ]


class ScalingSection(_Section):
    #: Workers in the group: a count, or ``[MIN, MAX]`` for elastic capacity (Ray Train's
    #: elastic scaling). An elastic run starts on as many workers as the cluster has free now
    #: (at least MIN; what other work holds is not counted), goes on with fewer after a node is
    #: lost, without waiting for it, and grows back when capacity returns or other work frees
    #: it; every resize resumes from the newest committed checkpoint.
    num_workers: PositiveInt | tuple[PositiveInt, PositiveInt]
    #: Elastic runs: seconds between Ray's checks whether the cluster has more workers free than
    #: the group has (Ray's ``elastic_resize_monitor_interval_s``); growing restarts the group.
    resize_interval_s: Annotated[float, Field(ge=0)] = 60.0
    use_gpu: bool = False
    resources_per_worker: dict[str, Annotated[float, Field(ge=0)]] | None = None
    #: Ray's placement of the worker group: "PACK" fills nodes in turn, "SPREAD" puts the
    #: workers on as many nodes as it can.
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"
    #: Seconds an attempt's first worker group waits for its resources while other work (other
    #: runs on a shared cluster) holds them; Ray starts it as soon as they are free. Past it the
    #: attempt fails with ``ClusterBusyError``, which spends no retry. 0: fail at once. Not
    #: for an elastic run, which sizes its group to what the cluster holds.
    wait_for_resources_s: Annotated[float, Field(ge=0)] = 1800.0
    #: The job server of a remote Ray cluster (e.g. ``http://head:8265``): the train task then
    #: submits each attempt as a Ray job. ``RELAYTRAIN_RAY_JOB_ADDRESS`` sets it from the
    #: environment; unset, the attempt is driven in-process (local Ray or ``RAY_ADDRESS``).
    job_address: str | None = None
    #: How the built-in loop spreads the model: "ddp" keeps a whole replica on every worker;
    #: "fsdp" shards parameters, gradients and optimizer state over the workers (FSDP2's
    #: ``fully_shard``), for a model too big for one worker, and checkpoints them with
    #: ``torch.distributed.checkpoint``, which a group of any size can load.
    strategy: Literal["ddp", "fsdp"] = "ddp"
    #: With "fsdp": ``module:function`` called as ``function(model, mesh)`` to shard the model
    #: your way (``fully_shard(block, mesh=mesh)`` per block). Unset: every layer holding
    #: parameters is a unit.
    shard_fn: str | None = None
    #: With "ddp": options of torch's ``DistributedDataParallel`` (``broadcast_buffers``,
    #: ``find_unused_parameters``, ``static_graph``), for the built-in loop and a loop on
    #: relaytrain's API (its ``setup(..., ddp=...)`` may add to them).
    ddp: DDPSection = Field(default_factory=DDPSection)

    @field_validator("num_workers")
    @classmethod
    def _min_not_above_max(cls, value: int | tuple[int, int]) -> int | tuple[int, int]:
        if isinstance(value, tuple) and value[0] > value[1]:
            raise ValueError(
                f"[MIN, MAX] = {list(value)} has MIN above MAX: give [{value[1]}, {value[0]}]"
            )
        return value

    @property
    def elastic(self) -> bool:
        """Whether the worker count is a range that Ray may resize within."""
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers


class CheckpointSection(_Section):
    #: Commit a checkpoint every this many optimizer steps (and always at the end).
    every: PositiveInt = 50
    #: Keep the newest N committed checkpoints; None keeps all.
    keep_last: PositiveInt | None = 3
    #: Also keep the best N by ``best_metric``; 0 disables.
    keep_best: NonNegativeInt = 1
    best_metric: str = "val_loss"
    best_mode: Literal["min", "max"] = "min"
    #: Every rank writes its own model/optimizer shard (rank-named files) instead of rank 0 only.
    sharded: bool = False
    #: Write checkpoints in the background: training waits only for a copy of the state in
    #: memory. Then a checkpoint whose write fails can lose, besides one interval, the steps
    #: run while it was being written; false waits for every write (at most one interval).
    asynchronous: bool = True
    #: With ``asynchronous``: at most this many checkpoints being written at once, each holding
    #: a copy of the state in host memory. A checkpoint due while the previous one is still
    #: being written (a validation's, a few steps after the cadence's) is staged and queued
    #: instead of waited for; 1 holds one copy, and training waits for the previous write.
    in_flight: PositiveInt = 2

    @model_validator(mode="after")
    def _in_flight_needs_asynchronous(self) -> CheckpointSection:
        if "in_flight" in self.model_fields_set and not self.asynchronous:
            warnings.warn(
                f"checkpoint.in_flight={self.in_flight} does nothing with checkpoint."
                "asynchronous false (every write is waited for): drop one of them",
                UserWarning,
                stacklevel=2,
            )
        return self


class ReportSection(_Section):
    #: Aggregate per-step losses across ranks and stream them to the driver every N steps.
    every: PositiveInt = 10
    #: Split each report window's time per rank (data wait, forward and backward, all-reduce
    #: wait, ...) and name stragglers. False leaves the step untimed (no DDP communication
    #: hook) and the views without the breakdown.
    step_time: bool = True


def tracking_uri_problem(uri: str) -> str | None:
    """Why ``uri`` cannot be a tracking URI, or None. Credentials never go in it."""
    parts = urlsplit(uri)
    if parts.username is not None or parts.password is not None:
        return (
            "it carries a user or password before the host: set MLFLOW_TRACKING_USERNAME and "
            "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) in the environment instead"
        )
    if parts.scheme in ("http", "https") and not parts.hostname:
        return "it names no host: give http://HOST:PORT"
    return None


class TrackingSection(_Section):
    """Experiment trackers the driver reports to. TensorBoard event files are always written
    into the run directory; MLflow is used when a tracking URI is set here or in
    ``MLFLOW_TRACKING_URI``."""

    #: An MLflow tracking URI (``http://host:5000``, ``databricks``, ``sqlite:///mlflow.db``).
    #: Credentials never go in it: MLflow reads MLFLOW_TRACKING_USERNAME / _PASSWORD / _TOKEN
    #: from the environment.
    mlflow_uri: str | None = None
    #: The MLflow experiment the run is logged under (created when missing).
    mlflow_experiment: str = "relaytrain"

    @field_validator("mlflow_uri")
    @classmethod
    def _mlflow_uri(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        problem = tracking_uri_problem(value)
        if problem:
            raise ValueError(f"tracking.mlflow_uri cannot be used: {problem}")
        return value

    @field_validator("mlflow_experiment")
    @classmethod
    def _experiment(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("tracking.mlflow_experiment is empty: name an experiment")
        return value


#: Prefect refuses a task with more retry delays than this (prefect/tasks.py).
PREFECT_MAX_RETRY_DELAYS = 50


class RetriesSection(_Section):
    #: Retries after a worker/node death, preemption or transient storage failure.
    infrastructure: NonNegativeInt = 3
    #: Retries after the training code raised (the same error at the same step twice stops).
    code: NonNegativeInt = 1
    #: Seconds before the first retry; each later one waits ``backoff`` times longer.
    delay_s: Annotated[float, Field(ge=0)] = 10.0
    backoff: Annotated[float, Field(ge=1)] = 2.0
    #: Random extra delay, as a fraction of the delay (Prefect's retry_jitter_factor).
    jitter: Annotated[float, Field(ge=0)] = 0.5
    #: Infrastructure failures Ray Train may recover in place, within one attempt, before a
    #: failure ends the attempt: it restarts the worker group, which resumes from the newest
    #: committed checkpoint, without a new fit() or a Prefect retry (the faster path: no new
    #: controller, relay or Prefect state changes). Each restart is recorded on the attempt.
    #: 1 (the default): the first infrastructure failure of an attempt restarts in place, the
    #: next ends the attempt and Prefect retries it; 0: every failure ends the attempt.
    in_place: NonNegativeInt = 1
    #: Restarts after a node is reclaimed for preemption (Ray's preemption budget, counted apart
    #: from ``infrastructure``). Recovered in place, within the attempt, from the newest commit,
    #: which a notice of the drain makes just in time. None (the default): unlimited, as in Ray.
    preemption: NonNegativeInt | None = None

    @property
    def num_retries(self) -> int:
        """Prefect retries of the train task: every budget's (a preemption that ends an attempt
        is one whose budget, or one without limit, is spent in place)."""
        return self.infrastructure + self.code + (self.preemption or 0)

    def delays(self) -> list[float]:
        """The delay before each retry (Prefect's ``retry_delay_seconds``). Prefect takes at
        most 50 and repeats the last for later retries: a longer budget would fail the flow."""
        count = min(self.num_retries, PREFECT_MAX_RETRY_DELAYS)
        return [self.delay_s * self.backoff**i for i in range(count)]


class FaultSection(_Section):
    """A fault to inject (tests, the chaos campaign): ``raise`` an error or ``kill`` the worker
    at ``at_step``, or make the rank ``slow``: ``seconds`` of sleep in each of its steps from
    ``at_step`` on (a straggler)."""

    kind: Literal["raise", "kill", "slow"]
    at_step: PositiveInt
    rank: NonNegativeInt = 0
    attempt: PositiveInt = 1
    seconds: PositiveFloat | None = None

    @model_validator(mode="after")
    def _seconds_with_slow(self) -> FaultSection:
        if (self.kind == "slow") != (self.seconds is not None):
            raise ValueError(
                f"fault kind {self.kind!r} with seconds={self.seconds}: a slow fault needs "
                "seconds (its sleep per step), and only a slow fault takes them"
            )
        return self
