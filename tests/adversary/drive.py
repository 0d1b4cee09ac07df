"""A scenario's history played against the `relaytrain` command, as an operator's shell plays
it: each action one command (a process group of its own, its output in a log file), each fault
done to the command or to storage from outside, and what every command did recorded for the
oracles (``Outcome``)."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.adversary import data as tables
from tests.adversary import interrupt
from tests.adversary.processes import left_running, wait_bounded
from tests.adversary.scenario import (
    AFTER_COMMITS,
    Action,
    Fault,
    Scenario,
    on_a_node_of_their_own,
)
from tests.adversary.spec import spec_raw, validation_directory
from tests.adversary.store import RunFiles
from tests.adversary.world import NODE_RESOURCE, World

#: A lost node's retry delay: past Ray's death of the node (9-15 s after it is lost:
#: ``world.NODE_HEALTH_CHECKS``), before it is back (``scenario.NODE_AWAY_S`` after its death).
NODE_RETRY_DELAY_S = 18
#: The seconds each step of a command takes at least while storage or a node is to fail under
#: it: a tiny run trains its steps in a second or two, over before the fault could land.
STRAGGLER_STEP_S = 0.2


@dataclass
class Outcome:
    """What one command did."""

    index: int  # the action's place in the history
    kind: str  # the action, or what the driver ran for it ("again": after a kill or a repair)
    argv: list[str]
    code: int | None
    log: str
    expect: str = "ok"  # ok, killed, lease_refused, damaged_data, store_full
    fault: Fault | None = None
    #: raise, kill_rank: the step it was placed at, and the attempt it was for.
    fault_step: int | None = None
    fault_attempt: int | None = None
    attempts_before: int = 0
    attempts_after: int = 0
    committed_before: list[int] = field(default_factory=list)
    committed_after: list[int] = field(default_factory=list)
    left_running: list[str] = field(default_factory=list)
    #: It ran past the campaign's liveness bound (``World.command_limit_s``) and was killed.
    hung: bool = False
    #: Its wall time, from its start to its end (what the campaign's time goes to).
    seconds: float = 0.0
    detail: dict[str, Any] = field(default_factory=dict)

    def tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.log).read_text(errors="replace").splitlines()[-lines:])
        return ""


def child_uri(storage: str, name: str) -> str:
    """``name`` under a storage path or URI (its query, an S3 endpoint, kept at the end)."""
    path, mark, query = storage.partition("?")
    return f"{path.rstrip('/')}/{name}{mark}{query}"


def fault_step(at: int, first: int, last: int) -> int:
    """The step a raise or kill placed at ``at`` thousandths of a command's steps fires at: one
    of ``first + 1 .. last`` (``first``: the steps done before the command), past its first
    step so that the command trained before it."""
    if last <= first + 1:
        return last
    return first + 2 + at * (last - first - 1) // 1000


class Player:
    """Plays ``scenario`` in ``workdir`` against ``world``'s `relaytrain`; ``steps_per_epoch``
    (the reference run's, asked for when a fault is to be placed at a step: the reference may
    still be running beside the scenario) places the faults."""

    def __init__(
        self,
        scenario: Scenario,
        world: World,
        workdir: Path,
        steps_per_epoch: Callable[[], int],
        label: str = "adv",
    ):
        self.scenario = scenario
        self.world = world
        self.workdir = workdir
        self.steps_per_epoch = steps_per_epoch
        self.label = label
        self.rng = random.Random(scenario.seed * 7919 + 1)  # where damage lands in a file
        self.name = f"adversary-{scenario.seed}"
        self.dataset = workdir / "data"
        prefix = f"{label}-{scenario.seed}-{os.getpid()}-{workdir.name}"
        self.storage = world.storage_uri(scenario.shape.storage, prefix)
        self.run_uri = child_uri(self.storage, self.name)
        creds = world.s3.credential_env() if world.s3 is not None else {}
        direct = world.storage_uri(scenario.shape.storage, prefix, direct=True)
        self.files = RunFiles.at(child_uri(direct, self.name), creds)
        self.epochs = scenario.shape.epochs
        self.workers = scenario.shape.workers
        self.outcomes: list[Outcome] = []
        self._count = 0
        self._started: list[subprocess.Popen[bytes]] = []
        self._began: dict[str, float] = {}  # each command's log: when it started

    # -- the history ----------------------------------------------------------------------------

    def play(self) -> list[Outcome]:
        self.workdir.mkdir(parents=True, exist_ok=True)
        tables.write(self.scenario.data, self.dataset)
        if on_a_node_of_their_own(self.scenario):
            assert self.world.node is not None, "lose_node needs the world's worker node"
            self.world.node.ensure()
        if self.scenario.shape.validation_file:
            tables.write_validation(self.scenario.data, validation_directory(self.dataset))
        try:
            for index, action in enumerate(self.scenario.history):
                if action.kind in ("run", "rerun", "continue"):
                    self._train(index, action)
                elif action.kind == "show":
                    self.command(index, "show", ["show", self.run_uri, *action.option.split()])
                elif action.kind == "export":
                    self._export(index, action)
        finally:  # a campaign stopped mid-command (Ctrl-C, SIGTERM) leaves none running
            self._end_started()
        return self.outcomes

    def _end_started(self) -> None:
        """Every command of the scenario still running: its process group killed. A command runs
        in a session of its own, which a terminal's Ctrl-C does not reach."""
        for process in self._started:
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait()

    def _train(self, index: int, action: Action) -> None:
        epochs_before = self.epochs if action.kind != "run" else 0
        if action.kind == "continue":
            self.epochs += action.epochs
            self.workers = action.workers or self.workers
        fault = action.fault
        restore = self._damage(fault) if fault else None
        faults: list[dict[str, Any]] = []
        placed: dict[str, Any] = {}
        if fault and fault.kind in ("raise", "kill_rank"):
            per_epoch = self.steps_per_epoch()
            step = fault_step(fault.at, epochs_before * per_epoch, self.epochs * per_epoch)
            attempt = len(self.files.attempts()) + 1
            kind = "raise" if fault.kind == "raise" else "kill"
            rank = min(fault.rank, self.workers - 1)
            faults.append({"kind": kind, "at_step": step, "rank": rank, "attempt": attempt})
            placed = {"fault_step": step, "fault_attempt": attempt}
        elif fault and fault.kind in ("outage", "store_full", "lose_node", "crowd"):
            # every rank a straggler in each step the attempt's first group trains (relaytrain's
            # slow fault: a sleep in each step from at_step on, the bits unchanged), so that the
            # fault lands while the command trains, not after it
            attempt = len(self.files.attempts()) + 1
            faults += [
                {"kind": "slow", "at_step": 1, "rank": r, "attempt": attempt}
                | {"seconds": STRAGGLER_STEP_S}
                for r in range(self.workers)
            ]
        argv = self._run_argv(index, faults, loses_node=bool(fault and fault.kind == "lose_node"))
        expect = "damaged_data" if fault and fault.kind == "flip_data" else "ok"
        if fault and fault.kind in AFTER_COMMITS:
            outcome = interrupt.interrupted(self, index, action.kind, argv, fault)
        else:
            outcome = self.command(index, action.kind, argv, expect=expect, fault=fault, **placed)
        if restore is not None:  # the operator restores the file from its source, runs again
            restore()
            self.command(index, "again", argv)
        elif outcome.expect in ("killed", "store_full"):  # space freed, for a full store
            self.command(index, "again", argv)

    def _run_argv(
        self, index: int, faults: list[dict[str, Any]], loses_node: bool = False
    ) -> list[str]:
        raw = spec_raw(
            self.scenario,
            name=self.name,
            storage=self.storage,
            dataset=self.dataset,
            epochs=self.epochs,
            workers=self.workers,
            faults=faults,
        )
        if on_a_node_of_their_own(self.scenario):  # the group on the node it loses
            raw["scaling"]["resources_per_worker"] = {"CPU": 1, NODE_RESOURCE: 1}
        if loses_node:  # a user's retries whose next attempt comes once Ray counts it dead
            # (the others keep the default: a killed rank restarts in place, not 18 s later)
            raw["retries"].update(in_place=0, delay_s=NODE_RETRY_DELAY_S)
        path = self.workdir / f"spec-{index}-{len(self.outcomes)}.yaml"
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
        return ["run", "--config", str(path), "--result-json", str(path.with_suffix(".json"))]

    def _export(self, index: int, action: Action) -> None:
        out = self.workdir / f"export-{index}.pt"
        outcome = self.command(
            index, "export", ["export", self.run_uri, f"--{action.option}", str(out)]
        )
        summary = self.files.summary() or {}
        outcome.detail.update(out=str(out), summary=summary)

    # -- damage ---------------------------------------------------------------------------------

    def _damage(self, fault: Fault) -> Any:
        """Damage storage before a command; returns how to undo it where the operator would
        (a data file restored from its source), else None."""
        if fault.kind == "add_file":
            tables.add_file(self.scenario.data, self.dataset, fault.what)
        elif fault.kind == "flip_data":
            files = sorted(self.dataset.glob("part-0*.parquet"))
            victim = files[int(fault.what or 0) % len(files)]
            original = tables.flip_page_byte(victim, self.rng)
            return lambda: victim.write_bytes(original)
        elif fault.kind in ("flip_checkpoint", "flip_best"):
            step = self._target_checkpoint(fault.kind)
            if step is not None:
                self._flip_model(step)
        return None

    def _target_checkpoint(self, kind: str) -> int | None:
        committed = self.files.committed_steps()
        if not committed:
            return None
        if kind == "flip_checkpoint":
            return committed[-1]
        best = (self.files.summary() or {}).get("best_checkpoint_uri")
        if not best:
            return None
        step = int(best.rstrip("/").rsplit("checkpoint-", 1)[-1].split("?")[0].strip("/"))
        return step if step in committed else None

    def _flip_model(self, step: int) -> None:
        name = f"checkpoint-{step:09d}/model.pt"
        damaged = bytearray(self.files.read(name))
        damaged[len(damaged) // 2] ^= 0xFF
        self.files.write(name, bytes(damaged))

    # -- commands -------------------------------------------------------------------------------

    def start(self, argv: list[str]) -> tuple[subprocess.Popen[bytes], str, Path]:
        self._count += 1
        marker = f"{self.label}-{self.name}-{os.getpid()}-{self._count}"
        log = self.workdir / f"command-{self._count:02d}-{argv[0]}.log"
        command = [self.world.python, "-m", "flows.cli", *argv]
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                cwd=self.world.target,
                env=self.world.env(marker, self.scenario.shape.storage),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._started.append(process)
        self._began[str(log)] = time.monotonic()
        return process, marker, log

    def command(
        self,
        index: int,
        kind: str,
        argv: list[str],
        expect: str = "ok",
        fault: Fault | None = None,
        **placed: Any,
    ) -> Outcome:
        before = self.state()
        process, marker, log = self.start(argv)
        code, hung = wait_bounded(process, time.monotonic(), self.world.command_limit_s)
        return self.record(
            index, kind, argv, code, log, marker, before, expect, fault, placed, hung
        )

    def state(self) -> tuple[int, list[int]]:
        return len(self.files.attempts()), self.files.committed_steps()

    def record(
        self,
        index: int,
        kind: str,
        argv: list[str],
        code: int | None,
        log: Path,
        marker: str,
        before: tuple[int, list[int]],
        expect: str = "ok",
        fault: Fault | None = None,
        placed: dict[str, Any] | None = None,
        hung: bool = False,
    ) -> Outcome:
        after = self.state()
        outcome = Outcome(
            index=index,
            kind=kind,
            argv=argv,
            code=code,
            log=str(log),
            expect=expect,
            fault=fault,
            attempts_before=before[0],
            attempts_after=after[0],
            committed_before=before[1],
            committed_after=after[1],
            left_running=left_running(marker),
            hung=hung,
            seconds=round(time.monotonic() - self._began.get(str(log), time.monotonic()), 1),
            **(placed or {}),
        )
        self.outcomes.append(outcome)
        return outcome
