"""The faults that come while a command runs, once it has committed ``fault.at`` checkpoints:
its process group killed (``kill_flow``), the same command started beside it (``second_flow``),
its object storage gone for a while (``outage``) or full (``store_full``), the node its workers
run on lost (``lose_node``), the cluster's CPUs held by other work from before it starts until
then (``crowd``). Each plays the fault from outside, as the world does it to a user,
and records what the command did (``Player.record``)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tests.adversary.crowd import crowded
from tests.adversary.processes import wait_bounded
from tests.adversary.scenario import Fault

if TYPE_CHECKING:
    from tests.adversary.drive import Outcome, Player


def interrupted(player: Player, index: int, kind: str, argv: list[str], fault: Fault) -> Outcome:
    """The command started, and ``fault`` done to it once it has committed ``fault.at``
    checkpoints; a command that ends first is recorded as it ended. A crowd holds the
    cluster's CPUs from before the command starts."""
    if fault.kind != "crowd":
        return _after_commits(player, index, kind, argv, fault)
    with contextlib.ExitStack() as crowd:
        held = crowd.enter_context(crowded(player.world, f"crowd-{player.name}"))
        outcome = _after_commits(player, index, kind, argv, fault, crowd.close)
    outcome.detail["cpus_held"] = held
    return outcome


def _after_commits(
    player: Player,
    index: int,
    kind: str,
    argv: list[str],
    fault: Fault,
    free: Callable[[], None] = lambda: None,
) -> Outcome:
    """The command started, and ``fault`` done to it once it has committed ``fault.at``
    checkpoints (``free``: what ends a crowd)."""
    before = player.state()
    process, marker, log = player.start(argv)
    started, limit = time.monotonic(), player.world.command_limit_s

    def overdue() -> bool:  # past the liveness bound: judged hung by wait_bounded
        return limit is not None and time.monotonic() - started > limit

    while process.poll() is None and not overdue():
        new = [s for s in player.files.committed_steps() if s not in before[1]]
        if len(new) >= fault.at:
            break
        time.sleep(0.2)
    if process.poll() is not None or overdue():  # it ended (or hung) before the fault
        code, hung = wait_bounded(process, started, limit)
        outcome = player.record(index, kind, argv, code, log, marker, before, hung=hung)
        outcome.detail["fault_missed"] = fault.kind
        return outcome
    if fault.kind == "kill_flow":
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
        return player.record(index, kind, argv, code, log, marker, before, "killed", fault)
    if fault.kind in ("outage", "store_full"):
        return _storage_fails(player, index, kind, argv, fault, (process, marker, log), before)
    if fault.kind == "lose_node":
        return _node_lost(player, index, kind, argv, fault, (process, marker, log), before)
    if fault.kind == "crowd":  # the CPUs free: Ray's resize monitor grows the group
        free()
        code, hung = wait_bounded(process, started, limit)
        return player.record(index, kind, argv, code, log, marker, before, "ok", fault, hung=hung)
    second = player.command(index, "second_flow", argv, expect="lease_refused", fault=fault)
    if second.code == 0 and process.poll() is not None:
        second.expect = "ok"  # the first had ended meanwhile: the run was free to take
    code, hung = wait_bounded(process, started, limit)
    outcome = player.record(index, kind, argv, code, log, marker, before, "ok", None, hung=hung)
    outcome.detail["second"] = second.code
    return outcome


def _storage_fails(
    player: Player,
    index: int,
    kind: str,
    argv: list[str],
    fault: Fault,
    started: tuple[subprocess.Popen[bytes], str, Path],
    before: tuple[int, list[int]],
) -> Outcome:
    """Object storage goes away for ``fault.what`` seconds and comes back (the command goes
    on), or fills up until the command ends (it stops naming the full store, or ends before
    it wrote again); storage is whole again for whatever comes next."""
    proxy = player.world.proxy
    assert proxy is not None, "storage faults need the world's proxy (S3 storage)"
    process, marker, log = started
    begun = time.monotonic()
    try:
        if fault.kind == "outage":
            proxy.down()
            time.sleep(float(fault.what))
            proxy.up()
        else:
            proxy.fill(fault.what)
        code, hung = wait_bounded(process, begun, player.world.command_limit_s)
    finally:
        if not proxy.is_up:
            proxy.up()
        proxy.free()
    expect = "store_full" if fault.kind == "store_full" else "ok"
    return player.record(index, kind, argv, code, log, marker, before, expect, fault, hung=hung)


def _node_lost(
    player: Player,
    index: int,
    kind: str,
    argv: list[str],
    fault: Fault,
    started: tuple[subprocess.Popen[bytes], str, Path],
    before: tuple[int, list[int]],
) -> Outcome:
    """The workers' node lost at once; back ``fault.what`` seconds after Ray counts it
    dead (the retry meets a cluster without it), while the command runs. The command must
    wait for it and go on."""
    node = player.world.node
    assert node is not None
    process, marker, log = started
    begun = time.monotonic()
    try:
        node.kill()
        while process.poll() is None and not node.gone():
            time.sleep(0.2)
        time.sleep(float(fault.what))
        node.start()
        code, hung = wait_bounded(process, begun, player.world.command_limit_s)
    finally:
        node.ensure()  # up for what comes next
    return player.record(index, kind, argv, code, log, marker, before, "ok", fault, hung=hung)
