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

A user's own Ray Train loop is held to the same rule for each of the spec's ``datasets`` (read
whole by Ray Data): ``tables_to_json`` records one snapshot a name, and Ray Data is handed the
pinned files, not the directory. ``pin`` is the rule both follow; a ``Source`` is what a
snapshot is of: the dataset as the spec names it, and where that resolves now.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from trainer_core import storage
from trainer_core.data import footers, samples
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection

SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Source:
    """What a snapshot is of: the dataset as the spec names it (``given``, in ``field``) and
    where that resolves from this process."""

    field: str
    given: str
    location: storage.Location
    #: relaytrain's own file (the built-in ``digits``): named, not located, by the spec.
    bundled: bool = False

    @classmethod
    def of(cls, data: DataSection | Source) -> Source:
        """The built-in loop's ``data.dataset`` (a Source as it is)."""
        if isinstance(data, Source):
            return data
        data = data.resolved()
        location = footers.dataset_location(data)
        return cls("data.dataset", data.dataset, location, data.dataset == "digits")

    @classmethod
    def of_table(cls, name: str, uri: str) -> Source:
        """``datasets.<name>`` of a user's own Ray Train loop."""
        return cls(f"datasets.{name}", uri, storage.resolve(uri))


def pin(
    source: Source, stored: dict[str, Any] | None, scan: Callable[[], footers.Layout]
) -> tuple[footers.Layout, list[str]]:
    """The layout an attempt reads, and the files added since its snapshot: with the run's
    snapshot ``stored``, the files it names where ``source`` resolves now (``at_location``),
    checked against what was pinned (``verify``), the rest of the dataset only listed; with
    none (a first attempt), ``scan()`` now."""
    if stored is None:
        return scan(), []
    layout = from_json(at_location(stored, source), source)
    return layout, verify(layout, source).added


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


def from_json(record: dict[str, Any], data: DataSection | Source) -> footers.Layout:
    """The layout a snapshot records, read from the files it names (nothing listed), through
    the dataset's filesystem (its URI carries the endpoint and options; the record only the
    location)."""
    location = Source.of(data).location
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
    an edited file list has another); of a Ray loop's ``tables_to_json``, of every table's."""
    if record.get("kind") == "torch_dataset":  # the Dataset form's: its sets' lengths
        return samples.lengths_record_fingerprint(record)
    if "held" in record:  # the training files' and each held-out set's
        return _tables_fingerprint(
            {
                "train": _fingerprint(footers.DataFile(**f) for f in record["files"]),
                **{name: recorded_fingerprint(held) for name, held in record["held"].items()},
            }
        )
    if "datasets" in record:
        return _tables_fingerprint(
            {name: recorded_fingerprint(table) for name, table in record["datasets"].items()}
        )
    return _fingerprint(footers.DataFile(**f) for f in record["files"])


def _fingerprint(files: Iterable[footers.DataFile]) -> str:
    pinned = [[f.path, f.size, f.footer] for f in files]
    return hashlib.sha256(json.dumps(pinned).encode()).hexdigest()


def _tables_fingerprint(fingerprints: dict[str, str]) -> str:
    canonical = json.dumps(sorted(fingerprints.items()))
    return hashlib.sha256(canonical.encode()).hexdigest()


def tables_to_json(layouts: dict[str, footers.Layout]) -> dict[str, Any]:
    """A Ray loop's ``datasets`` as the run directory records them: each one's snapshot
    (``to_json``), by name, and a fingerprint of them all."""
    tables = {name: to_json(layout) for name, layout in sorted(layouts.items())}
    return {
        "schema": SCHEMA_VERSION,
        "datasets": tables,
        "fingerprint": _tables_fingerprint({n: t["fingerprint"] for n, t in tables.items()}),
    }


def with_held(record: dict[str, Any], held: dict[str, footers.Layout]) -> dict[str, Any]:
    """The training set's snapshot with its held-out sets' (``data.validation``,
    ``data.test``: ``held_out``), and a fingerprint of them all."""
    if not held:
        return record
    combined = {**record, "held": {name: to_json(layout) for name, layout in held.items()}}
    return {**combined, "fingerprint": recorded_fingerprint(combined)}


def table_record(record: dict[str, Any], source: Source) -> dict[str, Any]:
    """The snapshot of ``source`` (``datasets.<name>``) in a Ray loop's stored record:
    SpecError naming the field when the record has none (it was replaced or edited)."""
    name = source.field.removeprefix("datasets.")
    table = record.get("datasets", {}).get(name)
    if table is None:
        raise SpecError(
            f"{source.field}: this run's dataset snapshot (dataset.json) has no snapshot of "
            f"{source.given!r} (it holds {sorted(record.get('datasets', {}))}): dataset.json was "
            "replaced or edited. Restore it, or start a new run.name to train on the "
            "datasets as they are now.",
            field=source.field,
        )
    return dict(table)


def at_location(record: dict[str, Any], data: DataSection | Source) -> dict[str, Any]:
    """The snapshot ``record`` as this process must read it, where the dataset resolves now:
    the record itself when that is the place it was taken of; the bundled ``digits``
    (relaytrain's own file, named and not located by the spec) re-based onto this
    installation's copy, whose size and footer ``verify`` still checks; otherwise a SpecError
    naming both places and the fix."""
    source = Source.of(data)
    location = source.location
    if location.uri == record["uri"]:
        return record
    if source.bundled and len(record["files"]) == 1:
        return {
            **record,
            "uri": location.uri,
            "files": [{**f, "path": location.path} for f in record["files"]],
            "row_groups": [{**g, "file": location.path} for g in record["row_groups"]],
        }
    given, field = source.given, source.field
    relative = not urlsplit(given).scheme and not os.path.isabs(given)
    hint = (
        " (a relative path resolves from the working directory: run from the directory the "
        "run started in)"
        if relative
        else ""
    )
    raise SpecError(
        f"{field} {given!r} resolves to {location.uri}, but this run's dataset snapshot was "
        f"taken of {record['uri']}: a run trains on the files it started with. Run it where "
        f"{field} resolves to {record['uri']}{hint}, or start a new run.name to train on "
        f"{location.uri}.",
        field=field,
    )


@dataclass(frozen=True)
class Check:
    """What a later attempt found against the snapshot: the files added since (ignored)."""

    added: list[str]


def verify(layout: footers.Layout, data: DataSection | Source) -> Check:
    """Check the files of ``layout`` are still those the snapshot pinned: SpecError naming the
    first file that vanished or changed (its size, or its footer when its modification time
    moved), with the fix. Lists the dataset once to count the files added since, by path:
    whatever they hold, none of them is opened."""
    location = layout.location
    assert location is not None
    fs = location.filesystem
    source = Source.of(data)
    field = source.field
    found = fs.get_file_info([f.path for f in layout.files])
    for pinned, info in zip(layout.files, found, strict=True):
        fix = (
            f"Restore it, or start a new run.name to train on {source.given} as it is now "
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
