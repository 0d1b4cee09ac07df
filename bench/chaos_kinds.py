"""The chaos campaign's fault kinds: what each one does to the run's cluster, flow, storage or
Prefect server, and when it can happen (``FaultKinds``, which ``chaos_faults.Campaign`` is).

Each ``_<kind>`` injects one fault and returns what it hit, or None when it cannot happen now (no
worker to kill, a node already down, the flow not ready); ``_inject`` takes the first pending
kind that can.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyarrow.parquet as pq

from trainer_core.checkpoint.run_directory import MANIFEST_FILE, MARKER_FILE

#: The fault kinds, as the module docstring of ``bench.chaos`` describes them.
KINDS = (
    "worker_kill",
    "node_kill",
    "drain",
    "flow_kill",
    "second_flow",
    "s3_outage",
    "s3_slow",
    "corrupt",
    "prefect_outage",
    "disk_full",
    "head_restart",
    "data_damaged",
)
NOTICE_S = 10.0


@dataclass
class Fault:
    """One injected fault: its kind, when (``time.time()``), and what it hit."""

    kind: str
    at: float
    detail: dict[str, Any] = field(default_factory=dict)


class FaultKinds:
    """The faults, as methods of the campaign that injects them (its cluster, proxy, flow, run
    directory and timers: ``chaos_faults.Campaign``)."""

    def _inject(self) -> bool:
        """Inject the first pending kind that can happen now; False if none can."""
        for index, kind in enumerate(self.pending):
            detail = getattr(self, f"_{kind}")()
            if detail is not None:
                del self.pending[index]
                self.faults.append(Fault(kind, time.time(), detail))
                newest = max(self.committed_seen, default=0)
                print(
                    f"[chaos] {time.strftime('%H:%M:%S')} {kind} {detail} "
                    f"(newest commit: step {newest} of {self.steps})",
                    flush=True,
                )
                return True
        return False

    def _add_node(self) -> None:
        self.cluster.command("add")
        self.nodes_down -= 1

    def _in_thread(self, action: Callable[[], None]) -> None:
        """``action`` on a thread of its own (a server or a head starting takes seconds the
        campaign's loop must not wait), joined before the campaign ends."""
        thread = threading.Thread(target=action, daemon=True)
        thread.start()
        self.background.append(thread)

    def _worker_node(self) -> str | None:
        """A node that hosts a Ray Train worker, when all nodes and the head are up."""
        if self.nodes_down or self.head_down:
            return None
        nodes = [n["node_id"] for n in self.cluster.nodes() if n["train_worker_pids"]]
        return self.rng.choice(nodes) if nodes else None

    def _worker_kill(self) -> dict[str, Any] | None:
        if self.head_down:
            return None
        pids = [p for n in self.cluster.nodes() for p in n["train_worker_pids"]]
        if not pids:
            return None
        pid = self.rng.choice(pids)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        return {"pid": pid}

    def _node_kill(self) -> dict[str, Any] | None:
        node = self._worker_node()
        if node is None:
            return None
        self.cluster.command("kill", node)
        self.nodes_down += 1
        back = self.rng.uniform(5, 15)
        self._later(back, self._add_node)
        return {"node": node[:8], "replaced_after_s": round(back, 1)}

    def _drain(self) -> dict[str, Any] | None:
        node = self._worker_node()
        if node is None:
            return None
        answer = self.cluster.command("drain", node, str(NOTICE_S))
        if not answer.get("accepted"):
            return None
        self.nodes_down += 1
        self._later(NOTICE_S - 1, lambda: self.cluster.command("kill", node))
        self._later(NOTICE_S + 2, self._add_node)
        return {"node": node[:8], "deadline_s": NOTICE_S}

    def _flow_ready(self) -> bool:
        """The flow lives and has held the lease a while; no second flow starts; the API and
        the Ray head are up; the store has room (a second flow must meet the lease, not a full
        store); no data file is damaged (the flow is about to fail of it)."""
        live_second = any(p.poll() is None for _, p, _ in self.second_flows)
        return (
            self.flow is not None
            and self.flow.poll() is None
            and time.time() - self.flow_started_at > 20
            and self._flow_holds_lease()
            and not live_second
            and not self.api_down
            and not self.head_down
            and not self.proxy.is_full
            and self.damaged is None
        )

    def _flow_holds_lease(self) -> bool:
        """The run's lease names the flow's process. A flow run again after a kill may take
        over 20 s to reach its setup on a loaded machine: a second flow started before would
        find the killed flow's lease gone, take it and drive the run, and the flow would meet
        the lease instead."""
        assert self.flow is not None
        with contextlib.suppress(Exception):  # storage being written: not yet
            lease = self.run_dir.read_lease()
            return bool(lease) and lease.get("pid") == self.flow.pid
        return False

    def _flow_kill(self) -> dict[str, Any] | None:
        if not self._flow_ready():
            return None
        assert self.flow is not None
        os.killpg(self.flow.pid, signal.SIGKILL)
        self.flow.wait(timeout=30)
        self._launch()  # the command run again
        return {"launch": self.launches}

    def _second_flow(self) -> dict[str, Any] | None:
        if not self._flow_ready():
            return None
        process, log = self.popen(self.spec, f"{self.name}-second-{len(self.second_flows)}.log")
        fault = Fault("second_flow", time.time())
        self.second_flows.append((fault, process, log))
        return {"log": log.name}

    def _s3_outage(self) -> dict[str, Any] | None:
        if self.proxy.armed or self.proxy._listener is None:
            return None
        outage = round(self.rng.uniform(3, 8), 1)
        if self.rng.random() < 0.5:
            self.proxy.down()
            self._later(outage, self.proxy.up)
            return {"outage_s": outage, "when": "now"}
        self.proxy.arm(rb"PUT /[^ ]*/checkpoint-\d+/", outage)
        return {"outage_s": outage, "when": "the next checkpoint upload"}

    def _s3_slow(self) -> dict[str, Any] | None:
        if self.proxy.is_slow or self.proxy._listener is None:
            return None
        low, high = 0.3, 1.0
        seconds = round(self.rng.uniform(5, 15), 1)
        self.proxy.slow(low, high)
        self._later(seconds, self.proxy.fast)
        return {"latency_s": [low, high], "for_s": seconds}

    def _disk_full(self) -> dict[str, Any] | None:
        """The store full (every write refused as a full MinIO refuses it), freed 3-8 s later.
        A full store is not retried (docs/storage.md): the flow fails with StorageFullError, and
        the campaign runs it again once space is freed, as an automation would."""
        if not self._flow_ready() or self.proxy._listener is None:
            return None
        seconds = round(self.rng.uniform(3, 8), 1)
        self.proxy.fill()
        self._later(seconds, self.proxy.free)
        return {"full_s": seconds}

    def _prefect_outage(self) -> dict[str, Any] | None:
        """The Prefect server killed (a crashed pod) mid-run, started again from a thread later."""
        if not self._flow_ready():
            return None
        seconds = round(self.rng.uniform(*self.settings.prefect_outage_s), 1)
        self.prefect.kill()
        self.api_down = True

        def back() -> None:
            self.prefect.start()
            self.api_down = False

        self._later(seconds, lambda: self._in_thread(back))
        return {"outage_s": seconds}

    def _head_restart(self) -> dict[str, Any] | None:
        """The Ray head lost (its machine, its pod) and, without GCS fault tolerance, the cluster
        with it; a new head at the same addresses 5-15 s later, with new worker nodes. The
        attempt waits for the job server (``RELAYTRAIN_RAY_HEAD_WAIT_S``), finds its job gone
        with the old head, and fails on the infrastructure budget; the retry submits again."""
        if self.nodes_down or self.head_down or not self._flow_ready():
            return None
        seconds = round(self.rng.uniform(5, 15), 1)
        self.cluster.command("head_kill")
        self.head_down = True
        detail: dict[str, Any] = {"down_s": seconds}

        def back() -> None:
            self.cluster.command("head_start")
            self.head_down = False
            detail["back_at"] = time.time()  # the new head answers: the flow finds its job gone

        self._later(seconds, lambda: self._in_thread(back))
        return detail

    def _data_damaged(self) -> dict[str, Any] | None:
        """A byte flipped in a data page of one of the pinned dataset's Parquet files (a disk or
        a copy gone wrong: size and footer unchanged). The page's checksum finds it when the
        rows are read again: DataFileDamagedError, not retried (docs/data.md), and the flow
        fails naming the file and row group; the campaign restores the file and runs the
        command again, as an operator restoring it from a backup would."""
        if not self._flow_ready():
            return None
        victim = self.rng.choice(sorted(self.data_dir.glob("*.parquet")))
        metadata = pq.ParquetFile(victim).metadata
        group = self.rng.randrange(metadata.num_row_groups)
        chunk = metadata.row_group(group).column(0)
        original = victim.read_bytes()
        data = bytearray(original)
        start = chunk.dictionary_page_offset or chunk.data_page_offset
        data[start + chunk.total_compressed_size // 2] ^= 0x5A
        victim.write_bytes(bytes(data))
        self.damaged = (victim, original)
        return {"file": victim.name, "row_group": group}

    def _corrupt(self) -> dict[str, Any] | None:
        newest = self.run_dir.scan().newest
        if newest is None:
            return None
        names = [n for n in newest.files if n not in (MARKER_FILE, MANIFEST_FILE)]
        name = max(names, key=lambda n: newest.files[n]["size"])
        location = self.run_dir.checkpoint_location(newest.step).child(name)
        data = bytearray(location.read_bytes())
        data[len(data) // 2] ^= 0xFF
        location.write_bytes(bytes(data))
        return {"step": newest.step, "file": name}
