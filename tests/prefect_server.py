"""A real `prefect server start` on loopback for the tests that need one (SQLite in a fresh
PREFECT_HOME, or a PostgreSQL database), which a test can stop and start again on the same
port and database: the Prefect API going away and coming back."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.net import free_port

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


@contextlib.contextmanager
def background(command: list[str], env: dict[str, str], log_path: Path, cwd: Path = REPO):
    """A process running beside the test, its output in ``log_path``; terminated afterwards."""
    with open(log_path, "a") as log:
        process = subprocess.Popen(command, env=env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT)
        try:
            yield process
        finally:
            process.terminate()
            try:
                process.wait(30)
            except subprocess.TimeoutExpired:  # a worker may wait on its runs: stop it hard
                process.kill()
                process.wait(30)


class PrefectServer:
    """``prefect server start --host 127.0.0.1`` on a port of its own; ``env`` reaches it."""

    def __init__(self, home: Path, ray_address: str, database_url: str | None = None):
        self.home = home
        self.port = free_port()
        self.api = f"http://127.0.0.1:{self.port}/api"
        self.ui = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(home),
            "PREFECT_API_URL": self.api,
            "PREFECT_UI_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RAY_ADDRESS": ray_address,
        }
        if database_url:
            self.env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = database_url
        self.env.pop("RELAYTRAIN_HOME", None)  # what older releases' pull step needed
        self.log = home / "server.log"
        self._running: contextlib.ExitStack | None = None
        self._process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 120) -> None:
        command = [str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1"]
        stack = contextlib.ExitStack()
        process = stack.enter_context(
            background([*command, "--port", str(self.port)], self.env, self.log)
        )
        self._running, self._process = stack, process
        deadline = time.time() + timeout_s
        while True:
            try:
                urllib.request.urlopen(f"{self.api}/health", timeout=2)
                return
            except OSError:
                assert process.poll() is None, self.log.read_text()[-5000:]
                assert time.time() < deadline, f"prefect server did not start in {timeout_s} s"
                time.sleep(0.5)

    def kill(self) -> None:
        """The server goes away at once (a crashed or rescheduled pod): SIGKILL to whatever
        listens on its port (the API's process) and to ``prefect server start`` itself."""
        assert self._process is not None
        for pid in {*_listening(self.port), self._process.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.stop()

    def stop(self) -> None:
        if self._running is not None:
            self._running.close()
            self._running = None

    def as_dict(self) -> dict[str, Any]:
        return {"api": self.api, "ui": self.ui, "env": self.env, "home": self.home}


def _listening(port: int) -> list[int]:
    """The pids listening on ``port``."""
    import psutil

    return sorted(
        {
            c.pid
            for c in psutil.net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid
        }
    )


@contextlib.contextmanager
def prefect_server(
    home: Path, ray_address: str, database_url: str | None = None
) -> Iterator[dict[str, Any]]:
    """A running server for the block, as ``{"api", "ui", "env", "home"}``."""
    server = PrefectServer(home, ray_address, database_url)
    server.start()
    try:
        yield server.as_dict()
    finally:
        server.stop()
