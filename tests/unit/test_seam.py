"""Ray is reached through one package: ``trainer_core.execution`` (the seam, as Ray Train v2
keeps its controller, policies and storage apart). Nothing else of the core, the tasks or the
flows imports Ray; and what Ray Train's controller process unpickles of ours imports no torch."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SEAM = REPO / "trainer_core" / "execution"


def imported_modules(path: Path) -> set[str]:
    """Every module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
    return found


def test_only_the_seam_imports_ray():
    modules = [
        path
        for folder in ("trainer_core", "tasks", "flows")
        for path in sorted((REPO / folder).rglob("*.py"))
        if SEAM not in path.parents
    ]
    assert len(modules) > 20
    offenders = {
        str(path.relative_to(REPO)): sorted(
            m for m in imported_modules(path) if m == "ray" or m.startswith("ray.")
        )
        for path in modules
    }
    assert {path: found for path, found in offenders.items() if found} == {}
    assert any(m.startswith("ray") for m in imported_modules(SEAM / "trainer.py"))


def test_the_controllers_part_imports_no_torch():
    probe = (
        "import sys, trainer_core.execution.controller, trainer_core.execution.elastic_capacity;"
        " print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_workers_get_a_runtime_env_only_for_settings_they_read(monkeypatch):
    """relaytrain's Ray Train settings are read by the controller alone: a group's workers start
    without a runtime env (Ray then gives them idle processes of the job, no setup step). A
    setting a worker reads, and the user's own runtime env, still reach them."""
    from trainer_core.execution import cluster
    from trainer_core.execution.worker_start import PooledWorkerGroup

    for key, value in cluster.RAY_ENV_DEFAULTS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv(cluster.PREEMPTION_WATCHER_ENV, "0")
    monkeypatch.setenv("RAY_WARN_BLOCKING_GET_INSIDE_ASYNC", "0")
    monkeypatch.delenv("RAY_TRAIN_COLLECTIVE_TIMEOUT_S", raising=False)
    assert PooledWorkerGroup._get_worker_runtime_env({}) == {}
    monkeypatch.setenv("RAY_TRAIN_COLLECTIVE_TIMEOUT_S", "30")
    custom = {"env_vars": {"MINE": "1"}, "working_dir": "."}
    assert PooledWorkerGroup._get_worker_runtime_env(custom) == {
        "env_vars": {"RAY_TRAIN_COLLECTIVE_TIMEOUT_S": "30", "MINE": "1"},
        "working_dir": ".",
    }
