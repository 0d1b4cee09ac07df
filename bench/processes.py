"""The processes a benchmark or campaign starts, each the leader of its own session, ended with
it whatever happens: a flow that ignores SIGTERM, and what it started, included."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil


class Processes:
    """The processes a campaign started, each the leader of its own session
    (``start_new_session``): ``end_all`` ends each whole group, the flow and whatever it
    started, even one that ignores SIGTERM, so none outlives the campaign, pass or fail."""

    def __init__(self, grace_s: float = 10.0):
        self.grace_s = grace_s
        self.started: list[subprocess.Popen] = []

    def track(self, process: subprocess.Popen) -> subprocess.Popen:
        self.started.append(process)
        return process

    def end_all(self) -> None:
        """SIGTERM to every group still alive, then SIGKILL to what is left after the grace."""
        alive = [p for p in self.started if _group_alive(p.pid)]
        for process in alive:
            _signal_group(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        while any(_group_alive(p.pid) for p in alive) and time.monotonic() < deadline:
            for process in alive:
                process.poll()  # reap the leader, so its group can empty
            time.sleep(0.1)
        for process in alive:
            _signal_group(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=self.grace_s)
        deadline = time.monotonic() + self.grace_s  # SIGKILL lands, but not at once
        while any(_group_alive(p.pid) for p in alive) and time.monotonic() < deadline:
            time.sleep(0.05)


def _signal_group(pgid: int, signum: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signum)


def _group_alive(pgid: int) -> bool:
    """Whether any process of group ``pgid`` is alive (a zombie leader not counted)."""
    for proc in psutil.process_iter(["pid"]):
        # a process may end between the listing and the asking: os.getpgid then raises
        with contextlib.suppress(psutil.Error, ProcessLookupError, PermissionError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
    return False
