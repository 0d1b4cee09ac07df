"""The sweep as an Optuna study, for Optuna's own tools (``optuna.load_study``,
optuna-dashboard): rebuilt whole from the sweep's result after every wave, and never read back
to decide anything (the trials' run directories are the record):

- on local storage, a journal in the sweep directory (``study.journal``, Optuna's
  ``JournalFileBackend``), put in place at once so that a reader never sees half of it;
- in a database, where ``sweep.study_url_env`` names the environment variable that holds its
  URL (SQLAlchemy's form: PostgreSQL, for instance a database of its own on the Prefect
  server's PostgreSQL; the URL, a credential, never enters the spec, the flow's parameters or
  a log): the study named after the sweep, replaced each wave;
- on object storage, no journal: an object cannot be appended to; name a database instead.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from typing import Any

import optuna
import sqlalchemy
from optuna.storages import RDBStorage
from optuna.storages.journal import JournalFileBackend, JournalStorage
from optuna.trial import TrialState, create_trial

from trainer_core.errors import SpecError
from trainer_core.storage import Location
from trainer_core.sweep.result import SweepResult
from trainer_core.sweep.spec import Sweep

STUDY_FILE = "study.journal"
#: The drivers Optuna's synchronous SQLAlchemy engine takes for a URL written for Prefect's
#: asynchronous one (``postgresql+asyncpg://``, ``sqlite+aiosqlite://``) or with none.
SYNC_DRIVERS = {"postgresql": "postgresql+psycopg", "sqlite": "sqlite"}


def build(sweep: Sweep, result: SweepResult, storage: Any = None) -> optuna.Study:
    """The sweep as an Optuna study in ``storage`` (None: in memory): each trial with its
    values as Optuna stores them, its metric by epoch, and its state."""
    dimensions = {d.key: d for d in sweep.dimensions}
    built = optuna.create_study(
        study_name=sweep.name, direction=sweep.direction, storage=storage, load_if_exists=False
    )
    states = {
        "completed": TrialState.COMPLETE,
        "pruned": TrialState.PRUNED,
        "failed": TrialState.FAIL,
        "pending": TrialState.WAITING,
    }
    for trial in result.trials:
        if not trial.values:
            continue
        state = states[trial.status]
        built.add_trial(
            create_trial(
                params={k: dimensions[k].stored(v) for k, v in trial.values.items()},
                distributions={k: dimensions[k].distribution for k in trial.values},
                value=trial.metric if state == TrialState.COMPLETE else None,
                intermediate_values={int(e): v for e, v in trial.reports.items()},
                state=state,
                user_attrs={"run_name": trial.run_name, "run_uri": trial.run_uri},
            )
        )
    return built


def write(location: Location, sweep: Sweep, result: SweepResult) -> None:
    """The study wherever the sweep keeps one: its journal (local storage) and its database
    (``sweep.study_url_env``)."""
    write_journal(location, sweep, result)
    if sweep.section.study_url_env:
        storage = database(sweep)
        with contextlib.suppress(KeyError):  # none yet: the first wave's
            optuna.delete_study(study_name=sweep.name, storage=storage)
        build(sweep, result, storage)


def write_journal(location: Location, sweep: Sweep, result: SweepResult) -> bool:
    """The study's journal in a local sweep directory, rebuilt whole and put in place at once
    (a reader never sees half of it); False on object storage, which gets none."""
    if not location.is_local:
        return False
    handle, staged = tempfile.mkstemp(prefix=".study-", dir=location.path)
    os.close(handle)
    os.unlink(staged)  # the journal backend makes its own file
    try:
        build(sweep, result, JournalStorage(JournalFileBackend(staged)))
        os.replace(staged, os.path.join(location.path, STUDY_FILE))
    finally:
        if os.path.exists(staged):
            os.unlink(staged)
    return True


def database(sweep: Sweep) -> RDBStorage:
    """The study's database, by the URL in the environment variable ``sweep.study_url_env``
    names, connected (Optuna makes its tables in a database that has none). SpecError naming
    the variable, never its value, for a URL missing, malformed or not reachable."""
    name = sweep.section.study_url_env
    field = "sweep.study_url_env"
    value = os.environ.get(name or "")
    if not value:
        raise SpecError(
            f"{field} {name}: this environment has no such variable: set it to the URL of the "
            "study's database (postgresql://user:password@host:5432/optuna), or remove "
            f"{field}",
            field=field,
        )
    try:
        url = sqlalchemy.engine.make_url(value)
    except sqlalchemy.exc.ArgumentError:
        raise SpecError(
            f"{field} {name}: its value is not a database URL: write it as "
            "postgresql://user:password@host:5432/database",
            field=field,
        ) from None
    url = url.set(drivername=SYNC_DRIVERS.get(url.get_backend_name(), url.drivername))
    try:
        return RDBStorage(url.render_as_string(hide_password=False))
    except Exception as e:  # the driver's own errors: unreachable, refused, unknown database
        raise SpecError(
            f"{field} {name}: the study's database at {url.render_as_string()} cannot be "
            f"used: {type(e).__name__}: {_first_line(e)} (is it running, and does the "
            "database exist? Optuna needs one of its own, not Prefect's)",
            field=field,
        ) from None


def _first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [""])[0]
