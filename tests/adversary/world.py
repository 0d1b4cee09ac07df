"""What a campaign's scenarios share, as users have it: a Ray cluster started with
`ray start --head` (the commands reach it through ``RAY_ADDRESS``), a `prefect server start`
(``PREFECT_API_URL``), and a moto S3 server for the scenarios that keep their runs in object
storage, which the commands reach through a proxy that can play an outage or a full store (the
adversary itself reads storage directly); and, for the scenarios that lose a node, a worker node
of its own (`ray start --address`) that only their workers ask for. Started once (the node when
first needed), stopped at the end whatever happened."""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.outage_proxy import OutageProxy
from tests.prefect_server import PrefectServer
from tests.ray_start import RayStartHead, RayStartNode
from tests.s3 import S3Server, moto_s3

#: A secret every command holds in its environment, as a tracking or database password would
#: be, that nothing it writes may contain (nor the S3 secret key, for S3 storage).
CANARY = "adversary-canary-5b1c0e7d"
CANARY_ENV = "RELAYTRAIN_ADVERSARY_CANARY_PASSWORD"
#: The resource only the world's worker node has: a spec that asks each worker for one places
#: its group there (two workers at most).
NODE_RESOURCE = "adversary_node"
#: A user's own code (the columns form's model and transform, a loop of one's own), installed
#: on every node as a team installs its package: its directory on the path of `ray start` and
#: of every command, so it is the same module whichever checkout the adversary drives.
USER_CODE = Path(__file__).resolve().parent / "user"
USER_MODULE = "adversary_user"
#: Ray's health checks of its nodes, as a cluster's operator may set them: a node whose raylet
#: misses five checks a second apart (two seconds each) is dead, 9-15 s after it is lost on
#: this machine (Ray's defaults take 15-25 s); a raylet on a loaded machine still answers one
#: check in five.
NODE_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "2000",
    "RAY_health_check_failure_threshold": "5",
}


@dataclass
class World:
    root: Path
    #: The checkout whose `relaytrain` the scenarios drive (this one, or an older commit's), and
    #: its Python.
    target: Path
    python: str
    ray_address: str
    prefect_api: str
    s3: S3Server | None = None
    #: In front of ``s3`` for the commands: what ``outage`` and ``store_full`` act through.
    proxy: OutageProxy | None = None
    #: The worker node ``lose_node`` loses (``NODE_RESOURCE``), started when first needed.
    node: RayStartNode | None = None
    extra_env: dict[str, str] = field(default_factory=dict)
    #: The campaign's liveness bound: a command still running this long after it started is
    #: killed and judged as hung (``oracles.commands``). None (the suite's fixed seeds): no
    #: bound, pytest's own timeout stands.
    command_limit_s: float | None = None

    def env(self, marker: str, storage: str) -> dict[str, str]:
        """A command's environment: the shared cluster and API, the offline defaults, the S3
        credentials (and the canary) for S3 storage, and ``marker`` in every process it starts
        (to find what it left running)."""
        env = {
            **os.environ,
            "RAY_ADDRESS": self.ray_address,
            "PREFECT_API_URL": self.prefect_api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "RAY_USAGE_STATS_ENABLED": "0",
            "RELAYTRAIN_ADVERSARY": marker,
            "PYTHONPATH": os.pathsep.join([str(self.target), str(USER_CODE)]),
            CANARY_ENV: CANARY,
            **self.extra_env,
        }
        for key in [k for k in env if k.startswith("AWS_")]:
            del env[key]
        if storage == "s3" and self.s3 is not None:
            env.update(self.s3.credential_env())
        return env

    def secrets(self) -> list[str]:
        """What no file of a run may hold."""
        return [CANARY, *([self.s3.secret_access_key] if self.s3 is not None else [])]

    def storage_uri(self, storage: str, prefix: str, direct: bool = False) -> str:
        """Where a scenario's runs go: for S3, through the proxy (the commands' way), or to the
        server itself (``direct``: the adversary's reads, through any outage it plays)."""
        if storage == "s3" and self.s3 is not None:
            port = self.proxy.port if self.proxy is not None and not direct else None
            return self.s3.uri(prefix, port=port)
        return str(self.root / "storage" / prefix)


@contextlib.contextmanager
def world(root: Path, target: Path | None = None, python: str | None = None) -> Iterator[World]:
    """Every shared server up for the block, and down after it."""
    root.mkdir(parents=True, exist_ok=True)
    target = target or Path(__file__).resolve().parents[2]
    with contextlib.ExitStack() as stack:
        head = RayStartHead(num_cpus=4)
        head.env.update(NODE_HEALTH_CHECKS)
        head.env["PYTHONPATH"] = os.pathsep.join(
            [str(USER_CODE), *filter(None, [head.env.get("PYTHONPATH")])]
        )
        stack.callback(head.stop)  # also when it is stopped while starting
        prefect = PrefectServer(root / "prefect", head.address)
        (root / "prefect").mkdir(exist_ok=True)
        stack.callback(prefect.stop)
        # The servers start side by side: each waits on its own process's start (Prefect's
        # about 15 s, Ray's head and moto's some seconds each on 2 cores).
        with concurrent.futures.ThreadPoolExecutor(1) as beside:
            starting = beside.submit(prefect.start)
            head.start()
            s3 = stack.enter_context(moto_s3(root))
            starting.result()
        proxy = stack.enter_context(OutageProxy(s3.port))
        node = RayStartNode(head, num_cpus=2, resources={NODE_RESOURCE: 2})
        stack.callback(node.kill)
        yield World(
            root=root,
            target=target,
            python=python or sys.executable,
            ray_address=head.address,
            prefect_api=prefect.api,
            s3=s3,
            proxy=proxy,
            node=node,
        )


def describe(checkout: Path) -> dict[str, Any]:
    """What a campaign's result says of a checkout (the one it drove, and its own): its commit,
    and whether its work tree differed from it (no path of this machine's)."""
    git = ["git", "-C", str(checkout)]
    commit = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True)
    status = subprocess.run([*git, "status", "--porcelain"], capture_output=True, text=True)
    return {
        "commit": commit.stdout.strip() or None,
        "dirty": bool(status.stdout.strip()) if status.returncode == 0 else None,
    }
