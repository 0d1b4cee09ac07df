"""Prefect's embedded API server, as ``relaytrain run`` starts it when no PREFECT_API_URL is set.

Prefect starts it on the flow's first call to its API and waits 20 s for it; on a loaded
machine it takes longer, and the failure is a traceback deep in Prefect's client that does not
name the setting. Here the command starts it first, waits longer unless told how long, and a
server that does not start is one line naming the setting and the value to raise it to.

It is also the command's to stop. A terminal's Ctrl-C signals the whole foreground process
group, Prefect's server with it: gone, the interrupted flow spent minutes retrying "Connection
refused" to record its end. So the server starts with SIGINT blocked (as Ray starts its own
processes), records the interrupted run, and the command stops it (SIGTERM) last.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

from prefect.settings import get_current_settings

STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
#: How long the command waits for the server unless the setting is set (in the environment or
#: the Prefect profile); Prefect's own default, 20 s, is short on a busy laptop.
DEFAULT_STARTUP_TIMEOUT_S = 120
#: How long the command waits, at its end, for Prefect to send its last logs and events.
DRAIN_TIMEOUT_S = 10


class ServerStartError(Exception):
    """Prefect's embedded server did not start; the message is one line saying what to do."""


def startup_timeout_s() -> int:
    """The user's PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (environment or profile),
    else ``DEFAULT_STARTUP_TIMEOUT_S``."""
    ephemeral = get_current_settings().server.ephemeral
    if "startup_timeout_seconds" in ephemeral.model_fields_set:
        return ephemeral.startup_timeout_seconds
    return DEFAULT_STARTUP_TIMEOUT_S


@contextlib.contextmanager
def embedded_server() -> Iterator[str | None]:
    """Prefect's embedded server for the block, started before the flow and stopped after it;
    yields its API URL. None, and nothing started, when PREFECT_API_URL names a server (or
    Prefect's ephemeral mode is off: Prefect then says so itself). ``ServerStartError`` when it
    does not start."""
    settings = get_current_settings()
    if settings.api.url or not settings.server.ephemeral.enabled:
        yield None
        return
    server = _deaf_to_ctrl_c()  # Prefect's client finds this one running (one per process)
    timeout_s = startup_timeout_s()
    try:
        server.start(timeout=timeout_s)
    except Exception as e:
        exit_code = server.server_process.poll() if server.server_process else None
        server.stop()
        raise ServerStartError(_did_not_start(timeout_s, exit_code, e)) from e
    except BaseException:  # Ctrl-C while it started
        server.stop()
        raise
    try:
        yield server.api_url
    finally:
        _drain_to_server()
        server.stop()


def _drain_to_server() -> None:
    """Send the server what Prefect still queues for it (the run's last logs and events), as
    Prefect's test harness does before it stops its server: at exit, they would be retried
    against a stopped server for minutes. Bounded: a server that stopped answering gets
    ``DRAIN_TIMEOUT_S``."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        worker.drain_all(timeout=DRAIN_TIMEOUT_S)


def _did_not_start(timeout_s: int, exit_code: int | None, error: Exception) -> str:
    server = (
        "or run a server (`prefect server start`) and set PREFECT_API_URL=http://127.0.0.1:4200/api"
    )
    if exit_code is not None:
        return (
            f"Prefect's embedded server exited with code {exit_code} while starting (its output "
            f"is above): {server}"
        )
    if not isinstance(error, RuntimeError):  # Prefect's own: it did not answer in time
        return f"Prefect's embedded server did not start ({error}): {server}"
    return (
        f"Prefect's embedded server did not answer within {timeout_s} s (a loaded machine "
        f"starts it slowly): set {STARTUP_TIMEOUT_SETTING}="
        f"{max(2 * timeout_s, DEFAULT_STARTUP_TIMEOUT_S)} to wait longer, {server}"
    )


def _deaf_to_ctrl_c() -> Any:
    """Prefect's embedded server, its process started with SIGINT blocked: a blocked signal
    stays blocked across exec, and uvicorn only installs handlers, so the terminal's Ctrl-C
    never reaches it; ``stop()`` ends it with SIGTERM. Prefect's server modules are imported
    here, only when the command starts one: with PREFECT_API_URL set (a deployment, a team's
    server) they are 1.4 s of every command's start for nothing."""
    from prefect.server.api.server import SubprocessASGIServer

    class DeafToCtrlC(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                return super()._run_uvicorn_command()
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)

    return DeafToCtrlC()
