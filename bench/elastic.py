"""Elastic capacity: a node lost mid-run, and what it costs with and without elasticity and notice.

One local multi-node Ray cluster (``tests/multinode.py``: a head without CPUs and three one-CPU
worker nodes, each its own raylet on this machine), one Prefect API, the ``training`` flow with
the probed built-in loop, alternated:

- ``elastic_continue``: ``num_workers: [2, 3]``; a worker node is killed; Ray Train's elastic
  policy goes on with 2 workers within the attempt, from the newest commit.
- ``fixed_retry``: ``num_workers: 3``; the same kill ends the attempt; a node is added back at
  once (the best case: replacement capacity that arrives in seconds, not minutes) and Prefect's
  retry (delay 0) resumes on 3 workers.
- ``preempted_notice``: ``[2, 3]``, a checkpoint every 50 steps, a report every 2: the node
  drains for preemption with a deadline 10 s away (after the first commit) and is killed 1 s
  before it. The loop commits
  a checkpoint at its first report after Ray's notice, and waits.
- ``killed_no_notice``: the same run, the node killed as late (9 s after the first commit)
  without a drain.

Figures: ``recovery_s`` from the kill (driver clock, the same machine) to rank 0's first step
of the next worker group; ``steps_lost``: the last step run minus the step the next group
resumed from. ``recovery_s`` is split into ``detect_s`` (until the attempt ended, or Ray's
controller restarted the group), ``relaunch_s`` (Prefect's retry; 0 in place), ``start_s`` (until
the next group had loaded the checkpoint) and ``first_step_s``. The workload is
``tests.helpers:slow_mlp`` (a small MLP whose forward sleeps 50 ms): three one-CPU workers on a
2-core machine would otherwise measure the CPU contention.
Targets: elastic_continue / fixed_retry recovery_s <= 0.5; steps lost with notice <=
report.every.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from bench.probe import PROBE_DIR_ENV, read_probe
from tests.multinode import wait_until
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.execution.cluster import RAY_ENV_DEFAULTS
from trainer_core.run import attempts
from trainer_core.run.attempts import AttemptRecord
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.run_spec import RunSpec

NAME = "elastic"
RATIO_TARGET = Target(
    "elastic/fixed recovery",
    "seconds from a node loss to the first step after it: elastic continue / fixed-size retry",
    "<=",
    0.5,
)
COLUMNS = [
    "recovery_s",
    "detect_s",
    "relaunch_s",
    "start_s",
    "first_step_s",
    "steps_lost",
    "seconds_to_deadline",
    "wall_s",
]
NOTICE_S = 10.0
REPORT_EVERY_WITH_NOTICE = 2


def make_spec(root: Path, name: str, quick: bool, workers: Any, notice: bool = False) -> RunSpec:
    epochs = 3 if quick else 4
    raw: dict[str, Any] = {
        "run": {"name": name, "storage": str(root), "seed": 0},
        "model": {"name": "tests.helpers:slow_mlp", "kwargs": {"hidden": [64], "delay_s": 0.05}},
        "data": {
            "dataset": "synthetic",
            "batch_size": 63,
            "validation_fraction": 0,
            "synthetic": {"num_samples": 4032, "num_features": 16},
        },
        "optimizer": {"name": "adam", "lr": 1e-3},
        "schedule": {"epochs": epochs},
        "scaling": {"num_workers": workers, "resize_interval_s": 5},
        "checkpoint": {"every": 50 if notice else 20, "keep_last": 2, "keep_best": 0},
        "report": {"every": REPORT_EVERY_WITH_NOTICE if notice else 5},
        # in_place 0: the fixed-size run's lost node ends its attempt (a Prefect retry, the
        # path fixed_retry measures); elastic runs restart in place on ``infrastructure``
        "retries": {"infrastructure": 2, "code": 0, "delay_s": 0, "jitter": 0, "in_place": 0},
    }
    raw["checkpoint"]["best_metric"] = "loss"
    return build_spec(raw)


@contextlib.contextmanager
def multinode_ray() -> Iterator[tuple[Any, dict[str, Any]]]:
    """The multi-node cluster, this process connected to it as the driver; the probe directory
    and relaytrain's Ray settings in every node's environment."""
    import ray

    from tests.multinode import MultiNodeCluster

    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-probe-") as probe_dir:
        env = {PROBE_DIR_ENV: probe_dir, "RAY_USAGE_STATS_ENABLED": "0"}
        started = time.perf_counter()
        cluster = MultiNodeCluster(num_workers=3, env=env)
        try:
            with harness.env(**env):
                ray.init(address=cluster.gcs_address, log_to_driver=False)
                try:
                    yield (
                        cluster,
                        {
                            "cluster": "head (0 CPU) + 3 worker nodes of 1 CPU, one machine",
                            "ray_settings": {k: cluster.env[k] for k in RAY_ENV_DEFAULTS},
                            "cluster_start_s": round(time.perf_counter() - started, 1),
                        },
                    )
                finally:
                    ray.shutdown()
        finally:
            cluster.stop()


def run_with_fault(
    spec: RunSpec, cluster: Any, fault: str, fixed: bool = False, after_s: float = 0.0
) -> Sample:
    """Run the flow; once the first checkpoint is committed, lose a node ``after_s`` seconds
    later (``kill``; ``drain`` tells Ray first, ``after_s`` ahead); returns the sample."""
    assert spec.run.name is not None
    cluster.ensure_worker_nodes(3)
    wait_until(lambda: not cluster.worker_nodes(), what="the previous run's workers to go")
    box: dict[str, Any] = {}

    def flow() -> None:
        try:
            box["result"] = harness.run_flow(spec)
        except BaseException as e:  # re-raised below
            box["error"] = e

    started = time.time()
    thread = threading.Thread(target=flow, daemon=True)
    thread.start()
    nodes = wait_until(lambda: len(cluster.worker_nodes()) == 3 and cluster.worker_nodes())
    run_dir = RunDirectory.of(spec.run.storage, spec.run.name)
    every = spec.checkpoint.every
    wait_until(lambda: _committed_step(run_dir) >= every, what="the first commit")
    lost_at = lose_node(cluster, nodes[-1], fault, fixed, after_s)
    thread.join(timeout=900)
    if "error" in box:
        raise box["error"]
    sample: Sample = {"wall_s": time.time() - started}
    after = [
        e for e in read_probe(spec.run.name) if e["event"] == "first_step" and e["time"] > lost_at
    ]
    if not after:
        raise RuntimeError(f"{spec.run.name}: no step ran after the node was lost")
    first_step_at = after[0]["time"]
    sample["recovery_s"] = first_step_at - lost_at
    records = attempts.read(run_dir)
    recovered = retried if fixed else continued
    sample.update(recovered(spec.run.name, records, lost_at, first_step_at))
    return sample


def lose_node(cluster: Any, victim: str, fault: str, fixed: bool, after_s: float) -> float:
    """Kill ``victim`` ``after_s`` seconds from now (``drain``: drained first, with that much
    notice), and with ``fixed`` add a node back at once; when it was killed."""
    if fault == "drain":
        answer = cluster.command("drain", victim, str(after_s + 1))
        if not answer.get("accepted"):
            raise RuntimeError(f"the drain was refused: {answer}")
    time.sleep(after_s)
    lost_at = time.time()
    cluster.command("kill", victim)
    if fixed:
        cluster.command("add")  # the replacement, at once
    return lost_at


def retried(
    name: str, records: list[AttemptRecord], lost_at: float, first_step_at: float
) -> Sample:
    """Steps lost and recovery phases of a node loss that ended an attempt (Prefect retried)."""
    failed = [a for a in records if a.status == "failed"]
    if not failed or len(records) < 2:
        raise RuntimeError(f"{name}: the kill did not end an attempt")
    following = records[records.index(failed[0]) + 1]
    return {
        "steps_lost": float((failed[0].last_step or 0) - (following.resumed_from_step or 0)),
        **common.recovery_phases(
            lost_at,
            failed[0].ended_at,
            following.started_at,
            following.resumed_at,
            first_step_at,
        ),
    }


def continued(
    name: str, records: list[AttemptRecord], lost_at: float, first_step_at: float
) -> Sample:
    """Steps lost and recovery phases of a node loss that the attempt went on through (its
    worker group restarted in place, elastic)."""
    restarts = [r for a in records for r in a.restarts]
    if len(records) != 1 or not restarts:
        raise RuntimeError(f"{name}: expected one attempt that went on in place")
    first = restarts[0]
    failed_at = first.get("failed_at")
    sample: Sample = {
        "steps_lost": float(first["last_step"] - first["resumed_from_step"]),
        **common.recovery_phases(
            lost_at, failed_at, failed_at, first.get("resumed_at"), first_step_at
        ),
    }
    if "seconds_to_deadline" in first:
        sample["seconds_to_deadline"] = float(first["seconds_to_deadline"])
    return sample


def _committed_step(run_dir: RunDirectory) -> int:
    newest = run_dir.scan().newest if run_dir.location.exists() else None
    return newest.step if newest else 0


def variants(root: Path, quick: bool, cluster: Any) -> list[Variant]:
    def spec(prefix: str, rep: int, workers: Any, notice: bool = False) -> RunSpec:
        return make_spec(root, f"{prefix}-{rep}", quick, workers, notice)

    return [
        Variant(
            "elastic_continue",
            "num_workers [2, 3]; a worker node killed; Ray's elastic policy goes on with 2",
            lambda rep: run_with_fault(spec("elastic", rep, [2, 3]), cluster, "kill"),
        ),
        Variant(
            "fixed_retry",
            "num_workers 3; a worker node killed and one added at once; Prefect retries",
            lambda rep: run_with_fault(spec("fixed", rep, 3), cluster, "kill", fixed=True),
        ),
        Variant(
            "preempted_notice",
            f"[2, 3]; the node drains for preemption {NOTICE_S:g} s ahead, then is reclaimed",
            lambda rep: run_with_fault(
                spec("notice", rep, [2, 3], True), cluster, "drain", after_s=NOTICE_S - 1
            ),
        ),
        Variant(
            "killed_no_notice",
            "[2, 3], the same run; the node killed as late, without a drain",
            lambda rep: run_with_fault(
                spec("nonotice", rep, [2, 3], True), cluster, "kill", after_s=NOTICE_S - 1
            ),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    args = cli.parse_args(argv)
    result = Result(NAME, args.quick, columns=COLUMNS)
    os.environ.setdefault("PYTHONPATH", str(common.REPO))
    with (
        multinode_ray() as (cluster, cluster_info),
        harness.prefect_api() as api_info,
        tempfile.TemporaryDirectory(prefix="relaytrain-bench-") as tmp,
    ):
        root = Path(tmp)
        result.settings.update(
            cluster_info,
            **api_info,
            workload="tests.helpers:slow_mlp (50 ms a forward), 64 steps an epoch, "
            + ("3 epochs (quick)" if args.quick else "4 epochs"),
            checkpoint_every="20 (notice variants: 50)",
            report_every=f"5 (notice variants: {REPORT_EVERY_WITH_NOTICE})",
            notice_s=NOTICE_S,
            prefect_retry_delay_s=0,
        )
        result.variants = common.measure(variants(root, args.quick, cluster), args)
    summarize(result)
    return common.finish(result, args)


def summarize(result: Result) -> None:
    records = result.variants
    value = common.ratio(records, "elastic_continue", "fixed_retry", "recovery_s")
    result.targets.append(RATIO_TARGET.check(value))
    notice = records.get("preempted_notice")
    lost: Any = notice.summary().get("steps_lost", {}).get("max") if notice else None
    result.targets.append(
        Target(
            "steps lost with notice",
            f"steps lost to a preemption with notice, at most report.every "
            f"({REPORT_EVERY_WITH_NOTICE})",
            "<=",
            float(REPORT_EVERY_WITH_NOTICE),
        ).check(lost, "worst repetition")
    )
    result.notes.append(
        "fixed_retry's node comes back at once, the best case for it; a cloud replacement takes "
        "minutes, which the fixed-size retry waits for and the elastic run does not"
    )
    result.notes.append(
        "a preempted group waits, after its just-in-time checkpoint, for the deadline (Ray Train "
        "restarts it then); the wait is not in steps_lost, which counts trained steps thrown "
        "away"
    )


if __name__ == "__main__":
    raise SystemExit(main())
