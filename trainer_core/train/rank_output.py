"""What a user's loop prints, on every rank, sent to the driver to log as ``[rank N] ...``.

Ray starts without sending its workers' output to the driver (``log_to_driver=False``: its own
lines would flood the console, and name a worker by its pid). While the loop runs, each rank's
``sys.stdout`` and ``sys.stderr`` become a ``RankOutput``: what the loop writes still goes to
the worker's own log, and each complete line goes to the driver through the relay, in batches
(at most ``INTERVAL_S`` after it was written). What a ``logging`` handler writes stays in the
worker's log: Ray Train's handlers write each record (its own, and the copy of each ``print``
its print patch logs) to whatever ``sys.stderr`` is, and would flood the driver's log, or say
each print twice. So what travels is what the loop prints or writes to the streams itself
(``print``, ``sys.stderr.write``, a warning), not its log records.
"""

from __future__ import annotations

import contextlib
import io
import sys
import threading
from collections.abc import Iterator
from typing import Any

from trainer_core.execution.worker_group import Relay

#: The longest a written line waits before it is sent to the driver.
INTERVAL_S = 0.5
#: The longest line sent (its end kept): a progress bar rewrites one line without ending it.
MAX_LINE_CHARS = 10_000
#: How long the last lines wait for the driver's relay to have them, before the loop's error
#: (or its end) lets Ray end the worker.
LAST_LINES_WAIT_S = 2.0


class RankOutput(io.TextIOBase):
    """A text stream that writes through to ``stream`` and sends complete lines to the driver
    (``relay.tell_output``) under the name ``name`` ("stdout", "stderr")."""

    def __init__(self, stream: Any, relay: Relay, name: str):
        super().__init__()
        self.stream = stream
        self.relay = relay
        self.name = name
        self.partial = ""
        self.lines: list[str] = []
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        self.stream.write(text)
        if sys._getframe(1).f_globals.get("__name__") == "logging":
            return len(text)  # a log record a handler writes: the worker's log only
        with self.lock:
            *complete, partial = (self.partial + text).split("\n")
            # A line rewritten in place (a progress bar's "\r") as a terminal shows it last.
            self.lines += [line.rsplit("\r", 1)[-1] for line in complete]
            self.partial = partial[-MAX_LINE_CHARS:]
            if self.lines and self.timer is None:
                self.timer = threading.Timer(INTERVAL_S, self.send)
                self.timer.daemon = True
                self.timer.start()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()

    def send(self, wait_s: float | None = None) -> None:
        """Send the complete lines written so far."""
        with self.lock:
            lines, self.lines, self.timer = self.lines, [], None
        self.relay.tell_output(self.name, lines, wait_s)

    def finish(self) -> None:
        """Send what is left, the line not ended yet too, and wait a moment for it to arrive."""
        with self.lock:
            if self.timer is not None:
                self.timer.cancel()
            if self.partial:
                self.lines.append(self.partial.rsplit("\r", 1)[-1])
                self.partial = ""
        self.send(LAST_LINES_WAIT_S)

    # what code that inspects sys.stdout asks of it
    @property
    def encoding(self) -> str:  # type: ignore[override]
        return str(getattr(self.stream, "encoding", "utf-8"))

    @property
    def buffer(self) -> Any:  # bytes written to it stay in the worker's log
        return self.stream.buffer

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self.stream.fileno())


@contextlib.contextmanager
def rank_output(relay: Relay) -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as ``RankOutput``s while the block runs; what is
    left is sent as it ends, however it ends."""
    saved = sys.stdout, sys.stderr
    out, err = RankOutput(saved[0], relay, "stdout"), RankOutput(saved[1], relay, "stderr")
    sys.stdout, sys.stderr = out, err  # type: ignore[assignment]
    try:
        yield
    finally:
        sys.stdout, sys.stderr = saved
        for stream in (out, err):
            stream.finish()
