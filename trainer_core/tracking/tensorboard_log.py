"""The run's TensorBoard event file, written from the merged metrics history.

    {run}/events.out.tfevents.{first row's time}.relaytrain

One file, rewritten whole from ``RunDirectory.read_metrics_history`` (one row per step across
every attempt) whenever an attempt ends and when the run is finalized. A step that a retry ran
again therefore appears once, on one step axis, and the file lives wherever the run does (a
local path or object storage). ``tensorboard --logdir runs/`` shows each run under its name.

Tags: ``train/loss``, ``train/lr`` and any other per-step value under ``train/``; ``val_x``
under ``val/x``. The bytes are TensorBoard's own records (``RecordWriter``), so nothing but the
``tensorboard`` package is needed to write or read them.
"""

from __future__ import annotations

import io
import logging
import time
from collections.abc import Sequence
from typing import Any

from tensorboard.compat.proto.event_pb2 import Event
from tensorboard.compat.proto.summary_pb2 import Summary
from tensorboard.summary.writer.record_writer import RecordWriter

from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.numbers import is_finite_number
from trainer_core.storage.locations import Location

logger = logging.getLogger("relaytrain.tensorboard")

PREFIX = "events.out.tfevents."
SUFFIX = ".relaytrain"
#: Row keys that place a value, rather than being one.
NOT_SCALARS = ("step", "epoch", "batch", "attempt", "time", "schema")


def tag(key: str) -> str:
    """The TensorBoard tag of a history key: ``val_loss`` -> ``val/loss``, ``loss`` ->
    ``train/loss``; the step-time breakdown's ``time/data_wait`` stays itself."""
    if key.startswith("time/"):
        return key
    if key.startswith("val_") and len(key) > 4:
        return f"val/{key[4:]}"
    return f"train/{key}"


def event_bytes(history: Sequence[dict[str, Any]]) -> bytes:
    """One event file's bytes for ``history``: a version record, then one summary per row."""
    buffer = io.BytesIO()
    records = RecordWriter(buffer)
    start = _wall_time(history[0]) if history else time.time()
    records.write(Event(wall_time=start, file_version="brain.Event:2").SerializeToString())
    for row in history:
        values = [
            Summary.Value(tag=tag(key), simple_value=float(value))
            for key, value in row.items()
            if key not in NOT_SCALARS and is_finite_number(value)
        ]
        if values:
            event = Event(wall_time=_wall_time(row, start), step=int(row["step"]))
            event.summary.CopyFrom(Summary(value=values))
            records.write(event.SerializeToString())
    return buffer.getvalue()


def write(run_dir: RunDirectory, history: Sequence[dict[str, Any]] | None = None) -> Location:
    """(Re)write the run's event file from ``history`` (read from the run when None); any
    event file of ours with another name (a history that now starts at another time) goes."""
    if history is None:
        history = read_metrics_history(run_dir)
    start = _wall_time(history[0]) if history else time.time()
    name = f"{PREFIX}{int(start):010d}{SUFFIX}"
    target = run_dir.location.child(name)
    target.write_bytes(event_bytes(history))
    for info in run_dir.location.list():
        if _ours(info.base_name) and info.base_name != name:
            run_dir.location.child(info.base_name).delete_file()
    return target


def write_quietly(run_dir: RunDirectory, history: Sequence[dict[str, Any]] | None = None) -> None:
    """``write``, for the end of an attempt: a failure is logged, never raised (the next
    attempt or finalize writes the file again)."""
    try:
        write(run_dir, history)
    except Exception as e:
        logger.warning("TensorBoard event file of %s not written: %s", run_dir.uri, e)


def event_files(run_dir: RunDirectory) -> list[str]:
    return sorted(info.base_name for info in run_dir.location.list() if _ours(info.base_name))


def _ours(name: str) -> bool:
    return name.startswith(PREFIX) and name.endswith(SUFFIX)


def _wall_time(row: dict[str, Any], default: float | None = None) -> float:
    value: Any = row.get("time")
    if is_finite_number(value):
        return float(value)
    return default if default is not None else time.time()
