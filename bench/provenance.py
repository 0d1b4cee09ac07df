"""Where a benchmark's figures came from, as every result file records it: the machine (and its
load), the versions of everything measured, and the git commit."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    """CPU model, cores, RAM, OS and load: enough to tell a quiet machine from a busy one."""
    import psutil

    return {
        "cpu_model": _cpu_model(),
        "logical_cores": os.cpu_count(),
        "physical_cores": psutil.cpu_count(logical=False),
        "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "ram_gb": round(psutil.virtual_memory().total / 2**30, 1),
        "os": platform.platform(),
        "hostname": platform.node(),
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def versions() -> dict[str, str]:
    """Versions of everything a figure depends on."""
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("relaytrain", "torch", "ray", "prefect", "pyarrow", "numpy", "moto"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            found[package] = "not installed"
    return found


def git_state(repo: Path) -> dict[str, Any]:
    """The commit of ``repo`` measured, and whether the tree had local changes (read-only git
    calls). Results written by earlier benchmarks of the same ``make bench`` are not changes to
    what is measured."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "--no-optional-locks", *args],
                cwd=repo,
                capture_output=True,
                text=True,
                timeout=20,
                check=True,
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    status = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!bench/results")
    return {
        "commit": git("rev-parse", "HEAD"),
        "dirty": bool(status) if status is not None else None,
    }
