"""The seeded adversary's campaign (``make adversary``): scenarios drawn from consecutive seeds,
each played against `relaytrain` and judged (``tests/adversary``), until ``--minutes`` have
passed; the result in ``bench/results/<date>-adversary.json``.

    python -m tools.adversary [--minutes 30] [--first-seed 1]
    python -m tools.adversary --seed 17              replay one seed (and shrink it if it fails)
    python -m tools.adversary --scenario FILE.json   replay a scenario written by a shrink
    python -m tools.adversary --target DIR --python DIR/.venv/bin/python ...
                                                     drive another checkout's `relaytrain`

A command still running after ``--command-limit`` seconds (600) is killed and judged hung.

Every violation prints its seed and the command that replays it; ``--shrink`` then looks for
the smallest history that still fails and writes it beside the result.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def play_one(scenario: Any, w: Any, root: Path) -> dict[str, Any]:
    """One scenario played and judged: its record for the campaign's result."""
    from tests.adversary.drive import Player
    from tests.adversary.oracles import judge
    from tests.adversary.reference import reference

    started = time.monotonic()
    record: dict[str, Any] = {"seed": scenario.seed, "scenario": scenario.describe()}
    record.update(scenario.kinds())

    def referenced() -> Any:
        made = reference(scenario, w, root / "references")
        record["reference_seconds"] = round(time.monotonic() - started, 1)
        return made

    try:
        root.mkdir(parents=True, exist_ok=True)
        workdir = Path(tempfile.mkdtemp(dir=root, prefix=f"seed-{scenario.seed}-"))
        # The reference runs beside the scenario (its own storage, on the cluster's spare
        # CPUs): its commands wait on Ray, Prefect and storage as much as they compute. Not
        # where the scenario crowds the cluster: its commands would hold the CPUs the crowd
        # leaves the scenario, or wait for them.
        crowds = any(a.fault and a.fault.kind == "crowd" for a in scenario.history)
        with concurrent.futures.ThreadPoolExecutor(1) as beside:
            pending = beside.submit(referenced)
            if crowds:
                pending.result()
            player = Player(scenario, w, workdir, lambda: pending.result().steps_per_epoch)
            player.play()
            ref = pending.result()
        checks, violations = judge(player, ref, w.secrets())
        record["checks"] = checks
        record["commands"] = [
            {
                "kind": o.kind,
                "code": o.code,
                "expect": o.expect,
                "seconds": o.seconds,
                "log": relative(o.log, root),
                **(
                    {"fault_missed": o.detail["fault_missed"]} if "fault_missed" in o.detail else {}
                ),
            }
            for o in player.outcomes
        ]
        # A fault due after commits that the command ended before: drawn, never done.
        record["faults_missed"] = [
            c["fault_missed"] for c in record["commands"] if "fault_missed" in c
        ]
        record["violations"] = [v.as_dict() for v in violations]
    except Exception as e:  # the adversary's own failure is reported, not a verdict
        record["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        record["violations"] = []
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def relative(path: str, root: Path) -> str:
    """``path`` under the campaign's root, as the result names it (no path of this machine's)."""
    with contextlib.suppress(ValueError):
        return str(Path(path).relative_to(root))
    return Path(path).name


def still_fails(record: dict[str, Any], w: Any, root: Path) -> Any:
    """Whether a smaller scenario still violates an invariant ``record`` violated."""
    invariants = {v["invariant"] for v in record["violations"]}

    def fails(candidate: Any) -> bool:
        got = play_one(candidate, w, root)
        return bool(invariants & {v["invariant"] for v in got["violations"]})

    return fails


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.adversary", description=__doc__)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--first-seed", type=int, default=1)
    parser.add_argument("--seed", type=int, action="append", default=[])
    parser.add_argument("--scenario", type=Path)
    parser.add_argument("--shrink", action="store_true")
    parser.add_argument(
        "--command-limit",
        type=float,
        default=600.0,
        help="seconds a command may run before it is killed and judged hung (0: no bound)",
    )
    parser.add_argument("--target", type=Path, default=REPO)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--root", type=Path, help="where scenarios write (default: a temp dir)")
    parser.add_argument("--out", type=Path, help="the result file (default: bench/results/)")
    args = parser.parse_args(argv)

    # A campaign ends on SIGTERM as on Ctrl-C: through its world's clean-up, which stops the
    # cluster and servers it started (the default handler would leave them running).
    signal.signal(signal.SIGTERM, _interrupt)
    # The cluster in token auth, as the test suite's (tests/conftest.py) and Ray 2.60's own
    # local clusters are: `ray start` and every command it runs read the same token. Set
    # before Ray is first imported (it reads the mode then).
    from tests import ray_auth

    ray_auth.token_mode()
    ray_auth.ensure_token()

    from tests.adversary.world import describe, world

    root = args.root or Path(tempfile.mkdtemp(prefix="adversary-"))
    replaying = bool(args.seed or args.scenario)
    deadline = time.monotonic() + args.minutes * 60
    records = []
    interrupted = False
    with world(root, args.target.resolve(), args.python) as w:
        # The liveness oracle: a tiny scenario's command trains for seconds to a minute or two
        # (retries and restarts included), so ten minutes is a hang, not a slow machine.
        w.command_limit_s = args.command_limit or None
        context = {"target": describe(w.target), "adversary": describe(REPO)}
        try:
            play_all(args, w, root, replaying, deadline, records)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: what was played is the result
            interrupted = True
            print("interrupted: the result holds the scenarios played to the end", flush=True)
    result = summarize(records, context, args)
    result["interrupted"] = interrupted
    out = args.out or REPO / "bench" / "results" / f"{time.strftime('%Y-%m-%d')}-adversary.json"
    if not replaying or args.out:
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"result: {out}")
    print(json.dumps({k: result[k] for k in ("scenarios", "violations", "errors")}))
    return 1 if result["violations"] or result["errors"] or interrupted else 0


def play_all(
    args: Any, w: Any, root: Path, replaying: bool, deadline: float, records: list[Any]
) -> None:
    """The campaign's scenarios, or the ones replayed, each played, judged and printed, its
    record added to ``records``; a violating one shrunk with ``--shrink``."""
    from tests.adversary.scenario import Scenario, draw
    from tests.adversary.shrink import shrink

    if args.scenario:
        queue = [Scenario.from_json(args.scenario.read_text())]
    else:
        queue = [draw(seed) for seed in args.seed]
    seed = args.first_seed
    while queue or (not replaying and time.monotonic() < deadline):
        scenario = queue.pop(0) if queue else draw(seed)
        seed += 0 if replaying else 1
        record = play_one(scenario, w, root)
        if scenario.shape.validation_file and "unknown key 'validation'" in record.get("error", ""):
            # A target from before data.validation: the same scenario, its validation rows a
            # hashed share of the table (drawn last, the knob leaves every other draw as it is).
            shape = dataclasses.replace(scenario.shape, validation_file=False)
            scenario = dataclasses.replace(scenario, shape=shape)
            record = play_one(scenario, w, root)
            record["adapted"] = "validation a hashed share: the target knows no data.validation"
        records.append(record)
        status = "VIOLATED" if record["violations"] else ("ERROR" if "error" in record else "ok")
        missed = record.get("faults_missed")
        note = f"; missed: {', '.join(missed)}, the command ended first" if missed else ""
        print(f"[{status}] {record['scenario']} ({record['seconds']} s{note})", flush=True)
        for v in record["violations"]:
            print(f"    {v['invariant']}: {v['what']}", flush=True)
        if record.get("error"):
            print(f"    adversary error: {record['error'][:2000]}", flush=True)
        if record["violations"]:
            print(f"    replay: python -m tools.adversary --seed {scenario.seed}", flush=True)
            if args.shrink:
                smallest, played = shrink(scenario, still_fails(record, w, root / "shrink"))
                path = root / f"shrunk-{scenario.seed}.json"
                path.write_text(smallest.to_json())
                record["shrunk"] = {
                    "scenario": smallest.describe(),
                    "played": played,
                    "file": str(path),
                }
                print(f"    shrunk ({played} played): {smallest.describe()}", flush=True)
                print(f"    replay: python -m tools.adversary --scenario {path}", flush=True)


def summarize(records: list[dict[str, Any]], context: dict[str, Any], args: Any) -> dict[str, Any]:
    actions: collections.Counter[str] = collections.Counter()
    faults: collections.Counter[str] = collections.Counter()
    shapes: collections.Counter[str] = collections.Counter()
    missed: collections.Counter[str] = collections.Counter()
    checks: collections.Counter[str] = collections.Counter()
    for r in records:
        actions.update(r.get("actions", []))
        faults.update(r.get("faults", []))
        shapes.update(r.get("shapes", []))
        missed.update(r.get("faults_missed", []))
        checks.update(r.get("checks", []))
    return {
        "schema": 1,
        "kind": "adversary",
        "at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **context,
        "minutes": args.minutes,
        "command_limit_s": args.command_limit or None,
        "scenarios": len(records),
        "actions": dict(actions),
        "faults": dict(faults),
        # Of those, the ones a command ended before (a fault due after commits: never done).
        "faults_missed": dict(missed),
        "shapes": dict(shapes),
        "invariants_checked": dict(checks),
        "violations": [
            {
                "seed": r["seed"],
                **v,
                "scenario": r["scenario"],
                **({"shrunk": r["shrunk"]} if "shrunk" in r else {}),
            }
            for r in records
            for v in r["violations"]
        ],
        "errors": [
            {"seed": r["seed"], "error": r["error"][:500]} for r in records if r.get("error")
        ],
        "records": records,
    }


if __name__ == "__main__":
    sys.exit(main())
