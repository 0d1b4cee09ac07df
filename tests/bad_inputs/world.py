"""What the bad-input catalog's cases are made of: the ``World`` they point at (an existing run,
a Parquet table), the ``Case`` record, and the small builders the cases share."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from tests.conftest import tiny_raw

EXISTING = "existing"


@dataclass(frozen=True)
class World:
    """What the cases point at: the storage of an existing run, its name, a Parquet table."""

    storage: Path
    table: Path

    def raw(self, name: str = EXISTING, **sections: Any) -> dict[str, Any]:
        return tiny_raw(self.storage, name, **sections)

    def parquet(self, **data: Any) -> dict[str, Any]:
        """The tiny spec reading the test table (x: list of 6 floats, y: float, ...)."""
        return self.raw(
            data={
                "dataset": str(self.table),
                "features": "x",
                "label": "y",
                "task": "regression",
                "batch_size": 16,
                **data,
            }
        )

    def copy_run(self, name: str, **record: Any) -> str:
        """A copy of the existing run under ``name`` whose run.json has ``record`` merged in."""
        target = self.storage / name
        if not target.exists():
            shutil.copytree(self.storage / EXISTING, target)
            run_json = target / "run.json"
            data = json.loads(run_json.read_text())
            for key, value in record.items():
                data[key] = {**data[key], **value} if isinstance(value, dict) else value
            run_json.write_text(json.dumps(data))
        return name


def unchanged(w: World) -> dict[str, Any]:
    return w.raw()


@dataclass(frozen=True)
class Case:
    id: str
    #: The field the message must name, and a phrase of the fix it must give (case-insensitive).
    field: str
    fix: str
    #: "spec", "setup" or "serve" (see the module docstring).
    stage: str
    raw: Callable[[World], dict[str, Any]] = unchanged
    overrides: tuple[str, ...] = ()
    run_name: str | None = None
    argv: tuple[str, ...] = ()
    #: Also refused end to end, through the ``training`` flow (a few of each stage: every case
    #: reaches the same checks, the flow adds only how it reports them).
    flow: bool = False


def broken(**sections: Any) -> Callable[[World], dict[str, Any]]:
    return lambda w: w.raw(**sections)


def renamed(name: str) -> Callable[[World], dict[str, Any]]:
    return lambda w: w.raw(run={"name": name})


def own_loop(path: str) -> Callable[[World], dict[str, Any]]:
    def make(w: World) -> dict[str, Any]:
        raw = w.raw(train_loop=path)
        for section in ("model", "data", "schedule"):
            del raw[section]
        return raw

    return make


def ray_data_loop(w: World, train: str, name: str = EXISTING, **sections: Any) -> dict[str, Any]:
    """The Ray Data example loop, its train dataset at ``train``: the run ``name``, the tiny
    spec's other sections replaced or extended by ``sections``."""
    raw = {**own_loop("examples.ray_data_loop:train_func")(w), "datasets": {"train": train}}
    raw["run"] = {**raw["run"], "name": name}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return raw


def empty_directory(w: World) -> Path:
    path = w.table.parent / "empty"
    path.mkdir(exist_ok=True)
    return path


def mixed_schemas(w: World) -> Path:
    """A directory of two Parquet files whose feature columns differ in type."""
    path = w.table.parent / "mixed"
    path.mkdir(exist_ok=True)
    table = pq.read_table(w.table, columns=["x", "y"])
    pq.write_table(table, path / "a.parquet")
    as_doubles = pa.array([[float(v) for v in row] for row in table["x"].to_pylist()])
    pq.write_table(table.set_column(0, "x", as_doubles), path / "b.parquet")
    return path


def typo(w: World) -> dict[str, Any]:
    raw = w.raw()
    raw["schedul"] = raw.pop("schedule")
    return raw


GREATER = "greater than 0"
