"""Recovery: a worker SIGKILLed at step k, and how each path gets training going again.

Variants, alternated in one process (one local Ray cluster, one Prefect API):
- ``prefect_retry``: the ``training`` flow with a ``kill`` fault at step k on attempt 1 and
  ``retries.in_place: 0``; the engine classifies the lost worker as infrastructure, Prefect
  retries the train task (retry delay 0, no jitter: the mechanism, not the back-off policy),
  attempt 2 resumes from the newest committed checkpoint.
- ``engine_rerun``: the same two attempts with ``engine.run_attempt`` and no Prefect (the
  share of the Prefect path that is relaytrain's own).
- ``ray_failure_config``: a stock Ray Train loop (``bench.rayloop``: Ray checkpoints via
  ``ray.train.report``) in a bare ``TorchTrainer`` with ``FailureConfig(max_failures=1)``: Ray
  restarts the worker group in place and the loop resumes from ``ray.train.get_checkpoint()``.
- ``relaytrain_in_place``: the same flow at relaytrain's defaults (``retries.in_place: 1``, the
  first infrastructure failure of an attempt restarts in place): Ray Train restarts the worker
  group within the attempt (relaytrain's failure policy), the restarted group rescans the run
  directory and resumes from the newest commit; no Prefect retry, no new fit().
- ``ray_refit``: the stock Ray loop with ``max_failures=0``; the driver calls a new ``fit()`` of
  the same run, which resumes from Ray's latest checkpoint: what any path that starts a new
  fit(), as a Prefect task retry does, costs in Ray itself (a new controller process, its
  helper actors and placement group, then the same worker-group start as Ray's restart).

Figures: ``recovery_s`` from the failure (rank 0's timestamp just before it kills itself) to the
end of the first resumed optimizer step; ``steps_lost`` = k - first resumed step (step k itself
never ran). relaytrain variants split recovery into detect (failure -> attempt recorded failed),
relaunch (-> next attempt started), start (-> workers loaded the checkpoint) and first step.
Every variant also splits it by rank 0's marks in the resumed group (``bench.probe``): to its
worker fn entered (``to_loop_s``: Ray's start of the group, after detection and any relaunch),
building model and data (``setup_s``), loading the checkpoint (``restore_s``), the first step
(``to_step_s``), and the age of the worker's process as the fn was entered (``process_age_s``).
Ray Train's controller splits its start of that group in its own log (``ray_group_start``): the
worker actors created (``actors_s``: their processes started, Ray Train's worker class imported)
and the process group set up (``backend_s``: torch imported in the workers, gloo's rendezvous).
Targets (issue 19): relaytrain's default recovery (relaytrain_in_place) / ray_failure_config
recovery_s <= 1.0, and the same for the Prefect-retry path (prefect_retry); steps lost <= one
checkpoint interval.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from bench.probe import GROUP_START, read_probe
from bench.rayloop import ray_native_loop
from bench.workload import QUICK_MLP, mlp_spec
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import InfrastructureError
from trainer_core.spec.run_spec import RunSpec

NAME = "recovery"
DEFAULT_TARGET = Target(
    "default/ray recovery",
    "seconds from failure to first resumed step, relaytrain's default path (restart in place) / "
    "Ray FailureConfig restart",
    "<=",
    1.0,
)
RATIO_TARGET = Target(
    "prefect/ray recovery",
    "seconds from failure to first resumed step, Prefect-retry path / Ray FailureConfig restart",
    "<=",
    1.0,
)
COLUMNS = [
    "recovery_s",
    "steps_lost",
    "detect_s",
    "relaunch_s",
    "start_s",
    "first_step_s",
    "to_loop_s",
    "setup_s",
    "restore_s",
    "to_step_s",
    "process_age_s",
    "actors_s",
    "backend_s",
    "reported_steps_lost",
    "wall_s",
]


def make_spec(root: Path, name: str, quick: bool, kill_at: int, in_place: int = 0) -> RunSpec:
    """The workload, with rank 0 killed before step ``kill_at`` of attempt 1."""
    fault: dict[str, Any] = {
        "faults": [{"kind": "kill", "at_step": kill_at, "rank": 0, "attempt": 1}],
        "retries": {"in_place": in_place},
    }
    if quick:
        return mlp_spec(root, name, epochs=3, checkpoint_every=5, **QUICK_MLP, **fault)
    return mlp_spec(root, name, epochs=3, **fault)


def kill_step(spec: RunSpec) -> int:
    return spec.faults[0].at_step


def probe_recovery(spec: RunSpec) -> Sample:
    """recovery_s and steps_lost from the probe: the failure, then the next first step."""
    assert spec.run.name is not None
    events = read_probe(spec.run.name)
    failures = [e for e in events if e["event"] == "failure"]
    if not failures:
        raise RuntimeError(f"{spec.run.name}: no failure was recorded (the fault did not fire)")
    failed = failures[0]
    resumed = [e for e in events if e["event"] == "first_step" and e["time"] > failed["time"]]
    if not resumed:
        raise RuntimeError(f"{spec.run.name}: no step ran after the failure")
    first = resumed[0]
    return {
        "recovery_s": first["time"] - failed["time"],
        "steps_lost": float(failed["step"] - first["step"]),
        "failure_time": failed["time"],
        "resumed_first_step_time": first["time"],
        **group_start(events, failed["time"], first["time"]),
        **ray_group_start(spec.run.name, failed["time"]),
    }


def group_start(events: list[dict[str, Any]], failed: float, first_step: float) -> Sample:
    """The resumed group's start, from rank 0's marks after the failure (``GROUP_START``):
    ``to_loop_s`` until its worker fn was entered (detection, any relaunch, and Ray's start of
    the group), ``setup_s`` building model and data, ``restore_s`` loading the checkpoint,
    ``to_step_s`` to the end of the first step; and how old the worker's process was then."""
    marks: dict[str, dict[str, Any]] = {}
    for event in events:
        if event["event"] in GROUP_START and event["time"] > failed:
            marks.setdefault(event["event"], event)
    if len(marks) < len(GROUP_START):
        return {}
    entered, set_up, restored = (marks[name]["time"] for name in GROUP_START)
    return {
        "to_loop_s": entered - failed,
        "setup_s": set_up - entered,
        "restore_s": restored - set_up,
        "to_step_s": first_step - restored,
        "process_age_s": marks["loop_entered"]["process_age_s"],
    }


#: What Ray Train's controller logs (its structured log, DEBUG) as it starts a worker group:
#: the figure each phase's line ends with (Ray 2.60's ``WorkerGroup._start``).
RAY_GROUP_PHASES = {
    "actors_s": "worker actors created in ",
    "backend_s": "after_worker_group_start callbacks completed in ",
}


def ray_group_start(run_name: str, failed: float) -> Sample:
    """Ray Train's own split of the first worker group its controller started for ``run_name``
    after ``failed``, from the controllers' logs in this process's Ray session (a retry's new
    controller's included); empty where they do not say."""
    import ray

    node = ray._private.worker._global_node
    if node is None:
        return {}
    logs = Path(node.get_session_dir_path()) / "logs" / "train"
    lines = [
        line
        for path in logs.glob("ray-train-sys-controller-*.log")
        for line in path.read_text().splitlines()
    ]
    return group_phases(lines, run_name, failed)


def group_phases(lines: list[str], run_name: str, failed: float) -> Sample:
    """``RAY_GROUP_PHASES`` of the first group start for ``run_name`` after ``failed``, from
    the controller's structured log lines (JSON; others skipped)."""
    records = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        at = record.get("timestamp_ns", 0) / 1e9
        if record.get("run_name") == run_name and at > failed:
            records.append((at, record.get("message", "")))
    phases: Sample = {}
    for _, message in sorted(records):
        for name, text in RAY_GROUP_PHASES.items():
            if "[Worker Group Initialization]" in message and text in message:
                phases.setdefault(name, float(message.split(text, 1)[1].split("s", 1)[0]))
        if len(phases) == len(RAY_GROUP_PHASES):
            break
    return phases


def attempt_phases(spec: RunSpec, sample: Sample) -> Sample:
    """Split a relaytrain recovery with the attempt records (driver clock, same machine)."""
    assert spec.run.name is not None
    records = {
        r["attempt"]: r for r in RunDirectory.of(spec.run.storage, spec.run.name).read_attempts()
    }
    first, second = records.get(1, {}), records.get(2, {})
    return common.recovery_phases(
        sample["failure_time"],
        first.get("ended_at"),
        second.get("started_at"),
        second.get("resumed_at"),
        sample["resumed_first_step_time"],
    )


def measure_prefect(spec: RunSpec) -> Sample:
    started = time.time()
    result = harness.run_flow(spec)
    sample: Sample = {"wall_s": time.time() - started, **probe_recovery(spec)}
    sample.update(attempt_phases(spec, sample))
    failed = [a for a in result.attempts if a.status == "failed"]
    if failed and failed[0].recovery_s is not None:
        sample["reported_recovery_s"] = failed[0].recovery_s
    if failed and failed[0].steps_lost is not None:
        sample["reported_steps_lost"] = float(failed[0].steps_lost)
    sample["attempts"] = float(len(result.attempts))
    return _clean(spec, sample)


def measure_engine(spec: RunSpec) -> Sample:
    started = time.time()
    try:
        harness.run_engine(spec)
    except InfrastructureError:
        pass
    else:
        raise RuntimeError(f"{spec.run.name}: attempt 1 did not fail")
    harness.run_engine(spec)
    sample: Sample = {"wall_s": time.time() - started, **probe_recovery(spec)}
    sample.update(attempt_phases(spec, sample))
    return _clean(spec, sample)


def ray_loop_config(spec: RunSpec, marker: Path) -> dict[str, Any]:
    """``bench.rayloop``'s config: the workload without relaytrain's fault, which the stock loop
    fires itself (once: ``marker`` records it)."""
    return {
        "spec": spec.model_copy(update={"faults": []}).model_dump(mode="json"),
        "checkpoint_every": spec.checkpoint.every,
        "kill_at_step": kill_step(spec),
        "kill_marker": str(marker),
    }


def measure_ray(spec: RunSpec, marker: Path) -> Sample:
    loop_config = ray_loop_config(spec, marker)
    started = time.time()
    trainer = harness.bare_trainer(
        spec, loop=ray_native_loop, loop_config=loop_config, max_failures=1
    )
    trainer.fit()
    sample: Sample = {"wall_s": time.time() - started, **probe_recovery(spec)}
    return _clean(spec, sample)


def measure_ray_refit(spec: RunSpec, marker: Path) -> Sample:
    from ray.train import TrainingFailedError

    loop_config = ray_loop_config(spec, marker)
    started = time.time()
    try:
        harness.bare_trainer(spec, loop=ray_native_loop, loop_config=loop_config).fit()
    except TrainingFailedError:
        pass
    else:
        raise RuntimeError(f"{spec.run.name}: the first fit() did not fail")
    harness.bare_trainer(spec, loop=ray_native_loop, loop_config=loop_config).fit()
    sample: Sample = {"wall_s": time.time() - started, **probe_recovery(spec)}
    return _clean(spec, sample)


def measure_in_place(spec: RunSpec) -> Sample:
    started = time.time()
    result = harness.run_flow(spec)
    sample: Sample = {"wall_s": time.time() - started, **probe_recovery(spec)}
    restarts = [r for a in result.attempts for r in a.restarts]
    if len(result.attempts) != 1 or len(restarts) != 1:
        raise RuntimeError(
            f"{spec.run.name}: expected one attempt restarted once in place, got "
            f"{len(result.attempts)} attempt(s) and {len(restarts)} restart(s)"
        )
    if restarts[0].recovery_s is not None:
        sample["reported_recovery_s"] = restarts[0].recovery_s
    if restarts[0].steps_lost is not None:
        sample["reported_steps_lost"] = float(restarts[0].steps_lost)
    sample["attempts"] = 1.0
    return _clean(spec, sample)


def _clean(spec: RunSpec, sample: Sample) -> Sample:
    harness.remove_run(spec)
    return {k: v for k, v in sample.items() if not k.endswith("_time")}


def variants(root: Path, quick: bool, kill_at: int) -> list[Variant]:
    def spec(prefix: str, rep: int, in_place: int = 0) -> RunSpec:
        return make_spec(root, f"{prefix}-{rep}", quick, kill_at, in_place)

    return [
        Variant(
            "prefect_retry",
            "training flow; kill -> InfrastructureError -> Prefect task retry -> resume",
            lambda rep: measure_prefect(spec("prefect", rep)),
        ),
        Variant(
            "engine_rerun",
            "engine.run_attempt twice, no Prefect (relaytrain's own share of the retry path)",
            lambda rep: measure_engine(spec("engine", rep)),
        ),
        Variant(
            "ray_failure_config",
            "stock Ray Train loop, bare TorchTrainer, FailureConfig(max_failures=1)",
            lambda rep: measure_ray(spec("ray", rep), root / f"ray-{rep}.killed"),
        ),
        Variant(
            "relaytrain_in_place",
            "training flow at its defaults (retries.in_place=1): Ray restarts the worker "
            "group in place",
            lambda rep: measure_in_place(spec("inplace", rep, in_place=1)),
        ),
        Variant(
            "ray_refit",
            "stock Ray Train loop, bare TorchTrainer, max_failures=0, then a new fit() that "
            "resumes from Ray's latest checkpoint",
            lambda rep: measure_ray_refit(spec("refit", rep), root / f"refit-{rep}.killed"),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    args = cli.parse_args(argv)
    result = Result(NAME, args.quick, columns=COLUMNS)
    with harness.session(prefect=True) as (root, session):
        interval = make_spec(root, "settings", args.quick, 1).checkpoint.every
        kill_at = 3 * interval - 1  # the worst case: the last step before a checkpoint
        result.settings.update(
            session,
            workload="synthetic MLP, 2 workers, 3 epochs" + (" (quick)" if args.quick else ""),
            checkpoint_every=interval,
            kill_at_step=kill_at,
            killed_rank=0,
            prefect_retry_delay_s=0,
        )
        result.variants = common.measure(variants(root, args.quick, kill_at), args)
    summarize(result, interval)
    return common.finish(result, args)


def summarize(result: Result, interval: int) -> None:
    records = result.variants
    default = common.ratio(records, "relaytrain_in_place", "ray_failure_config", "recovery_s")
    result.targets.append(DEFAULT_TARGET.check(default))
    value = common.ratio(records, "prefect_retry", "ray_failure_config", "recovery_s")
    result.targets.append(RATIO_TARGET.check(value))
    for variant, path in [("prefect_retry", "Prefect path"), ("relaytrain_in_place", "in place")]:
        record = records.get(variant)
        lost: Any = record.summary().get("steps_lost", {}).get("max") if record else None
        result.targets.append(
            Target(
                f"steps lost ({path})",
                f"steps lost, {path}, at most one checkpoint interval ({interval})",
                "<=",
                float(interval),
            ).check(lost, "worst repetition")
        )
    result.figures["in_place/ray recovery_s"] = common.ratio(
        records, "relaytrain_in_place", "ray_failure_config", "recovery_s"
    )
    result.figures["prefect/in_place recovery_s"] = common.ratio(
        records, "prefect_retry", "relaytrain_in_place", "recovery_s"
    )
    result.figures["ray_refit/ray recovery_s"] = common.ratio(
        records, "ray_refit", "ray_failure_config", "recovery_s"
    )
    result.figures["prefect/ray_refit recovery_s"] = common.ratio(
        records, "prefect_retry", "ray_refit", "recovery_s"
    )
    result.notes.append(
        "steps_lost is measured (k - first resumed step); reported_steps_lost is what the "
        "flow's TrainingResult says (its last_step comes from the relayed metric windows)"
    )
    result.notes.append(
        "ray_refit / ray_failure_config is what a new fit() costs in Ray itself, the floor of "
        "any retry that starts one; prefect_retry / ray_refit is relaytrain's share"
    )
    result.notes.append(
        "rank 0 is killed before the last step of the third checkpoint interval, the worst case "
        "for steps lost; Prefect's retry delay is 0 here (its default, retries.delay_s=10 s with "
        "jitter, adds to the Prefect path as configured)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
