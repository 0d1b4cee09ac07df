"""A loopback TCP proxy in front of a storage server that can play what storage does to a run:
go away and come back (``down``/``up``, or ``cut_on`` a request), turn slow (``slow``), or fill
up (``fill``: every write answered as a full MinIO or Ceph store answers it).

``OutageProxy(target_port)`` forwards to the server on ``target_port``; ``down()`` closes its
listener and every connection (clients see connection refused / reset, as when a server stops),
``up()`` binds the same port again.
"""

from __future__ import annotations

import contextlib
import random
import re
import socket
import threading
import time
from typing import Any

from tests.net import free_port

#: The start of an HTTP request (what ``OutageProxy.slow`` delays).
REQUEST_LINE = re.compile(rb"(GET|PUT|POST|HEAD|DELETE) ")

#: What stores answer a write with once they are full: MinIO past its drives' free-space threshold
#: (cmd/api-errors.go, ErrStorageFull) and Ceph's RGW past a user or bucket quota
#: (rgw_common.cc, ERR_QUOTA_EXCEEDED): (HTTP status line, error code, message).
STORE_FULL_ANSWERS = {
    "minio": (
        "507 Insufficient Storage",
        "XMinioStorageFull",
        "Storage backend has reached its minimum free drive threshold. Please delete a few "
        "objects to proceed.",
    ),
    "ceph": ("403 Forbidden", "QuotaExceeded", ""),
}


class OutageProxy:
    """A loopback TCP proxy to ``target_port`` that can stop and restart like a server, or
    turn slow (``slow``).

    ``cut_on`` (a regex over the client's bytes, e.g. a PUT request line) takes the proxy down
    the first time it matches, before that request reaches the server, and brings it back up on
    the same port ``outage_s`` later. ``events`` records what happened and when.
    """

    def __init__(
        self, target_port: int, *, cut_on: bytes | None = None, outage_s: float = 5.0
    ) -> None:
        self.target_port = target_port
        self.port = free_port()
        self.cut_on = re.compile(cut_on) if cut_on else None
        self.outage_s = outage_s
        self.events: list[tuple[float, str]] = []
        self._lock = threading.Lock()
        self._listener: socket.socket | None = None
        self._connections: set[socket.socket] = set()
        self._cut = False
        #: While set (``slow``): (low, high) seconds of delay before each request it matches
        #: goes on.
        self._latency: tuple[float, float] | None = None
        self._slow_on = REQUEST_LINE
        self._rng = random.Random(0)
        self.delayed = 0  # requests delayed
        #: (time, request line) of every request, when a list (set it to one to record).
        self.request_log: list[tuple[float, bytes]] | None = None
        #: While set (``fill``): every PUT is answered by the proxy as this full store would.
        self._full: str | None = None
        self.refused = 0  # writes refused as a full store

    def __enter__(self) -> OutageProxy:
        self.up()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.down("closed")

    def up(self) -> None:
        """Listen on the proxy's port (again)."""
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        with self._lock:
            self._listener = listener
            self.events.append((time.time(), "up"))
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def down(self, why: str = "down") -> None:
        """Close the listener and every open connection, as a stopped server would."""
        with self._lock:
            listener, self._listener = self._listener, None
            connections, self._connections = self._connections, set()
            if listener is not None:
                self.events.append((time.time(), why))
        for sock in [listener, *connections]:
            if sock is None:
                continue
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def slow(self, low_s: float, high_s: float, only: bytes | None = None) -> None:
        """Delay every request from now on (those whose request line matches ``only``) by a
        seeded uniform ``[low_s, high_s]`` seconds, as storage turning slow does (``fast``
        ends it)."""
        with self._lock:
            self._latency = (low_s, high_s)
            self._slow_on = re.compile(only) if only else REQUEST_LINE
            self.events.append((time.time(), f"slow {low_s}-{high_s} s"))

    @property
    def is_slow(self) -> bool:
        return self._latency is not None

    def fast(self) -> None:
        with self._lock:
            self._latency = None
            self.events.append((time.time(), "fast"))

    def fill(self, store: str = "minio") -> None:
        """Answer every PUT from now on (uploads, parts, copies) as ``store`` does when full
        (``STORE_FULL_ANSWERS``), the request's body read first; reads and deletes go on
        (``free`` ends it)."""
        with self._lock:
            self._full = store
            self.events.append((time.time(), "full"))

    def free(self) -> None:
        with self._lock:
            self._full = None
            self.events.append((time.time(), "freed"))

    @property
    def is_full(self) -> bool:
        return self._full is not None

    def arm(self, cut_on: bytes, outage_s: float) -> None:
        """Cut once more: down when ``cut_on`` next matches, for ``outage_s``."""
        with self._lock:
            self.cut_on, self.outage_s, self._cut = re.compile(cut_on), outage_s, False

    @property
    def armed(self) -> bool:
        return self.cut_on is not None and not self._cut

    @property
    def was_cut(self) -> bool:
        return self._cut

    @property
    def cut_at(self) -> float:
        """When the cut happened (epoch seconds); only after ``was_cut``."""
        return next(t for t, what in self.events if what.startswith("cut on"))

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # listener closed
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                if self._listener is not listener:  # went down meanwhile
                    client.close()
                    upstream.close()
                    return
                self._connections.update((client, upstream))
            open_ends = [2]  # the pumps still running; the last one closes both sockets
            for args in ((client, upstream, True, open_ends), (upstream, client, False, open_ends)):
                threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(
        self, source: socket.socket, sink: socket.socket, from_client: bool, open_ends: list[int]
    ) -> None:
        try:
            self._forward(source, sink, from_client)
        finally:
            with self._lock:
                open_ends[0] -= 1
                done = open_ends[0] == 0
                if done:
                    self._connections.difference_update((source, sink))
            if done:  # without this a long run leaks two descriptors a connection
                for sock in (source, sink):
                    with contextlib.suppress(OSError):
                        sock.close()

    def _forward(self, source: socket.socket, sink: socket.socket, from_client: bool) -> None:
        tail = b""
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                if from_client and self.cut_on is not None and not self._cut:
                    match = self.cut_on.search(tail + data)
                    tail = (tail + data)[-512:]
                    if match:
                        self._trigger(match.group(0).decode(errors="replace"))
                        return
                if from_client and REQUEST_LINE.match(data) and self.request_log is not None:
                    self.request_log.append((time.time(), data[: data.find(b" HTTP/")]))
                if from_client and self._full and data.startswith(b"PUT "):
                    self._refuse_as_full(source, data)
                    return
                if from_client and self._latency is not None and self._slow_on.match(data):
                    with self._lock:
                        delay = self._rng.uniform(*self._latency)
                        self.delayed += 1
                    time.sleep(delay)
                sink.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                sink.shutdown(socket.SHUT_WR)

    def _refuse_as_full(self, client: socket.socket, data: bytes) -> None:
        """Read the request's headers and body (unless it waits for 100-continue), answer 507
        and close, as a full store does; the server never sees the request."""
        while b"\r\n\r\n" not in data:
            more = client.recv(65536)
            if not more:
                return
            data += more
        head, _, body = data.partition(b"\r\n\r\n")
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(b":") for line in head.split(b"\r\n")[1:])
        }
        if headers.get(b"expect", b"").lower() != b"100-continue":
            remaining = int(headers.get(b"content-length", b"0")) - len(body)
            while remaining > 0:
                more = client.recv(min(remaining, 1 << 20))
                if not more:
                    return
                remaining -= len(more)
        with self._lock:
            self.refused += 1
            status, code, message = STORE_FULL_ANSWERS[self._full or "minio"]
        body = (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            f"<Error><Code>{code}</Code><Message>{message}</Message>"
            "<RequestId>relaytrain-proxy</RequestId></Error>"
        ).encode()
        client.sendall(
            f"HTTP/1.1 {status}\r\nContent-Type: application/xml\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )

    def _trigger(self, line: str) -> None:
        with self._lock:
            if self._cut:
                return
            self._cut = True
            self.events.append((time.time(), f"cut on {line}"))
        self.down()
        timer = threading.Timer(self.outage_s, self.up)
        timer.daemon = True
        timer.start()

    def outage_seconds(self) -> float | None:
        """How long the cut kept the server away (None if it never happened)."""
        times = [t for t, what in self.events if what == "down"]
        ups = [t for t, what in self.events if what == "up"]
        if not times:
            return None
        later = [t for t in ups if t > times[0]]
        return (later[0] - times[0]) if later else None
