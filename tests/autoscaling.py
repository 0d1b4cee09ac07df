"""An autoscaling Ray cluster for tests, made as Ray's own autoscaler tests make one: a head
started with ``ray start --head --autoscaling-config=...`` under ``RAY_FAKE_CLUSTER=1``, whose
autoscaler (Ray's monitor, autoscaler v1) launches and removes worker nodes through the
``fake_multinode`` provider, each a raylet on this machine.

Not ``ray.cluster_utils.AutoscalingCluster``: in the Ray 2.60 wheel it reads a
``fake_multi_node/example.yaml`` the wheel lacks, and its ``start()`` and ``shutdown()`` run
``ray stop --force``, which kills every Ray process on the machine (other tests' clusters
too). Here the config is written in full and the head runs in a process group of its own
(``--block``): stopping it kills that group and nothing else, and checks that none of its
processes remain.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil

from tests.net import free_port
from tests.ray_start import head_command
from trainer_core.execution.cluster import RAY_ENV_DEFAULTS

REPO = Path(__file__).resolve().parents[1]


def fake_autoscaling_config(gcs_address: str, node_types: dict[str, dict[str, Any]]) -> dict:
    """A complete cluster config for the fake multi-node provider: a head of no CPUs and the
    worker ``node_types`` (name -> ``{"resources": {...}, "max_workers": n}``), none at start."""
    types: dict[str, Any] = {
        "ray.head.default": {"resources": {"CPU": 0}, "node_config": {}, "max_workers": 0}
    }
    for name, node_type in node_types.items():
        types[name] = {"node_config": {}, "min_workers": 0, **node_type}
    return {
        "cluster_name": "relaytrain-fake",
        "max_workers": sum(t.get("max_workers", 0) for t in node_types.values()),
        "idle_timeout_minutes": 5,
        "upscaling_speed": 1.0,
        "provider": {
            "type": "fake_multinode",
            "gcs_address": gcs_address,
            # What the wheel's missing example.yaml sets: the provider is read-only (no
            # setup commands to run on a node, no launch config to compare with), and its nodes
            # are known by id (all share one IP), so a lost one is seen as lost and replaced.
            "use_node_id_as_ip": True,
            "disable_node_updaters": True,
            "disable_launch_config_check": True,
        },
        "available_node_types": types,
        "head_node_type": "ray.head.default",
        "auth": {"ssh_user": "ray"},
        "docker": {},
        "file_mounts": {},
        "cluster_synced_files": [],
        "file_mounts_sync_continuously": False,
        "rsync_exclude": [],
        "rsync_filter": [],
        "initialization_commands": [],
        "setup_commands": [],
        "head_setup_commands": [],
        "worker_setup_commands": [],
        "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


class FakeAutoscalingCluster:
    """The head (no CPUs; the job server on 127.0.0.1) and its autoscaler, which starts worker
    nodes of ``node_types`` when work waits for them. ``job_address`` takes Ray jobs."""

    def __init__(self, node_types: dict[str, dict[str, Any]], env: dict[str, str] | None = None):
        self.port = free_port()
        self.gcs_address = f"127.0.0.1:{self.port}"
        dashboard_port = free_port()
        self.job_address = f"http://127.0.0.1:{dashboard_port}"
        self.temp_dir = tempfile.mkdtemp(prefix="rt-as-")  # short: Ray's socket paths
        config_path = Path(self.temp_dir) / "autoscaling.json"
        config_path.write_text(json.dumps(fake_autoscaling_config(self.gcs_address, node_types)))
        self.args = [
            *head_command(self.port),
            "--num-cpus=0",
            f"--autoscaling-config={config_path}",
            "--include-dashboard=true",
            "--dashboard-host=127.0.0.1",
            f"--dashboard-port={dashboard_port}",
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
            f"--temp-dir={self.temp_dir}",
        ]
        venv_bin = str(Path(sys.executable).parent)
        self.env = {
            **RAY_ENV_DEFAULTS,  # the nodes are started as the README asks of a user's cluster
            **os.environ,
            **(env or {}),
            "RAY_FAKE_CLUSTER": "1",
            "AUTOSCALER_UPDATE_INTERVAL_S": "1",
            # The jobs' drivers run `python -m trainer_core.run.jobs` and import test workloads.
            "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
            "PYTHONPATH": str(REPO),
            "RAY_USAGE_STATS_ENABLED": "0",
        }
        self.env.pop("RAY_ADDRESS", None)
        self.process: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}

    def start(self, timeout_s: float = 120) -> FakeAutoscalingCluster:
        """The head up: its GCS answers with the head node alive, and its job server answers."""
        import ray._raylet

        from tests.multinode import _wait_for_job_server

        log = open(Path(self.temp_dir) / "ray-start.log", "ab")  # noqa: SIM115 (the process's)
        self.process = subprocess.Popen(
            self.args, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.poll() is None, (Path(self.temp_dir) / "ray-start.log").read_text()
            try:
                gcs = ray._raylet.GcsClient(address=self.gcs_address)
                if any(n.state == 0 for n in gcs.get_all_node_info(timeout=2).values()):
                    break
            except Exception:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.5)
        _wait_for_job_server(self.job_address)
        return self

    def processes(self) -> list[psutil.Process]:
        """The head's process and every process it started, however deep (the autoscaler's
        nodes, their raylets' workers, jobs), and any other of its process group: a raylet
        starts its workers in process groups of their own."""
        if self.process is None:
            return []
        found: dict[int, psutil.Process] = {}
        try:
            head = psutil.Process(self.process.pid)
            found[head.pid] = head
            found.update((p.pid, p) for p in head.children(recursive=True))
        except psutil.Error:
            pass
        for proc in psutil.process_iter(["pid"]):
            try:
                if os.getpgid(proc.pid) == self.process.pid:
                    found.setdefault(proc.pid, proc)
            except (ProcessLookupError, psutil.Error):
                continue
        for proc in found.values():
            self._seen.setdefault(proc.pid, proc)
        return list(found.values())

    def worker_nodes(self) -> dict[str, int]:
        """The live worker nodes the autoscaler started: node id -> its raylet's pid."""
        nodes = {}
        for proc in self.processes():
            try:
                if proc.name() != "raylet":
                    continue
                env = proc.environ()
            except psutil.Error:
                continue
            node_id = env.get("RAY_OVERRIDE_NODE_ID_FOR_TESTING", "")
            if env.get("RAY_NODE_TYPE_NAME") and node_id:  # the head's raylet has no type
                nodes[node_id] = proc.pid
        return nodes

    def ensure_worker_node(self, timeout_s: float = 300) -> None:
        """At least one worker node up: a job that needs a CPU asks the autoscaler for one."""
        from ray.job_submission import JobStatus, JobSubmissionClient

        if self.worker_nodes():
            return
        client = JobSubmissionClient(self.job_address)
        job = client.submit_job(entrypoint="python -c pass", entrypoint_num_cpus=1)
        deadline = time.monotonic() + timeout_s  # only against a hang: a node takes seconds
        while client.get_job_status(job) not in (JobStatus.SUCCEEDED, JobStatus.FAILED):
            assert time.monotonic() < deadline, client.get_job_logs(job)
            time.sleep(0.5)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED, client.get_job_logs(job)

    def kill_node(self, node_id: str) -> None:
        """A worker node lost at once, as a machine is: every process of it SIGKILLed (its
        raylet, agents and workers, which carry its node id; a worker outlives its raylet
        for a while, talking to its peers directly)."""
        for proc in self.processes():
            try:
                if proc.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id:
                    proc.kill()
            except psutil.Error:
                continue

    def stop(self) -> None:
        """Every process of the head's group killed; asserts none of them remains."""
        if self.process is not None:
            running = self.processes()  # what runs now, to check after
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)
            for proc in running:  # those outside the group (a raylet's workers) too
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            self.process.wait(30)
            _, alive = psutil.wait_procs(list(self._seen.values()), timeout=30)
            alive = [p for p in alive if _running(p)]
            self.process = None
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            assert not alive, f"processes of the test's Ray cluster left running: {alive}"


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
