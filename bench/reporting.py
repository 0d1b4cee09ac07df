"""Reporting: what streaming metrics costs the training step, at the default cadence (every 10
steps), under Ray Train's controller poll interval (``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``).

Variants, alternated in one process (one local Ray cluster), each at poll intervals of 0.5 s
(relaytrain's default) and 2 s (Ray's default):
- ``relaytrain@<poll>``: one engine attempt of the default example (digits CNN, 2 workers). The
  built-in loop's own timings: ``aggregate_s`` (the per-window asynchronous loss all-reduce and
  the batched relay push, ``relay_s`` included) against ``step_s`` (the optimizer steps).
- ``relaytrain-untimed@0.5s``: the same without the step-time breakdown
  (``report.step_time: false``: no clock, no DDP communication hook, no per-rank figures in
  the window's collective). Against it, ``relaytrain@0.5s`` shows what measuring where the
  step time goes costs: in ``step_ms`` (the parts' timers and the hook) and in
  ``per_report_ms`` (every rank's figures in the window's all-reduce, the straggler rule).
- ``ray_report@<poll>``: the same workload in a stock Ray Train loop calling
  ``ray.train.report(metrics)`` every 10 steps (``bench.rayloop``): time inside ``report``
  against time stepping.

``report_share_pct`` = 100 x reporting time / step time. Target: relaytrain at its default
poll interval <= 2 %, the breakdown included: the reporting share (every rank's figures in the
window's collective and the straggler rule are in it), plus the breakdown's timers in each
step (timed alone; the step times of the timed and untimed runs differ by less than their
spread, which the figures give run against run).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from bench.probe import done_event, read_probe, span
from bench.rayloop import ray_native_loop
from bench.workload import digits_spec
from trainer_core.spec.run_spec import RunSpec

NAME = "reporting"
POLL_ENV = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S"
POLL_INTERVALS = ("0.5", "2.0")
DEFAULT_POLL = "0.5"
SHARE_TARGET = Target(
    "report share",
    "relaytrain reporting time / step time at report.every=10, poll 0.5 s (%)",
    "<=",
    2.0,
)
COLUMNS = ["report_share_pct", "per_report_ms", "step_ms", "reports", "steps_per_s", "wall_s"]


def measure_relaytrain(spec: RunSpec, poll: str) -> Sample:
    started = time.time()
    with harness.env(**{POLL_ENV: poll}):
        _, events = harness.run_engine(spec)
    wall = time.time() - started
    timings = harness.finished_timings(events)
    sample = _shares(timings["aggregate_s"], timings["num_aggregates"], timings)
    sample["relay_share_pct"] = 100 * timings["relay_s"] / timings["step_s"]
    return _finish(spec, sample, wall)


def measure_ray(spec: RunSpec, poll: str) -> Sample:
    assert spec.run.name is not None
    config = {"spec": spec.model_dump(mode="json"), "report_every": spec.report.every}
    started = time.time()
    with harness.env(**{POLL_ENV: poll}):
        harness.bare_trainer(spec, loop=ray_native_loop, loop_config=config).fit()
    wall = time.time() - started
    done = done_event(spec.run.name)
    timings = done["timings"]
    sample = _shares(
        timings["report_s"], timings["reports"], {"num_steps": done["num_steps"], **timings}
    )
    return _finish(spec, sample, wall)


def _shares(report_s: float, reports: float, timings: dict) -> Sample:
    steps = timings["num_steps"]
    return {
        "report_share_pct": 100 * report_s / timings["step_s"],
        "per_report_ms": 1000 * report_s / reports if reports else float("nan"),
        "step_ms": 1000 * timings["step_s"] / steps,
        "reports": float(reports),
    }


def _finish(spec: RunSpec, sample: Sample, wall: float) -> Sample:
    assert spec.run.name is not None
    probe = span(read_probe(spec.run.name))
    harness.remove_run(spec)
    return {**sample, "steps_per_s": probe.get("steps_per_s", float("nan")), "wall_s": wall}


def clock_cost_us(steps: int = 20_000) -> float:
    """Microseconds per step of the built-in loop's step-time timers (its three parts), on the
    CPU (the DDP hook's own cost is in the step times above)."""
    import torch

    from trainer_core.execution.worker_group import Timings
    from trainer_core.train.step_clock import StepClock

    clock = StepClock(torch.device("cpu"), Timings())
    started = time.perf_counter()
    for _ in range(steps):
        with clock.part("h2d"):
            pass
        with clock.part("forward_backward"):
            pass
        with clock.part("optimizer"):
            pass
    return 1e6 * (time.perf_counter() - started) / steps


def variants(root: Path, epochs: int) -> list[Variant]:
    def spec(prefix: str, rep: int) -> RunSpec:
        return digits_spec(root, f"{prefix}-{rep}", epochs=epochs)

    def relaytrain(poll: str) -> Callable[[int], Sample]:
        return lambda rep: measure_relaytrain(spec(f"rt{poll}", rep), poll)

    def untimed(rep: int) -> Sample:
        raw = spec(f"untimed{DEFAULT_POLL}", rep).model_dump(mode="json")
        raw["report"]["step_time"] = False
        return measure_relaytrain(RunSpec.model_validate(raw), DEFAULT_POLL)

    def ray(poll: str) -> Callable[[int], Sample]:
        return lambda rep: measure_ray(spec(f"ray{poll}", rep), poll)

    found = []
    for poll in POLL_INTERVALS:
        found += [
            Variant(
                f"relaytrain@{poll}s",
                f"built-in loop, async all-reduce + batched relay every 10 steps, poll {poll} s",
                relaytrain(poll),
            ),
            *(
                [
                    Variant(
                        f"relaytrain-untimed@{poll}s",
                        "the same without the step-time breakdown (report.step_time: false)",
                        untimed,
                    )
                ]
                if poll == DEFAULT_POLL
                else []
            ),
            Variant(
                f"ray_report@{poll}s",
                f"stock loop, ray.train.report(metrics) every 10 steps, poll {poll} s",
                ray(poll),
            ),
        ]
    return found


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--epochs", type=int, default=None, help="epochs of digits (default 40)")
    args = cli.parse_args(argv)
    epochs = args.epochs or (3 if args.quick else 40)
    result = Result(NAME, args.quick, columns=COLUMNS)
    with harness.session() as (root, session):
        result.settings.update(
            session,
            workload="examples/digits_cnn.yaml (small CNN, 2 workers)",
            epochs=epochs,
            report_every=10,
            poll_intervals_s=list(POLL_INTERVALS),
        )
        result.variants = common.measure(variants(root, epochs), args)
    record = result.variants.get(f"relaytrain@{DEFAULT_POLL}s")
    bare = result.variants.get(f"relaytrain-untimed@{DEFAULT_POLL}s")
    default = record.median("report_share_pct") if record else None
    step = record.median("step_ms") if record else None
    if default is not None and step:
        # The breakdown's work inside each step (its parts' timers), timed here alone: what
        # it adds is too small for the runs' step times to show through their spread.
        per_step_us = clock_cost_us()
        result.figures["breakdown_timers_us_per_step"] = round(per_step_us, 2)
        default += 100 * per_step_us / 1000 / step
    if record and bare:
        # Run against run (the variants alternate): what the breakdown adds, and the spread.
        for metric in ("step_ms", "per_report_ms"):
            pairs = [
                a[metric] - b[metric] for a, b in zip(record.samples, bare.samples, strict=False)
            ]
            result.figures[f"breakdown_added_{metric}"] = {
                "median": round(statistics.median(pairs), 4),
                "min": round(min(pairs), 4),
                "max": round(max(pairs), 4),
            }
    result.targets.append(SHARE_TARGET.check(default))
    result.figures["ray_report/relaytrain per_report_ms"] = {
        poll: common.ratio(
            result.variants, f"ray_report@{poll}s", f"relaytrain@{poll}s", "per_report_ms"
        )
        for poll in POLL_INTERVALS
    }
    result.notes.append(
        "relaytrain's aggregate_s includes relay_s (its relay pushes); step time excludes "
        "validation and checkpoints in every variant"
    )
    return common.finish(result, args)


if __name__ == "__main__":
    raise SystemExit(main())
