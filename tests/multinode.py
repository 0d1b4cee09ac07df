"""A local multi-node Ray cluster for tests: a head node (no CPUs, the job server on 127.0.0.1)
and worker nodes of one CPU each, as separate raylets on this machine (Ray's cluster utilities).

It lives in its own process (``python -m tests.multinode``) so it never mixes with the test
session's own Ray, and takes commands on stdin, answering one JSON line each:

    kill <node_id>              the node's processes are killed at once (a lost machine)
    drain <node_id> <seconds>   GCS is told the node will be preempted after <seconds>
    add                         one more worker node
    stop                        everything down

``MultiNodeCluster`` is the test-side handle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.net import free_port
from trainer_core.execution.cluster import RAY_ENV_DEFAULTS

REPO = Path(__file__).resolve().parents[1]


class MultiNodeCluster:
    """Starts ``python -m tests.multinode`` and talks to it."""

    def __init__(self, num_workers: int = 3, env: dict[str, str] | None = None):
        venv_bin = str(Path(sys.executable).parent)
        self.env = {
            **RAY_ENV_DEFAULTS,  # the nodes are started as the README asks of a user's cluster
            **os.environ,
            **(env or {}),
            # The jobs' drivers run `python -m trainer_core.run.jobs` and import test workloads.
            "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tests.multinode", str(num_workers)],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = self._answer()
        self.job_address: str = self.info["job_address"]
        self.gcs_address: str = self.info["gcs_address"]

    def _answer(self) -> dict[str, Any]:
        assert self.process.stdout is not None
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"multi-node cluster exited with {self.process.wait()}")
        return dict(json.loads(line))

    def command(self, *words: str) -> dict[str, Any]:
        assert self.process.stdin is not None
        self.process.stdin.write(" ".join(words) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def nodes(self) -> list[dict[str, Any]]:
        """Alive worker nodes with the actors on them:
        [{node_id, actors: [class names], train_worker_pids: [the Ray Train workers' pids]}]."""
        return list(self.command("nodes")["nodes"])

    def worker_nodes(self) -> list[str]:
        """Ids of the nodes that host a Ray Train worker now."""
        return [n["node_id"] for n in self.nodes() if "RayTrainWorker" in n["actors"]]

    def ensure_worker_nodes(self, count: int) -> None:
        """Add worker nodes until ``count`` are alive."""
        while len(self.nodes()) < count:
            self.command("add")

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.command("stop")
                self.process.wait(timeout=60)
            except Exception:
                self.process.kill()


def wait_until(predicate: Any, timeout_s: float = 180, what: str = "condition") -> Any:
    """``predicate()``'s first truthy value, polled; AssertionError after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out waiting for {what}")


# -- the cluster's own process ---------------------------------------------------------------------


def _serve(num_workers: int) -> None:
    import ray
    from ray.cluster_utils import Cluster
    from ray.core.generated import autoscaler_pb2

    dashboard_port = free_port()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 0,
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": dashboard_port,
            # Not Ray's fixed default (52365): the test session's own Ray may hold it, and
            # without its HTTP server the head's agent cannot take job submissions.
            "dashboard_agent_listen_port": free_port(),
        },
    )
    workers = {}
    for _ in range(num_workers):
        node = cluster.add_node(num_cpus=1)
        workers[node.node_id] = node
    cluster.wait_for_nodes()
    gcs = ray._raylet.GcsClient(address=cluster.gcs_address)
    job_address = f"http://127.0.0.1:{dashboard_port}"
    _wait_for_job_server(job_address)
    _reply(
        {
            "gcs_address": cluster.gcs_address,
            "job_address": job_address,
            "worker_node_ids": list(workers),
            "head_node_id": cluster.head_node.node_id,
        }
    )
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "stop":
            cluster.shutdown()
            _reply({"ok": True})
            return
        if words[0] == "kill":
            cluster.remove_node(workers.pop(words[1]), allow_graceful=False)
            _reply({"ok": True})
        elif words[0] == "drain":
            deadline_ms = int((time.time() + float(words[2])) * 1000)
            accepted, message = gcs.drain_node(
                words[1],
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "relaytrain test: spot instance reclaimed",
                deadline_ms,
            )
            _reply({"accepted": accepted, "message": message})
        elif words[0] == "add":
            node = cluster.add_node(num_cpus=1)
            workers[node.node_id] = node
            _reply({"node_id": node.node_id})
        elif words[0] == "nodes":
            _reply({"nodes": _actors_by_node(job_address, set(workers))})
        else:
            _reply({"error": f"unknown command {words[0]!r}"})


def _actors_by_node(job_address: str, node_ids: set[str]) -> list[dict[str, Any]]:
    from ray.util.state import list_actors

    actors = list_actors(address=job_address, filters=[("state", "=", "ALIVE")], limit=1000)
    return [
        {
            "node_id": node,
            "actors": sorted(a.class_name for a in actors if a.node_id == node),
            "train_worker_pids": sorted(
                a.pid for a in actors if a.node_id == node and a.class_name == "RayTrainWorker"
            ),
        }
        for node in sorted(node_ids)
    ]


def _wait_for_job_server(address: str, timeout_s: float = 60) -> None:
    import urllib.error
    import urllib.request

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(f"{address}/api/version", timeout=2):
                return
        except urllib.error.HTTPError:
            # It answers. Ray 2.60 turns on token auth for a new local cluster (RAY_AUTH_MODE
            # =token reaches this process): a request without the token is refused with 401,
            # which Ray's own clients send. Waiting for a 200 here waited out the deadline.
            return
        except OSError:
            time.sleep(0.5)
    raise RuntimeError(f"the Ray job server at {address} did not answer in {timeout_s} s")


def _reply(value: dict[str, Any]) -> None:
    print(json.dumps(value), flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]) if len(sys.argv) > 1 else 3)
