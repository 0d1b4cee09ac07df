"""What the ranks of a worker group share while they train: the collectives every rank joins
(``all_reduce``, ``all_ok``), rank 0's relay of events to the driver, and the timings it
reports."""

from __future__ import annotations

import logging
import resource
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from trainer_core.execution import step_marks, worker_api

logger = logging.getLogger("relaytrain.worker")


class Relay:
    """Rank 0's non-blocking channel to the driver (fire-and-forget actor calls).

    Metric rows are batched and pushed at most every ``interval_s`` (an actor call costs about
    half a millisecond on a busy machine); any other event flushes them first, in order. Each
    push of rows names the worker group they came from (``group``): rows held back until the
    group ended may reach the driver after the restart that ended it.
    """

    #: This worker process's relay (every rank's), for what ends its group from outside the
    #: training thread (``flush_before_shutdown``).
    of_this_process: Relay | None = None

    def __init__(
        self,
        handle: Any,
        rank: int,
        marks: str | None = None,
        earlier_marks: str | None = None,
        interval_s: float = 1.0,
    ):
        self.handle = handle if rank == 0 else None
        self.rank = rank
        self.driver = handle  # every rank's, for what only a rank that outlived rank 0 knows
        self.interval_s = interval_s
        self.rows: list[dict[str, Any]] = []
        self.last_push = 0.0
        #: The worker group of the attempt this rank is in (``joined``).
        self.group = 0
        #: The last step this rank completed (the loop sets it): what it tells the driver when
        #: its group ends from outside (``flush_before_shutdown``).
        self.completed_step = 0
        #: Where this rank keeps its last completed step for a restarted group, or the next
        #: attempt, to find, should it be killed outright (``step_marks``), under the attempt's
        #: key (``marks``; None: no marks); and the key of the attempt before this one.
        self.mark: step_marks.StepMark | None = None
        self.mark_key = marks if handle is not None else None
        self.earlier_marks = earlier_marks
        self.lock = threading.Lock()  # the checkpoint thread sends too
        Relay.of_this_process = self

    def send(self, kind: str, **payload: Any) -> None:
        if self.handle is None:
            return
        with self.lock:
            now = time.time()
            if kind == "metrics":
                self.rows.extend(payload["rows"])
                if now - self.last_push < self.interval_s:
                    return
            self._flush_rows(now)
            if kind != "metrics":
                self.handle.push.remote({"kind": kind, "time": now, **payload})

    def begin_group(self) -> int:
        """Tell the driver a worker group started: 0 for an attempt's first, n after the n-th
        in-place restart (rank 0 asks; other ranks get 0 and learn it by broadcast)."""
        if self.handle is None:
            return 0
        self.group = int(worker_api.ask(self.handle.begin_group))
        return self.group

    def joined(self, group: int) -> None:
        """The group number every rank agreed on (``begin_group``'s, shared): what this rank's
        word of its last step names. After an in-place restart, tell the driver the steps that
        the ended groups' ranks on this node marked: a rank killed outright said nothing."""
        self.group = group
        if self.mark_key is None:
            return
        if self.mark is not None:
            self.mark.close()
            self.mark = None
        try:  # best effort: a temp dir this process cannot write costs only the count
            for earlier, step in sorted(step_marks.take_earlier(self.mark_key, group).items()):
                self.tell_last_step(step, earlier)
            if group == 0 and self.earlier_marks:
                self._tell_earlier_attempts_step()
            self.mark = step_marks.StepMark(self.mark_key, group, self.rank)
        except OSError as e:
            logger.warning("no step mark in %s: %s", step_marks.DIRECTORY, e)

    def _tell_earlier_attempts_step(self) -> None:
        """The attempt before this one ended with ranks that left marks on this node (killed
        outright, or ended by Ray): tell the driver the furthest step they marked, which the
        earlier attempt's record may not know (its rank 0's rows lag; when rank 0 itself was
        killed, or was the only rank, nobody could say)."""
        assert self.earlier_marks is not None and self.driver is not None
        marked = step_marks.take_all(self.earlier_marks)
        if marked:
            self.driver.push.remote(
                {
                    "kind": "earlier_last_step",
                    "time": time.time(),
                    "rank": self.rank,
                    "last_step": max(marked.values()),
                }
            )

    def finished(self, **payload: Any) -> None:
        """This rank's loop finished (every rank says so): its step mark is no longer needed,
        and rank 0 tells the driver."""
        if self.mark is not None:
            self.mark.close()
            self.mark = None
        self.send("finished", **payload)

    def completed(self, step: int) -> None:
        """This rank completed ``step``: what it tells the driver if its group ends, and what
        its mark keeps should it be killed."""
        self.completed_step = step
        if self.mark is not None:
            self.mark.write(step)

    def tell_last_step(self, last_step: int, group: int) -> Any:
        """A failure ends this rank's group: tell the driver the last step it completed. Rank
        0's rows name only the steps up to its last report window (up to ``report.every``
        steps behind, twice that while a window's rows wait to be pushed); and when rank 0 is
        the one that died, only another rank can say it."""
        if self.driver is None or last_step <= 0:
            return None
        return self.driver.push.remote(
            {
                "kind": "last_step",
                "time": time.time(),
                "rank": self.rank,
                "last_step": last_step,
                "group": group,
            }
        )

    def tell_output(self, stream: str, lines: list[str], wait_s: float | None = None) -> None:
        """Lines this rank's loop wrote to ``stream`` ("stdout", "stderr"), for the driver to
        log under the rank's name; ``wait_s``: wait up to that long for the driver's relay to
        have them (the last lines, before an error ends the worker)."""
        if self.driver is None or not lines:
            return
        pushed = self.driver.push.remote(
            {
                "kind": "output",
                "time": time.time(),
                "rank": self.rank,
                "stream": stream,
                "lines": lines,
            }
        )
        if wait_s is not None:
            import ray

            ray.wait([pushed], timeout=wait_s)

    def flush(self) -> None:
        """Push buffered rows now (before an error ends the worker)."""
        if self.handle is not None:
            with self.lock:
                self._flush_rows(time.time())

    @classmethod
    def flush_before_shutdown(cls, wait_s: float = 2.0) -> None:
        """Ray ends this worker's group (another rank died, or the run is stopped) while the
        training thread may still be computing: push the rows rank 0 holds and, from every
        rank, the last step it completed (when rank 0 is the one that died, its rows stop at its
        last pushed window and only its peers know how far the group got), and wait up to
        ``wait_s`` for the driver's relay to have them, before Ray kills the process."""
        relay = cls.of_this_process
        if relay is None:
            return
        with relay.lock:
            pushed = [relay._flush_rows(time.time())]
            pushed.append(relay.tell_last_step(relay.completed_step, relay.group))
        pushed = [p for p in pushed if p is not None]
        if pushed:
            import ray

            ray.wait(pushed, num_returns=len(pushed), timeout=wait_s)

    def _flush_rows(self, now: float) -> Any:
        pushed = None
        if self.rows and self.handle is not None:
            pushed = self.handle.push.remote(
                {"kind": "metrics", "time": now, "group": self.group, "rows": self.rows}
            )
            self.rows = []
        self.last_push = now
        return pushed


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def collective_device() -> torch.device:
    """Where the default process group's collectives take their tensors: the current GPU under
    nccl, the CPU under gloo."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce(values: list[float], op: Any = None) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return tensor.tolist()


def gather_nodes(world_size: int) -> list[str]:
    """Each rank's node (its IP address), in rank order: one collective, when a group starts."""
    if world_size == 1:
        return [worker_api.node_ip()]
    nodes: list[Any] = [None] * world_size
    dist.all_gather_object(nodes, worker_api.node_ip())
    return [str(node) for node in nodes]


def all_ok(ok: bool) -> bool:
    return all_reduce([1.0 if ok else 0.0], dist.ReduceOp.MIN)[0] == 1.0


@dataclass
class Timings:
    """Seconds this rank spent in each part of the loop (reported by rank 0 when it finishes)."""

    step_s: float = 0.0
    data_wait_s: float = 0.0  # waiting for the next step's batches (read, transform)
    aggregate_s: float = 0.0
    checkpoint_s: float = 0.0  # training blocked: waiting for the previous one, then staging
    checkpoint_wait_s: float = 0.0  # of which waiting for the previous checkpoint's write
    checkpoint_copy_wait_s: float = 0.0  # of which the next optimizer step waiting for the copy
    checkpoint_write_s: float = 0.0  # in the background: serialize, upload, commit, retention
    preemption_hold_s: float = 0.0  # waiting, after a just-in-time checkpoint, for the drain
    relay_s: float = 0.0
    num_steps: int = 0
    num_aggregates: int = 0
    num_checkpoints: int = 0

    def to_json(self) -> dict[str, float]:
        return dict(self.__dict__)

    def waited(self, items: Iterator[Any]) -> Iterator[Any]:
        """``items``, the time spent waiting for each added to ``data_wait_s``."""
        while True:
            started = time.perf_counter()
            item = next(items, _DONE)
            self.data_wait_s += time.perf_counter() - started
            if item is _DONE:
                return
            yield item


_DONE = object()


def share_peak_rss(relay: Relay) -> None:
    """The largest peak resident memory of any rank so far, to the driver (one small
    collective, at each checkpoint and at the end)."""
    peak = torch.tensor([peak_rss_mb()], dtype=torch.float64, device=collective_device())
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    relay.send("memory", peak_worker_rss_mb=round(float(peak), 1))
