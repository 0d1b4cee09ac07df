"""The job's side of an attempt run as a Ray job (``jobs``): the driver inside the cluster.

``python -m trainer_core.run.job_entry --attempt N --spec BASE64`` runs ``engine.run_attempt``
there and prints each relayed event and, last, the outcome (the result, or the classified
error) as JSON lines behind a tag, which the caller's ``jobs.follow`` reads from the job's log.
``--lease-fence`` is the job's own id: its commits land only while the run's lease names it.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import sys
from typing import Any

from trainer_core import errors
from trainer_core.errors import RelaytrainError
from trainer_core.run import engine
from trainer_core.spec.run_spec import RunSpec

EVENT_TAG = "RELAYTRAIN_EVENT "
OUTCOME_TAG = "RELAYTRAIN_OUTCOME "


def _emit(tag: str, payload: dict[str, Any]) -> None:
    print(tag + json.dumps(payload, default=str), flush=True)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the job: run one attempt in the cluster, print events and the outcome."""
    parser = argparse.ArgumentParser(prog="python -m trainer_core.run.job_entry")
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--spec", required=True, help="the RunSpec as base64 JSON")
    parser.add_argument(
        "--lease-fence", help="commit only while the run's lease names this (the job's id)"
    )
    parser.add_argument("--until-epoch", type=int, help="pause the run after this epoch")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = RunSpec.model_validate_json(base64.b64decode(args.spec))
    try:
        result = engine.run_attempt(
            spec,
            attempt=args.attempt,
            on_event=lambda e: _emit(EVENT_TAG, e),
            lease_owner=args.lease_fence,
            until_epoch=args.until_epoch,
        )
    except RelaytrainError as error:
        _emit(OUTCOME_TAG, {"error": errors.to_json(error)})
        return 1
    _emit(OUTCOME_TAG, {"result": result.to_dict()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
