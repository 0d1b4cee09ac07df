"""Overhead: the full ``training`` flow vs. a bare ``TorchTrainer.fit()`` running relaytrain's
own built-in loop vs. plain PyTorch DDP (``torch.multiprocessing`` + gloo), same workload.

Variants, alternated in one process (one local Ray cluster, one Prefect API):
- ``flow``: ``flows.training.training(spec)``: setup, train (engine: preflight, relay, attempt
  records) and finalize, under Prefect.
- ``bare_fit``: ``ray.train.torch.TorchTrainer(builtin_train_loop, WorkerConfig).fit()`` built
  as the engine builds it, with no flow, preflight, relay actor or attempt records.
- ``plain_ddp``: the same model, batches, optimizer, schedule and seeds in a
  ``torch.multiprocessing`` gloo script, with the same cadence of loss all-reduces, validation
  passes and checkpoints (plain ``torch.save`` to local disk, no manifest or marker).

Workload: a compute-bound synthetic MLP on 2 workers, relaytrain's default checkpoint (50 steps)
and report (10 steps) cadence. The number of epochs is calibrated on a plain warm-up run so
that a run trains for about ``--train-seconds`` (default 75 s, at least 60 s).

Figures per run: wall time (call to return), time to first step (call or process-tree start
to the end of rank 0's first optimizer step), steps/s over rank 0's first to last step.
Target: median flow wall / median bare-fit wall <= 1.05.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from bench.plain_ddp import run_plain_ddp
from bench.probe import first_step_time, read_probe, span
from bench.workload import QUICK_MLP, mlp_spec, steps_per_epoch
from trainer_core.spec.run_spec import RunSpec

NAME = "overhead"
WALL_TARGET = Target(
    "flow/bare wall", "full flow wall time / bare TorchTrainer.fit() wall time", "<=", 1.05
)
FIRST_STEP_TARGET = Target(  # issue 19's higher bar
    "flow/plain first step",
    "seconds to the first step, full flow / plain PyTorch DDP (torch.multiprocessing)",
    "<=",
    1.5,
)
MIN_TRAIN_S = 60.0
COLUMNS = ["wall_s", "first_step_s", "steps_per_s", "train_s", "num_steps"]

SpecMaker = Callable[[str, int], RunSpec]


def spec_maker(root: Path, quick: bool) -> SpecMaker:
    """``make(run_name, epochs)``: the benchmark's workload under ``root``."""
    if quick:
        return lambda name, epochs: mlp_spec(
            root, name, epochs=epochs, checkpoint_every=10, **QUICK_MLP
        )
    return lambda name, epochs: mlp_spec(root, name, epochs=epochs)


def measure_flow(spec: RunSpec) -> Sample:
    started = time.time()
    result = harness.run_flow(spec)
    wall = time.time() - started
    return {**_timing(spec, started, wall), "steps": float(result.steps_completed)}


def measure_bare_fit(spec: RunSpec) -> Sample:
    started = time.time()
    harness.bare_trainer(spec).fit()
    return _timing(spec, started, time.time() - started)


def measure_plain(spec: RunSpec, root: Path) -> Sample:
    assert spec.run.name is not None
    started = run_plain_ddp(spec, root / spec.run.name)
    return _timing(spec, started, time.time() - started)


def _timing(spec: RunSpec, started: float, wall: float) -> Sample:
    assert spec.run.name is not None
    events = read_probe(spec.run.name)
    first = first_step_time(events)
    harness.remove_run(spec)
    return {
        "wall_s": wall,
        "first_step_s": (first - started) if first is not None else float("nan"),
        **span(events),
    }


def calibrate(make: SpecMaker, plain_warmup: Sample, train_seconds: float) -> int:
    """Epochs for ``train_seconds`` of training, from the plain warm-up run's steps/s (the
    fastest variant: the others train at least as long)."""
    per_epoch = steps_per_epoch(make("calibrate", 1))
    return max(1, math.ceil(train_seconds * plain_warmup["steps_per_s"] / per_epoch))


def variants(make: SpecMaker, epochs: int, root: Path) -> list[Variant]:
    return [
        Variant(
            "flow",
            "flows.training.training(spec) under Prefect: setup -> train -> finalize",
            lambda rep: measure_flow(make(f"flow-{rep}", epochs)),
        ),
        Variant(
            "bare_fit",
            "TorchTrainer(builtin_train_loop, WorkerConfig).fit(), no flow/preflight/relay",
            lambda rep: measure_bare_fit(make(f"bare-{rep}", epochs)),
        ),
        Variant(
            "plain_ddp",
            "torch.multiprocessing + gloo DDP, same steps, torch.save checkpoints, same cadence",
            lambda rep: measure_plain(make(f"plain-{rep}", epochs), root),
        ),
    ]


def warm_up(make: SpecMaker, root: Path) -> dict[str, Sample]:
    """One short run of each variant first: cold-start costs (imports, Ray worker processes,
    Prefect client) are reported here and kept out of the alternating repetitions."""
    return {
        "flow": measure_flow(make("warmup-flow", 1)),
        "bare_fit": measure_bare_fit(make("warmup-bare", 1)),
        "plain_ddp": measure_plain(make("warmup-plain", 1), root),
    }


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--train-seconds", type=float, default=75.0, help="training time per run")
    cli.add_argument("--epochs", type=int, default=None, help="skip calibration: train this long")
    args = cli.parse_args(argv)
    result = Result(NAME, args.quick, columns=COLUMNS)
    settings = result.settings
    settings["workload"] = "synthetic MLP 64-512-512-512-1, batch 128/worker"
    with harness.session(prefect=True) as (root, session):
        make = spec_maker(root, args.quick)
        figures = result.figures
        if args.quick:
            epochs = args.epochs or 2
            settings["workload"] = "synthetic MLP 64-64-64-1 (quick)"
        else:
            figures["warmup"] = warm_up(make, root)
            epochs = args.epochs or calibrate(
                make, figures["warmup"]["plain_ddp"], args.train_seconds
            )
        spec = make("settings", epochs)
        settings.update(
            session,
            epochs=epochs,
            steps_per_epoch=steps_per_epoch(spec),
            num_workers=spec.scaling.num_workers,
            checkpoint_every=spec.checkpoint.every,
            report_every=spec.report.every,
        )
        result.variants = common.measure(variants(make, epochs, root), args)
    summarize(result)
    return common.finish(result, args)


def summarize(result: Result) -> None:
    """Targets, the informative ratios, and whether the workload was long enough."""
    records = result.variants
    wall = common.ratio(records, "flow", "bare_fit", "wall_s")
    result.targets.append(WALL_TARGET.check(wall))
    first_step = common.ratio(records, "flow", "plain_ddp", "first_step_s")
    result.targets.append(FIRST_STEP_TARGET.check(first_step))
    result.figures["ratios"] = {
        "flow/bare first_step_s": common.ratio(records, "flow", "bare_fit", "first_step_s"),
        "flow/bare steps_per_s": common.ratio(records, "flow", "bare_fit", "steps_per_s"),
        "bare/plain wall_s": common.ratio(records, "bare_fit", "plain_ddp", "wall_s"),
        "bare/plain steps_per_s": common.ratio(records, "bare_fit", "plain_ddp", "steps_per_s"),
        "flow/plain wall_s": common.ratio(records, "flow", "plain_ddp", "wall_s"),
    }
    trained = [s["train_s"] for r in records.values() for s in r.samples if "train_s" in s]
    result.figures["min_train_s"] = min(trained) if trained else None
    if not result.quick and (not trained or min(trained) < MIN_TRAIN_S):
        result.notes.append(
            f"a run trained for less than {MIN_TRAIN_S:.0f} s: raise --train-seconds or --epochs"
        )
    result.notes.append(
        "time to first step counts from the call (flow, fit) or from before mp.spawn (plain) to "
        "the end of rank 0's first optimizer step"
    )


if __name__ == "__main__":
    raise SystemExit(main())
