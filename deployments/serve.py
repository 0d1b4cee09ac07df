"""Serve relaytrain's deployments from this process (no work pool): ``python -m deployments.serve``.

The same two deployments as deployments/prefect.yaml: ``training/default`` and
``retraining/nightly`` (02:00 Europe/Berlin, one run at a time). ``--nightly-every SECONDS``
replaces the nightly cron with an interval, for demos and the schedule test.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

from prefect import serve
from prefect.schedules import Cron, Interval

from flows.retraining import retraining
from flows.training import training
from trainer_core.spec import load_spec

DEFAULT_SPEC = "examples/digits_cnn.yaml"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m deployments.serve", description=__doc__)
    parser.add_argument("--spec", default=DEFAULT_SPEC, help="the spec both deployments default to")
    parser.add_argument("--model-name", default="digits-cnn")
    parser.add_argument("--nightly-every", type=float, metavar="SECONDS")
    args = parser.parse_args(argv)
    spec = load_spec(args.spec).model_dump(mode="json")
    schedule = (
        Interval(timedelta(seconds=args.nightly_every))
        if args.nightly_every
        else Cron("0 2 * * *", timezone="Europe/Berlin")
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
