"""Serve relaytrain's deployments from this process (no work pool): ``python -m deployments.serve``.

The same two deployments as deployments/prefect.yaml: ``training/default`` and
``retraining/nightly`` (02:00 Europe/Berlin, one run at a time). ``--cron EXPR`` replaces the
nightly cron (still Europe/Berlin); ``--nightly-every SECONDS`` replaces it with an interval, for
demos and the schedule test. Bad options are refused before anything is served.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from prefect import serve
from prefect.client.schemas.schedules import CronSchedule
from prefect.schedules import Cron, Interval
from pydantic import ValidationError

from flows.retraining import retraining
from flows.training import training
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import load_spec

DEFAULT_SPEC = "examples/digits_cnn.yaml"
NIGHTLY_CRON = "0 2 * * *"


def cron_expression(value: str) -> str:
    """``--cron``: a cron string as Prefect's own CronSchedule validates it."""
    try:
        CronSchedule(cron=value)
    except ValidationError as e:
        reason = e.errors()[0]["msg"].removeprefix("Value error, ")
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a cron schedule ({reason}): give five fields, minute hour "
            f"day-of-month month day-of-week, e.g. --cron '{NIGHTLY_CRON}'"
        ) from e
    return value


def positive_seconds(value: str) -> float:
    """``--nightly-every``: seconds > 0."""
    try:
        if float(value) > 0:
            return float(value)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"{value!r} is not a number of seconds > 0: e.g. 60")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__)
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="the spec both deployments default to")
    parser.add_argument("--model-name", default="digits-cnn")
    when = parser.add_mutually_exclusive_group()
    when.add_argument(
        "--cron", type=cron_expression, default=NIGHTLY_CRON, metavar="EXPR", help="nightly's cron"
    )
    when.add_argument(
        "--nightly-every", type=positive_seconds, metavar="SECONDS", help="nightly as an interval"
    )
    args = parser.parse_args(argv)
    try:
        spec = load_spec(args.spec).model_dump(mode="json")
    except SpecError as e:
        parser.error(f"argument --spec: {e}")
    schedule = (
        Interval(timedelta(seconds=args.nightly_every))
        if args.nightly_every
        else Cron(args.cron, timezone="Europe/Berlin")
    )
    serve(
        training.to_deployment(name="default", parameters={"spec": spec}, tags=["relaytrain"]),
        retraining.to_deployment(
            name="nightly",
            parameters={"spec": spec, "model_name": args.model_name, "promote_margin": 0.002},
            schedules=[schedule],
            concurrency_limit=1,
            tags=["relaytrain", "retraining"],
        ),
    )


if __name__ == "__main__":
    main()
