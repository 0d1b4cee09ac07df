"""The processes of a scenario's commands: each waited for, within the campaign's liveness
bound where it has one, and what a command left running after it ended."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time

import psutil

#: How long the processes of a command that has ended may take to end after it (a Ray
#: worker's loader, a Prefect log flusher) before they count as left running.
LEFT_RUNNING_GRACE_S = 60.0


def wait_bounded(
    process: subprocess.Popen[bytes], started: float, limit_s: float | None
) -> tuple[int, bool]:
    """``process``'s exit code, and whether it ran past ``limit_s`` seconds from ``started``
    (``time.monotonic()``): then its process group (a session of its own) is killed. None: no
    bound."""
    if limit_s is None:
        return process.wait(), False
    try:
        return process.wait(timeout=max(0.0, started + limit_s - time.monotonic())), False
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait(), True


def left_running(marker: str) -> list[str]:
    """The processes a command started (its marker in their environment) still running once
    ``LEFT_RUNNING_GRACE_S`` has passed since it ended."""

    def ours() -> list[psutil.Process]:
        found = []
        for process in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if process.environ().get("RELAYTRAIN_ADVERSARY") == marker:
                    found.append(process)
        return found

    _, alive = psutil.wait_procs(ours(), timeout=LEFT_RUNNING_GRACE_S)
    running = []
    for process in alive:  # a zombie runs nothing: its reaper may just be late
        with contextlib.suppress(psutil.Error):
            if process.is_running() and process.status() != psutil.STATUS_ZOMBIE:
                running.append(f"{process.pid} {' '.join(process.cmdline()[:4])}")
    return running
