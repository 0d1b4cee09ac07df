"""TensorBoard event files from the merged history, the spec as MLflow params, tracking URIs
that carry credentials, and an unreachable tracking server (no server: a closed port)."""

from __future__ import annotations

import math

import pytest

from flows.pytest_plugin import tiny_spec_dict
from tests.net import free_port
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError
from trainer_core.spec.overrides import build_spec
from trainer_core.storage.uris import resolve
from trainer_core.tracking import mlflow_log, mlflow_server, mlflow_state, tensorboard_log


def _history() -> list[dict]:
    rows = []
    for step in range(1, 11):
        row = {"step": step, "epoch": step // 6, "batch": step, "attempt": 1, "time": 1e9 + step}
        row |= {"loss": 1.0 / step, "lr": 0.01}
        if step % 5 == 0:
            row["val_loss"] = 0.5 / step
            row["val_accuracy"] = 0.1 * step
        rows.append(row)
    rows[3]["loss"] = math.nan  # not a number: left out, the rest of the row stays
    return rows


def _read(path) -> dict[str, list[tuple[int, float, float]]]:
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    series: dict[str, list[tuple[int, float, float]]] = {}
    for event in LegacyEventFileLoader(str(path)).Load():
        for value in event.summary.value:
            series.setdefault(value.tag, []).append(
                (event.step, value.simple_value, event.wall_time)
            )
    return series


def test_event_file_holds_each_value_under_its_tag_at_its_step(tmp_path):
    run_dir = RunDirectory(resolve(str(tmp_path)).child("r"))
    run_dir.location.ensure_dir()
    target = tensorboard_log.write(run_dir, _history())
    assert target.path.endswith(".relaytrain") and "tfevents" in target.path
    series = _read(target.path)
    assert set(series) == {"train/loss", "train/lr", "val/loss", "val/accuracy"}
    assert [s for s, _, _ in series["train/loss"]] == [1, 2, 3, 5, 6, 7, 8, 9, 10]
    assert series["val/loss"] == [
        (5, pytest.approx(0.1), 1e9 + 5),
        (10, pytest.approx(0.05), 1e9 + 10),
    ]
    assert [s for s, _, _ in series["train/lr"]] == list(range(1, 11))


def test_event_file_is_rewritten_whole_and_stale_ones_go(tmp_path):
    run_dir = RunDirectory(resolve(str(tmp_path)).child("r"))
    run_dir.location.ensure_dir()
    first = tensorboard_log.write(run_dir, _history()[:4])
    shifted = [{**row, "time": row["time"] + 1000} for row in _history()]
    second = tensorboard_log.write(run_dir, shifted)
    assert tensorboard_log.event_files(run_dir) == [second.path.rsplit("/", 1)[1]]
    assert first.path != second.path
    assert [s for s, _, _ in _read(second.path)["train/lr"]] == list(range(1, 11))


def test_spec_as_mlflow_params(tmp_path):
    spec = build_spec(
        tiny_spec_dict(tmp_path, "p", tracking={"mlflow_uri": "http://127.0.0.1:5000"})
    )
    params = mlflow_server.spec_params(spec)
    assert params["scaling.num_workers"] == "2"
    assert params["model.kwargs.hidden"] == "[16, 16]"
    assert params["run.name"] == "p" and params["schedule.lr_schedule"] == "cosine"
    assert not any(key.startswith("tracking") for key in params)
    assert all(len(value) <= mlflow_server.PARAM_CHARS for value in params.values())


@pytest.mark.parametrize(
    "uri, words",
    [
        ("http://alice:s3cret@mlflow.example:5000", "MLFLOW_TRACKING_USERNAME"),
        ("http://:5000", "names no host"),
    ],
)
def test_a_tracking_uri_with_credentials_or_no_host_is_refused(tmp_path, uri, words):
    with pytest.raises(SpecError) as raised:
        build_spec(tiny_spec_dict(tmp_path, "p", tracking={"mlflow_uri": uri}))
    message = str(raised.value)
    assert words in message and "tracking.mlflow_uri" in message
    assert "s3cret" not in message and "alice" not in message


def test_an_unreachable_server_is_recorded_never_raised(tmp_path):
    uri = f"http://127.0.0.1:{free_port()}"
    spec = build_spec(tiny_spec_dict(tmp_path, "down", tracking={"mlflow_uri": uri}))
    run_dir = RunDirectory(resolve(str(tmp_path)).child("down"))
    run_dir.location.ensure_dir()
    tracker = mlflow_log.for_run(spec, run_dir)
    assert tracker is not None
    tracker.attempt_started()
    tracker.on_event({"kind": "metrics", "rows": [{"step": 1, "loss": 1.0, "time": 1e9}]})
    tracker.on_event({"kind": "checkpoint", "step": 1})
    tracker.attempt_ended()
    state = mlflow_state.read_state(run_dir)
    assert state is not None and state.tracking_uri == uri
    assert state.run_id is None and state.logged_through_step == -1
    assert "connection refused" in (state.pending or "")
    assert "relaytrain sync" in state.describe()


def test_no_tracking_uri_no_tracker(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    spec = build_spec(tiny_spec_dict(tmp_path, "none"))
    assert mlflow_log.for_run(spec, RunDirectory(resolve(str(tmp_path)))) is None
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:1")
    assert mlflow_state.tracking_uri(spec) == "http://127.0.0.1:1"
