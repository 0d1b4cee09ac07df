"""What relaytrain remembers of a run's MLflow run, in the run directory (``mlflow.json``): the
server, experiment and run ids, what it has logged so far; and the tracking URI a spec names."""

from __future__ import annotations

import logging
import os
from urllib.parse import parse_qsl, urlsplit

from pydantic import BaseModel

from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError
from trainer_core.spec.operations import tracking_uri_problem
from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage.uris import is_credential_option

logger = logging.getLogger("relaytrain.mlflow")

STATE_FILE = "mlflow.json"


class MlflowState(BaseModel):
    """``{run}/mlflow.json``; also the result's ``mlflow`` field."""

    tracking_uri: str
    experiment_id: str | None = None
    run_id: str | None = None
    #: Every metric row with a step at or below this one is logged (-1: none yet).
    logged_through_step: int = -1
    params_logged: bool = False
    #: The logged model (``models:/...``) and the checkpoint step it holds.
    model_uri: str | None = None
    model_step: int | None = None
    #: Set at finalize: the run's terminal status was sent.
    finished: bool = False
    #: Why the last call did not reach the server; None when everything asked was logged.
    pending: str | None = None

    def describe(self) -> str:
        where = f"MLflow run {self.run_id or '(not created)'} at {self.tracking_uri}"
        if self.pending:
            return (
                f"{where}: logged through step {self.logged_through_step}; not reached "
                f"({self.pending}). What is missing is logged from the run's history by the "
                "next attempt, a rerun of the flow, or `relaytrain sync RUN`."
            )
        return f"{where}: logged through step {self.logged_through_step}"


def tracking_uri(spec: RunSpec | None) -> str | None:
    """The MLflow tracking URI a run logs to: ``tracking.mlflow_uri``, else the environment's
    ``MLFLOW_TRACKING_URI``; None: no MLflow."""
    configured = spec.tracking.mlflow_uri if spec is not None else None
    found = configured or os.environ.get("MLFLOW_TRACKING_URI") or None
    if found is None:
        return None
    where = "tracking.mlflow_uri" if configured else "MLFLOW_TRACKING_URI"
    problem = tracking_uri_problem(found)
    secret = [k for k, _ in parse_qsl(urlsplit(found).query) if is_credential_option(k)]
    if secret:
        problem = (
            f"its query carries a credential ({secret[0]}=...): set MLFLOW_TRACKING_TOKEN (or "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD) in the environment instead"
        )
    if problem:  # it would be written into mlflow.json, the result and Prefect's artifacts
        raise SpecError(f"{where} cannot be used: {problem}", field=where)
    return found


def read_state(run_dir: RunDirectory) -> MlflowState | None:
    path = run_dir.location.child(STATE_FILE)
    if not path.exists():
        return None
    data = path.read_json()
    data.pop("schema", None)
    return MlflowState.model_validate(data)


def read_state_quietly(run_dir: RunDirectory) -> MlflowState | None:
    try:
        return read_state(run_dir)
    except Exception as e:
        logger.warning(
            "%s of %s unreadable (%s): starting from the history", STATE_FILE, run_dir.uri, e
        )
        return None
