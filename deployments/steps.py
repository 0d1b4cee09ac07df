"""The steps of deployments/prefect.yaml: a deployment's flow runs start in the checkout that
registered it, whichever process worker runs them and however it was started.

- ``checkout`` (a build step, run by ``prefect deploy``) records the directory ``prefect deploy``
  ran in: the checkout, since the entrypoints are relative to it.
- ``enter_checkout`` (the pull step, run before each flow run) enters that directory. When it is
  gone (moved, deleted, or the worker runs on another host) the flow run fails with a message
  that names the fix, instead of ending ``Crashed`` with nothing said.
"""

from __future__ import annotations

import os
from pathlib import Path

#: A file every relaytrain checkout has: the training deployment's entrypoint.
ENTRYPOINT_FILE = Path("flows", "training.py")


def checkout() -> dict[str, str]:
    """Build step: the absolute directory ``prefect deploy`` runs in, as ``directory``."""
    return {"directory": os.getcwd()}


def enter_checkout(directory: str) -> dict[str, str]:
    """Pull step: enter the recorded checkout ``directory``; fail the flow run if it is gone."""
    problem = checkout_problem(directory)
    if problem:
        _fail_flow_run(problem)
        raise FileNotFoundError(problem)
    os.chdir(directory)
    return {"directory": os.getcwd()}


def checkout_problem(directory: str) -> str | None:
    """Why ``directory`` cannot be the checkout a flow run starts in, or None if it can."""
    fix = (
        "Register the deployments again from the checkout the worker should run (make deploy, "
        "or prefect deploy --all --prefect-file deployments/prefect.yaml, in that directory), "
        "or start the worker on the host that holds it."
    )
    if not directory:
        return f"the deployment records no checkout directory (its pull step has none). {fix}"
    if not Path(directory).is_dir():
        return (
            f"relaytrain's checkout {directory!r}, where this deployment was registered, does not "
            f"exist on this worker's host. {fix}"
        )
    if not (Path(directory) / ENTRYPOINT_FILE).is_file():
        return (
            f"{directory!r}, where this deployment was registered, holds no {ENTRYPOINT_FILE}: it "
            f"is not (or no longer) a relaytrain checkout. {fix}"
        )
    return None


def _fail_flow_run(message: str) -> None:
    """Mark the flow run this process was started for Failed with ``message``.

    Otherwise the worker reports only that the process exited non-zero (Crashed). A worker's
    Crashed proposal after this is refused by the server: the run is already terminal.
    """
    flow_run_id = os.environ.get("PREFECT__FLOW_RUN_ID")
    if not flow_run_id:
        return
    from prefect.client.orchestration import get_client
    from prefect.states import Failed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Failed(message=message), force=True)
