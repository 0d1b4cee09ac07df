"""Queue: many runs on one Ray cluster that holds only some of them at once.

``RUNS`` runs of the tiny synthetic MLP spec, on 1 worker each and each with its own seed, on a
local Ray cluster of 2 CPUs, which holds 2 worker groups at a time. Each run is driven by a
process of its own connected to the cluster (as flow runs are), in two ways:

- ``alone``: each run by itself, one after another: its wall (process start to result) and its
  final weights;
- ``queued``: all of them started at once. The runs that find the cluster's resources held wait
  for them in Ray's queue (``scaling.wait_for_resources_s``).

Figures: ``makespan / (sum of the alone walls / 2)``, against 1.15 at most (issue 33: what the
queue costs over the 2 groups' perfect packing); whether every queued run completed in one
attempt (no retry spent on capacity) with the bits of its run alone; while runs waited, the
longest gap between a group ending and a waiting group starting, and the share of the time in
which both of the cluster's slots trained.

That packing bound holds where a run keeps at most one core busy. A run alone keeps more (its
worker's data thread beside its step, its driver, Ray's controller and relay): the machine's
busy cores are measured (``/proc/stat``, through psutil) while each run runs alone and while the
queue runs, and the makespan is also set against the CPU bound, the alone runs' busy
core-seconds over the machine's cores: where that bound is the larger, the queue can come no
closer to the packing bound on this machine, whatever it does.
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from bench import common, harness
from bench.common import Result, Target

NAME = "queue"
RUNS = 6
#: The cluster's CPUs: 2 groups of 1 worker at once.
SLOTS = 2
COLUMNS = [
    "makespan_s",
    "alone_walls_s",
    "ratio",
    "longest_idle_gap_s",
    "both_slots_share",
    "trained_s_alone",
    "trained_s_queued",
    "alone_busy_cores",
    "queued_busy_cores",
    "cpu_bound_s",
    "ratio_to_cpu_bound",
]
MAKESPAN_TARGET = Target(
    "makespan / (alone walls / 2)",
    f"{RUNS} runs started at once on a cluster that holds {SLOTS}: the time until the last "
    f"ends / (the sum of each one's wall alone / {SLOTS})",
    "<=",
    1.15,
)


class BusyCores:
    """The machine's busy cores (every process's CPU time, from ``/proc/stat``) over a block."""

    def __enter__(self) -> BusyCores:
        self.began, self.cpu_began = time.monotonic(), self._busy_s()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall_s = time.monotonic() - self.began
        self.busy_s = self._busy_s() - self.cpu_began

    @property
    def cores(self) -> float:
        return self.busy_s / self.wall_s

    @staticmethod
    def _busy_s() -> float:
        times = psutil.cpu_times()
        return sum(times) - times.idle - getattr(times, "iowait", 0.0)


#: Rows of the synthetic table: 1400 steps of 32 an epoch (a fifth held out to validate). Each
#: validation is followed by a checkpoint (the ranked ones): epochs this long keep the runs'
#: checkpoint traffic to one every 1400 steps, and training fills the cluster. (With the tiny
#: spec's 13 steps an epoch, its checkpoint thread was busy half the time and a run alone kept
#: 1.23 cores busy: 2026-11-28, py-spy on the worker.)
NUM_SAMPLES = 56000


def run_spec(root: Path, name: str, seed: int, epochs: int) -> dict[str, Any]:
    """The spec of run ``seed`` (its name under ``root``)."""
    from flows.pytest_plugin import tiny_spec_dict

    raw = tiny_spec_dict(
        root,
        name,
        scaling={"num_workers": 1},
        schedule={"epochs": epochs},
        checkpoint={"every": 2000},
        report={"every": 100},
    )
    raw["data"]["synthetic"]["num_samples"] = NUM_SAMPLES
    raw["run"]["seed"] = seed
    return raw


def drive(spec_file: Path, out_file: Path) -> None:
    """One run's driver process (``--drive``): the attempt on ``RAY_ADDRESS``'s cluster, and the
    times of what happened, written to ``out_file``."""
    from trainer_core.execution.cluster import ray_cluster
    from trainer_core.run.engine import run_attempt
    from trainer_core.spec.overrides import build_spec

    started = float(os.environ["RELAYTRAIN_BENCH_STARTED"])
    spec = build_spec(json.loads(spec_file.read_text()))
    seen: dict[str, float] = {}

    def note(event: dict[str, Any]) -> None:
        seen.setdefault(event["kind"], event.get("time", time.time()))

    with ray_cluster():
        result = run_attempt(spec, on_event=note)
    out_file.write_text(
        json.dumps(
            {
                "started": started,
                "told_busy": "waiting_for_resources" in seen,
                "group_began": seen.get("fresh_start", seen.get("resumed")),
                "finished": time.time(),
                "status": result.status,
            }
        )
    )


def launch(root: Path, name: str, seed: int, epochs: int) -> tuple[subprocess.Popen, Path]:
    """Start run ``name``'s driver process; returns it and where it writes its times."""
    spec_file = root / f"{name}.json"
    spec_file.write_text(json.dumps(run_spec(root / "runs", name, seed, epochs)))
    out_file = root / f"{name}.out.json"
    env = {**os.environ, "RELAYTRAIN_BENCH_STARTED": repr(time.time())}
    command = [sys.executable, "-m", "bench.queue", "--drive", str(spec_file), str(out_file)]
    return subprocess.Popen(command, env=env, cwd=common.REPO), out_file


def finished(process: subprocess.Popen, out_file: Path) -> dict[str, Any]:
    if process.wait() != 0:
        raise RuntimeError(f"{out_file.name}: the driver exited {process.returncode}")
    return json.loads(out_file.read_text())


def run_dir(root: Path, name: str) -> Any:
    from trainer_core import storage
    from trainer_core.checkpoint.run_directory import RunDirectory

    return RunDirectory(storage.resolve(str(root / "runs")).child(name))


def same_bits(root: Path, a: str, b: str) -> bool:
    """Whether runs ``a`` and ``b`` under ``root`` ended at the same weights and optimizer."""
    from tests.recovery import assert_same_tensors, final_state

    try:
        assert_same_tensors(final_state(run_dir(root, a)), final_state(run_dir(root, b)))
    except AssertionError:
        return False
    return True


def attempts_of(root: Path, name: str) -> list[str]:
    return [a["status"] for a in run_dir(root, name).read_attempts()]


def use_of_slots(runs: list[dict[str, Any]]) -> tuple[float, float]:
    """While any run waited: the longest time between a group ending and the next waiting
    group starting, and the share of that time in which ``SLOTS`` groups trained."""
    waiting_from = min(r["started"] for r in runs)
    waiting_until = max(r["group_began"] for r in runs)
    gaps = [
        min(o["group_began"] for o in runs if o["group_began"] >= r["finished"]) - r["finished"]
        for r in runs
        if r["finished"] < waiting_until
    ]
    edges = sorted(
        {waiting_from, waiting_until, *(t for r in runs for t in (r["group_began"], r["finished"]))}
    )
    edges = [t for t in edges if waiting_from <= t <= waiting_until]
    full = 0.0
    for left, right in itertools.pairwise(edges):
        middle = (left + right) / 2
        training = sum(r["group_began"] <= middle < r["finished"] for r in runs)
        full += (right - left) if training >= SLOTS else 0.0
    span = waiting_until - waiting_from
    return max(gaps, default=0.0), full / span if span > 0 else 1.0


def measure(root: Path, epochs: int) -> dict[str, Any]:
    alone, alone_trained, alone_busy = [], [], []
    for seed in range(RUNS):
        with BusyCores() as busy:
            process, out_file = launch(root, f"alone-{seed}", seed, epochs)
            times = finished(process, out_file)
        alone.append(times["finished"] - times["started"])
        alone_trained.append(times["finished"] - times["group_began"])
        alone_busy.append(busy)
        print(f"[bench] alone-{seed}: {alone[-1]:.1f} s, {busy.cores:.2f} cores busy", flush=True)
    with BusyCores() as queued_busy:
        launched = [launch(root, f"queued-{seed}", seed, epochs) for seed in range(RUNS)]
        queued = [finished(process, out_file) for process, out_file in launched]
    makespan = max(r["finished"] for r in queued) - min(r["started"] for r in queued)
    gap, share = use_of_slots(queued)
    cpu_bound = sum(b.busy_s for b in alone_busy) / (psutil.cpu_count() or 1)
    sample = {
        "makespan_s": makespan,
        "alone_walls_s": sum(alone),
        "ratio": makespan / (sum(alone) / SLOTS),
        "alone_busy_cores": statistics.median(b.cores for b in alone_busy),
        "queued_busy_cores": queued_busy.cores,
        "cpu_bound_s": cpu_bound,
        "ratio_to_cpu_bound": makespan / cpu_bound,
        "longest_idle_gap_s": gap,
        "both_slots_share": share,
        # Two runs at once on 2 cores: each trains slower than alone as far as a run alone
        # kept more than one core busy (its worker's prefetch thread, its driver, Ray's
        # processes): 28.8 s against 28.3 s on 2026-11-28, and 47.2 against 30.0 while the
        # runs checkpointed every 13 steps.
        "trained_s_alone": statistics.median(alone_trained),
        "trained_s_queued": statistics.median(r["finished"] - r["group_began"] for r in queued),
        "longest_wait_s": max(r["group_began"] - r["started"] for r in queued),
        # Runs that saw the cluster short when they began (the others started at the same
        # moment and saw it free: they wait all the same).
        "told_busy": sum(r["told_busy"] for r in queued),
        "one_attempt_each": all(
            attempts_of(root, f"queued-{s}") == ["completed"] for s in range(RUNS)
        ),
        "bit_identical": all(same_bits(root, f"alone-{s}", f"queued-{s}") for s in range(RUNS)),
    }
    print(f"[bench] queued: {sample}", flush=True)
    return sample


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--drive"]:
        drive(Path(argv[1]), Path(argv[2]))
        return 0
    cli = common.parser(NAME, __doc__ or "", repetitions=1)
    cli.add_argument("--epochs", type=int, default=None, help="epochs per run (default 10)")
    args = cli.parse_args(argv)
    # 10 epochs of 1400 steps: about 30 s of training a run, against about 8 s to start its
    # driver and worker group on 2 cores: the runs, not their start, fill the cluster.
    epochs = args.epochs or (1 if args.quick else 10)
    result = Result(NAME, args.quick, columns=COLUMNS)
    with harness.local_ray(num_cpus=SLOTS) as session, tempfile.TemporaryDirectory() as tmp:
        import ray

        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
        result.settings.update(
            session, runs=RUNS, workers_per_run=1, epochs=epochs, workload="tiny synthetic MLP"
        )
        variant = common.Variant(
            "queued", f"{RUNS} runs at once on {SLOTS} CPUs", lambda rep: measure(Path(tmp), epochs)
        )
        result.variants = common.measure([variant], args)
        os.environ.pop("RAY_ADDRESS", None)
    record = result.variants["queued"]
    result.targets.append(MAKESPAN_TARGET.check(record.median("ratio")))
    for key in ("one_attempt_each", "bit_identical"):
        values = [s.get(key) for s in record.samples]
        result.figures[key] = bool(values) and all(values)
    return common.finish(result, args)


if __name__ == "__main__":
    raise SystemExit(main())
