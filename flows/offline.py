"""The environment relaytrain's flows run with unless the user says otherwise: no telemetry.

Offline (a laptop on a train, a cluster without egress), Prefect's embedded server logs an
ERROR for every telemetry heartbeat it cannot send, and Prefect's SDK and Ray would try to phone
home. ``apply()`` sets what turns that off, for this process and every process it starts (the
embedded server, the local Ray cluster, its workers), before Prefect is imported: Prefect reads
its settings once, at its first import (its SDK's analytics read the same setting there). It
runs when the ``flows`` package is imported, so before the first line of ``relaytrain`` and of
``python -m flows.training``. A value already in the environment wins.
"""

from __future__ import annotations

import os

#: Each variable, and the value relaytrain's commands default it to.
#:
#: - ``PREFECT_SERVER_ANALYTICS_ENABLED``: the embedded server's telemetry heartbeat, and
#:   Prefect's SDK analytics, which read the same setting when no PREFECT_API_URL is set.
#: - ``RAY_USAGE_STATS_ENABLED``: Ray's usage stats, for a cluster this process starts. (Ray
#:   2.60's ``ray.init`` turns them off itself for a new local cluster unless it is a nightly
#:   wheel; ``ray start`` asks.)
DEFAULTS = {
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "RAY_USAGE_STATS_ENABLED": "0",
}


def apply() -> None:
    """Set each of ``DEFAULTS`` in this process's environment unless it is set already."""
    for key, value in DEFAULTS.items():
        os.environ.setdefault(key, value)
