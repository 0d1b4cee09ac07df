"""``make test``'s phase 2 hands each module whole to one of its 2 xdist processes, so that a
module fixture (a training run, a tracking server) is built once, not once in each process. The
test runs two quick modules of many tests with phase 2's xdist options, read from tools/test.sh;
the oracle is xdist's own report of which process ran each test. (Under pytest 9.2, xdist 3.8's
``--dist loadgroup`` split them test by test: pytest-xdist#1386.)"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
#: Two quick modules of many tests each: split test by test, each would land on both processes.
MODULES = ("tests/unit/test_plan.py", "tests/unit/test_errors_and_state.py")


def phase2_options() -> list[str]:
    script = (ROOT / "tools" / "test.sh").read_text()
    found = re.search(r"^PHASE2_PROCESSES=\((.*)\)$", script, re.MULTILINE)
    assert found, "tools/test.sh names phase 2's xdist options in PHASE2_PROCESSES"
    return shlex.split(found.group(1))


def test_each_module_runs_whole_in_one_xdist_process():
    options = phase2_options()
    assert "-n" in options
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *MODULES, *options, "-v", "-p", "no:cacheprovider"],
        cwd=ROOT,
        env={**os.environ, "PYTEST_ADDOPTS": ""},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ran = re.findall(r"^\[(gw\d+)\] .*?PASSED (tests/\S+?)::", done.stdout, re.MULTILINE)
    assert len(ran) >= 20, done.stdout[-3000:]
    processes: dict[str, set[str]] = defaultdict(set)
    for process, module in ran:
        processes[module].add(process)
    assert {module: len(p) for module, p in processes.items()} == dict.fromkeys(MODULES, 1)
