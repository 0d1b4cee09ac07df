"""The sweep's own directory (trainer_core/sweep/directory.py) and its files: the spec it began
with, the study as Optuna's journal, a sweep file that names its run spec."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.storages.journal import JournalFileBackend, JournalStorage

from tests.unit.test_sweep_spec import EXAMPLE, raw
from trainer_core.errors import SpecError
from trainer_core.sweep import directory, study
from trainer_core.sweep.result import SweepResult, TrialResult
from trainer_core.sweep.spec import build_sweep, load_sweep, read_sweep_file

REPO = Path(__file__).resolve().parents[2]


def test_a_rerun_must_give_the_spec_the_sweep_began_with(tmp_path):
    spec = raw()
    s = build_sweep(spec)
    location = directory.claim(s, str(tmp_path), spec)
    assert json.loads((tmp_path / "digits-lr" / "sweep.json").read_text())["spec"] == spec
    assert directory.claim(s, str(tmp_path), json.loads(json.dumps(spec))).uri == location.uri
    other = raw(seed=8)
    other["optimizer"]["lr"] = 0.5
    with pytest.raises(SpecError, match=r"differs at optimizer\.lr, sweep\.seed") as refused:
        directory.claim(build_sweep(other), str(tmp_path), other)
    assert refused.value.field == "run.name"
    # where the study is also kept decides nothing about the trials: a rerun may name a database
    with_database = json.loads(json.dumps(spec))
    with_database["sweep"]["study_url_env"] = "STUDY_DB"
    assert directory.check(build_sweep(with_database), str(tmp_path), with_database) == location
    with_database["sweep"]["seed"] = 8
    with pytest.raises(SpecError, match=r"differs at sweep\.seed\)"):
        directory.check(build_sweep(with_database), str(tmp_path), with_database)
    (tmp_path / "a-run").mkdir()
    (tmp_path / "a-run" / "run.json").write_text("{}")
    with pytest.raises(SpecError, match="a run's directory"):
        directory.claim(build_sweep(spec, "a-run"), str(tmp_path), spec)


def result_of(values: list[dict], statuses: list[str]) -> SweepResult:
    trials = [
        TrialResult(
            number=n,
            run_name=f"digits-lr-t{n:03d}",
            run_uri=f"/runs/digits-lr-t{n:03d}",
            values=v,
            status=status,
            metric=0.5 - 0.1 * n if status == "completed" else None,
            epochs=2,
            steps=20,
            pruned_at_epoch=1 if status == "pruned" else None,
            reports={1: 0.9 - 0.1 * n, 2: 0.5 - 0.1 * n},
        )
        for n, (v, status) in enumerate(zip(values, statuses, strict=True))
    ]
    return SweepResult(
        name="digits-lr",
        sweep_uri="/runs/digits-lr",
        metric="val_loss",
        direction="minimize",
        sampler="random",
        pruner="successive_halving",
        seed=7,
        status="completed",
        trials=trials,
        best=trials[-1],
        steps_trained=60,
        steps_full=60,
    )


def test_the_study_journal_loads_in_optuna_with_every_trial(tmp_path):
    """Optuna's own load_study reads the journal: each trial's values (a list choice as the
    run spec had it), state, metric by epoch and run directory; rebuilt whole each time."""
    s = build_sweep(raw())
    values = [
        {"optimizer.lr": 0.01, "model.kwargs.channels": [8, 16], "data.batch_size": 64},
        {"optimizer.lr": 0.02, "model.kwargs.channels": [16, 32], "data.batch_size": 32},
        {"optimizer.lr": 0.03, "model.kwargs.channels": [8, 16], "data.batch_size": 128},
    ]
    location = directory.claim(s, str(tmp_path), raw())
    for _ in range(2):  # rewritten, not appended to
        result = result_of(values, ["pruned", "failed", "completed"])
        assert study.write_journal(location, s, result)
    journal = JournalStorage(JournalFileBackend(str(tmp_path / "digits-lr" / "study.journal")))
    loaded = optuna.load_study(study_name="digits-lr", storage=journal)
    assert [t.state.name for t in loaded.trials] == ["PRUNED", "FAIL", "COMPLETE"]
    assert loaded.best_trial.number == 2 and loaded.best_value == pytest.approx(0.3)
    assert json.loads(loaded.trials[1].params["model.kwargs.channels"]) == [16, 32]
    assert loaded.trials[0].intermediate_values == {1: pytest.approx(0.9), 2: pytest.approx(0.5)}
    assert loaded.trials[2].user_attrs["run_name"] == "digits-lr-t002"
    assert directory.read_result(location) is None  # the result is the flow's to write
    directory.write_result(location, result)
    assert directory.read_result(location) == result


def test_the_study_kept_in_a_database_named_by_the_environment_is_replaced_each_wave(
    tmp_path, monkeypatch
):
    """sweep.study_url_env names the variable holding the database's URL (SQLite's file here;
    PostgreSQL in tests/integration/test_sweep.py): Optuna's load_study reads the study there,
    the second wave's in place of the first's; the URL is in no file of the sweep directory."""
    url = f"sqlite:///{tmp_path / 'optuna.db'}"
    monkeypatch.setenv("STUDY_DB", url)
    raw_sweep = raw()
    raw_sweep["sweep"]["study_url_env"] = "STUDY_DB"
    s = build_sweep(raw_sweep)
    values = [{"optimizer.lr": 0.01, "model.kwargs.channels": [8, 16], "data.batch_size": 64}]
    location = directory.claim(s, str(tmp_path / "runs"), raw_sweep)
    study.write(location, s, result_of(values, ["pruned"]))
    values.append({"optimizer.lr": 0.02, "model.kwargs.channels": [16, 32], "data.batch_size": 32})
    study.write(location, s, result_of(values, ["pruned", "completed"]))
    loaded = optuna.load_study(study_name="digits-lr", storage=url)
    assert [t.state.name for t in loaded.trials] == ["PRUNED", "COMPLETE"]
    assert loaded.best_trial.params["optimizer.lr"] == pytest.approx(0.02)
    written = [f.read_text(errors="replace") for f in (tmp_path / "runs").rglob("*") if f.is_file()]
    assert written and not any(url in text or "optuna.db" in text for text in written)


def test_a_study_database_that_is_missing_or_unreachable_is_named_not_shown(tmp_path, monkeypatch):
    raw_sweep = raw()
    raw_sweep["sweep"]["study_url_env"] = "STUDY_DB"
    s = build_sweep(raw_sweep)
    monkeypatch.delenv("STUDY_DB", raising=False)
    with pytest.raises(SpecError, match="STUDY_DB: this environment has no such variable"):
        study.database(s)
    monkeypatch.setenv("STUDY_DB", "not a url")
    with pytest.raises(SpecError, match="STUDY_DB: its value is not a database URL"):
        study.database(s)
    monkeypatch.setenv("STUDY_DB", "postgresql://someone:hunter2@127.0.0.1:1/optuna")
    with pytest.raises(SpecError, match="cannot be used") as refused:
        study.database(s)
    assert "hunter2" not in str(refused.value) and refused.value.field == "sweep.study_url_env"
    raw_sweep["sweep"]["study_url_env"] = "not-a-name"
    with pytest.raises(SpecError, match="study_url_env"):
        build_sweep(raw_sweep)


def test_a_sweep_file_may_name_its_run_spec(tmp_path):
    (tmp_path / "base.yaml").write_text(EXAMPLE.read_text())
    sweep_file = tmp_path / "sweep.yaml"
    sweep_file.write_text(
        yaml.safe_dump(
            {
                "spec": "base.yaml",
                "run": {"name": "named"},
                "sweep": {
                    "trials": 2,
                    "metric": "val_loss",
                    "space": {"optimizer.lr": {"uniform": [0.001, 0.01]}},
                },
            }
        )
    )
    merged = read_sweep_file(sweep_file)
    assert merged["run"]["storage"] == "./runs" and merged["run"]["name"] == "named"
    assert merged["model"]["name"] == "cnn" and "spec" not in merged
    assert load_sweep(sweep_file).name == "named"
    sweep_file.write_text(yaml.safe_dump({"spec": "missing.yaml", "sweep": {}}))
    with pytest.raises(SpecError, match=r"missing\.yaml"):
        read_sweep_file(sweep_file)


def test_the_example_sweep_is_valid():
    s = load_sweep(REPO / "examples" / "digits_sweep.yaml")
    assert (s.name, s.section.trials, s.epochs, s.pruner_name()) == (
        "digits-sweep",
        16,
        10,
        "successive_halving",
    )


def test_the_sweep_deployment_is_the_example_sweep():
    """deployments/prefect.yaml's sweep/digits: a valid sweep, the example's settings."""
    deployments = yaml.safe_load((REPO / "deployments" / "prefect.yaml").read_text())
    (found,) = [d for d in deployments["deployments"] if d["entrypoint"].endswith(":sweep")]
    deployed = build_sweep(found["parameters"]["spec"])
    example = load_sweep(REPO / "examples" / "digits_sweep.yaml")
    assert deployed.name == example.name and deployed.section == example.section
