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
- ``corrupt``: one file of the newest committed checkpoint damaged in storage.

Node faults wait until all three nodes are back (two workers need two nodes; the third is the
spare), and the flow faults wait for a live flow that holds the lease. Nothing else waits: a
fault may arrive while the group recovers from the one before.

What must hold, asserted by ``verdict`` (the test suite runs a short seeded campaign):

- the command, run again after every kill, ends with exit code 0, and never failed otherwise;
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
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from bench import common
from bench.common import Result, Target
from trainer_core import storage
from trainer_core.checkpoint.run_directory import MANIFEST_FILE, MARKER_FILE, RunDirectory
from trainer_core.run import attempts
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.summary import attempt_summaries, steps_computed

NAME = "chaos"
KINDS = (
    "worker_kill",
    "node_kill",
    "drain",
    "flow_kill",
    "second_flow",
    "s3_outage",
    "corrupt",
)
#: The budgets a failure that ``kind`` causes may draw on. A drain whose notice the loop does
#: not see in time fails like a node loss; an outage the storage retries ride out fails nothing.
EXPECTED_BUDGETS: dict[str, set[str]] = {
    "worker_kill": {"infrastructure"},
    "node_kill": {"infrastructure"},
    "drain": {"preemption", "infrastructure"},
    "flow_kill": {"infrastructure"},  # DriverLost: killed between two attempts
    "second_flow": set(),
    "s3_outage": {"infrastructure"},
    "corrupt": set(),
}
NODES = 3
NOTICE_S = 10.0
GOODPUT_TARGET = Target(
    "goodput", "steps kept / steps computed, under the campaign's faults", ">=", 0.90
)


@dataclass(frozen=True)
class Settings:
    seed: int = 0
    faults: int = 21
    mean_gap_s: float = 15.0
    #: 64 steps each: 100 make about 9 minutes of uninterrupted training here.
    epochs: int = 100
    delay_s: float = 0.06
    #: The reference run's forward delay: the same as ``delay_s`` to measure wall-time
    #: efficiency; 0 when only its parameters matter (SlowMLP's delay changes no number).
    reference_delay_s: float | None = None
    #: No fault once the newest commit passed this fraction of the run (the last checkpoints
    #: are the ones the final checks read).
    window: float = 0.85


#: The test suite's: one fault of each kind at 8 s gaps, about 3 minutes under faults.
QUICK = Settings(faults=7, mean_gap_s=8.0, epochs=16, delay_s=0.06, reference_delay_s=0.0)


@dataclass
class Fault:
    kind: str
    at: float
    detail: dict[str, Any] = field(default_factory=dict)


def chaos_raw(storage_uri: str, name: str, job_address: str, epochs: int, delay_s: float) -> dict:
    """2 workers of a small MLP (dropout, Adam, a cosine schedule: an exact resume must restore
    RNG, optimizer and schedule), 64 steps an epoch, a checkpoint every 20 steps."""
    return {
        "run": {"name": name, "storage": storage_uri, "seed": 5},
        "model": {
            "name": "tests.helpers:slow_mlp",
            "kwargs": {"hidden": [64, 64], "dropout": 0.1, "delay_s": delay_s},
        },
        "data": {
            "dataset": "synthetic",
            "batch_size": 32,
            "validation_fraction": 0,
            "synthetic": {"num_samples": 2048, "num_features": 16},
        },
        "optimizer": {"name": "adam", "lr": 1e-3},
        "schedule": {"epochs": epochs, "lr_schedule": "cosine", "warmup_steps": 10},
        "scaling": {"num_workers": 2, "placement_strategy": "SPREAD", "job_address": job_address},
        "checkpoint": {"every": 20, "keep_last": 2, "keep_best": 0, "best_metric": "loss"},
        "report": {"every": 5},
        "retries": {"infrastructure": 100, "code": 0, "delay_s": 0, "jitter": 0, "in_place": 1},
    }


def total_steps(raw: dict) -> int:
    data = raw["data"]
    return data["synthetic"]["num_samples"] // data["batch_size"] * raw["schedule"]["epochs"]


class Campaign:
    """Drives one run through its faults. ``cluster`` is a ``tests.multinode.MultiNodeCluster``,
    ``s3`` a ``tests.s3.S3Server``, ``proxy`` an ``OutageProxy`` in front of it."""

    def __init__(
        self,
        cluster: Any,
        s3: Any,
        proxy: Any,
        workdir: Path,
        settings: Settings,
        env: dict[str, str],
    ) -> None:
        self.cluster, self.s3, self.proxy = cluster, s3, proxy
        self.workdir, self.settings, self.env = workdir, settings, env
        self.rng = random.Random(settings.seed)
        rotation = list(KINDS)
        self.rng.shuffle(rotation)
        self.pending = [rotation[i % len(rotation)] for i in range(settings.faults)]
        self.faults: list[Fault] = []
        self.timers: list[tuple[float, Callable[[], None]]] = []
        self.flow: subprocess.Popen | None = None
        self.flow_started_at = 0.0
        self.launches = 0
        self.unexpected_exits: list[dict[str, Any]] = []
        self.second_flows: list[tuple[Fault, subprocess.Popen, Path]] = []
        self.committed_seen: set[int] = set()
        self.nodes_down = 0

    # -- the runs ------------------------------------------------------------------------------

    def spec_file(self, name: str, delay_s: float) -> Path:
        raw = chaos_raw(
            self.s3.uri("chaos", port=self.proxy.port),
            name,
            self.cluster.job_address,
            self.settings.epochs,
            delay_s,
        )
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(raw))
        return path

    def direct(self, name: str) -> RunDirectory:
        """The run directory through the S3 server itself, not the proxy (the checks must see
        storage while an outage is played)."""
        return RunDirectory(storage.resolve(self.s3.uri("chaos")).child(name))

    def command(self, spec_file: Path) -> list[str]:
        return [sys.executable, "-m", "flows.training", "--config", str(spec_file)]

    def popen(self, spec_file: Path, log_name: str) -> tuple[subprocess.Popen, Path]:
        log = self.workdir / log_name
        with open(log, "w") as out:
            process = subprocess.Popen(
                self.command(spec_file),
                cwd=common.REPO,
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return process, log

    def reference(self, name: str) -> float:
        """Run the spec uninterrupted; its wall time."""
        delay = self.settings.reference_delay_s
        spec_file = self.spec_file(name, self.settings.delay_s if delay is None else delay)
        started = time.time()
        process, log = self.popen(spec_file, f"{name}.log")
        if process.wait(timeout=3600) != 0:
            raise RuntimeError(f"the uninterrupted run failed: {log.read_text()[-3000:]}")
        return time.time() - started

    def run(self, name: str) -> float:
        """Run the spec under the schedule of faults; its wall time, first launch to exit 0."""
        self.name = name
        self.spec = self.spec_file(name, self.settings.delay_s)
        self.steps = total_steps(yaml.safe_load(self.spec.read_text()))
        self.run_dir = self.direct(name)
        started = time.time()
        self._launch()
        next_at = time.time() + self._gap()
        while True:
            self._watch_commits()
            self._fire_timers()
            assert self.flow is not None
            code = self.flow.poll()
            if code == 0:
                break
            if code is not None:  # failed on its own: what a user would do is run it again
                self.unexpected_exits.append({"at": time.time(), "exit_code": code})
                if len(self.unexpected_exits) > 3:
                    raise RuntimeError(f"the flow keeps failing: {self._log_tail()}")
                self._launch()
            ready = self.pending and time.time() >= next_at and self._in_window()
            if ready and self._inject():
                next_at = time.time() + self._gap()
            time.sleep(0.2)
        wall = time.time() - started
        self._settle()
        return wall

    def _gap(self) -> float:
        return self.rng.expovariate(1.0 / self.settings.mean_gap_s)

    def _launch(self) -> None:
        self.launches += 1
        self.flow, self.flow_log = self.popen(self.spec, f"{self.name}-{self.launches}.log")
        self.flow_started_at = time.time()

    def _log_tail(self) -> str:
        return self.flow_log.read_text()[-4000:]

    def _watch_commits(self) -> None:
        with contextlib.suppress(Exception):  # storage being written: look again next time
            self.committed_seen.update(c.step for c in self.run_dir.scan().committed)

    def _in_window(self) -> bool:
        return max(self.committed_seen, default=0) < self.settings.window * self.steps and bool(
            self.committed_seen
        )

    def _later(self, delay_s: float, action: Callable[[], None]) -> None:
        self.timers.append((time.time() + delay_s, action))

    def _fire_timers(self) -> None:
        now = time.time()
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, action in sorted(due, key=lambda t: t[0]):
            action()

    def _settle(self) -> None:
        """Every timer run (nodes back, the proxy up), every second flow ended."""
        while self.timers:
            time.sleep(0.2)
            self._fire_timers()
        for _, process, _ in self.second_flows:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=120)

    # -- faults --------------------------------------------------------------------------------

    def _inject(self) -> bool:
        """Inject the first pending kind that can happen now; False if none can."""
        for index, kind in enumerate(self.pending):
            detail = getattr(self, f"_{kind}")()
            if detail is not None:
                del self.pending[index]
                self.faults.append(Fault(kind, time.time(), detail))
                print(f"[chaos] {time.strftime('%H:%M:%S')} {kind} {detail}", flush=True)
                return True
        return False

    def _add_node(self) -> None:
        self.cluster.command("add")
        self.nodes_down -= 1

    def _worker_node(self) -> str | None:
        """A node that hosts a Ray Train worker, when all nodes are up."""
        if self.nodes_down:
            return None
        nodes = [n["node_id"] for n in self.cluster.nodes() if n["train_worker_pids"]]
        return self.rng.choice(nodes) if nodes else None

    def _worker_kill(self) -> dict[str, Any] | None:
        pids = [p for n in self.cluster.nodes() for p in n["train_worker_pids"]]
        if not pids:
            return None
        pid = self.rng.choice(pids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return {"pid": pid}

    def _node_kill(self) -> dict[str, Any] | None:
        node = self._worker_node()
        if node is None:
            return None
        self.cluster.command("kill", node)
        self.nodes_down += 1
        back = self.rng.uniform(5, 15)
        self._later(back, self._add_node)
        return {"node": node[:8], "replaced_after_s": round(back, 1)}

    def _drain(self) -> dict[str, Any] | None:
        node = self._worker_node()
        if node is None:
            return None
        answer = self.cluster.command("drain", node, str(NOTICE_S))
        if not answer.get("accepted"):
            return None
        self.nodes_down += 1
        self._later(NOTICE_S - 1, lambda: self.cluster.command("kill", node))
        self._later(NOTICE_S + 2, self._add_node)
        return {"node": node[:8], "deadline_s": NOTICE_S}

    def _flow_ready(self) -> bool:
        """The flow lives and has held the lease a while, and no second flow is starting."""
        live_second = any(p.poll() is None for _, p, _ in self.second_flows)
        return (
            self.flow is not None
            and self.flow.poll() is None
            and time.time() - self.flow_started_at > 20
            and not live_second
        )

    def _flow_kill(self) -> dict[str, Any] | None:
        if not self._flow_ready():
            return None
        assert self.flow is not None
        os.killpg(self.flow.pid, signal.SIGKILL)
        self.flow.wait(timeout=30)
        self._launch()  # the command run again
        return {"launch": self.launches}

    def _second_flow(self) -> dict[str, Any] | None:
        if not self._flow_ready():
            return None
        process, log = self.popen(self.spec, f"{self.name}-second-{len(self.second_flows)}.log")
        fault = Fault("second_flow", time.time())
        self.second_flows.append((fault, process, log))
        return {"log": log.name}

    def _s3_outage(self) -> dict[str, Any] | None:
        if self.proxy.armed or self.proxy._listener is None:
            return None
        outage = round(self.rng.uniform(3, 8), 1)
        if self.rng.random() < 0.5:
            self.proxy.down()
            self._later(outage, self.proxy.up)
            return {"outage_s": outage, "when": "now"}
        self.proxy.arm(rb"PUT /[^ ]*/checkpoint-\d+/", outage)
        return {"outage_s": outage, "when": "the next checkpoint upload"}

    def _corrupt(self) -> dict[str, Any] | None:
        newest = self.run_dir.scan().newest
        if newest is None:
            return None
        names = [n for n in newest.files if n not in (MARKER_FILE, MANIFEST_FILE)]
        name = max(names, key=lambda n: newest.files[n]["size"])
        location = self.run_dir.checkpoint_location(newest.step).child(name)
        data = bytearray(location.read_bytes())
        data[len(data) // 2] ^= 0xFF
        location.write_bytes(bytes(data))
        return {"step": newest.step, "file": name}


# -- what the campaign left -------------------------------------------------------------------


def failures(records: list[AttemptRecord]) -> list[dict[str, Any]]:
    """Every worker group that ended by failing: when, on which budget, and when the next group
    resumed (None if none did)."""
    found = []
    for index, record in enumerate(records):
        for restart in record.restarts:
            if restart.get("reason") in ("capacity", None) or "failed_at" not in restart:
                continue
            found.append(
                {
                    "at": restart["failed_at"],
                    "budget": restart["reason"],
                    "error_class": restart.get("error_class"),
                    "resumed_at": restart.get("resumed_at"),
                    "resumed_from_step": restart.get("resumed_from_step"),
                }
            )
        if record.status == "failed":
            following = records[index + 1] if index + 1 < len(records) else None
            found.append(
                {
                    "at": record.ended_at or record.started_at,
                    "budget": record.error_budget,
                    "error_class": record.error_class,
                    "resumed_at": following.resumed_at if following else None,
                    "resumed_from_step": following.resumed_from_step if following else None,
                }
            )
    return sorted(found, key=lambda f: f["at"])


#: How long after a fault a failure may still be its doing: a drain's deadline (10 s), an
#: outage's length and the storage retries after it, the detection of a death.
EFFECT_S = 30.0


def attribute(faults: list[Fault], failure: dict[str, Any]) -> list[Fault]:
    """The faults a failure may answer, newest first: those in the ``EFFECT_S`` before it (a
    second of clock slack). Overlapping faults blur the cause: a worker killed while a node
    drains is charged to the preemption, by design (the survivors of a preemption fail first)."""
    return [
        f
        for f in reversed(faults)
        if failure["at"] - EFFECT_S <= f.at <= failure["at"] + 1.0 and f.kind != "corrupt"
    ]


def in_effect(faults: list[Fault], proxy_events: list[tuple[float, str]]) -> list[Fault]:
    """The faults at the time each took effect, oldest first. An outage armed for the next
    checkpoint upload begins when that upload is cut, which can be long after it was armed (the
    group was down, or the flow killed and run again); one never cut stays where it was armed.
    One outage is armed at a time, so the first cut after its arming is its own."""
    cuts = sorted(t for t, what in proxy_events if what.startswith("cut on"))
    placed = []
    for fault in faults:
        if fault.kind == "s3_outage" and fault.detail.get("when") == "the next checkpoint upload":
            cut = next((t for t in cuts if t >= fault.at), None)
            if cut is not None:
                fault = dataclasses.replace(fault, at=cut)
        placed.append(fault)
    return sorted(placed, key=lambda f: f.at)


def verdict(
    campaign: Campaign, run_dir: RunDirectory, reference_dir: RunDirectory
) -> dict[str, Any]:
    """The checks (``problems``: empty when everything held) and the figures."""
    from tests.recovery import assert_same_tensors, final_state, losses

    problems: list[str] = []
    records = attempts.read(run_dir)
    if not records or records[-1].status != "completed":
        problems.append(f"the run did not complete: {[r.status for r in records]}")
    if campaign.unexpected_exits:
        problems.append(f"the flow failed without a fault's kill: {campaign.unexpected_exits}")
    try:
        assert_same_tensors(final_state(run_dir), final_state(reference_dir))
    except AssertionError as e:
        problems.append(f"final state differs from the uninterrupted run's: {e}")
    history, expected = losses(run_dir), losses(reference_dir)
    steps = [step for step, _ in history]
    if steps != list(range(1, campaign.steps + 1)):
        problems.append(f"metrics history steps are not 1..{campaign.steps} once each")
    elif history != expected:
        problems.append("metrics history losses differ from the uninterrupted run's")
    kept = {c.step for c in run_dir.scan().committed}
    keep_last = 2
    must_keep = set(sorted(campaign.committed_seen | kept)[-keep_last:])
    if not must_keep <= kept:
        problems.append(f"committed checkpoints lost: kept {sorted(kept)}, newest {must_keep}")
    corrupted = {(f.detail["step"], f.at) for f in campaign.faults if f.kind == "corrupt"}
    found = failures(records)
    effective = in_effect(campaign.faults, campaign.proxy.events)
    per_kind: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for failure in found:
        causes = attribute(effective, failure)
        if not causes:
            problems.append(f"a failure with no fault in the {EFFECT_S:g} s before it: {failure}")
            continue
        if not any(failure["budget"] in EXPECTED_BUDGETS[f.kind] for f in causes):
            problems.append(
                f"{[f.kind for f in causes]} at {causes[0].at:.1f} was followed by a failure on "
                f"the {failure['budget']} budget ({failure['error_class']})"
            )
        fault = causes[0]
        if failure["resumed_at"] is not None:
            per_kind[fault.kind].append(failure["resumed_at"] - fault.at)
        for step, at in corrupted:
            if failure["at"] > at and failure["resumed_from_step"] == step:
                problems.append(f"a resume read the damaged checkpoint of step {step}")
    for _, process, log in campaign.second_flows:
        code = process.poll()
        text = log.read_text()
        if code != 2 or ("LeaseHeldError" not in text and "is held by" not in text):
            problems.append(f"a second flow was not refused by the lease: exit {code}, {log}")
    if campaign.pending:
        problems.append(f"the run ended before these faults came: {campaign.pending}")
    computed = steps_computed(attempt_summaries(records))
    figures = {
        "faults": len(campaign.faults),
        "faults_by_kind": {k: sum(f.kind == k for f in campaign.faults) for k in KINDS},
        "steps": campaign.steps,
        "steps_computed": computed,
        "goodput": round(campaign.steps / computed, 4) if computed else None,
        "attempts": len(records),
        "restarts_in_place": sum(len(r.restarts) for r in records),
        "failures": len(found),
        "faults_during_recovery": _during_recovery(effective, found),
        "checkpoint_uploads_cut": sum(
            1 for _, what in campaign.proxy.events if what.startswith("cut on")
        ),
        "flow_launches": campaign.launches,
        "recovery_s_by_kind": {
            kind: {
                "count": sum(f.kind == kind for f in campaign.faults),
                "restarts_caused": len(values),
                "median_recovery_s": round(statistics.median(values), 1) if values else None,
            }
            for kind, values in per_kind.items()
        },
    }
    return {"problems": problems, "figures": figures}


def _during_recovery(faults: list[Fault], found: list[dict[str, Any]]) -> int:
    """Faults that arrived while a worker group was failing over (failure to resume)."""
    windows = [(f["at"], f["resumed_at"]) for f in found if f["resumed_at"]]
    return sum(1 for fault in faults if any(a < fault.at < b for a, b in windows))


# -- the benchmark --------------------------------------------------------------------------------


@contextlib.contextmanager
def chaos_setup(workdir: Path) -> Iterator[tuple[Any, Any, Any, dict[str, str]]]:
    """moto S3 and its proxy, the multi-node cluster (the nodes hold the storage credentials),
    and a Prefect API; the environment a flow process gets."""
    from prefect.settings import PREFECT_API_URL

    from bench import harness
    from tests.multinode import MultiNodeCluster
    from tests.s3 import OutageProxy, moto_s3

    with moto_s3(workdir) as s3, OutageProxy(s3.port) as proxy:
        cluster = MultiNodeCluster(num_workers=NODES, env=s3.credential_env())
        try:
            with harness.prefect_api(), harness.env(**s3.credential_env()):
                env = {
                    **os.environ,
                    **s3.credential_env(),
                    "PREFECT_API_URL": str(PREFECT_API_URL.value()),
                    "PYTHONPATH": str(common.REPO),
                    "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                }
                yield cluster, s3, proxy, env
        finally:
            cluster.stop()


def campaign(workdir: Path, settings: Settings, setup: tuple[Any, ...]) -> dict[str, Any]:
    """Run the uninterrupted reference, then the campaign; the verdict with wall times."""
    cluster, s3, proxy, env = setup
    chaos = Campaign(cluster, s3, proxy, workdir, settings, env)
    tag = f"seed{settings.seed}-{int(time.time())}"
    reference_wall = chaos.reference(f"reference-{tag}")
    wall = chaos.run(f"chaos-{tag}")
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
    cli.add_argument("--faults", type=int, default=None, help="faults in all (default 21)")
    cli.add_argument("--mean-gap-s", type=float, default=None, help="default 15 (quick: 8)")
    args = cli.parse_args(argv)
    base = QUICK if args.quick else Settings()
    settings = dataclasses.replace(
        base,
        seed=args.seed,
        faults=args.faults or base.faults,
        mean_gap_s=args.mean_gap_s or base.mean_gap_s,
    )
    result = Result(NAME, args.quick, columns=["count", "restarts_caused", "median_recovery_s"])
    result.settings.update(
        dataclasses.asdict(settings),
        cluster=f"head (0 CPU) + {NODES} worker nodes of 1 CPU, one machine; 2 DDP workers",
        storage="moto S3 behind an outage proxy",
        workload="tests.helpers:slow_mlp, 64 steps an epoch, a checkpoint every 20, in_place 1",
    )
    with tempfile.TemporaryDirectory(prefix="relaytrain-chaos-") as tmp:
        workdir = Path(tmp)
        with chaos_setup(workdir) as setup:
            outcome = campaign(workdir, settings, setup)
    figures = result.figures = outcome["figures"]
    figures["problems"] = outcome["problems"]
    figures["faults"] = outcome["faults"]
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
        "checks: " + ("all held" if not outcome["problems"] else "; ".join(outcome["problems"])),
    ]
    result.targets.append(
        GOODPUT_TARGET.check(
            outcome["figures"]["goodput"],
            f"one fault every {settings.mean_gap_s:g} s on average (the issue's goal: 60 s)",
        )
    )
    for problem in outcome["problems"]:
        print(f"[chaos] PROBLEM: {problem}", file=sys.stderr)
    code = common.finish(result, args)
    return 1 if outcome["problems"] else code


if __name__ == "__main__":
    raise SystemExit(main())
