"""Reaching a Ray cluster at an address (``RAY_ADDRESS``): a first contact refused fast where
nothing answers, an address whose head this process lost waited for
(``RELAYTRAIN_RAY_HEAD_WAIT_S``), and the driver's own bound on a silent GCS raised while it
connects. The head's watch, and what it saw lost, is ``ray_head``'s."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from collections.abc import Iterator

import ray._raylet
from ray._private import services

from trainer_core.errors import InfrastructureError, SpecError

logger = logging.getLogger("relaytrain.engine")

#: Ray's own bound for a driver whose GCS is silent (``gcs_rpc_server_reconnect_timeout_s``,
#: 60 s), raised for the driver of a cluster at an address (unless the user set it): leaving a
#: dead cluster (``ray.shutdown``) took from 5 s on an idle machine to over 40 s on a loaded
#: one, and Ray must not end the process before the watch has left.
RECONNECT_ENV = "RAY_gcs_rpc_server_reconnect_timeout_s"
RECONNECT_S = 600
#: How long ``ray_cluster()`` waits for an address whose head this process lost to answer again
#: (the job path's bound as well).
HEAD_WAIT_ENV = "RELAYTRAIN_RAY_HEAD_WAIT_S"
HEAD_WAIT_S = 120.0
#: How long a first contact with an address waits for its GCS to accept a connection before it
#: is refused (``ray.init`` alone retries for many minutes).
FIRST_CONTACT_S = 10.0


def head_wait_s() -> float:
    return float(os.environ.get(HEAD_WAIT_ENV) or HEAD_WAIT_S)


def await_address(
    address: str,
    lost_gcs: str | None,
    poll_s: float = 2.0,
    first_contact_s: float = FIRST_CONTACT_S,
) -> None:
    """Before ``ray.init(address)``, which retries a GCS that does not answer for many minutes:

    - if this process lost that cluster's head (``lost_gcs``: its GCS address), wait up to
      ``RELAYTRAIN_RAY_HEAD_WAIT_S`` until its GCS accepts connections (said once in the log),
      else an InfrastructureError naming the address (the infrastructure budget's);
    - else (a first contact) refuse an address where nothing accepts connections within
      ``first_contact_s``: a SpecError naming it and the fix, on no retry budget.

    A Ray Client address (``ray://``) and ``auto`` are left to ``ray.init``."""
    if lost_gcs is not None:
        _await_lost(address, lost_gcs, poll_s)
        return
    if address.startswith("ray://") or address == "auto":
        return
    try:
        gcs_address = services.canonicalize_bootstrap_address(address)
    except Exception as e:  # ValueError: not host:port; OSError: the host does not resolve
        raise SpecError(
            f"RAY_ADDRESS={address!r} is not the address of a Ray cluster ({e}): set it to the "
            "head node's GCS address, host:port (`ray start --head` prints it; port 6379 by "
            "default), or unset it to start a local cluster"
        ) from e
    if gcs_address is None:
        return
    deadline = time.monotonic() + first_contact_s
    while not _accepts(gcs_address):
        if time.monotonic() >= deadline:
            raise SpecError(
                f"no Ray cluster answers at RAY_ADDRESS={address!r}: nothing accepted a "
                f"connection at {gcs_address} for {first_contact_s:.0f} s. Start the cluster "
                "(`ray start --head`) or fix RAY_ADDRESS (the head node's GCS address, "
                "host:port), or unset it to start a local cluster"
            )
        time.sleep(min(poll_s, 1.0))


@contextlib.contextmanager
def driver_settings() -> Iterator[None]:
    """Around ``ray.init(address)``: Ray's reconnect bound raised for this driver (``RECONNECT_S``)
    unless the user set it, read as the driver connects, and the environment as it was after
    (a local cluster started later must not inherit it).

    Ray reads its settings from the environment once, as ``ray`` is imported, and again only as
    a core worker starts. The GCS client ``ray.init`` makes before its core worker (the
    driver's ``gcs_client``, what Ray's internal KV calls go through) would keep the bound of
    the import, 60 s: a call on it pending when the head died ended the flow then, the watch
    still leaving. So Ray's settings are read again here, with the bound in the environment."""
    ours = RECONNECT_ENV not in os.environ
    if ours:
        os.environ[RECONNECT_ENV] = str(RECONNECT_S)
    try:
        ray._raylet.Config.initialize("")  # type: ignore[attr-defined]  # read again, now
        yield
    finally:
        if ours:
            os.environ.pop(RECONNECT_ENV, None)


def _await_lost(address: str, gcs_address: str, poll_s: float) -> None:
    deadline = time.monotonic() + head_wait_s()
    said = False
    while not _accepts(gcs_address):
        if not said:
            logger.warning(
                "the Ray cluster at %s does not answer (its head restarting?): waiting up to "
                "%.0f s (%s)",
                address,
                head_wait_s(),
                HEAD_WAIT_ENV,
            )
            said = True
        if time.monotonic() >= deadline:
            raise InfrastructureError(
                f"the Ray cluster at {address} (GCS {gcs_address}) did not answer for "
                f"{head_wait_s():.0f} s after its head was lost. The retry waits for it again "
                f"and resumes from the newest committed checkpoint; set {HEAD_WAIT_ENV} to "
                "wait longer"
            )
        time.sleep(poll_s)


def _accepts(gcs_address: str) -> bool:
    host, _, port = gcs_address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False
