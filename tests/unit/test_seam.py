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
    probe = "import sys, trainer_core.execution.controller; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
