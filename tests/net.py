"""Loopback helpers the tests' own servers share."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from pathlib import Path

import requests


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until_answers(
    url: str, process: subprocess.Popen, log_file: Path, name: str, timeout_s: float = 60.0
) -> None:
    """Poll ``url`` until it answers with success; fail with the server's log if ``process``
    exits first, or after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}: {log_file.read_text()}")
        with contextlib.suppress(requests.RequestException):
            if requests.get(url, timeout=1).ok:
                return
        time.sleep(0.05)
    raise RuntimeError(f"{name} at {url} did not answer within {timeout_s:.0f} s")


def stop(process: subprocess.Popen) -> None:
    """Terminate a server process, and kill it if it does not exit within 10 s."""
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(10)
