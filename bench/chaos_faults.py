"""The chaos campaign's injection: the run it drives (an uninterrupted reference, then the same
spec under faults) and, on a seeded schedule, the faults of ``bench.chaos_kinds`` it injects.

``Campaign`` starts the flow as its own process (``python -m flows.training --config ...``),
injects the next fault of a seeded rotation of ``KINDS`` at seeded exponential gaps, runs the
command again after a kill or a failure, and records what it did (``faults``, the flow's
launches and exits, the second flows, the commits it saw) for ``bench.chaos_analysis`` to judge.
"""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

from bench import common
from bench.chaos_kinds import KINDS, Fault, FaultKinds
from bench.processes import Processes
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory

NODES = 3
#: The newest commits that retention keeps (``checkpoint.keep_last`` of the campaign's spec).
KEEP_LAST = 2
#: Marks of the lines Ray's processes print into the flow's log.
RAY_OWN_LINES = ("(raylet)", "(gcs", "[state-dump]")


@dataclass(frozen=True)
class Settings:
    """The campaign's schedule of faults and its workload."""

    seed: int = 0
    faults: int = 36
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
    #: How long the Prefect server stays down (``prefect_outage``), at random within.
    prefect_outage_s: tuple[float, float] = (30.0, 90.0)
    #: The run under faults is stuck (``Overran``; ``chaos_analysis.stuck`` says what it was
    #: doing) when nothing moved (no new commit, fault or launch) for this many times the
    #: uninterrupted reference's wall time, measured just before on the same machine and load:
    #: a bound from the work, not a wall-clock guess. None: no bound.
    stall_references: float | None = None


#: The test suite's: one fault of each kind at 5 s gaps (exponential), about 3 minutes under faults
#: (16 epochs: in two runs on 2026-11-28 the last fault came at a newest commit of 680 and 540 of
#: 1024, the window closing at 870; with 14 epochs at 8 s gaps, and 18 at 7 s, ten kinds' last
#: faults came after the run's last window). With twelve kinds (a lost head, a damaged file) on
#: 2026-11-29 every fault came in the window, and the test took 355 s, its reference included.
QUICK = Settings(
    faults=len(KINDS),
    mean_gap_s=5.0,
    epochs=16,
    delay_s=0.06,
    reference_delay_s=0.0,
    prefect_outage_s=(10.0, 20.0),
    # About 175 s on 2 cores, its reference 40-60 s; the longest still spell seen between two
    # commits, faults or launches was a lost head's recovery, under a minute.
    stall_references=4.0,
)


class Overran(RuntimeError):
    """The run under faults stalled past ``Settings.stall_references`` reference runs."""


def chaos_raw(
    storage_uri: str, name: str, job_address: str, epochs: int, delay_s: float, dataset: Path
) -> dict:
    """2 workers of a small MLP (dropout, Adam, a cosine schedule: an exact resume must restore
    RNG, optimizer and schedule) on ``dataset`` (``write_dataset``), 64 steps an epoch, a
    checkpoint every 20 steps. Its shuffle windows are small, so that its readers hold a
    fraction of the rows and read the files again every epoch, as a dataset larger than memory
    is read (a damaged page is met within an epoch)."""
    return {
        "run": {"name": name, "storage": storage_uri, "seed": 5},
        "model": {
            "name": "tests.helpers:slow_mlp",
            "kwargs": {"hidden": [64, 64], "dropout": 0.1, "delay_s": delay_s},
        },
        "data": {
            "dataset": str(dataset),
            "features": "x",
            "label": "y",
            "task": "regression",
            "batch_size": 32,
            "validation_fraction": 0,
            "shuffle_window": 64,
            "partitions": 2,
        },
        "optimizer": {"name": "adam", "lr": 1e-3},
        "schedule": {"epochs": epochs, "lr_schedule": "cosine", "warmup_steps": 10},
        "scaling": {"num_workers": 2, "placement_strategy": "SPREAD", "job_address": job_address},
        "checkpoint": {"every": 20, "keep_last": KEEP_LAST, "keep_best": 0, "best_metric": "loss"},
        "report": {"every": 5},
        "retries": {"infrastructure": 100, "code": 0, "delay_s": 0, "jitter": 0, "in_place": 1},
    }


#: The campaign's dataset: the built-in synthetic regression rows as Parquet files.
ROWS, FEATURES, FILES, ROW_GROUP = 2048, 16, 4, 128


def write_dataset(directory: Path) -> None:
    """``FILES`` Parquet files of ``ROWS`` rows in all (a list column ``x`` of ``FEATURES``
    floats, a float label ``y``) in row groups of ``ROW_GROUP``, each page with its CRC32, as
    Spark writes them."""
    import numpy as np
    import pyarrow as pa

    from trainer_core.data.arrays import synthetic_arrays

    rows = synthetic_arrays(ROWS, FEATURES, noise=0.1)
    directory.mkdir(parents=True, exist_ok=True)
    for index, part in enumerate(np.array_split(np.arange(ROWS), FILES)):
        features = rows.features[part]
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), FEATURES),
                "y": pa.array(rows.labels[part]),
            }
        )
        pq.write_table(
            table,
            directory / f"part-{index}.parquet",
            row_group_size=ROW_GROUP,
            write_page_checksum=True,
        )


def total_steps(raw: dict) -> int:
    return ROWS // raw["data"]["batch_size"] * raw["schedule"]["epochs"]


def full_during(faults: list[Fault], start: float, end: float) -> bool:
    """Whether the store was full at some moment from ``start`` to ``end`` (a launch's life).
    Only a ``disk_full`` fills it, so a StorageFullError in such a launch is that fault's, however
    late it is reported: a failed write's error may reach the flow's exit a minute later, behind
    a worker group's end and a Prefect server that is down (seen at 68 s)."""
    return any(
        f.kind == "disk_full" and f.at <= end and f.at + f.detail["full_s"] >= start for f in faults
    )


class Campaign(FaultKinds):
    """Drives one run through its faults. ``cluster`` is a ``tests.multinode.MultiNodeCluster``,
    ``s3`` a ``tests.s3.S3Server``, ``proxy`` a ``tests.outage_proxy.OutageProxy`` in front of
    it, ``prefect`` the ``tests.prefect_server.PrefectServer`` that ``env`` names."""

    def __init__(
        self,
        cluster: Any,
        s3: Any,
        proxy: Any,
        workdir: Path,
        settings: Settings,
        env: dict[str, str],
        prefect: Any,
    ) -> None:
        self.cluster, self.s3, self.proxy, self.prefect = cluster, s3, proxy, prefect
        #: While the Prefect server, the Ray head is down.
        self.api_down = self.head_down = False
        #: Threads that start a server or a head again (``_in_thread``).
        self.background: list[threading.Thread] = []
        self.workdir, self.settings, self.env = workdir, settings, env
        self.data_dir = workdir / "data"
        write_dataset(self.data_dir)
        #: The data file damaged (``data_damaged``) and its bytes, until the flow fails of it.
        self.damaged: tuple[Path, bytes] | None = None
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
        #: The flow's exits of a full store (``disk_full``): each run again once space is freed.
        self.full_store_exits: list[dict[str, Any]] = []
        #: The flow's exits of a damaged data file (``data_damaged``): each run again once the
        #: file is restored.
        self.damaged_exits: list[dict[str, Any]] = []
        self.second_flows: list[tuple[Fault, subprocess.Popen, Path]] = []
        #: Every process started (the flows, the reference): ended by ``close``.
        self.processes = Processes()
        #: The uninterrupted reference's wall time (``reference``): the stall bound's unit.
        self.reference_wall_s: float | None = None
        self.committed_seen: set[int] = set()
        self.nodes_down = 0

    # -- the runs ------------------------------------------------------------------------------

    def spec_file(self, name: str, delay_s: float, commit_at_end_only: bool = False) -> Path:
        raw = chaos_raw(
            self.s3.uri("chaos", port=self.proxy.port),
            name,
            self.cluster.job_address,
            self.settings.epochs,
            delay_s,
            self.data_dir,
        )
        if commit_at_end_only:  # a checkpoint changes no number the checks compare
            raw["checkpoint"]["every"] = total_steps(raw)
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
        return self.processes.track(process), log

    def close(self) -> None:
        """End every process the campaign started that is still running (after a failure: a
        campaign that completed has none)."""
        self.processes.end_all()

    def reference(self, name: str) -> float:
        """Run the spec uninterrupted; its wall time. Where only its parameters and losses
        matter (``reference_delay_s`` set), it commits only its last step: its checkpoints every
        20 fast steps blocked half its training time (52 commits in 20 s of 1024 steps)."""
        delay = self.settings.reference_delay_s
        if delay is None:  # measured: trained as the run under faults is
            spec_file = self.spec_file(name, self.settings.delay_s)
        else:
            spec_file = self.spec_file(name, delay, commit_at_end_only=True)
        started = time.time()
        process, log = self.popen(spec_file, f"{name}.log")
        if process.wait(timeout=3600) != 0:
            raise RuntimeError(f"the uninterrupted run failed: {log.read_text()[-3000:]}")
        self.reference_wall_s = time.time() - started
        return self.reference_wall_s

    def run(self, name: str) -> float:
        """Run the spec under the schedule of faults; its wall time, first launch to exit 0."""
        self.name = name
        self.spec = self.spec_file(name, self.settings.delay_s)
        self.steps = total_steps(yaml.safe_load(self.spec.read_text()))
        self.run_dir = self.direct(name)
        started = time.time()
        self._launch()
        next_at = time.time() + self._gap()
        moved_at, moved = time.time(), self._progress()
        while True:
            if self._progress() != moved:
                moved_at, moved = time.time(), self._progress()
            self._check_stall(moved_at)
            self._watch_commits()
            self._fire_timers()
            code = None if self.flow is None else self.flow.poll()
            if code == 0:
                break
            if code is not None and self._failed_of_damaged_data():
                self.damaged_exits.append(
                    {"at": time.time(), "exit_code": code, "log": self.flow_log.name}
                )
                self._restore_data()
                self._launch()
            elif code is not None and self._failed_of_full_store():
                self.full_store_exits.append(
                    {"at": time.time(), "exit_code": code, "log": self.flow_log.name}
                )
                self.flow = None  # run again once space is freed
            elif code is not None:  # failed on its own: what a user would do is run it again
                self.unexpected_exits.append(
                    {"at": time.time(), "exit_code": code, "log": self.own_lines()}
                )
                if len(self.unexpected_exits) > 3:
                    raise RuntimeError(f"the flow keeps failing: {self._log_tail()}")
                self._launch()
            if self.flow is None and not self.proxy.is_full:
                self._launch()
            ready = self.pending and time.time() >= next_at and self._in_window()
            if ready and self._inject():
                next_at = time.time() + self._gap()
            time.sleep(0.2)
        wall = time.time() - started
        self._settle()
        return wall

    def _progress(self) -> tuple[int, int, int]:
        """What moves while the run is not stuck: the newest commit seen, faults, launches."""
        return max(self.committed_seen, default=-1), len(self.faults), self.launches

    def _check_stall(self, moved_at: float) -> None:
        """Overran when nothing moved for ``stall_references`` reference runs' wall time."""
        factor, unit = self.settings.stall_references, self.reference_wall_s
        if factor is None or unit is None:
            return
        still = time.time() - moved_at
        if still > factor * unit:
            raise Overran(
                f"the run under faults stalled: no new commit, fault or launch for {still:.0f} s, "
                f"{factor:g} times the uninterrupted run's {unit:.0f} s"
            )

    def _gap(self) -> float:
        return self.rng.expovariate(1.0 / self.settings.mean_gap_s)

    def _launch(self) -> None:
        self.launches += 1
        self.flow, self.flow_log = self.popen(self.spec, f"{self.name}-{self.launches}.log")
        self.flow_started_at = time.time()

    def _failed_of_full_store(self) -> bool:
        """The flow failed with StorageFullError and the store was full during its launch."""
        full = full_during(self.faults, self.flow_started_at, time.time())
        return full and "StorageFullError" in self.flow_log.read_text()

    def _failed_of_damaged_data(self) -> bool:
        """The flow failed with DataFileDamagedError while a data file was damaged (anywhere in
        this launch's log: its last lines may be a job's log relayed whole)."""
        return self.damaged is not None and "DataFileDamagedError" in self.flow_log.read_text()

    def _restore_data(self) -> None:
        """The damaged file's bytes back, as a backup restores them."""
        if self.damaged is not None:
            victim, original = self.damaged
            victim.write_bytes(original)
            self.damaged = None

    def own_lines(self, count: int = 40) -> list[str]:
        """The last ``count`` lines of the flow's log without Ray's own (a failure's record,
        what a stuck run was doing)."""
        lines = self.flow_log.read_text().splitlines()
        ours = [x for x in lines if x.strip() and not any(r in x for r in RAY_OWN_LINES)]
        return [x[:400] for x in ours[-count:]]

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
        """Every timer run (nodes, the proxy, the Prefect server back), every second flow ended."""
        while self.timers:
            time.sleep(0.2)
            self._fire_timers()
        for thread in self.background:
            thread.join()
        for _, process, _ in self.second_flows:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=120)
