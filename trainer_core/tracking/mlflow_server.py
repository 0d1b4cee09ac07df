"""Reaching an MLflow tracking server without letting it hold training up: MLflow's HTTP retries
cut to seconds, a probe before the first call, and the spec as MLflow params."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from trainer_core.spec.run_spec import RunSpec

PARAM_CHARS = 6000


#: What one unreachable server may cost a call: a short probe, few retries, a short timeout.
#: A value the user set in the environment wins.
PROBE_TIMEOUT_S = 3.0


BOUNDED_HTTP = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}


def spec_params(spec: RunSpec) -> dict[str, str]:
    """The spec as MLflow params: dotted keys, JSON for lists, values cut to MLflow's limit."""
    flat: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict) and value:
            for key, inner in value.items():
                walk(f"{prefix}.{key}" if prefix else str(key), inner)
        elif value is not None:
            text = value if isinstance(value, str) else json.dumps(value)
            flat[prefix] = text[:PARAM_CHARS]

    walk("", spec.model_dump(mode="json", exclude={"tracking"}))
    return flat


@contextmanager
def _bounded_http() -> Iterator[None]:
    """MLflow's HTTP retries (7, with backoff up to minutes) cut to a few seconds, unless the
    user set them."""
    ours = [key for key in BOUNDED_HTTP if key not in os.environ]
    os.environ.update({key: BOUNDED_HTTP[key] for key in ours})
    try:
        yield
    finally:
        for key in ours:
            os.environ.pop(key, None)


def _probe(uri: str) -> None:
    """Fail within seconds when an http(s) tracking server does not answer."""
    parts = urlsplit(uri)
    if parts.scheme not in ("http", "https"):
        return
    import requests

    requests.get(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S).raise_for_status()


def _get_run(client: Any, run_id: str | None) -> Any:
    from mlflow.exceptions import MlflowException

    if run_id is None:
        return None
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        if "RESOURCE_DOES_NOT_EXIST" in str(getattr(e, "error_code", "")) or "not found" in str(e):
            return None
        raise
    return None if run.info.lifecycle_stage == "deleted" else run
