"""Reading back what a flow run left in Prefect (through the client, as the UI does)."""

from __future__ import annotations

from typing import Any

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterId,
)


def task_runs(flow_run_id: Any) -> dict:
    """The flow run's task runs by task name (setup, train, finalize)."""
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id]))
        )
    return {run.name.rsplit("-", 1)[0]: run for run in runs}


def logs(flow_run_id: Any) -> list[str]:
    """The flow run's log lines (its tasks' too), once the process's log handler has sent
    what it holds."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        found = client.read_logs(
            log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id]))
        )
    return [entry.message for entry in found]


def artifacts(flow_run_id: Any) -> dict:
    """The flow run's artifacts by key: the newest of a key (each attempt posts its own
    progress artifact; the UI shows a key's newest)."""
    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in sorted(found, key=lambda a: a.created or 0)}
