"""What a campaign's scenarios share, as users have it: a Ray cluster started with
`ray start --head` (the commands reach it through ``RAY_ADDRESS``), a `prefect server start`
(``PREFECT_API_URL``), and a moto S3 server for the scenarios that keep their runs in object
storage. Started once, stopped at the end whatever happened."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.prefect_server import PrefectServer
from tests.ray_start import RayStartHead
from tests.s3 import S3Server, moto_s3

#: A secret every command holds in its environment, as a tracking or database password would
#: be, that nothing it writes may contain (nor the S3 secret key, for S3 storage).
CANARY = "adversary-canary-5b1c0e7d"
CANARY_ENV = "RELAYTRAIN_ADVERSARY_CANARY_PASSWORD"


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
            "PYTHONPATH": str(self.target),
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

    def storage_uri(self, storage: str, prefix: str) -> str:
        if storage == "s3" and self.s3 is not None:
            return self.s3.uri(prefix)
        return str(self.root / "storage" / prefix)


@contextlib.contextmanager
def world(root: Path, target: Path | None = None, python: str | None = None) -> Iterator[World]:
    """Every shared server up for the block, and down after it."""
    root.mkdir(parents=True, exist_ok=True)
    target = target or Path(__file__).resolve().parents[2]
    with contextlib.ExitStack() as stack:
        head = RayStartHead(num_cpus=4)
        stack.callback(head.stop)  # also when it is stopped while starting
        head.start()
        prefect = PrefectServer(root / "prefect", head.address)
        (root / "prefect").mkdir(exist_ok=True)
        stack.callback(prefect.stop)
        prefect.start()
        s3 = stack.enter_context(moto_s3(root))
        yield World(
            root=root,
            target=target,
            python=python or sys.executable,
            ray_address=head.address,
            prefect_api=prefect.api,
            s3=s3,
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
