"""A real S3-compatible server on loopback for tests: moto's server mode as a subprocess, with
IAM authentication enforced, and a TCP proxy in front of it that can play "the server went away".

- ``moto_s3(log_dir)`` starts ``python -m moto.server`` on 127.0.0.1 and a free port, waits until
  it answers, creates IAM users and a bucket through moto's own IAM API, and stops it on exit.
  moto lets the first ``INITIAL_NO_AUTH_ACTION_COUNT`` authenticated actions through unsigned
  (moto/core/authorization.py counts every IAM/S3 action it authorizes); three bootstrap calls
  create an admin user with its key, and from then on every request must carry a valid,
  permitted key. The trainer user's generated key pair is the tests' credential (and canary).
- ``OutageProxy`` forwards TCP to the server; ``down()`` closes its listener and every
  connection (clients see connection refused / reset, as when a server stops), ``up()`` binds the
  same port again. ``cut_on`` takes the server down when a request line matches, for a while.

No key in this file is real: moto generates them per server.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.net import free_port, stop, wait_until_answers

REGION = "us-east-1"
#: Bootstrap actions moto lets through unsigned: create the admin user, its policy, its key.
BOOTSTRAP_ACTIONS = 3
ALLOW_ALL = {
    "Version": "2012-10-17",
    "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}],
}


@dataclass
class S3Server:
    """A running moto server: where it listens, its bucket, and the users' key pairs."""

    port: int
    bucket: str
    access_key_id: str
    secret_access_key: str
    admin_key: tuple[str, str]
    trainer_user: str
    log_file: Path
    process: subprocess.Popen = field(repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def uri(self, prefix: str, *, port: int | None = None, fsspec: bool = False) -> str:
        """``s3://bucket/prefix`` through pyarrow (or s3fs when ``fsspec``), via ``port``."""
        scheme = "fsspec+s3" if fsspec else "s3"
        endpoint = f"127.0.0.1:{port or self.port}"
        return f"{scheme}://{self.bucket}/{prefix}?endpoint_override={endpoint}&scheme=http"

    def credential_env(self) -> dict[str, str]:
        """The trainer's credentials as the AWS SDKs read them from the environment."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key_id,
            "AWS_SECRET_ACCESS_KEY": self.secret_access_key,
            "AWS_DEFAULT_REGION": REGION,
        }

    def admin(self, service: str) -> Any:
        """A boto3 client of ``service`` signed with the admin key (for the tests' own checks)."""
        import boto3

        return boto3.client(
            service,
            endpoint_url=f"http://{self.endpoint}",
            region_name=REGION,
            aws_access_key_id=self.admin_key[0],
            aws_secret_access_key=self.admin_key[1],
        )

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object below ``prefix`` in the bucket, key -> bytes (read as admin)."""
        s3 = self.admin("s3")
        found: dict[str, bytes] = {}
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                body = s3.get_object(Bucket=self.bucket, Key=item["Key"])["Body"].read()
                found[item["Key"]] = body
        return found

    @contextlib.contextmanager
    def denied(self, actions: list[str], resource: str) -> Iterator[None]:
        """While inside, the trainer's key is explicitly denied ``actions`` on ``resource``."""
        iam = self.admin("iam")
        name = f"deny-{uuid.uuid4().hex[:8]}"
        document = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Deny", "Action": actions, "Resource": resource}],
        }
        iam.put_user_policy(
            UserName=self.trainer_user, PolicyName=name, PolicyDocument=json.dumps(document)
        )
        try:
            yield
        finally:
            iam.delete_user_policy(UserName=self.trainer_user, PolicyName=name)


def _bootstrap(port: int, bucket: str) -> dict[str, Any]:
    """Admin user (unsigned, within moto's no-auth allowance), then the trainer and the bucket."""
    import boto3
    from botocore.exceptions import ClientError

    endpoint = f"http://127.0.0.1:{port}"

    def client(service: str, key: str, secret: str) -> Any:
        return boto3.client(
            service,
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
        )

    # Counted as moto's unauthenticated allowance: any signature passes for these three.
    iam = client("iam", "bootstrap", "bootstrap")
    iam.create_user(UserName="relaytrain-admin")
    iam.put_user_policy(
        UserName="relaytrain-admin", PolicyName="all", PolicyDocument=json.dumps(ALLOW_ALL)
    )
    admin_key = iam.create_access_key(UserName="relaytrain-admin")["AccessKey"]
    admin = (admin_key["AccessKeyId"], admin_key["SecretAccessKey"])
    iam = client("iam", *admin)
    iam.create_user(UserName="relaytrain-trainer")
    trainer_policy = {
        "Version": "2012-10-17",
        "Statement": [
            {
                "Effect": "Allow",
                "Action": "s3:*",
                "Resource": [f"arn:aws:s3:::{bucket}", f"arn:aws:s3:::{bucket}/*"],
            }
        ],
    }
    iam.put_user_policy(
        UserName="relaytrain-trainer",
        PolicyName="bucket",
        PolicyDocument=json.dumps(trainer_policy),
    )
    trainer_key = iam.create_access_key(UserName="relaytrain-trainer")["AccessKey"]
    client("s3", *admin).create_bucket(Bucket=bucket)
    try:  # the server really enforces credentials now
        client("s3", "unknown-access-key", "not-a-secret").list_objects_v2(Bucket=bucket)
    except ClientError as e:
        assert e.response["ResponseMetadata"]["HTTPStatusCode"] == 403, e.response
    else:
        raise RuntimeError("moto accepted an unknown access key: IAM auth is not enforced")
    return {
        "access_key_id": trainer_key["AccessKeyId"],
        "secret_access_key": trainer_key["SecretAccessKey"],
        "admin_key": admin,
        "trainer_user": "relaytrain-trainer",
    }


@contextlib.contextmanager
def moto_s3(log_dir: Path, bucket: str = "relaytrain") -> Iterator[S3Server]:
    """Start moto's server (IAM auth enforced) with ``bucket``; stop it on exit."""
    port = free_port()
    log_file = log_dir / f"moto-{port}.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(BOOTSTRAP_ACTIONS)
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        wait_until_answers(f"http://127.0.0.1:{port}/moto-api/", process, log_file, "moto server")
        users = _bootstrap(port, bucket)
        yield S3Server(port=port, bucket=bucket, log_file=log_file, process=process, **users)
    finally:
        stop(process)


# -- the outage proxy -------------------------------------------------------------------------


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


#: Where the storage tests append their measured figures (not asserted).
TIMINGS_FILE = Path(__file__).resolve().parents[1] / "runs" / "object-storage-timings.jsonl"


def record_timing(case: str, **figures) -> None:
    TIMINGS_FILE.parent.mkdir(parents=True, exist_ok=True)
    with TIMINGS_FILE.open("a") as f:
        f.write(json.dumps({"case": case, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **figures}))
        f.write("\n")
