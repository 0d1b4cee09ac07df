"""The sweep flow: many trials of a run spec, each a ``training`` subflow (a relaytrain run with
every guarantee), searched and pruned by Optuna, the whole sweep a function of its seed.

    relaytrain sweep --config examples/digits_sweep.yaml [--set key=value ...] [--name NAME]
        [--result-json PATH]
    relaytrain sweep show DIR                 the trials of a sweep (its directory or its name)

(``python -m flows.sweep`` takes the first form's options.) Trial ``n`` is the run
``<name>-tNNN`` beside the sweep's own directory ``<run.storage>/<name>/`` (docs/sweeps.md).
Killed at any moment and run again with the same spec, the sweep goes on where its trials'
run directories say it was: ended trials kept, paused and cut-short ones resumed from their
checkpoints, and it ends as the sweep that was never stopped.
"""

from __future__ import annotations

import argparse
import contextvars
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_image_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run
from prefect.states import State

from flows.embedded_server import ServerStartError, embedded_server
from flows.training import training
from tasks import credentials
from tasks.naming import artifact_key
from tasks.setup import refuse_bad_input
from trainer_core.errors import SpecError
from trainer_core.execution import cluster
from trainer_core.run import jobs
from trainer_core.run.plan import canonical_storage_uri
from trainer_core.spec.overrides import apply_override, parse_override
from trainer_core.storage import Location
from trainer_core.sweep import directory, plot, sampling, schedule, study, trials
from trainer_core.sweep import tracking as sweep_tracking
from trainer_core.sweep.result import SweepResult, sweep_result
from trainer_core.sweep.spec import Sweep, build_sweep, read_sweep_file
from trainer_core.tracking import plots


def _flow_run_name() -> str:
    spec, name = flow_run.parameters.get("spec"), flow_run.parameters.get("name")
    run = spec.get("run", {}) if isinstance(spec, dict) else {}
    return f"sweep-{name or run.get('name') or 'unnamed'}"


@task(name="sweep-setup", cache_policy=NO_CACHE)
def sweep_setup(spec: dict[str, Any], name: str | None) -> str:
    """Refuse a bad sweep before any trial starts (the sweep spec whole, then the first
    trial's run spec as a run's setup checks it: storage, data, model, the cluster), then hold
    the sweep's directory for this spec. Returns the directory's URI."""
    sweep = build_sweep(spec, name)
    storage = trials.storage_uri(sweep)
    directory.check(sweep, storage, spec)  # a rerun's spec, before its trials' own checks
    if sweep.section.study_url_env:
        study.database(sweep)  # reachable, before any trial trains
    first = sweep.trial_spec(0, sampling.trial_values(sweep, 0))  # the first batch: no learning
    refuse_bad_input(first)
    return directory.claim(sweep, storage, spec).uri


@flow(name="sweep", flow_run_name=_flow_run_name, log_prints=True)
def sweep(spec: dict[str, Any], name: str | None = None) -> SweepResult:
    """Run the sweep ``spec`` (a run spec with a ``sweep:`` section; ``name`` over its
    run.name): waves of trial legs, each a ``training`` subflow, until ``schedule.standing``
    says it is over. Returns (and writes as ``result.json``) the SweepResult."""
    logger = get_run_logger()
    swept = build_sweep(spec, name)
    first = swept.trial_spec(0, {})
    with jobs.driver_cluster(first), credentials.restored():
        credentials.apply(first.run.credentials)
        sweep_setup(spec, name)
        location = directory.sweep_location(swept, trials.storage_uri(swept))
        at_once = _at_once(swept)
        logger.info(
            "sweep %s: %s trials, %s at a time, %s sampler, %s pruner, seed %s; its directory %s",
            swept.name,
            swept.section.trials,
            at_once,
            swept.section.sampler,
            swept.pruner_name(),
            swept.section.seed,
            location.uri,
        )
        while True:
            runs = read_runs(swept, location)
            now = schedule.standing(swept, runs)
            trials.record_pruned(swept, runs, now.pruned)
            result = sweep_result(swept, location.uri, runs, now)
            png = plot.sweep_png(result) if now.over else None
            parent = sweep_tracking.sync(swept, first, location, result, png)
            result = result.model_copy(update={"mlflow_run_id": parent})
            directory.write_result(location, result)
            study.write(location, swept, result)
            if now.over:
                break
            logger.info("next: %s", ", ".join(_describe(swept, leg) for leg in now.legs))
            for leg, state in run_wave(swept, now, at_once):
                if not state.is_completed():
                    _note_failure(swept, location, leg, state)
        publish(result, png)
        best = result.best
        logger.info(
            "sweep %s: %s; best %s",
            swept.name,
            _counts(result),
            f"{best.run_name} {result.metric}={best.metric}" if best else "none",
        )
        return result


def run_wave(
    swept: Sweep, now: schedule.Standing, at_once: int
) -> list[tuple[schedule.Leg, State]]:
    """The wave's legs, ``at_once`` at a time, each a ``training`` subflow of this flow run;
    each leg's final state (a failure is the trial's, not the sweep's)."""

    def leg_state(leg: schedule.Leg) -> State:
        trial = swept.trial_spec(leg.number, now.values[leg.number])
        subflow = training.with_options(flow_run_name=trial.run.name)
        return subflow(trial, until_epoch=leg.until_epoch, return_state=True)

    with ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="trial") as pool:
        # each leg in a copy of this flow run's context: its training runs as our subflow
        futures = [pool.submit(contextvars.copy_context().run, leg_state, leg) for leg in now.legs]
        return [(leg, f.result()) for leg, f in zip(now.legs, futures, strict=True)]


def read_runs(swept: Sweep, location: Location) -> dict[int, trials.TrialRun]:
    """Every trial as its run directory stands; a trial whose leg failed before its run could
    say so (its setup refused it) stands failed by the sweep's note."""
    noted = directory.failed_trials(location)
    runs = {n: trials.read_trial(swept, n) for n in range(swept.section.trials)}
    out = {n: run.run_name in noted and run.status != "failed" for n, run in runs.items()}
    return {n: replace(run, status="failed") if out[n] else run for n, run in runs.items()}


def _note_failure(swept: Sweep, location: Location, leg: schedule.Leg, state: State) -> None:
    """A leg that failed: its run's summary says failed after its retries; where it does not
    (setup refused the trial's spec), the sweep notes it, so a rerun does not train it again."""
    error = state.result(raise_on_failure=False)
    run = trials.read_trial(swept, leg.number)
    get_run_logger().warning(
        "trial %s failed (%s: %s); the sweep goes on without it",
        run.run_name,
        type(error).__name__,
        error,
    )
    if run.status != "failed":
        directory.note_failed(location, run.run_name, f"{type(error).__name__}: {error}")


def _at_once(swept: Sweep) -> int:
    """Legs at once: ``concurrent``, else as many worker groups as the cluster holds (the
    batched kinds, median and TPE, learn at batch ends: there unset means 1)."""
    if swept.section.concurrent:
        return swept.section.concurrent
    if swept.pruner_name() == "median" or swept.section.sampler == "tpe":
        return 1
    if jobs.job_address(swept.trial_spec(0, {})):
        return 1  # the remote cluster's size is the job's to know
    return cluster.groups_held(swept.trial_spec(0, {}))


def _describe(swept: Sweep, leg: schedule.Leg) -> str:
    until = "its end" if leg.until_epoch is None else f"epoch {leg.until_epoch}"
    return f"{swept.trial_name(leg.number)} to {until}"


def _counts(result: SweepResult) -> str:
    counts: dict[str, int] = {}
    for t in result.trials:
        counts[t.status] = counts.get(t.status, 0) + 1
    return ", ".join(f"{v} {k}" for k, v in counts.items())


def publish(result: SweepResult, png: bytes | None) -> None:
    """The UI's view of the sweep: a table of its trials and its picture."""
    key = artifact_key(result.name, "sweep")
    create_table_artifact(
        table=trial_table(result),
        key=key,
        description=f"Trials of sweep {result.name} ({result.metric}, {result.direction})",
    )
    if png is not None:
        create_image_artifact(
            image_url=plots.data_uri(png),
            key=artifact_key(result.name, "sweep-plot"),
            description=f"Sweep {result.name}: each trial's {result.metric} by epoch, and "
            "against each value",
        )


def trial_table(result: SweepResult) -> list[dict[str, Any]]:
    best = result.best.number if result.best else None
    return [
        {
            "trial": t.run_name + (" (best)" if t.number == best else ""),
            "status": t.status
            + (f" at epoch {t.pruned_at_epoch}" if t.pruned_at_epoch is not None else ""),
            result.metric: t.metric,
            "epochs": t.epochs,
            "steps": t.steps,
            **{k: _plain(v) for k, v in t.values.items()},
        }
        for t in result.trials
    ]


def _plain(value: Any) -> Any:
    return value if isinstance(value, int | float | str | bool) or value is None else str(value)


# -- the command --------------------------------------------------------------------------------


def load(config: str, overrides: list[str], name: str | None) -> tuple[dict[str, Any], Sweep]:
    """The sweep spec in ``config`` with ``--set`` overrides applied, and the Sweep it makes
    (SpecError naming the key of anything wrong)."""
    raw = read_sweep_file(config)
    if isinstance(raw, dict):
        for item in overrides:
            apply_override(raw, *parse_override(item))
    return raw, build_sweep(raw, name)


def main(argv: list[str] | None = None, prog: str = "python -m flows.sweep") -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] == "show":
        return show_main(args[1:], prog)
    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--config", required=True, help="a sweep spec YAML (see examples/)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--name", help="the sweep's name (default: its run.name)")
    parser.add_argument("--result-json", help="write the SweepResult as JSON here")
    parsed = parser.parse_args(args)
    try:
        raw, swept = load(parsed.config, parsed.set, parsed.name)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with embedded_server():
            state = sweep(raw, parsed.name, return_state=True)
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"interrupted: sweep {swept.name}: its trials are kept; the same command goes on "
            "where it stopped",
            file=sys.stderr,
        )
        return 130
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        print(f"\nsweep {swept.name} did not complete: {error}", file=sys.stderr)
        return 2 if isinstance(error, SpecError) else 1
    result: SweepResult = state.result()
    if parsed.result_json:
        with open(parsed.result_json, "w") as f:
            f.write(result.model_dump_json(indent=2))
    print(render(result))
    return 0


def show_main(argv: list[str], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=f"{prog} show")
    parser.add_argument("sweep", help="the sweep's directory, or its name under ./runs")
    parsed = parser.parse_args(argv)
    from trainer_core import storage

    where = parsed.sweep if "/" in parsed.sweep else f"./runs/{parsed.sweep}"
    location = storage.resolve(canonical_storage_uri(where))
    result = directory.read_result(location) if location.exists() else None
    if result is None:
        print(f"error: {location.uri} holds no sweep (no {directory.RESULT_FILE})", file=sys.stderr)
        return 2
    print(render(result))
    return 0


def render(result: SweepResult) -> str:
    """The sweep as a person reads it: a line per trial, the best, what pruning saved."""
    lines = [
        f"sweep {result.name} ({result.status}): {result.metric} {result.direction}, "
        f"{result.sampler} sampler, {result.pruner} pruner, seed {result.seed}",
        f"  {'trial':<24} {'status':<18} {result.metric:>12} {'epochs':>6} {'steps':>6}  values",
    ]
    for t in result.trials:
        status = t.status + (f" @{t.pruned_at_epoch}" if t.pruned_at_epoch is not None else "")
        metric = f"{t.metric:.6g}" if t.metric is not None else "-"
        values = ", ".join(f"{k}={v}" for k, v in t.values.items())
        lines.append(
            f"  {t.run_name:<24} {status:<18} {metric:>12} {t.epochs:>6} {t.steps:>6}  {values}"
        )
    if result.best is not None:
        lines.append(f"  best: {result.best.run_name} ({result.best.checkpoint_uri})")
    if result.steps_full:
        saved = 1 - result.steps_trained / result.steps_full
        lines.append(
            f"  steps trained: {result.steps_trained} of {result.steps_full} for every trial "
            f"in full (pruning saved {saved:.0%})"
        )
    lines.append(f"  sweep directory: {result.sweep_uri}")
    if result.mlflow_run_id:
        lines.append(f"  MLflow:          parent run {result.mlflow_run_id}, a child run per trial")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
