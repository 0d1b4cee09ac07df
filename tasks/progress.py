"""The train task's live progress artifact, updated off training's path.

An update is a request to the Prefect API. The API can be slow or away for a while (a server
restarted, a database failing over); Prefect's client then retries a request for about a
minute (``PREFECT_CLIENT_MAX_RETRIES``, 5 by default, backing off 2, 4, 8, ... s) or, on a
client that has not connected yet, fails it at once. Neither may reach the attempt: the newest
progress is handed to a thread of its own, which posts it, keeps it while the API does not
answer, and posts the newest again once it does. The run's log says when the API stopped and
started answering.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from prefect.artifacts import create_progress_artifact, update_progress_artifact

#: After a failed update, the next try waits this long (or for the attempt's end).
RETRY_S = 2.0


class ProgressArtifact:
    """A Prefect progress artifact whose updates never block or fail their caller."""

    def __init__(self, key: str, description: str, percent: float, logger: Any):
        self.artifact_id: Any = create_progress_artifact(  # sync here: a UUID
            progress=percent, key=key, description=description
        )
        self.logger = logger
        self._wake = threading.Condition()
        self._pending: float | None = None
        self._closing = False
        self._failing_since: float | None = None
        self._thread = threading.Thread(target=self._post_pending, name="progress", daemon=True)
        self._thread.start()

    def post(self, percent: float) -> None:
        """Post ``percent`` soon; a newer value replaces one not yet posted."""
        with self._wake:
            self._pending = percent
            self._wake.notify()

    def close(self, percent: float, timeout_s: float) -> None:
        """Post the last value, waiting for it at most ``timeout_s`` (if it is not posted by
        then, the thread goes on trying while the process lives)."""
        with self._wake:
            self._pending = percent
            self._closing = True
            self._wake.notify()
        self._thread.join(timeout_s)

    def _post_pending(self) -> None:
        while True:
            with self._wake:
                while self._pending is None and not self._closing:
                    self._wake.wait()
                if self._pending is None:
                    return
                percent, self._pending = self._pending, None
            if not self._send(percent):
                with self._wake:
                    if self._pending is None:  # nothing newer came: this one again
                        self._pending = percent
                    self._wake.wait(RETRY_S)

    def _send(self, percent: float) -> bool:
        try:
            update_progress_artifact(artifact_id=self.artifact_id, progress=percent)
        except Exception as error:
            if self._failing_since is None:
                self._failing_since = time.monotonic()
                self.logger.warning(
                    "the Prefect API did not take a progress update (%s: %s). Training goes "
                    "on; the progress artifact is updated when the API answers again",
                    type(error).__name__,
                    error,
                )
            return False
        if self._failing_since is not None:
            self.logger.info(
                "the Prefect API answers again after %.0f s: progress artifact updated",
                time.monotonic() - self._failing_since,
            )
            self._failing_since = None
        return True
