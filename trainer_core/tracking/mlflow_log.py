"""MLflow tracking of a run, from the driver: one MLflow run per relaytrain run, continued by
every attempt, retry and rerun.

``tracking.mlflow_uri`` (else ``MLFLOW_TRACKING_URI``) turns it on. What is logged:
- the spec as params (dotted keys), once; a rerun that changes one records it as a tag;
- per-step metrics from the merged history, each step once: live at each committed checkpoint
  (rows a retry may run again are never logged before their checkpoint commits), then caught up
  from ``RunDirectory.read_metrics_history`` when an attempt ends and at finalize;
- tags: the run directory, the status, and each attempt with its error and retry decision;
- at finalize: the best checkpoint's model (MLflow's pytorch flavour, the module pickled) for
  the built-in models,
  the loss curve and ``summary.json``, then the run's terminal status.

Where the MLflow run is and how far it got lives in ``{run}/mlflow.json``, so an attempt, a
retry or a rerun of the flow (even after the driver died) continues the same MLflow run. A
tracking server that cannot be reached never fails training: the call is bounded (a probe of a
few seconds, at most 2 HTTP retries), the reason is kept in ``mlflow.json`` as ``pending``, the
summary says so, and the next attempt end, finalize, a rerun of the finished flow, or
``relaytrain sync RUN`` logs what is missing from the history.
"""

from __future__ import annotations

import logging
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from trainer_core.checkpoint.files import checkpoint_step
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import SCHEMA_VERSION, RunDirectory, stored_spec
from trainer_core.errors import CheckpointCorruptError, SpecError
from trainer_core.numbers import is_finite_number
from trainer_core.spec.run_spec import RunSpec
from trainer_core.tracking import mlflow_model
from trainer_core.tracking.mlflow_server import _bounded_http, _get_run, _probe, spec_params
from trainer_core.tracking.mlflow_state import (
    STATE_FILE,
    MlflowState,
    read_state_quietly,
    tracking_uri,
)

logger = logging.getLogger("relaytrain.mlflow")

#: Row keys that are not metrics.
NOT_METRICS = ("step", "batch", "attempt", "time", "schema")
#: MLflow's limits: params per batch, metrics per batch, characters of a param / tag value.
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000
TAG_CHARS = 5000

T = TypeVar("T")


def for_run(spec: RunSpec, run_dir: RunDirectory) -> Tracker | None:
    """The run's tracker, or None when no MLflow tracking URI is configured."""
    uri = tracking_uri(spec)
    return Tracker(spec, run_dir, uri) if uri else None


class Tracker:
    """Logs one relaytrain run to one MLflow run. Every method is safe to call with the server
    down: it records why in ``pending`` and returns."""

    def __init__(self, spec: RunSpec, run_dir: RunDirectory, uri: str, import_code: bool = True):
        self.spec = spec
        self.run_dir = run_dir
        self.uri = uri
        #: Whether the spec's code (its model builder, data transform) may be imported: not
        #: when the spec came only from the run directory (``sync_run``; docs/security.md).
        self.import_code = import_code
        #: Why the best checkpoint's model was not logged (``import_code`` off, or a checkpoint
        #: that cannot be read as data), naming it; None when it was, or needs no logging.
        self.model_not_logged: str | None = None
        stored = read_state_quietly(run_dir)
        # another server: start over there (the history has everything)
        self.state = (
            stored if stored and stored.tracking_uri == uri else MlflowState(tracking_uri=uri)
        )
        self._buffer: dict[int, dict[str, Any]] = {}
        self._down = False
        self._client: Any = None

    # -- the attempt's events ---------------------------------------------------------------

    def attempt_started(self) -> None:
        """Find or create the MLflow run, log the spec, mark it running."""
        self._down = False
        self._call("start the run", lambda: None, running=True)

    def on_event(self, event: dict[str, Any]) -> None:
        """Rows are held until a checkpoint commits them, then logged (a failure after it
        reruns them, so they are not final before)."""
        kind = event.get("kind")
        if kind == "metrics":
            for row in event.get("rows") or []:
                if isinstance(row.get("step"), int):
                    self._buffer[row["step"]] = row
        elif kind == "checkpoint" and isinstance(event.get("step"), int) and not self._down:
            step = event["step"]
            rows = [self._buffer.pop(s) for s in sorted(self._buffer) if s <= step]
            if rows:
                self._call("log metrics", lambda: self._log_rows(rows))

    def attempt_ended(self) -> None:
        """Catch up from the merged history and record the attempts as tags."""
        self._buffer.clear()
        self._down = False
        self._call("catch up", self._catch_up)
        self._call("tag attempts", self._tag_attempts)

    def finish(self, result: Any, history: Sequence[dict[str, Any]] | None = None) -> None:
        """At finalize: catch up, tags, the best model, the loss curve and the summary, then
        the terminal status."""
        self._down = False
        if self._call("catch up", lambda: self._catch_up(history)) is None:
            return
        self._call("tag attempts", self._tag_attempts)
        self._call("log the result", lambda: self._log_result(result, history))
        if self.state.pending is None:
            self._call("end the run", lambda: self._end(result.status))

    # -- the calls --------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], running: bool = False) -> T | None:
        """Run ``fn`` against the server (bounded); on failure keep why, and skip the rest of
        this attempt's live logging."""
        if self._down:
            return None
        try:
            with _bounded_http():
                _probe(self.uri)
                if self.state.run_id is None or running:
                    self._ensure_run(running=running)
                value = fn()
            if value is None:
                value = True  # type: ignore[assignment]
            self.state.pending = None
            return value
        except Exception as e:
            self._down = True
            self.state.pending = f"{what}: {type(e).__name__}: {_first_line(e)}"
            logger.warning(
                "MLflow at %s not reached (%s); training goes on, and what is missing is "
                "logged later from the run's history",
                self.uri,
                self.state.pending,
            )
            return None
        finally:
            self._save()

    def _ensure_run(self, running: bool = False) -> None:
        client = self._mlflow_client()
        state = self.state
        if state.run_id is not None:
            run = _get_run(client, state.run_id)
            if run is not None:
                if running and run.info.status != "RUNNING":
                    client.update_run(state.run_id, status="RUNNING")
                    state.finished = False
                self._log_params(client)
                return
            state.run_id, state.logged_through_step, state.params_logged = None, -1, False
        experiment = self.spec.tracking.mlflow_experiment
        found = client.get_experiment_by_name(experiment)
        state.experiment_id = (
            found.experiment_id if found is not None else client.create_experiment(experiment)
        )
        existing = client.search_runs(
            [state.experiment_id],
            filter_string=f"tags.`relaytrain.run_uri` = '{_quoted(self.run_dir.uri)}'",
            max_results=1,
        )
        if existing:
            state.run_id = existing[0].info.run_id
            logged = existing[0].data.tags.get("relaytrain.logged_through_step")
            state.logged_through_step = int(logged) if logged else -1
        else:
            run = client.create_run(
                state.experiment_id,
                run_name=self.run_dir.location.path.rstrip("/").rsplit("/", 1)[-1],
                tags={"relaytrain.run_uri": self.run_dir.uri, "relaytrain.status": "running"},
            )
            state.run_id = run.info.run_id
        self._save()
        self._log_params(client)

    def _log_params(self, client: Any) -> None:
        if self.state.params_logged:
            return self._note_changed_params(client)
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in spec_params(self.spec).items()]
        for start in range(0, len(params), PARAMS_PER_BATCH):
            client.log_batch(self.state.run_id, params=params[start : start + PARAMS_PER_BATCH])
        self.state.params_logged = True

    def _note_changed_params(self, client: Any) -> None:
        """A rerun that continues the run with other values (more epochs): params cannot
        change in MLflow, so the new values become ``relaytrain.param.<key>`` tags."""
        logged = _get_run(client, self.state.run_id)
        if logged is None:
            return
        for key, value in spec_params(self.spec).items():
            if logged.data.params.get(key, value) != value:
                client.set_tag(self.state.run_id, f"relaytrain.param.{key}", value[:TAG_CHARS])

    def _log_rows(self, rows: Sequence[dict[str, Any]]) -> None:
        from mlflow.entities import Metric

        fresh = [r for r in rows if int(r["step"]) > self.state.logged_through_step]
        if not fresh:
            return
        metrics = [
            Metric(key, float(value), int(float(row.get("time", time.time())) * 1000), row["step"])
            for row in fresh
            for key, value in row.items()
            if key not in NOT_METRICS and is_finite_number(value)
        ]
        client = self._mlflow_client()
        for start in range(0, len(metrics), METRICS_PER_BATCH):
            client.log_batch(self.state.run_id, metrics=metrics[start : start + METRICS_PER_BATCH])
        self.state.logged_through_step = max(int(r["step"]) for r in fresh)
        client.set_tag(
            self.state.run_id, "relaytrain.logged_through_step", self.state.logged_through_step
        )

    def _catch_up(self, history: Sequence[dict[str, Any]] | None = None) -> None:
        rows = read_metrics_history(self.run_dir) if history is None else history
        self._log_rows(rows)

    def _tag_attempts(self) -> None:
        records = self.run_dir.read_attempts()
        tags = {"relaytrain.attempts": str(len(records))}
        for r in records:
            text = r.get("status", "?")
            if r.get("error_class"):
                text += f": {r['error_class']}: {_flat(r.get('error_message'))}"
            if r.get("resumed_from_step") is not None:
                text += f" (resumed from step {r['resumed_from_step']})"
            if r.get("retry_decision"):
                text += f" -> {_flat(r['retry_decision'])}"
            tags[f"relaytrain.attempt.{r.get('attempt')}"] = text[:TAG_CHARS]
        client = self._mlflow_client()
        for key, value in tags.items():
            client.set_tag(self.state.run_id, key, value)

    def _log_result(self, result: Any, history: Sequence[dict[str, Any]] | None) -> None:
        from trainer_core.tracking import plots

        client = self._mlflow_client()
        run_id = self.state.run_id
        client.set_tag(run_id, "relaytrain.status", result.status)
        if result.best_checkpoint_uri:
            client.set_tag(run_id, "relaytrain.best_checkpoint", result.best_checkpoint_uri)
        client.log_dict(run_id, result.model_dump(mode="json"), "summary.json")
        rows = read_metrics_history(self.run_dir) if history is None else history
        if rows:
            png = plots.curve_png(rows, f"{result.run_name}: loss and validation metrics")
            bars = plots.run_step_time_png(rows, f"{result.run_name}: where each step's time went")
            with tempfile.TemporaryDirectory() as tmp:
                path = Path(tmp, "loss_curve.png")
                path.write_bytes(png)
                client.log_artifact(run_id, str(path))
                if bars is not None:
                    path = Path(tmp, "step_time.png")
                    path.write_bytes(bars)
                    client.log_artifact(run_id, str(path))
        self._log_model(client, result)

    def _log_model(self, client: Any, result: Any) -> None:
        """The best checkpoint as an MLflow pytorch model, for the built-in models (a user's
        ``train_loop`` builds its own module, which relaytrain cannot)."""
        uri = result.best_checkpoint_uri
        step = checkpoint_step(uri.rsplit("/", 1)[-1]) if uri else None
        if step is None or self.state.model_step == step:
            return
        if self.spec.model is None or self.spec.data is None:
            client.set_tag(
                self.state.run_id,
                "relaytrain.model",
                f"not logged: a train_loop builds its own module; weights at {uri}",
            )
            return
        if not self.import_code:  # logged by a later sync given the spec, or the flow's rerun
            self.model_not_logged = (
                f"{uri}: building it needs the spec's model.name ({self.spec.model.name!r}), "
                "which only the run directory's run.json names, and relaytrain imports nothing "
                "a file in storage names. Give the run's spec with --config SPEC.yaml (or "
                "--trust-stored-spec for a run directory nobody else can write)."
            )
            return
        assert uri is not None and self.state.run_id is not None
        try:
            model_uri = mlflow_model.log_checkpoint_model(
                self.spec, self.run_dir, self.uri, self.state.run_id, step, uri
            )
        except (CheckpointCorruptError, SpecError) as e:  # never loggable: say so, once
            self.model_not_logged = f"{uri}: {e}"
            logger.warning("best model not logged to MLflow: %s", self.model_not_logged)
            client.set_tag(self.state.run_id, "relaytrain.model", f"not logged: {e}"[:TAG_CHARS])
            return
        self.state.model_uri, self.state.model_step = model_uri, step

    def _end(self, status: str) -> None:
        self._mlflow_client().set_terminated(
            self.state.run_id, "FAILED" if status == "failed" else "FINISHED"
        )
        self.state.finished = True

    def _mlflow_client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient(tracking_uri=self.uri)
        return self._client

    def _save(self) -> None:
        try:
            self.run_dir.location.child(STATE_FILE).write_json(
                {"schema": SCHEMA_VERSION, **self.state.model_dump(mode="json")}
            )
        except Exception as e:  # the next save writes it; training goes on
            logger.warning("%s not written: %s", STATE_FILE, e)


def sync_run(
    run_dir: RunDirectory, result: Any | None, uri: str | None = None, spec: RunSpec | None = None
) -> Tracker:
    """Log to MLflow what the server missed, from the run directory alone (``relaytrain
    sync``, and a rerun of a finished flow): the history, the attempts and, once finalized,
    its ``result`` (summary.json's; None before). SpecError when the run names no tracking
    URI. Without ``spec`` (the caller's own), the stored spec (``run.json``) is read as data
    only: nothing it names is imported, so the best model is not logged
    (``Tracker.model_not_logged``)."""
    trusted = spec is not None
    spec = spec or stored_spec(run_dir)
    state = read_state_quietly(run_dir)
    uri = uri or (state.tracking_uri if state else None) or tracking_uri(spec)
    if spec is None or not uri:
        raise SpecError(
            f"run {run_dir.uri} names no MLflow tracking URI: set tracking.mlflow_uri in its "
            "spec or MLFLOW_TRACKING_URI",
            field="tracking.mlflow_uri",
        )
    tracker = Tracker(spec, run_dir, uri, import_code=trusted)
    if result is None:
        tracker.attempt_ended()
    else:
        tracker.finish(result)
    return tracker


# -- helpers ----------------------------------------------------------------------------------


def _quoted(text: str) -> str:
    return text.replace("\\", "\\\\").replace("'", "\\'")


def _first_line(error: BaseException) -> str:
    text = str(error)
    for words, short in (
        ("Connection refused", "connection refused"),
        ("timed out", "timed out"),
        ("Name or service not known", "unknown host"),
    ):
        if words in text:
            return short
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else ""


def _flat(text: Any) -> str:
    return " ".join(str(text or "").split())
