"""A run's pinned snapshot of its dataset.

A scheduled retraining job writes into a growing table; a run must not notice. The first
attempt takes the snapshot (``footers.scan``: each file's path, size, modification time and
footer digest, with its row groups' row counts) and the run directory records it
(``dataset.json``); the driver hands it to every rank, so no rank lists the dataset again. Every
later attempt starts from the snapshot, not from the dataset: it reads exactly those files
(``from_json``), checks them against what was pinned (``verify``: a file that changed or
vanished is a SpecError naming it) and lists the dataset only to count the files added since,
by name: none of them is opened, so a half-written file, one of another schema or one that is
not Parquet cannot stop a retry. A dataset that resolves to another place than the snapshot's
(``at_location``: a relative path from another working directory) is refused, naming both.
Row ids, the epoch order and the validation split are functions of the snapshot, so they
cannot move under a saved cursor.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from trainer_core.data import footers
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection

SCHEMA_VERSION = 1


def to_json(layout: footers.Layout) -> dict[str, Any]:
    """A scanned layout as the run directory records it (and the driver hands the workers)."""
    return {
        "schema": SCHEMA_VERSION,
        "uri": layout.uri,
        "arrow_schema": base64.b64encode(layout.schema.serialize().to_pybytes()).decode(),
        "files": [asdict(f) for f in layout.files],
        "row_groups": [asdict(g) for g in layout.row_groups],
        "fingerprint": fingerprint(layout),
    }


def from_json(record: dict[str, Any], data: DataSection) -> footers.Layout:
    """The layout a snapshot records, read from the files it names (nothing listed), through
    ``data.dataset``'s filesystem (its URI carries the endpoint and options; the record only
    the location)."""
    location = footers.dataset_location(data.resolved())
    schema = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(record["arrow_schema"])))
    row_groups = tuple(
        footers.RowGroup(
            **{
                **g,
                "label_range": tuple(g["label_range"]) if g["label_range"] else None,
            }
        )
        for g in record["row_groups"]
    )
    files = tuple(footers.DataFile(**f) for f in record["files"])
    return footers.Layout(location.uri, location, row_groups, schema, files=files)


def fingerprint(layout: footers.Layout) -> str:
    """sha256 of what the snapshot pins: every file's path, size and footer, in order."""
    return _fingerprint(layout.files)


def recorded_fingerprint(record: dict[str, Any]) -> str:
    """The fingerprint of the files a stored snapshot names (computed, not the one it states:
    an edited file list has another)."""
    return _fingerprint(footers.DataFile(**f) for f in record["files"])


def _fingerprint(files: Iterable[footers.DataFile]) -> str:
    pinned = [[f.path, f.size, f.footer] for f in files]
    return hashlib.sha256(json.dumps(pinned).encode()).hexdigest()


def at_location(record: dict[str, Any], data: DataSection) -> dict[str, Any]:
    """The snapshot ``record`` as this process must read it, where ``data.dataset`` resolves
    now: the record itself when that is the place it was taken of; the bundled ``digits``
    (relaytrain's own file, named and not located by the spec) re-based onto this
    installation's copy, whose size and footer ``verify`` still checks; otherwise a SpecError
    naming both places and the fix."""
    location = footers.dataset_location(data.resolved())
    if location.uri == record["uri"]:
        return record
    if data.dataset == "digits" and len(record["files"]) == 1:
        return {
            **record,
            "uri": location.uri,
            "files": [{**f, "path": location.path} for f in record["files"]],
            "row_groups": [{**g, "file": location.path} for g in record["row_groups"]],
        }
    relative = not urlsplit(data.dataset).scheme and not os.path.isabs(data.dataset)
    hint = (
        " (a relative path resolves from the working directory: run from the directory the "
        "run started in)"
        if relative
        else ""
    )
    raise SpecError(
        f"data.dataset {data.dataset!r} resolves to {location.uri}, but this run's dataset "
        f"snapshot was taken of {record['uri']}: a run trains on the files it started with. "
        f"Run it where data.dataset resolves to {record['uri']}{hint}, or start a new "
        f"run.name to train on {location.uri}.",
        field="data.dataset",
    )


@dataclass(frozen=True)
class Check:
    """What a later attempt found against the snapshot: the files added since (ignored)."""

    added: list[str]


def verify(layout: footers.Layout, data: DataSection) -> Check:
    """Check the files of ``layout`` are still those the snapshot pinned: SpecError naming the
    first file that vanished or changed (its size, or its footer when its modification time
    moved), with the fix. Lists the dataset once to count the files added since, by path:
    whatever they hold, none of them is opened."""
    location = layout.location
    assert location is not None
    fs = location.filesystem
    field = "data.dataset"
    found = fs.get_file_info([f.path for f in layout.files])
    for pinned, info in zip(layout.files, found, strict=True):
        fix = (
            f"Restore it, or start a new run.name to train on {data.dataset} as it is now "
            "(a run trains on the files it started with)."
        )
        if info.type != pafs.FileType.File:
            raise SpecError(
                f"{field} {layout.uri}: file {pinned.path!r} of this run's dataset snapshot is "
                f"gone. {fix}",
                field=field,
            )
        changed = info.size != pinned.size
        if not changed and info.mtime_ns != pinned.mtime_ns:  # touched, copied, or rewritten
            changed = footers.footer_digest(footers.read_footer(location, pinned.path, field)) != (
                pinned.footer
            )
        if changed:
            raise SpecError(
                f"{field} {layout.uri}: file {pinned.path!r} changed since this run took its "
                f"dataset snapshot ({pinned.size} bytes then, {info.size} now). {fix}",
                field=field,
            )
    if len(layout.files) == 1 and location.info().type == pafs.FileType.File:
        return Check(added=[])
    pinned_paths = {f.path for f in layout.files}
    now = footers.parquet_files(location, field)
    return Check(added=[f.path for f in now if f.path not in pinned_paths])
