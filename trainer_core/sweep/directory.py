"""The sweep's own directory, ``{run.storage}/{sweep name}/``, beside its trials' run
directories (``{sweep name}-t001``, ...):

    sweep.json      the sweep spec as given (a rerun must give the same one)
    result.json     the SweepResult, rewritten after every wave
    failed/<trial>.json   a trial whose leg failed before its run could say so (its setup
                    refused it): out of the sweep, and not trained again by a rerun
    study.journal   the study in Optuna's journal format (local storage; ``study``)

Apart from ``failed/``, nothing here is read back to decide anything: the trials' run
directories are the record (``trials``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from trainer_core import storage
from trainer_core.checkpoint.run_directory import RUN_FILE
from trainer_core.errors import SpecError
from trainer_core.storage import Location
from trainer_core.sweep.result import SweepResult
from trainer_core.sweep.spec import Sweep

SCHEMA_VERSION = 1
SWEEP_FILE = "sweep.json"
RESULT_FILE = "result.json"
FAILED_DIR = "failed"


def sweep_location(sweep: Sweep, storage_uri: str) -> Location:
    return storage.resolve(storage_uri).child(sweep.name)


def check(sweep: Sweep, storage_uri: str, raw: Mapping[str, Any]) -> Location:
    """The sweep's directory, if ``raw`` (the sweep spec as given) may hold it: a new one, or
    one begun with the same spec; else a SpecError (another spec under this name would make the
    trials it finds another sweep's). A run's directory by the name is refused too. Writes
    nothing."""
    location = sweep_location(sweep, storage_uri)
    if location.child(RUN_FILE).exists():  # a run's record, whatever it holds
        raise SpecError(
            f"run.name {sweep.name!r}: {location.uri} is a run's directory, not a sweep's: "
            "give the sweep another name",
            field="run.name",
        )
    stored_file = location.child(SWEEP_FILE)
    if stored_file.exists():
        stored = _deciding(stored_file.read_json().get("spec"))
        if stored != _deciding(raw):
            keys = sorted(_differing(stored, _deciding(raw)))
            raise SpecError(
                f"sweep {sweep.name} at {location.uri} was begun with another spec (it differs "
                f"at {', '.join(keys) or 'its layout'}): its trials belong to that spec. Run it "
                "with the spec it began with, or give this one another run.name",
                field="run.name",
            )
    return location


def claim(sweep: Sweep, storage_uri: str, raw: Mapping[str, Any]) -> Location:
    """``check``, then the sweep's directory holding ``raw`` (written on the first run)."""
    location = check(sweep, storage_uri, raw)
    stored_file = location.child(SWEEP_FILE)
    if not stored_file.exists():
        location.ensure_dir()
        stored_file.write_json(
            {"schema": SCHEMA_VERSION, "name": sweep.name, "spec": _canonical(raw)}
        )
    return location


def write_result(location: Location, result: SweepResult) -> None:
    location.child(RESULT_FILE).write_json(
        {"schema": SCHEMA_VERSION, **result.model_dump(mode="json")}
    )


def read_result(location: Location) -> SweepResult | None:
    found = location.child(RESULT_FILE)
    if not found.exists():
        return None
    data = found.read_json()
    data.pop("schema", None)
    return SweepResult.model_validate(data)


def note_failed(location: Location, run_name: str, error: str) -> None:
    location.child(FAILED_DIR, f"{run_name}.json").write_json(
        {"schema": SCHEMA_VERSION, "run_name": run_name, "error": error}
    )


def failed_trials(location: Location) -> set[str]:
    """The run names of the trials ``note_failed`` noted."""
    folder = location.child(FAILED_DIR)
    if not folder.exists():
        return set()
    return {i.base_name[: -len(".json")] for i in folder.list() if i.base_name.endswith(".json")}


def _canonical(raw: Any) -> Any:
    return json.loads(json.dumps(raw, sort_keys=True, default=str))


def _deciding(raw: Any) -> Any:
    """The sweep spec as far as it decides the trials: without where the study is also kept
    (``sweep.study_url_env``), which a rerun may add, change or drop."""
    spec = _canonical(raw)
    if isinstance(spec, dict) and isinstance(spec.get("sweep"), dict):
        spec["sweep"].pop("study_url_env", None)
    return spec


def _differing(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys at which ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = []
        for key in sorted(set(a) | set(b)):
            found += _differing(a.get(key), b.get(key), f"{prefix}{key}.")
        return found
    return [] if a == b else [prefix.rstrip(".") or "(the whole spec)"]
