"""A local multi-node Ray cluster for tests: a head node (no CPUs, the job server on 127.0.0.1)
and worker nodes of one CPU each, as separate raylets on this machine (Ray's cluster utilities).

It lives in its own process (``python -m tests.multinode``) so it never mixes with the test
session's own Ray, and takes commands on stdin, answering one JSON line each:

    kill <node_id>              the node's processes are killed at once (a lost machine)
    drain <node_id> <seconds>   GCS is told the node will be preempted after <seconds>
    add                         one more worker node
    head_kill                   the head node lost at once, and with it (no GCS fault
                                tolerance) the worker nodes: everything killed
    head_start                  a new head at the lost one's GCS and job server ports (a new
                                cluster, as a restarted head pod is) with as many worker nodes
    stop                        everything down

``MultiNodeCluster`` is the test-side handle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
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
            # The jobs' drivers (`python -m trainer_core.run.job_entry`) import test workloads.
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
        self._lock = threading.Lock()
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
        """One command and its answer; one at a time (a head is started from a thread)."""
        assert self.process.stdin is not None
        with self._lock:
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
    from ray.core.generated import autoscaler_pb2

    nodes = _Nodes(num_workers)
    nodes.start()
    _reply(
        {
            "gcs_address": nodes.gcs_address,
            "job_address": nodes.job_address,
            "worker_node_ids": list(nodes.workers),
            "head_node_id": nodes.cluster.head_node.node_id,
        }
    )
    for line in sys.stdin:
        words = line.split()
        if not words:
            continue
        if words[0] == "stop":
            if nodes.up:
                nodes.cluster.shutdown()
            _reply({"ok": True})
            return
        if words[0] == "kill":
            node = nodes.workers.pop(words[1], None)
            if node is not None:  # a node of a head since lost went with it
                nodes.cluster.remove_node(node, allow_graceful=False)
            _reply({"ok": node is not None})
        elif words[0] == "drain":
            deadline_ms = int((time.time() + float(words[2])) * 1000)
            accepted, message = nodes.gcs.drain_node(
                words[1],
                autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
                "relaytrain test: spot instance reclaimed",
                deadline_ms,
            )
            _reply({"accepted": accepted, "message": message})
        elif words[0] == "add" and not nodes.up:  # Ray would start the node as a new head
            _reply({"error": "the head is down: head_start first"})
        elif words[0] == "add":
            node = nodes.cluster.add_node(num_cpus=1)
            nodes.workers[node.node_id] = node
            _reply({"node_id": node.node_id})
        elif words[0] == "nodes":
            alive = _actors_by_node(nodes.job_address, set(nodes.workers)) if nodes.up else []
            _reply({"nodes": alive})
        elif words[0] == "head_kill":
            _reply({"worker_nodes": nodes.kill()})
        elif words[0] == "head_start":
            nodes.start()
            _reply({"worker_node_ids": list(nodes.workers)})
        else:
            _reply({"error": f"unknown command {words[0]!r}"})


class _Nodes:
    """The head and worker nodes, at fixed GCS and job server ports: a head lost and started
    again is found where the first one was."""

    def __init__(self, num_workers: int) -> None:
        self.count = num_workers
        self.head_args = {
            "num_cpus": 0,
            "gcs_server_port": free_port(),
            "include_dashboard": True,
            "dashboard_host": "127.0.0.1",
            "dashboard_port": free_port(),
            # Not Ray's fixed default (52365): the test session's own Ray may hold it, and
            # without its HTTP server the head's agent cannot take job submissions.
            "dashboard_agent_listen_port": free_port(),
        }
        self.job_address = f"http://127.0.0.1:{self.head_args['dashboard_port']}"
        self.cluster: Any = None
        self.workers: dict[str, Any] = {}
        self.up = False

    def start(self) -> None:
        """A new cluster (its own GCS state: a new cluster id) and ``count`` worker nodes."""
        import ray
        from ray.cluster_utils import Cluster

        # A Cluster of its own: the old one's GCS accessor would ask the new head as the old
        # cluster (Ray aborts on the cluster id it does not know).
        self.cluster = Cluster(initialize_head=True, head_node_args=self.head_args)
        for _ in range(self.count):
            node = self.cluster.add_node(num_cpus=1)
            self.workers[node.node_id] = node
        self.cluster.wait_for_nodes()
        self.gcs_address = self.cluster.gcs_address
        self.gcs = ray._raylet.GcsClient(address=self.gcs_address)
        _wait_for_job_server(self.job_address)
        self.up = True

    def kill(self) -> int:
        """Every node killed at once, the head first; how many worker nodes there were."""
        self.up = False
        self.count = len(self.workers)
        self.cluster.remove_node(self.cluster.head_node, allow_graceful=False)
        for node in list(self.workers.values()):
            self.cluster.remove_node(node, allow_graceful=False)
        self.workers.clear()
        return self.count


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
