"""The training flow: setup -> train (retried, resuming) -> finalize; and its command line.

    relaytrain run --config examples/digits_cnn.yaml [--set key=value ...]
        [--run-name NAME] [--result-json PATH]

(``python -m flows.training`` takes the same options.)

Runs under Prefect's embedded API, or against PREFECT_API_URL when set. Re-running with the
same run name resumes from the newest committed checkpoint; a finished run returns its result.
Ctrl-C stops the run, its Ray workers, the Ray cluster and the embedded server it started, and
says what was kept and the command that resumes it (exit code 130).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from datetime import datetime

from prefect import flow
from prefect.runtime import flow_run
from prefect.settings import PREFECT_UI_URL

from flows.embedded_server import ServerStartError, embedded_server
from tasks import Prepared, credentials, finalize, setup, train
from tasks.setup import holding
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError
from trainer_core.run import jobs
from trainer_core.run.plan import canonical_storage_uri
from trainer_core.run.summary import TrainingResult, committed_checkpoints
from trainer_core.spec.overrides import load_spec
from trainer_core.spec.run_spec import RunSpec


def default_run_name(spec: RunSpec) -> str:
    """The spec's name, else one derived from the workload and the flow run's scheduled time.

    The scheduled time belongs to the flow run, so retrying the same flow run (or a scheduled
    slot) names, and therefore resumes, the same run.
    """
    if spec.run.name:
        return spec.run.name
    scheduled = flow_run.scheduled_start_time
    moment = scheduled if isinstance(scheduled, datetime) else datetime.now()
    return spec.default_run_name(moment.strftime("%Y%m%d-%H%M%S"))


def _flow_run_name() -> str:
    spec = flow_run.parameters.get("spec")
    if isinstance(spec, dict):
        spec = RunSpec.model_validate(spec)
    return default_run_name(spec) if isinstance(spec, RunSpec) else "training"


@flow(name="training", flow_run_name=_flow_run_name, log_prints=True)
def training(spec: RunSpec, until_epoch: int | None = None) -> TrainingResult:
    """Train ``spec`` on Ray Train: setup, train (each failure a retry that resumes), finalize.
    ``until_epoch``: stop after that epoch (counted from 1), its checkpoint committed: the
    result says ``paused``, and the same run name trains on from there."""
    spec = spec.with_run_name(default_run_name(spec))
    # setup applies run.credentials' block to the environment; restored when the flow ends.
    with jobs.driver_cluster(spec), credentials.restored():
        owner = f"flow-run-{flow_run.id or 'local'}"
        prepared: Prepared = setup(spec, lease_owner=owner, until_epoch=until_epoch)
        if prepared.stored_result is not None:
            return prepared.stored_result
        attempt = train.with_options(
            retries=spec.retries.num_retries,
            retry_delay_seconds=spec.retries.delays() or 0,
            retry_jitter_factor=spec.retries.jitter,
        )
        with holding(prepared):  # the lease, renewed across train's retry delays
            try:
                attempt(spec, prepared)
            except Exception:
                finalize(spec, prepared, status="failed")  # show what happened, then fail
                raise
            return finalize(spec, prepared, status="paused" if until_epoch else "completed")


def main(argv: list[str] | None = None, prog: str = "python -m flows.training") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", required=True, help="a run spec YAML (see examples/)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, e.g. --set scaling.num_workers=2",
    )
    parser.add_argument("--run-name", help="the run's durable name (the same name resumes)")
    parser.add_argument("--result-json", help="write the TrainingResult as JSON here")
    parser.add_argument(
        "--until-epoch",
        type=int,
        metavar="N",
        help="pause after epoch N, its checkpoint committed; the same command without it "
        "(or with a later N) trains on",
    )
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.config, args.set)
        name = (
            args.run_name or spec.run.name or spec.default_run_name(time.strftime("%Y%m%d-%H%M%S"))
        )
        spec = spec.with_run_name(name)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        with embedded_server():
            state = training(spec, until_epoch=args.until_epoch, return_state=True)
    except ServerStartError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        given = list(sys.argv[1:] if argv is None else argv)
        resume = [*prog.split(), *given, *([] if args.run_name else ["--run-name", name])]
        print(interrupted(spec, shlex.join(resume)), file=sys.stderr)
        return 130
    if not state.is_completed():
        error = state.result(raise_on_failure=False)
        kind = type(error).__name__ if isinstance(error, BaseException) else state.type.value
        print(f"\nrun {name} did not complete ({kind}): {error}", file=sys.stderr)
        return 2 if isinstance(error, SpecError) else 1
    result: TrainingResult = state.result()
    if args.result_json:
        with open(args.result_json, "w") as f:
            f.write(result.model_dump_json(indent=2))
    print_summary(result)
    return 0


def interrupted(spec: RunSpec, resume: str) -> str:
    """The line a Ctrl-C'd run ends with: its run directory, the newest committed checkpoint
    there (what the same command resumes from), and that command."""
    name = spec.run.name or ""
    run_dir = RunDirectory.of(canonical_storage_uri(spec.run.storage), name)
    try:
        found = committed_checkpoints(spec, run_dir) if run_dir.location.exists() else []
    except Exception as e:  # storage unreachable: the command to resume is still the one
        kept = f"its run directory {run_dir.location.uri} could not be read ({e})"
    else:
        kept = (
            f"kept {run_dir.location.uri}, its newest committed checkpoint at step "
            f"{found[-1].step} ({found[-1].uri})"
            if found
            else f"no checkpoint committed yet in {run_dir.location.uri}"
        )
    return f"interrupted: run {name}: {kept}; resume it with: {resume}"


def print_summary(result: TrainingResult) -> None:
    best = {
        k: round(v, 4)
        for k, v in result.best_metrics.items()
        if isinstance(v, float) and (k.startswith("val_") or k == "loss")
    }
    retried = [a for a in result.attempts if a.status == "failed"]
    print(
        f"\nrun {result.run_name}: {result.status} after {len(result.attempts)} attempt(s)"
        f"{f' ({len(retried)} failed and resumed)' if retried else ''}, "
        f"{result.steps_completed} steps, {result.wall_time_s:.1f} s"
    )
    print(f"  best checkpoint:  {result.best_checkpoint_uri} {best}")
    print(f"  best model file:  {result.best_model_uri}  (torch.load(path, weights_only=True))")
    print(
        f"  run directory:    {result.run_uri}  (summary.json, loss_curve.png, step_time.png, "
        "metrics/)"
    )
    if result.time is not None and result.time.productive_share is not None:
        print(
            f"  time:             {result.time.productive_share:.0%} of the wall time trained "
            f"kept steps; `relaytrain show {result.run_uri} --time` has the breakdown"
        )
        for line in result.time.advice:
            print(f"  advice:           {line}")
    if result.status == "paused":
        print(
            f"  paused:           after epoch {result.epochs_completed} of "
            f"{result.target_epochs}; the same command without --until-epoch trains on"
        )
    print(f"  inspect it:       relaytrain show {result.run_uri}")
    print(f"  TensorBoard:      tensorboard --logdir {result.storage_uri}")
    if result.mlflow is not None:
        print(f"  MLflow:           {result.mlflow.describe()}")
    ui = PREFECT_UI_URL.value()  # None without PREFECT_API_URL
    if ui:  # a Prefect server holds the flow run and its artifacts
        print(f"  Prefect UI:       {ui}/runs")
    else:
        print(
            "  Prefect UI:       `prefect server start`, then rerun with "
            "PREFECT_API_URL=http://127.0.0.1:4200/api to see flow runs and artifacts there"
        )


if __name__ == "__main__":
    sys.exit(main())
