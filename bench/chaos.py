"""Chaos campaign: one long run under a seeded random schedule of every fault kind in the fault
matrix, overlapping, and what it cost.

The run trains on the local multi-node cluster (``tests/multinode.py``: a head without CPUs and
three one-CPU worker nodes), 2 DDP workers spread over them, through Ray's Jobs API, its run
directory on the moto S3 server (``tests/s3.py``) behind a proxy that can play an outage. The
flow is a process of its own (``python -m flows.training --config ...``), as a user or a
Prefect worker starts it, so it can be killed and the command run again.

Faults arrive at seeded exponential gaps (``--mean-gap-s``), their kinds in a seeded rotation
so that every kind comes round (``--faults`` in all):

- ``worker_kill``: SIGKILL to one Ray Train worker process;
- ``node_kill``: a worker node lost at once; a new node joins 5-15 s later;
- ``drain``: a worker node drained for preemption with a 10 s deadline, lost 9 s later, and
  replaced;
- ``flow_kill``: SIGKILL to the flow process, and the command run again at once;
- ``second_flow``: the same command started a second time while the first one drives the run;
- ``s3_outage``: the S3 endpoint refuses connections for 3-8 s, either now or from the next
  checkpoint upload on (a fault during a checkpoint write);
- ``s3_slow``: every request to the S3 endpoint waits 0.3-1 s for 5-15 s (storage turning
  slow: nothing may fail of it; commits lag and catch up);
- ``corrupt``: one file of the newest committed checkpoint damaged in storage;
- ``prefect_outage``: the Prefect server (a real ``prefect server start`` on SQLite) killed
  while the flow trains, and started again on its database 30-90 s later (quick: 10-20 s).
- ``disk_full``: the S3 store full for 3-8 s (every write answered HTTP 507
  ``XMinioStorageFull``, as a full MinIO answers): a full store is not retried
  (docs/storage.md), so the flow fails with StorageFullError, and the command is run again once
  space is freed, as an automation would.
- ``head_restart``: the Ray head node lost and, without GCS fault tolerance, every worker node
  with it; a new head at the same GCS and job server ports 5-15 s later, with new worker nodes
  (a restarted head pod). The flow waits for the job server (``RELAYTRAIN_RAY_HEAD_WAIT_S``),
  finds its job gone with the old head, and the attempt fails on the infrastructure budget;
  the retry submits it again.
- ``data_damaged``: a byte flipped in a data page of one of the dataset's Parquet files (size
  and footer unchanged, so the pinned snapshot still matches). The page's checksum finds it
  when the rows are read again (within an epoch: the readers hold a fraction of the rows); a
  damaged file is not retried (docs/data.md), so the flow fails naming the file and row group,
  and the command is run again once the file is restored from its source.

The run reads the built-in synthetic regression rows written as Parquet files (with page
checksums, as Spark writes them) in the campaign's directory. Node faults wait until all three
nodes and the head are up (two workers need two nodes; the third is the spare), and the flow
faults (a Prefect outage, a lost head and a damaged file among them) wait for a live flow that
holds the lease, for the Prefect API and the head to answer, and for no file to be damaged.
Nothing else waits: a fault may arrive while the group recovers from the one before.

What must hold, asserted by ``verdict`` (the test suite runs a short seeded campaign):

- the command, run again after every kill and every failure of a full store or a damaged file,
  ends with exit code 0, and never failed otherwise; a failure of a full store says so, and one
  of a damaged file names it and its row group, both on no retry budget; every damaged file
  failed the flow (its damage was read);
- final parameters and optimizer state bit-identical to an uninterrupted run of the same spec
  (the world size is fixed at 2, so this is exact, not a coverage rule);
- the metrics history has one row per step, each loss the uninterrupted run's;
- no committed checkpoint was lost that retention did not remove (every commit seen while the
  run went is either kept or older than the ``keep_last`` newest);
- every failure drew on the budget its fault calls for, and happened after a fault;
- every second flow was refused with the lease error (exit code 2), and no resume read a
  damaged checkpoint.

Figures: goodput (steps kept / steps computed), wall-time efficiency (the uninterrupted run's
wall time / this run's), and per fault kind the count, the restarts it caused and their median
recovery seconds (fault to the next worker group's resume).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import common
from bench.chaos_analysis import PHASES, stuck, verdict
from bench.chaos_faults import KINDS, NODES, QUICK, Campaign, Overran, Settings
from bench.common import Result, Target

#: The command line, and what the test suite runs: a ``QUICK`` ``campaign`` on the cluster and
#: S3 server it brings, one fault of each of ``KINDS``.
__all__ = [
    "KINDS",
    "QUICK",
    "Settings",
    "campaign",
    "chaos_setup",
    "flow_env",
    "main",
    "prefect_server",
]

NAME = "chaos"
#: The per-kind table's medians of a recovery's phases (``chaos_analysis.PHASES``).
MEDIAN_PHASES = [f"median_{p}" for p in PHASES]
#: Issue 33's targets (issue 19 asked goodput >= 0.90).
GOODPUT_TARGET = Target(
    "goodput", "steps kept / steps computed, under the campaign's faults", ">=", 0.98
)
WALL_TARGET = Target(
    "wall_time_efficiency",
    "the uninterrupted run's wall time / the wall time under the campaign's faults",
    ">=",
    0.80,
)


@contextlib.contextmanager
def chaos_setup(workdir: Path) -> Iterator[tuple[Any, ...]]:
    """moto S3 and its proxy, the multi-node cluster (the nodes hold the storage credentials),
    and a Prefect server (``prefect_server``); the environment a flow process gets."""
    from bench import harness
    from tests.multinode import MultiNodeCluster
    from tests.outage_proxy import OutageProxy
    from tests.s3 import moto_s3

    with moto_s3(workdir) as s3, OutageProxy(s3.port) as proxy:
        cluster = MultiNodeCluster(num_workers=NODES, env=s3.credential_env())
        try:
            with prefect_server(workdir) as server, harness.env(**s3.credential_env()):
                yield cluster, s3, proxy, flow_env(server, s3.credential_env()), server
        finally:
            cluster.stop()


@contextlib.contextmanager
def prefect_server(workdir: Path) -> Iterator[Any]:
    """A real ``prefect server start`` on SQLite that the campaign can kill and start again."""
    from tests.prefect_server import PrefectServer

    home = workdir / "prefect"
    home.mkdir(exist_ok=True)
    server = PrefectServer(home, ray_address="")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def flow_env(server: Any, credentials: dict[str, str]) -> dict[str, str]:
    """The environment of a flow process: the server's API, the storage credentials, the repo.
    Prefect's client retries 7 times (about 4 minutes of backoff, where 5 give a minute), as
    docs/failure-and-resume.md advises for outages longer than a minute: a task's state change
    may fall into a 90 s outage."""
    return {
        **os.environ,
        **credentials,
        "PREFECT_API_URL": server.api,
        "PREFECT_CLIENT_MAX_RETRIES": "7",
        "PYTHONPATH": str(common.REPO),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }


def campaign(workdir: Path, settings: Settings, setup: tuple[Any, ...]) -> dict[str, Any]:
    """Run the uninterrupted reference, then the campaign; the verdict with wall times."""
    cluster, s3, proxy, env, prefect = setup
    chaos = Campaign(cluster, s3, proxy, workdir, settings, env, prefect)
    tag = f"seed{settings.seed}-{int(time.time())}"
    try:
        reference_wall = chaos.reference(f"reference-{tag}")
        wall = chaos.run(f"chaos-{tag}")
    except Overran as e:
        raise RuntimeError(f"{e}: {stuck(chaos)}") from e
    finally:
        chaos.close()  # a failed campaign leaves no flow running
    outcome = verdict(chaos, chaos.direct(f"chaos-{tag}"), chaos.direct(f"reference-{tag}"))
    figures = outcome["figures"]
    figures["wall_s"] = round(wall, 1)
    figures["reference_wall_s"] = round(reference_wall, 1)
    if settings.reference_delay_s is None:
        figures["wall_time_efficiency"] = round(reference_wall / wall, 4)
    outcome["faults"] = [dataclasses.asdict(f) for f in chaos.faults]
    return outcome


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=1)
    cli.add_argument("--seed", type=int, default=0)
    cli.add_argument(
        "--faults", type=int, default=None, help="faults in all (default 36: 3 of each kind)"
    )
    cli.add_argument("--mean-gap-s", type=float, default=None, help="default 15 (quick: 5)")
    cli.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="the run's length: 64 steps an epoch, about 5.4 s each uninterrupted here "
        "(default 100; quick: 20); a sparser campaign (--mean-gap-s 60) needs a longer run "
        "to place its faults in",
    )
    args = cli.parse_args(argv)
    base = QUICK if args.quick else Settings()
    settings = dataclasses.replace(
        base,
        seed=args.seed,
        faults=args.faults or base.faults,
        mean_gap_s=args.mean_gap_s or base.mean_gap_s,
        epochs=args.epochs or base.epochs,
    )
    result = Result(
        NAME, args.quick, columns=["count", "restarts_caused", "median_recovery_s", *MEDIAN_PHASES]
    )
    result.settings.update(
        dataclasses.asdict(settings),
        cluster=f"head (0 CPU) + {NODES} worker nodes of 1 CPU, one machine; 2 DDP workers",
        storage="moto S3 behind an outage proxy",
        workload="tests.helpers:slow_mlp on 4 Parquet files (2048 rows), 64 steps an epoch, "
        "a checkpoint every 20, in_place 1",
    )
    with tempfile.TemporaryDirectory(prefix="relaytrain-chaos-") as tmp:
        workdir = Path(tmp)
        with chaos_setup(workdir) as setup:
            outcome = campaign(workdir, settings, setup)
    report(result, outcome, settings)
    for problem in outcome["problems"]:
        print(f"[chaos] PROBLEM: {problem}", file=sys.stderr)
    code = common.finish(result, args)
    return 1 if outcome["problems"] else code


def report(result: Result, outcome: dict[str, Any], settings: Settings) -> None:
    """The campaign's outcome as the result's figures (its kinds as the table's rows), notes
    and goodput target."""
    figures = result.figures = outcome["figures"]
    figures["problems"] = outcome["problems"]
    figures["faults"] = outcome["faults"]
    figures["attempt_records"] = outcome["attempts"]
    figures["row_name"] = "fault kind"
    figures["rows"] = figures["recovery_s_by_kind"]
    count = len(figures["faults"])
    result.notes += [
        f"{count} faults in {figures['wall_s']:g} s; {figures['failures']} ended a "
        f"worker group ({figures['attempts']} attempts, {figures['restarts_in_place']} restarts "
        f"in place); {figures['faults_during_recovery']} arrived during a recovery, "
        f"{figures['checkpoint_uploads_cut']} cut a checkpoint upload",
        f"goodput {figures['goodput']}: {figures['steps']} steps kept of "
        f"{figures['steps_computed']} computed; wall-time efficiency "
        f"{figures.get('wall_time_efficiency')} (uninterrupted {figures['reference_wall_s']:g} s)",
        "recovery seconds summed over the failures that resumed, by phase (fault to failure "
        "known, to the next attempt's driver, to its workers resumed): "
        + ", ".join(f"{p} {s:g}" for p, s in figures["recovery_phases_s"].items()),
        "checks: " + ("all held" if not outcome["problems"] else "; ".join(outcome["problems"])),
    ]
    rate = f"one fault every {settings.mean_gap_s:g} s on average"
    result.targets.append(GOODPUT_TARGET.check(figures["goodput"], rate))
    if "wall_time_efficiency" in figures:  # measured when the reference trains as slowly
        result.targets.append(WALL_TARGET.check(figures["wall_time_efficiency"], rate))


if __name__ == "__main__":
    raise SystemExit(main())
