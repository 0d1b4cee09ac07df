"""MLflow for a sweep, as MLflow users expect of one: a parent run named after the sweep, and
each trial's own MLflow run (which the trial logs as any run does: ``tracking.mlflow_log``) its
child, by MLflow's ``mlflow.parentRunId`` tag.

The parent holds the sweep's settings as params, the best metric so far and the trials ended by
status as metrics (their step: the trials ended), and once the sweep is over its result and
picture as artifacts and the status FINISHED. Each child gets the trial's sweep status as a tag
(``relaytrain.sweep_status``: completed, pruned, failed, pending). Where the parent is lives in
the sweep directory's ``mlflow.json``, so a sweep run again continues it.

A tracking server that cannot be reached never stops the sweep: ``sync`` says why and returns,
and the next wave's call (or the sweep run again) logs what is missing.
"""

from __future__ import annotations

import json
import logging
import tempfile
from pathlib import Path
from typing import Any

from trainer_core.spec.run_spec import RunSpec
from trainer_core.storage import Location
from trainer_core.sweep.result import SweepResult
from trainer_core.sweep.spec import Sweep
from trainer_core.sweep.trials import trial_directory
from trainer_core.tracking.mlflow_server import _bounded_http, _get_run, _probe
from trainer_core.tracking.mlflow_state import read_state_quietly, tracking_uri

logger = logging.getLogger("relaytrain.mlflow")

STATE_FILE = "mlflow.json"
SWEEP_TAG = "relaytrain.sweep_uri"
STATUS_TAG = "relaytrain.sweep_status"
PARENT_TAG = "mlflow.parentRunId"


def sync(
    sweep: Sweep, spec: RunSpec, location: Location, result: SweepResult, png: bytes | None
) -> str | None:
    """Bring the sweep's MLflow runs up to ``result``; the parent's run id, or None (no MLflow
    for this spec, or the server not reached: logged as a warning)."""
    uri = tracking_uri(spec)
    if uri is None:
        return None
    try:
        with _bounded_http():
            _probe(uri)
            return _sync(sweep, spec, uri, location, result, png)
    except Exception as e:
        logger.warning(
            "MLflow at %s not reached for sweep %s (%s: %s); the sweep goes on, and the next "
            "wave logs what is missing",
            uri,
            sweep.name,
            type(e).__name__,
            str(e).splitlines()[0] if str(e) else "",
        )
        return None


def _sync(
    sweep: Sweep,
    spec: RunSpec,
    uri: str,
    location: Location,
    result: SweepResult,
    png: bytes | None,
) -> str:
    from mlflow.entities import Metric
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    parent = _parent(client, sweep, spec, uri, location)
    ended = [t for t in result.trials if t.status != "pending"]
    metrics = [
        Metric(f"trials_{status}", sum(t.status == status for t in ended), 0, len(ended))
        for status in ("completed", "pruned", "failed")
    ]
    if result.best is not None and result.best.metric is not None:
        metrics.append(Metric(f"best_{result.metric}", result.best.metric, 0, len(ended)))
    client.log_batch(parent, metrics=metrics)
    for trial in result.trials:
        child = read_state_quietly(trial_directory(sweep, trial.number))
        if child is not None and child.run_id is not None:
            client.set_tag(child.run_id, PARENT_TAG, parent)
            client.set_tag(child.run_id, STATUS_TAG, trial.status)
    if result.status == "completed":
        if result.best is not None:
            client.set_tag(parent, "relaytrain.best_trial", result.best.run_name)
        with tempfile.TemporaryDirectory() as folder:
            (Path(folder) / "result.json").write_text(result.model_dump_json(indent=2))
            if png is not None:
                (Path(folder) / "sweep.png").write_bytes(png)
            client.log_artifacts(parent, folder)
        client.set_terminated(parent, "FINISHED")
    return parent


def _parent(client: Any, sweep: Sweep, spec: RunSpec, uri: str, location: Location) -> str:
    """The parent run's id: the one ``mlflow.json`` names, else the one tagged with this sweep
    directory, else a new one with the sweep's settings as params."""
    from mlflow.entities import Param

    state_file = location.child(STATE_FILE)
    stored = state_file.read_json() if state_file.exists() else {}
    found = _get_run(client, stored.get("run_id"))
    if found is not None:
        if found.info.status != "RUNNING":
            client.update_run(found.info.run_id, status="RUNNING")
        return str(found.info.run_id)
    experiment = spec.tracking.mlflow_experiment
    known = client.get_experiment_by_name(experiment)
    experiment_id = (
        known.experiment_id if known is not None else client.create_experiment(experiment)
    )
    tagged = client.search_runs(
        [experiment_id], filter_string=f"tags.`{SWEEP_TAG}` = '{location.uri}'", max_results=1
    )
    if tagged:
        run_id = str(tagged[0].info.run_id)
    else:
        run = client.create_run(experiment_id, run_name=sweep.name, tags={SWEEP_TAG: location.uri})
        run_id = str(run.info.run_id)
        client.log_batch(run_id, params=[Param(k, v) for k, v in settings(sweep).items()])
    state_file.write_json({"schema": 1, "tracking_uri": uri, "run_id": run_id})
    return run_id


def settings(sweep: Sweep) -> dict[str, str]:
    """The sweep's settings as MLflow params (each trial's values are its own run's params)."""
    section = sweep.section
    found = {
        "sweep.trials": str(section.trials),
        "sweep.concurrent": str(section.concurrent),
        "sweep.metric": section.metric,
        "sweep.direction": sweep.direction,
        "sweep.sampler": section.sampler,
        "sweep.pruner": json.dumps(section.pruner, sort_keys=True),
        "sweep.seed": str(section.seed),
    }
    for d in sweep.dimensions:
        found[f"sweep.space.{d.key}"] = json.dumps(section.space[d.key], sort_keys=True)[:5000]
    return found
