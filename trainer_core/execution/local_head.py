"""The head of a local Ray cluster that this process started, watched.

A local cluster's head (its GCS server and raylet, children of this process) can die under a
run: killed, or out of memory. Ray's driver then waits for its GCS, every call to the cluster
blocked, and after ``gcs_rpc_server_reconnect_timeout_s`` (60 s) ends the whole process: the
flow with it, between attempts as well as in one. The watch sees the head's processes exit
within ``INTERVAL_S`` and leaves the dead cluster (``ray.shutdown``, what the blocked calls
return from), so the attempt fails on the infrastructure budget with an error that names the
lost head, and the next ``ray_cluster()`` (the retry's) starts a new local cluster, which resumes
from the newest committed checkpoint.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import ray

from trainer_core.errors import InfrastructureError, LeaseLostError

logger = logging.getLogger("relaytrain.engine")

#: How often the watch looks at the head's processes (a ``poll()`` of each: no system call
#: beyond ``waitpid``).
INTERVAL_S = 0.5
#: The processes without which the cluster is gone (Ray's names for them).
HEAD_PROCESSES = ("gcs_server", "raylet")

_lock = threading.Lock()
_watch: HeadWatch | None = None
#: The node of the last watch that fired and what it saw (None: none has).
_lost: tuple[Any, str] | None = None


class HeadWatch:
    """A daemon thread that polls the head's processes of ``node`` (Ray's ``Node`` of a cluster
    this process started) and leaves the cluster once one has exited."""

    def __init__(self, node: Any, interval_s: float = INTERVAL_S):
        self.node = node
        self.processes = [
            (kind, info.process)
            for kind in HEAD_PROCESSES
            for info in node.all_processes.get(kind, [])
        ]
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(
            target=self._watch, name="relaytrain-head-watch", daemon=True
        )

    def start(self) -> HeadWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before this process shuts its cluster down on purpose)."""
        self.stopped.set()
        self.thread.join()

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval_s):
            dead = [(kind, p) for kind, p in self.processes if p.poll() is not None]
            if dead:
                self._lose(dead)
                return

    def _lose(self, dead: list[tuple[str, Any]]) -> None:
        global _lost
        which = ", ".join(f"{kind} (pid {p.pid}) exited {p.returncode}" for kind, p in dead)
        message = (
            f"the local Ray cluster this process started lost its head: {which}, killed or out "
            "of memory. The attempt left that cluster; the retry starts a new local cluster and "
            "resumes from the newest committed checkpoint"
        )
        with _lock:
            _lost = (self.node, message)  # before the shutdown: the attempt's loop reads it
        logger.error(message)
        try:
            ray.shutdown()  # the calls blocked on the dead cluster return (SystemExit)
        except Exception as e:  # the attempt still fails on the loss, which is recorded
            logger.warning("leaving the lost cluster: %s: %s", type(e).__name__, e)


def watch_started_cluster() -> None:
    """Watch the head of the local cluster ``ray.init`` has just started in this process."""
    global _watch
    node = ray._private.worker._global_node
    with _lock:
        _watch = HeadWatch(node).start() if node is not None else None


def settle() -> None:
    """Once a watch has fired: wait until it has left the dead cluster (``ray.shutdown`` takes
    some seconds), so that whoever asks next whether Ray runs is told the truth."""
    watch = _watch
    if lost() is not None and watch is not None:
        watch.thread.join()


def stop_watching() -> None:
    """Before this process shuts down the cluster it started: its processes exit on purpose."""
    global _watch
    with _lock:
        watch, _watch = _watch, None
    if watch is not None:
        watch.stop()


def name_loss(error: BaseException) -> BaseException:
    """What ended an attempt: an InfrastructureError naming the lost head when the watch saw
    it lost (whatever Ray raised as this process left the cluster), else ``error``. A lost
    lease stays one: the run is another flow's."""
    message = lost()
    if message is None or isinstance(error, LeaseLostError):
        return error
    return InfrastructureError(message)


def lost() -> str | None:
    """What the watch saw when the head of the local cluster was lost, while this process is
    still on that cluster or on none (None: not lost, or Ray started anew since)."""
    if _lost is None:
        return None
    node, message = _lost
    current = ray._private.worker._global_node if ray.is_initialized() else None
    return message if current is None or current is node else None
