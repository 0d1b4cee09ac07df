"""Memory: the driver's resident set size across a 200-epoch run.

Variants, alternated in one process (one local Ray cluster, one Prefect API):
- ``flow``: the ``training`` flow on the default example (digits CNN, 2 workers) for 200
  epochs (4600 steps, 92 checkpoints with retention, every metric row relayed to the driver).
- ``bare_fit``: the same loop in a bare ``TorchTrainer.fit()`` (no flow, engine or relay): the
  driver-side cost of Ray Train alone.

The benchmark process is the driver: a thread samples its RSS (psutil) every 0.25 s. Over the
training window (rank 0's first to last step), ``growth_mb`` = median RSS of the last 5 % minus
median of the first 5 %; ``slope_mb_per_100_epochs`` is a least-squares fit over the window.
Target: flow growth <= 50 MB.
"""

from __future__ import annotations

import statistics
import threading
import time
from pathlib import Path
from typing import Any

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from bench.probe import done_event
from bench.workload import digits_spec
from trainer_core.spec.run_spec import RunSpec

NAME = "memory"
MB = 2**20
GROWTH_TARGET = Target("flow RSS growth", "driver RSS growth over the run (MB)", "<=", 50.0)
COLUMNS = ["growth_mb", "max_growth_mb", "slope_mb_per_100_epochs", "rss_start_mb", "wall_s"]
SAMPLE_INTERVAL_S = 0.25


class RssSampler:
    """Samples this process's RSS in a background thread while inside ``with``."""

    def __init__(self, interval_s: float = SAMPLE_INTERVAL_S):
        import psutil

        self.process = psutil.Process()
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while True:
            self.samples.append((time.time(), self.process.memory_info().rss / MB))
            if self._stop.wait(self.interval_s):
                return


def growth(samples: list[tuple[float, float]], start: float, end: float, epochs: int) -> Sample:
    """RSS figures over the window ``[start, end]`` (seconds since the epoch)."""
    window = [(t, rss) for t, rss in samples if start <= t <= end]
    if len(window) < 4:
        raise RuntimeError(f"only {len(window)} RSS samples in the training window")
    edge = max(2, len(window) // 20)
    first = statistics.median(rss for _, rss in window[:edge])
    last = statistics.median(rss for _, rss in window[-edge:])
    span = end - start
    xs = [epochs * (t - start) / span for t, _ in window]
    ys = [rss for _, rss in window]
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return {
        "growth_mb": last - first,
        "max_growth_mb": max(ys) - first,
        "slope_mb_per_100_epochs": 100 * slope,
        "rss_start_mb": first,
        "rss_end_mb": last,
    }


def measure(
    spec: RunSpec, run: str, series: dict[str, Any], label: str, interval_s: float
) -> Sample:
    """Train ``spec`` the ``run`` way (``flow`` or ``bare_fit``) while sampling RSS."""
    assert spec.run.name is not None and spec.schedule is not None
    started = time.time()
    with RssSampler(interval_s) as sampler:
        if run == "flow":
            harness.run_flow(spec)
        else:
            harness.bare_trainer(spec).fit()
    wall = time.time() - started
    done = done_event(spec.run.name)
    sample = growth(sampler.samples, done["first_time"], done["last_time"], spec.schedule.epochs)
    sample.update(
        wall_s=wall,
        rss_before_mb=sampler.samples[0][1],
        rss_after_mb=sampler.samples[-1][1],
    )
    series[label] = _downsample([(t - started, rss) for t, rss in sampler.samples], 200)
    harness.remove_run(spec)
    return sample


def _downsample(points: list[tuple[float, float]], count: int) -> list[tuple[float, float]]:
    step = max(1, len(points) // count)
    return [(round(t, 2), round(rss, 1)) for t, rss in points[::step]]


def variants(root: Path, epochs: int, series: dict[str, Any], interval_s: float) -> list[Variant]:
    def spec(prefix: str, rep: int) -> RunSpec:
        return digits_spec(root, f"{prefix}-{rep}", epochs=epochs)

    return [
        Variant(
            "flow",
            f"training flow, digits CNN, {epochs} epochs",
            lambda rep: measure(spec("flow", rep), "flow", series, f"flow-{rep}", interval_s),
        ),
        Variant(
            "bare_fit",
            f"bare TorchTrainer.fit() with the built-in loop, {epochs} epochs",
            lambda rep: measure(
                spec("bare", rep), "bare_fit", series, f"bare_fit-{rep}", interval_s
            ),
        ),
    ]


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=2)
    cli.add_argument("--epochs", type=int, default=None, help="epochs per run (default 200)")
    args = cli.parse_args(argv)
    epochs = args.epochs or (10 if args.quick else 200)
    interval_s = 0.05 if args.quick else SAMPLE_INTERVAL_S
    result = Result(NAME, args.quick, columns=COLUMNS)
    series: dict[str, Any] = {}
    with harness.session(prefect=True) as (root, session):
        result.settings.update(
            session,
            workload="examples/digits_cnn.yaml (small CNN, 2 workers)",
            epochs=epochs,
            sample_interval_s=interval_s,
        )
        result.variants = common.measure(variants(root, epochs, series, interval_s), args)
    result.figures["rss_series_s_mb"] = series
    worst = result.variants["flow"].summary().get("growth_mb", {}).get("max")
    result.targets.append(GROWTH_TARGET.check(worst, "worst repetition"))
    return common.finish(result, args)


if __name__ == "__main__":
    raise SystemExit(main())
