"""The head of the Ray cluster this process drives, watched.

A Ray driver depends on its cluster's head (the GCS server, and the raylet beside it). When the
head dies (killed, out of memory, its machine restarted), every call to the cluster blocks;
Ray ends a driver whose GCS has been silent for ``gcs_rpc_server_reconnect_timeout_s`` (60 s),
the flow with it, and one whose head came back as a new cluster may block for good. So
``ray_cluster()`` watches the head of the cluster it started or connected to:

- a local cluster this process started: its head's processes are its children, polled every
  ``INTERVAL_S``; one that has exited is the head lost;
- a cluster at an address (``RAY_ADDRESS``): its GCS is asked whether it is alive every
  ``INTERVAL_S``; silent for ``SILENCE_S``, or answering for another cluster (the head
  restarted without GCS fault tolerance: the attempt's workers went with the old one), the head
  is lost.

The watch then leaves the cluster (``ray.shutdown``, what the blocked calls return from; of a
local cluster it ends the agents the dead raylet left behind too), so the attempt fails on the
infrastructure budget with an error that names the lost head, and the next ``ray_cluster()``
(the retry's) starts a new local cluster, or waits up to
``RELAYTRAIN_RAY_HEAD_WAIT_S`` for the address to answer again; either resumes from the newest
committed checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time
import traceback
from typing import Any

import psutil
import ray

from trainer_core.errors import InfrastructureError, LeaseLostError
from trainer_core.execution import ray_address

logger = logging.getLogger("relaytrain.engine")

#: How often the watch looks at the head (a ``poll()`` of each local process, or one GCS call).
INTERVAL_S = 0.5
#: The processes without which a local cluster is gone (Ray's names for them).
HEAD_PROCESSES = ("gcs_server", "raylet")
#: How long the GCS of a cluster at an address may be silent before the attempt leaves it; a
#: head restarted with GCS fault tolerance within it is reconnected to by Ray itself.
SILENCE_S = 10.0
#: How long the agents a lost local cluster's raylet left behind are given to end once killed.
AGENTS_END_S = 10.0
#: How long leaving a lost cluster (``ray.shutdown``) may take before the log shows every
#: thread's stack.
LEAVE_SLOW_S = 90.0
_lock = threading.Lock()
_watch: HeadWatch | None = None
#: The node of the last watch that fired and what it saw (None: none has).
_lost: tuple[Any, str] | None = None
#: The address and GCS address of a cluster whose head was lost, until connected to again.
_lost_address: tuple[str, str] | None = None


class HeadWatch:
    """A daemon thread that asks ``head`` every ``interval_s`` whether it is lost and, once it
    says so (a message), leaves the cluster of ``node`` (Ray's ``Node`` of it)."""

    def __init__(
        self,
        node: Any,
        head: StartedHead | ConnectedHead,
        interval_s: float = INTERVAL_S,
    ):
        self.node = node
        self.head = head
        self.interval_s = interval_s
        self.stopped = threading.Event()
        self.fired = threading.Lock()  # held by whoever leaves the cluster: once
        self.thread = threading.Thread(
            target=self._watch, name="relaytrain-head-watch", daemon=True
        )

    def start(self) -> HeadWatch:
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop watching (before this process leaves its cluster on purpose)."""
        self.stopped.set()
        self.thread.join()

    def check_now(self) -> None:
        """Ask the head at once (an attempt has just failed: was the head the cause?), and
        leave the cluster here if it is lost, before anyone calls Ray on it again."""
        message = self.head.confirm()
        if message is not None:
            self._lose(message)

    def _watch(self) -> None:
        while not self.stopped.wait(self.interval_s):
            message = self.head.probe()
            if message is not None:
                self._lose(message)
                return

    def _lose(self, message: str) -> None:
        global _lost, _lost_address
        if self.stopped.is_set() or not self.fired.acquire(blocking=False):
            return
        self.stopped.set()
        with _lock:
            _lost = (self.node, message)  # before the shutdown: the attempt's loop reads it
            _lost_address = self.head.wait_for
        logger.error(message)
        # Leaving took 5 s on an idle machine and over 40 s on a loaded one; one that does not
        # end leaves the attempt stalled until Ray ends the process (RECONNECT_S): said, with
        # where every thread stands, so the stall can be read from the log.
        slow = threading.Timer(LEAVE_SLOW_S, _say_leaving_is_slow, args=(time.monotonic(),))
        slow.daemon = True
        slow.start()
        try:
            ray.shutdown()  # the calls blocked on the dead cluster return (SystemExit)
        except Exception as e:  # the attempt still fails on the loss, which is recorded
            logger.warning("leaving the lost cluster: %s: %s", type(e).__name__, e)
        finally:
            slow.cancel()
        self.head.end_rest()


def _say_leaving_is_slow(since: float) -> None:
    stacks = "\n".join(
        f"thread {thread.name}:\n{''.join(traceback.format_stack(frame))}"
        for thread in threading.enumerate()
        if (frame := sys._current_frames().get(thread.ident or 0)) is not None
    )
    logger.warning(
        "leaving the lost Ray cluster (ray.shutdown) has taken %.0f s so far; where each "
        "thread stands:\n%s",
        time.monotonic() - since,
        stacks,
    )


class StartedHead:
    """The head of a local cluster this process started: lost once one of its processes has
    exited (``Popen.poll``: no system call beyond ``waitpid``)."""

    #: Lost, a local cluster is not waited for: the retry starts a new one.
    wait_for = None

    def __init__(self, node: Any):
        self.processes = [
            (kind, info.process)
            for kind in HEAD_PROCESSES
            for info in node.all_processes.get(kind, [])
        ]
        #: What the raylet started before it registered (its dashboard and runtime env
        #: agents): ``ray.shutdown`` ends only what this process started, and an agent whose
        #: raylet died lives on until its last word to the dead GCS times out (60 s).
        self.agents = [
            child
            for _, process in self.processes
            if process.poll() is None
            for child in _children(process.pid)
        ]

    def end_rest(self) -> None:
        """Once this process has left the lost cluster: end the agents its dead raylet left
        behind (psutil's ``Process`` knows a reused pid for another process)."""
        for agent in self.agents:
            with contextlib.suppress(psutil.Error):
                agent.kill()
        deadline = time.monotonic() + AGENTS_END_S
        while any(map(_running, self.agents)) and time.monotonic() < deadline:
            time.sleep(0.1)

    def probe(self) -> str | None:
        dead = [(kind, p) for kind, p in self.processes if p.poll() is not None]
        if not dead:
            return None
        which = ", ".join(f"{kind} (pid {p.pid}) exited {p.returncode}" for kind, p in dead)
        return (
            f"the local Ray cluster this process started lost its head: {which}, killed or out "
            "of memory. The attempt left that cluster; the retry starts a new local cluster and "
            "resumes from the newest committed checkpoint"
        )

    confirm = probe


def _running(process: psutil.Process) -> bool:
    """Not ended: a zombie has (it waits only for its new parent to reap it)."""
    with contextlib.suppress(psutil.Error):
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    return False


def _children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:  # ended already: the watch finds it so
        return []


class ConnectedHead:
    """The head of the cluster at ``address``: lost once its GCS (``gcs``, the driver's client
    of it) has not answered for ``silence_s``, or answers for another cluster."""

    def __init__(self, address: str, gcs_address: str, gcs: Any, silence_s: float = SILENCE_S):
        self.address = address
        self.gcs_address = gcs_address
        #: Lost, the retry waits for this address (and this GCS) to answer again.
        self.wait_for = (address, gcs_address)
        self.gcs = gcs
        self.silence_s = silence_s
        self.silent_since: float | None = None

    def probe(self, silence_s: float | None = None) -> str | None:
        try:
            self.gcs.check_alive([], timeout=1)
        except ray.exceptions.AuthenticationError as e:  # e.g. WrongClusterID: a new head
            return self._message(
                f"the GCS at {self.gcs_address} answers, but not as this run's cluster ({e}): "
                "the head restarted, and without GCS fault tolerance the attempt's workers went "
                "with the old one"
            )
        except Exception:  # silent (RpcError: timed out, unavailable)
            now = time.monotonic()
            self.silent_since = self.silent_since or now
            if now - self.silent_since >= (self.silence_s if silence_s is None else silence_s):
                return self._message(
                    f"its GCS at {self.gcs_address} has not answered for "
                    f"{now - self.silent_since:.0f} s (the head node down or restarting)"
                )
            return None
        self.silent_since = None
        return None

    def confirm(self, patience_s: float = 2.0) -> str | None:
        """Once an attempt has failed: the head is lost if its GCS stays silent ``patience_s``
        (a head that answers the watch within a second otherwise)."""
        while True:  # each silent probe takes its second
            message = self.probe(patience_s)
            if message is not None or self.silent_since is None:
                return message

    def end_rest(self) -> None:
        """A cluster at an address is not this process's to end."""

    def _message(self, what: str) -> str:
        return (
            f"the Ray cluster at {self.address} lost its head: {what}. The attempt left that "
            f"cluster; the retry waits up to {ray_address.head_wait_s():.0f} s "
            f"({ray_address.HEAD_WAIT_ENV}) for {self.address} to answer and resumes from the "
            "newest committed checkpoint"
        )


def watch_started_cluster() -> None:
    """Watch the head of the local cluster ``ray.init`` has just started in this process."""
    global _watch
    node = ray._private.worker._global_node
    with _lock:
        _watch = HeadWatch(node, StartedHead(node)).start() if node is not None else None


def watch_connected_cluster(address: str) -> None:
    """Watch the head of the cluster at ``address`` that ``ray.init`` has just connected to."""
    global _watch, _lost_address
    worker = ray._private.worker.global_worker
    node = ray._private.worker._global_node
    if node is None:  # a Ray Client address (ray://): no GCS of its own to ask
        return
    head = ConnectedHead(address, node.gcs_address, worker.gcs_client)
    with _lock:
        _lost_address = None
        _watch = HeadWatch(node, head).start()


def await_head(
    address: str, poll_s: float = 2.0, first_contact_s: float = ray_address.FIRST_CONTACT_S
) -> None:
    """Before ``ray.init(address)``: ``ray_address.await_address``, told whether this process
    lost that cluster's head (and its GCS address then)."""
    lost_address = _lost_address
    lost_gcs = lost_address[1] if lost_address is not None and lost_address[0] == address else None
    ray_address.await_address(address, lost_gcs, poll_s, first_contact_s)


def check_now() -> None:
    """An attempt has just failed: if its cluster's head is lost, leave the cluster now (the
    watch's ``check_now``), before the attempt's clean-up calls Ray on it."""
    watch = _watch
    if watch is not None and lost() is None:
        watch.check_now()


def settle() -> None:
    """Once a watch has fired: wait until it has left the dead cluster (``ray.shutdown`` takes
    some seconds), so that whoever asks next whether Ray runs is told the truth."""
    watch = _watch
    if lost() is not None and watch is not None:
        watch.thread.join()


def stop_watching() -> None:
    """Before this process leaves its cluster on purpose (a local one's processes exit then)."""
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
    """What the watch saw when the head of this process's cluster was lost, while this process
    is still on that cluster or on none (None: not lost, or Ray started or joined anew since)."""
    if _lost is None:
        return None
    node, message = _lost
    current = ray._private.worker._global_node if ray.is_initialized() else None
    return message if current is None or current is node else None
