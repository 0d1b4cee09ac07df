"""Sweeps (flows/sweep.py) on the session's Ray cluster and Prefect harness, with real Optuna:
a sweep is a function of its seed, whatever ran at once, whatever was killed."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
import yaml
from optuna.storages.journal import JournalFileBackend, JournalStorage

from flows.pytest_plugin import tiny_spec_dict
from flows.sweep import sweep
from tests.conftest import ONE_WORKER
from tests.recovery import assert_same_tensors, final_state, measure_checkpoints
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError
from trainer_core.run import catalog
from trainer_core.sweep import trials
from trainer_core.sweep.spec import build_sweep

REPO = Path(__file__).resolve().parents[2]
STUDY_URL_ENV = "RELAYTRAIN_TEST_STUDY_URL"
#: Six trials of the tiny spec (three epochs: rungs after epochs 1 and 2), halving at each.
SECTION = {
    "trials": 6,
    "metric": "val_loss",
    "pruner": {"successive_halving": {"reduction_factor": 2}},
    "seed": 11,
    "space": {
        "optimizer.lr": {"log_uniform": [1.0e-3, 1.0e-1]},
        "model.kwargs.hidden": {"choice": [[16], [16, 16]]},
    },
}


def sweep_dict(storage: Path, name: str, concurrent: int, **sections) -> dict:
    raw = tiny_spec_dict(storage, name, scaling=ONE_WORKER, **sections)
    raw["sweep"] = {**SECTION, "concurrent": concurrent}
    return raw


def outcome(result) -> list[tuple]:
    """What a sweep decided and reached, trial by trial (run names aside)."""
    return [
        (t.number, t.values, t.status, t.pruned_at_epoch, t.epochs, t.steps, t.metric)
        for t in result.trials
    ]


@pytest.fixture(scope="module")
def study_url():
    """A real PostgreSQL server with a database of its own for the study (as a user gives the
    Prefect server's PostgreSQL one); its URL in the environment variable STUDY_URL_ENV."""
    from tests.postgres import Postgres

    database = Postgres().start()
    try:
        database.create_database("optuna")
        url = database.url("postgresql+asyncpg", "optuna")
        os.environ[STUDY_URL_ENV] = url
        yield url
    finally:
        os.environ.pop(STUDY_URL_ENV, None)
        database.stop()


@pytest.fixture(scope="module")
def one_at_a_time(relaytrain_ray, relaytrain_prefect, tmp_path_factory, study_url):
    """The sweep run 1 trial at a time in this process, its study kept in PostgreSQL too:
    what every other way of running it must end as."""
    storage = tmp_path_factory.mktemp("sweep-serial")
    raw = sweep_dict(storage, "serial", concurrent=1)
    raw["sweep"]["study_url_env"] = STUDY_URL_ENV
    return raw, sweep(raw)


def test_successive_halving_keeps_the_best_half_at_each_rung(one_at_a_time):
    """The oracle is the rule's definition, on the metrics the trials' own run directories
    hold: at epoch 1 the best 3 of 6 go on, at epoch 2 the best 1 of those 3, which alone
    trains to the end; the others stop at the checkpoint of the validation that pruned them."""
    raw, result = one_at_a_time
    swept = build_sweep(raw)
    runs = {t.number: trials.read_trial(swept, t.number) for t in result.trials}
    at_1 = sorted(runs, key=lambda n: runs[n].reports[1])
    at_2 = sorted(at_1[:3], key=lambda n: runs[n].reports[2])
    expected = {n: ("pruned", 1) for n in at_1[3:]} | {n: ("pruned", 2) for n in at_2[1:]}
    expected[at_2[0]] = ("completed", None)
    assert {t.number: (t.status, t.pruned_at_epoch) for t in result.trials} == expected
    for t in result.trials:
        assert t.epochs == (t.pruned_at_epoch or 3) and t.steps == 13 * t.epochs
        assert RunDirectory.of(str(raw["run"]["storage"]), t.run_name).scan().newest.step == t.steps
    assert result.best is not None and result.best.number == at_2[0]
    assert (result.steps_trained, result.steps_full) == (13 * (6 + 3 + 1), 6 * 39)
    # each trial trained with its values: its run's own record of its spec
    for t in result.trials:
        spec = RunDirectory.of(str(raw["run"]["storage"]), t.run_name).read_run_record()["spec"]
        assert spec["optimizer"]["lr"] == t.values["optimizer.lr"]
        assert spec["model"]["kwargs"]["hidden"] == t.values["model.kwargs.hidden"]
    assert len({t.values["optimizer.lr"] for t in result.trials}) == 6
    # each trial's own run says how it ended, as `relaytrain show` reads it
    for t in result.trials:
        run_dir = RunDirectory.of(str(raw["run"]["storage"]), t.run_name)
        assert catalog.view(run_dir).status == t.status


def test_the_study_in_postgresql_and_the_journal_hold_every_trial_as_it_ended(
    one_at_a_time, study_url
):
    """Optuna's own load_study reads the sweep from PostgreSQL and from the sweep directory's
    journal: each trial's values, state and metric as the sweep's result has them."""
    raw, result = one_at_a_time
    journal = JournalStorage(
        JournalFileBackend(str(Path(raw["run"]["storage"]) / "serial" / "study.journal"))
    )
    states = {"completed": "COMPLETE", "pruned": "PRUNED"}
    # Optuna's way: a pruned trial has no value, its metric is its last intermediate value
    expected = [(states[t.status], t.metric, t.values["optimizer.lr"]) for t in result.trials]
    # the study's URL as Prefect's is written (asyncpg); Optuna's engine reads it with psycopg
    for storage in (study_url.replace("+asyncpg", "+psycopg"), journal):
        loaded = optuna.load_study(study_name="serial", storage=storage)
        assert [
            (
                t.state.name,
                t.value
                if t.state.name == "COMPLETE"
                else t.intermediate_values[max(t.intermediate_values)],
                t.params["optimizer.lr"],
            )
            for t in loaded.trials
        ] == expected
        assert loaded.best_trial.user_attrs["run_name"] == result.best.run_name


def test_the_best_trial_scores_what_the_sweep_reports(one_at_a_time):
    """Its checkpoint evaluated on the driver gives the metric the sweep reports for it."""
    raw, result = one_at_a_time
    best = result.best
    swept = build_sweep(raw)
    spec = swept.trial_spec(best.number, best.values)
    run_dir = RunDirectory.of(str(raw["run"]["storage"]), best.run_name)
    measured = measure_checkpoints(spec, run_dir)[best.steps]["measured"]
    assert measured["val_loss"] == pytest.approx(best.metric, rel=1e-5)
    assert best.checkpoint_uri == run_dir.scan().newest.uri


def test_two_at_a_time_killed_twice_with_workers_lost_ends_as_one_at_a_time(
    relaytrain_ray, relaytrain_prefect, one_at_a_time, tmp_path
):
    """The same sweep, 2 trials at once, as the command in a process of its own: SIGKILLed
    twice mid-sweep and run again, and every trial's first attempt losing a worker at step 8
    unless the kill of the sweep cut it short first (the attempt is retried and resumed).
    Values, statuses, pruned epochs, steps and metrics equal the sweep run 1 at a time, and
    every trial's final weights and optimizer state equal it bit for bit."""
    raw, serial = one_at_a_time
    storage = tmp_path / "runs"
    killed = sweep_dict(storage, "serial", concurrent=2)  # the same name: the same trial names
    killed["faults"] = [{"kind": "kill", "at_step": 8, "rank": 0, "attempt": 1}]
    config = tmp_path / "sweep.yaml"
    config.write_text(yaml.safe_dump(killed))
    swept = build_sweep(killed)

    def progress() -> int:
        return sum(trials.read_trial(swept, n).epochs for n in range(6))

    for at_least in (2, 5):  # epochs committed by any trials when the kill lands
        process = start_sweep(config, relaytrain_ray)
        try:
            while progress() < at_least:
                assert process.poll() is None, process.stdout.read()
                time.sleep(0.5)
        finally:
            process.kill()
            process.wait()
    process = start_sweep(config, relaytrain_ray)
    try:
        out, _ = process.communicate()
    finally:  # a test stopped meanwhile (its timeout) leaves no sweep running
        process.kill()
        process.wait()
    assert process.returncode == 0, out
    result = sweep(killed)  # run again once over: returns what the trials hold, trains nothing
    assert outcome(result) == outcome(serial)
    for t in result.trials:
        ran = RunDirectory.of(str(storage), t.run_name)
        alone = RunDirectory.of(str(raw["run"]["storage"]), t.run_name)
        assert_same_tensors(final_state(ran), final_state(alone))
    # the trials whose first attempt reached step 8 before a kill of the sweep lost a worker
    # there and were resumed (the others' first attempt was cut short by the kill itself)
    assert [t for t in result.trials if _attempt_failed(storage, t.run_name)]


def _attempt_failed(storage: Path, run_name: str) -> bool:
    from trainer_core.run import attempts

    records = attempts.read(RunDirectory.of(str(storage), run_name))
    return any(r.status == "failed" for r in records)


def start_sweep(config: Path, ray) -> subprocess.Popen:
    """``python -m flows.sweep`` on the session's cluster and Prefect API."""
    from prefect.settings import PREFECT_API_URL

    env = dict(os.environ)
    env.update(
        {
            "PREFECT_API_URL": str(PREFECT_API_URL.value()),
            "RAY_ADDRESS": ray.get_runtime_context().gcs_address,
        }
    )
    return subprocess.Popen(
        [sys.executable, "-m", "flows.sweep", "--config", str(config)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_a_bad_sweep_is_refused_before_anything_is_written(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """A metric no trial records, and a value at the space's edge the run spec refuses: each a
    SpecError naming the key, at setup, with nothing in storage."""
    storage = tmp_path / "runs"
    raw = sweep_dict(storage, "bad", concurrent=1)
    raw["sweep"]["metric"] = "val_accuracy"  # a regression records no accuracy
    with pytest.raises(SpecError, match=r"sweep\.metric"):
        sweep(raw)
    raw = sweep_dict(storage, "bad", concurrent=1)
    raw["sweep"]["space"] = {"data.batch_size": {"int": [0, 64, 32]}}
    with pytest.raises(SpecError, match=r"sweep\.space\.data\.batch_size"):
        sweep(raw)
    assert not storage.exists() or not any(storage.iterdir())


def test_a_sweep_begun_with_another_spec_is_refused(one_at_a_time):
    """The same name with another seed: refused, naming where the specs differ; the trials
    that name holds are untouched."""
    raw, result = one_at_a_time
    other = {**raw, "sweep": {**raw["sweep"], "seed": 12}}
    storage = str(raw["run"]["storage"])
    before = {
        t.run_name: RunDirectory.of(storage, t.run_name).summary_file.read_bytes()
        for t in result.trials
    }
    with pytest.raises(SpecError, match=r"another spec \(it differs at sweep\.seed\)"):
        sweep(other)
    after = {name: RunDirectory.of(storage, name).summary_file.read_bytes() for name in before}
    assert after == before
