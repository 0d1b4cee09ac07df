"""The bare ``relaytrain run`` as a user first types it: no PREFECT_API_URL (Prefect's embedded
server), no RAY_ADDRESS (a local Ray cluster of its own), no telemetry settings in the
environment, and Ctrl-C to stop it. The command runs as a separate process, in a session of its
own, as a terminal's foreground job; every process it starts is looked for after it ends."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]
RELAYTRAIN = str(Path(sys.executable).with_name("relaytrain"))
TELEMETRY = ("PREFECT_SERVER_ANALYTICS_ENABLED", "RAY_USAGE_STATS_ENABLED")
STARTUP_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
#: Only against a hang: the command ends within seconds of Ctrl-C (nothing here is timed).
HANG_GUARD_S = 600


def bare_env(home: Path, **settings: str) -> dict[str, str]:
    """The test's environment less what a user's first shell lacks; its own PREFECT_HOME (a
    SQLite of its own, no profile of the developer's), and ``settings``."""
    unset = {"PREFECT_API_URL", "RAY_ADDRESS", "PYTHONPATH", STARTUP_TIMEOUT, *TELEMETRY}
    env = {k: v for k, v in os.environ.items() if k not in unset}
    return {**env, "PREFECT_HOME": str(home), **settings}


def command(storage_dir: Path, name: str) -> list[str]:
    """The README's first command on the synthetic example, long enough to be interrupted."""
    return [
        RELAYTRAIN,
        "run",
        "--config",
        "examples/synthetic_mlp.yaml",
        "--set",
        f"run.storage={storage_dir}",
        "--set",
        "scaling.num_workers=1",
        "--set",
        "schedule.epochs=1000",
        "--run-name",
        name,
    ]


@dataclass
class Interrupted:
    exit_code: int
    output: str
    kept_step: int  # the newest committed checkpoint in the run directory once it ended
    server_settings: dict  # the embedded Prefect server's own settings, read while it ran
    started: list[str]  # the processes the command had started when it was interrupted
    left: list[str]  # those, and its process group's, still there once it ended


def newest_step(run_dir: RunDirectory) -> int | None:
    if not run_dir.location.exists():
        return None
    newest = run_dir.scan().newest
    return None if newest is None else newest.step


def interrupt_after_commit(
    argv: list[str], env: dict[str, str], run_dir: RunDirectory, after: int, log: Path
) -> Interrupted:
    """Start ``argv``; once it committed a checkpoint past step ``after``, Ctrl-C it (SIGINT to
    its process group, as a terminal does) and wait for it to end."""
    with log.open("w") as out:
        process = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=as_a_foreground_job,
        )
    started: list[psutil.Process] = []
    try:
        while (step := newest_step(run_dir)) is None or step <= after:
            assert process.poll() is None, log.read_text()
            time.sleep(0.2)
        address = re.search(r"Starting temporary server on (http://\S+)", log.read_text())
        assert address, log.read_text()
        with urllib.request.urlopen(f"{address.group(1)}/api/admin/settings") as response:
            server_settings = json.load(response)
        started = psutil.Process(process.pid).children(recursive=True)
        described = [describe(p) for p in started]
        os.killpg(process.pid, signal.SIGINT)
        process.wait(timeout=HANG_GUARD_S)
        left = [describe(p) for p in [*started, *in_group(process.pid)] if alive(p)]
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        for p in [*started, *in_group(process.pid)]:
            if alive(p):
                p.kill()
    kept = newest_step(run_dir)
    assert kept is not None
    return Interrupted(
        process.returncode,
        log.read_text(),
        kept,
        server_settings,
        described,
        sorted(set(left)),
    )


def as_a_foreground_job() -> None:
    """In the child, before exec: Ctrl-C's SIGINT handled as in a terminal's foreground job,
    not ignored or blocked as a test run from a background shell (``cmd &``) would pass on."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def in_group(pgid: int) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == pgid:
                found.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return found


def alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(p: psutil.Process) -> str:
    try:
        return f"{p.pid} {' '.join(p.cmdline())[:120]}"
    except psutil.Error:
        return str(p.pid)


@pytest.fixture(scope="module")
def interrupted_twice(tmp_path_factory) -> tuple[RunDirectory, Interrupted, Interrupted]:
    """The bare command Ctrl-C'd after its first checkpoint, then run again the same way and
    Ctrl-C'd after the rerun's first checkpoint of its own."""
    root = tmp_path_factory.mktemp("command")
    name = "ctrl-c"
    argv = command(root / "runs", name)
    env = bare_env(root / "prefect-home")
    run_dir = RunDirectory(storage.resolve(str(root / "runs")).child(name))
    first = interrupt_after_commit(argv, env, run_dir, 0, root / "first.log")
    second = interrupt_after_commit(argv, env, run_dir, first.kept_step, root / "second.log")
    return run_dir, first, second


def test_the_bare_command_runs_with_telemetry_off(interrupted_twice):
    """Started with neither telemetry variable set, the command's embedded Prefect server runs
    with its analytics off (Prefect's own account of its settings), and nothing is logged of a
    telemetry call that failed offline."""
    _, first, _ = interrupted_twice
    assert first.server_settings["server"]["analytics_enabled"] is False
    assert "telemetry" not in first.output.lower(), first.output


def test_ctrl_c_ends_the_command_with_what_was_kept_and_how_to_resume(interrupted_twice):
    run_dir, first, _ = interrupted_twice
    assert first.exit_code == 130, first.output
    for refused in ("Connection refused", "All connection attempts failed"):
        assert refused not in first.output, first.output
    assert "Traceback" not in first.output, first.output
    lines = [line for line in first.output.splitlines() if line.startswith("interrupted:")]
    assert len(lines) == 1, first.output
    line = lines[0]
    assert re.search(rf"\bstep {first.kept_step}\b", line) and run_dir.location.uri in line, line
    assert "relaytrain run" in line and "--run-name ctrl-c" in line, line
    # what it started was looked for: the embedded server, the Ray cluster, its worker
    for process in ("uvicorn", "raylet", "gcs_server", "RayTrainWorker"):
        assert any(process in started for started in first.started), first.started
    assert first.left == [], first.left


def test_the_same_command_resumes_from_the_kept_checkpoint(interrupted_twice):
    run_dir, first, second = interrupted_twice
    attempts = run_dir.read_attempts()
    assert [a["attempt"] for a in attempts] == [1, 2], attempts
    assert attempts[1]["resumed_from_step"] == first.kept_step, attempts
    assert second.kept_step > first.kept_step
    assert second.exit_code == 130 and second.left == [], second.output


def test_a_server_that_does_not_start_in_time_names_the_setting(tmp_path):
    """Prefect's embedded server given no time to start (the setting at 0: Prefect's wait loop
    never polls it): one line naming the setting and a longer wait, not a traceback."""
    done = subprocess.run(
        command(tmp_path / "runs", "slow-server"),
        cwd=REPO,
        env=bare_env(tmp_path / "prefect-home", **{STARTUP_TIMEOUT: "0"}),
        capture_output=True,
        text=True,
        timeout=HANG_GUARD_S,
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert "Traceback" not in output, output
    lines = [line for line in output.splitlines() if STARTUP_TIMEOUT in line]
    assert len(lines) == 1, output
    raise_to = re.search(rf"{STARTUP_TIMEOUT}=(\d+)", lines[0])
    assert raise_to and int(raise_to.group(1)) > 0, lines[0]
