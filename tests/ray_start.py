"""A Ray cluster as a user's `ray start --head` makes it, at a fixed address, for tests that
take its head down and start it again there (a head node restarting)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.net import free_port
from trainer_core.execution.cluster import RAY_ENV_DEFAULTS


def head_command(port: int) -> list[str]:
    """`ray start --head --block` on GCS port ``port``, from this venv, without usage stats:
    the start of every head command a test runs (options of its own follow)."""
    return [
        str(Path(sys.executable).parent / "ray"),
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        f"--port={port}",
    ]


class RayStartHead:
    """`ray start --head --block` in its own process group; ``kill()`` SIGKILLs the whole group
    (GCS server, raylet, agents, workers: a lost head node) and ``start()`` starts it again at
    the same GCS address. Its ports are its own (not Ray's fixed defaults, which the test
    session's Ray may hold)."""

    def __init__(self, num_cpus: int = 2):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp_dir = tempfile.mkdtemp(prefix="rt-head-")  # short: Ray's socket paths
        self.args = [
            *head_command(self.port),
            f"--num-cpus={num_cpus}",
            "--include-dashboard=false",
            f"--dashboard-port={free_port()}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
        ]
        self.env = {
            **RAY_ENV_DEFAULTS,  # as the README asks of a user's cluster
            **os.environ,
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 120) -> RayStartHead:
        import ray._raylet

        log = open(Path(self.temp_dir) / "ray-start.log", "ab")  # noqa: SIM115 (the process's)
        self.process = subprocess.Popen(
            self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while True:  # up once its GCS answers and the head node is alive in it
            assert self.process.poll() is None, (Path(self.temp_dir) / "ray-start.log").read_text()
            try:
                gcs = ray._raylet.GcsClient(address=self.address)
                if any(n.state == 0 for n in gcs.get_all_node_info(timeout=2).values()):
                    return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def kill(self) -> None:
        """Every process of the head node, at once (SIGKILL to the group)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.process = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


class RayStartNode:
    """`ray start --address=<head> --block` for a worker node of this machine in its own process
    group, with ``resources`` of its own (what a spec asks for to place its workers there):
    ``kill()`` SIGKILLs the group (raylet, object store, agents; its workers exit as their raylet
    goes: a lost machine), ``gone()`` says once Ray counts it dead, and ``start()`` joins the
    cluster again (the machine back: a new node to Ray)."""

    def __init__(self, head: RayStartHead, num_cpus: int, resources: dict[str, float]):
        self.head = head
        self.resources = resources
        self.args = [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--block",
            "--disable-usage-stats",
            f"--address={head.address}",
            f"--num-cpus={num_cpus}",
            f"--resources={json.dumps(resources)}",
            f"--dashboard-agent-listen-port={free_port()}",
        ]
        self.log = Path(head.temp_dir) / "ray-start-node.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.node_id: bytes | None = None  # the node Ray knows it as, since its last start

    def _alive_ids(self) -> set[bytes]:
        """The alive nodes of the cluster that have this node's resources."""
        import ray._raylet

        gcs = ray._raylet.GcsClient(address=self.head.address)
        return {
            node_id
            for node_id, n in gcs.get_all_node_info(timeout=2).items()
            if n.state == 0 and all(k in dict(n.resources_total) for k in self.resources)
        }

    def start(self, timeout_s: float = 120) -> RayStartNode:
        before = self._alive_ids()  # a node killed a moment ago may still count as alive
        with self.log.open("ab") as log:
            self.process = subprocess.Popen(
                self.args,
                env=self.head.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout_s
        while True:  # up once the GCS counts a new node alive
            assert self.process.poll() is None, self.log.read_text()
            try:
                new = self._alive_ids() - before
                if new:
                    self.node_id = new.pop()
                    return self
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)

    def ensure(self) -> RayStartNode:
        """Up, started now if it is not."""
        if self.process is None or self.process.poll() is not None:
            self.start()
        return self

    def gone(self) -> bool:
        """Whether Ray counts the node of its last start dead."""
        return self.node_id not in self._alive_ids()

    def kill(self) -> None:
        """Every process of the node, at once (SIGKILL to the group)."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(30)
        self.process = None
