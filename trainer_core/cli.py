"""Run one attempt of a spec on Ray without Prefect: ``python -m trainer_core.cli --config X``.

Re-running the same command with the same ``--run-name`` resumes from the newest committed
checkpoint. Retries, progress artifacts and the UI come with the Prefect flow (flows/).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

from trainer_core import engine
from trainer_core.errors import RelaytrainError
from trainer_core.spec import load_spec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer_core.cli", description=__doc__)
    parser.add_argument("--config", required=True, help="a run spec YAML (see examples/)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a spec field, e.g. --set scaling.num_workers=2",
    )
    parser.add_argument("--run-name", help="the run's durable name (same name resumes)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    try:
        spec = load_spec(args.config, args.set)
        name = (
            args.run_name or spec.run.name or spec.default_run_name(time.strftime("%Y%m%d-%H%M%S"))
        )
        spec = spec.with_run_name(name)

        def show(event: dict) -> None:
            if event["kind"] == "metrics":
                last = event["rows"][-1]
                extra = {k: round(v, 4) for k, v in last.items() if k.startswith("val_")}
                print(
                    f"step {last['step']:>5}  epoch {last['epoch']}  loss {last['loss']:.4f}"
                    + (f"  {extra}" if extra else ""),
                    flush=True,
                )
            elif event["kind"] in ("resumed", "fresh_start", "checkpoint"):
                shown = {k: v for k, v in event.items() if k not in ("kind", "time", "rows")}
                print(f"{event['kind']}: {shown}", flush=True)

        result = engine.run_attempt(spec, on_event=show)
    except RelaytrainError as e:
        print(f"error ({type(e).__name__}): {e}", file=sys.stderr)
        return 2
    print(json.dumps(result.to_dict(), indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
