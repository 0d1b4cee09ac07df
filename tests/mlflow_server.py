"""A real `mlflow server` on loopback (SQLite backend, artifacts proxied through it), that a test
can stop and start again on the same port and database."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

from tests.net import free_port, stop, wait_until_answers


class MlflowServer:
    def __init__(self, root: Path):
        self.root = root
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.log_file = root / "mlflow-server.log"
        self.process: subprocess.Popen | None = None

    def start(self) -> MlflowServer:
        mlflow = Path(sys.executable).with_name("mlflow")
        command = [
            str(mlflow),
            "server",
            "--backend-store-uri",
            f"sqlite:///{self.root / 'mlflow.db'}",
            "--artifacts-destination",
            str(self.root / "artifacts"),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--workers",
            "1",
        ]
        env = {
            **os.environ,
            "MLFLOW_TRACKING_URI": "",
            # MLflow 3's server-side jobs (GenAI evaluation, trace roll-ups) start a job runner
            # and its huey consumers: 10 processes instead of 2, 28.9 CPU-s in the first 28 s
            # instead of 6.4; runs, metrics and artifacts, all relaytrain logs, need none of it.
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
        }
        with self.log_file.open("a") as log:
            self.process = subprocess.Popen(
                command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        wait_until_answers(f"{self.uri}/health", self.process, self.log_file, "mlflow server", 120)
        return self

    def stop(self) -> None:
        """Stop the server and the uvicorn process it started (its whole process group)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        stop(self.process)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process = None

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(tracking_uri=self.uri)
