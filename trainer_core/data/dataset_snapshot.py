"""A run's pinned snapshot of its dataset.

A scheduled retraining job writes into a growing table; a run must not notice. The first
attempt takes the snapshot (``footers.scan``: each file's path, size, modification time and
footer digest, with its row groups' row counts) and the run directory records it
(``dataset.json``); the driver hands it to every rank, so no rank lists the dataset again. Every
later attempt reads exactly those files: files added since are ignored (and counted), a file
of the snapshot that changed or vanished is refused with a SpecError naming it. Row ids, the
epoch order and the validation split are functions of the snapshot, so they cannot move under
a saved cursor.
"""

from __future__ import annotations

import base64
import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Any

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
    pinned = [[f.path, f.size, f.footer] for f in layout.files]
    return hashlib.sha256(json.dumps(pinned).encode()).hexdigest()


@dataclass(frozen=True)
class Check:
    """What a later attempt found against the snapshot: the files added since (ignored)."""

    added: list[str]


def verify(layout: footers.Layout, data: DataSection) -> Check:
    """Check the files of ``layout`` are still those the snapshot pinned: SpecError naming the
    first file that vanished or changed (its size, or its footer when its modification time
    moved), with the fix. Lists the dataset once to count the files added since."""
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
