"""A dataset's layout from its Parquet footers alone: its files, row groups, columns and sizes,
and the fingerprint that pins it (no row is read here)."""

from __future__ import annotations

import hashlib
import posixpath
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from trainer_core import storage
from trainer_core.data import arrays as data_mod
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DATASET_FORMATS, DataSection


@dataclass(frozen=True)
class RowGroup:
    """One row group: its file, its index in the file, its rows and the id of its first row
    (row ids count every row of the dataset, files in name order)."""

    file: str
    index: int
    rows: int
    first_row: int
    #: The label column's (min, max) from the footer's statistics, when it has them.
    label_range: tuple[float, float] | None = None
    #: Its uncompressed size in the file (the footer's): about its decoded size.
    bytes: int = 0


@dataclass(frozen=True)
class DataFile:
    """One Parquet file as a scan found it: its size, modification time (ns, when the
    filesystem gives one) and a digest of its footer, which names every row group, column
    chunk and their statistics: a file rewritten in place has another."""

    path: str
    size: int
    mtime_ns: int | None
    footer: str


@dataclass(frozen=True)
class Layout:
    """What a dataset holds, from its Parquet footers alone (or, for the generated
    ``synthetic`` set, the table itself, cut into row groups of ``MEMORY_ROW_GROUP`` rows)."""

    uri: str
    location: storage.Location | None
    row_groups: tuple[RowGroup, ...]
    schema: pa.Schema
    table: pa.Table | None = None
    #: The files, in name order (none for a generated set).
    files: tuple[DataFile, ...] = ()

    @property
    def num_rows(self) -> int:
        return sum(g.rows for g in self.row_groups)

    def file_size(self, path: str) -> int | None:
        return next((f.size for f in self.files if f.path == path), None)


def columns_of(data: DataSection) -> list[str]:
    if data.columns is not None:
        return list(data.columns)
    features = [data.features] if isinstance(data.features, str) else list(data.features or [])
    return [*features, *([data.label] if data.label else [])]


def row_bytes(layout: Layout) -> float:
    """Decoded bytes of a row, the largest of any row group's (from the footers: Parquet's
    uncompressed size; the in-memory table's own)."""
    if layout.table is not None:
        return layout.table.nbytes / max(layout.table.num_rows, 1)
    return max((g.bytes / g.rows for g in layout.row_groups if g.rows), default=1.0)


def dataset_location(data: DataSection) -> storage.Location:
    """Where ``data.dataset``'s files are (the built-in digits: the file shipped with
    relaytrain)."""
    return storage.resolve(data_mod.digits_uri() if data.dataset == "digits" else data.dataset)


def scan(data: DataSection) -> Layout:
    """The layout of ``data.dataset`` (resolved), its columns checked: SpecError naming the
    file and the fix for an empty directory, differing schemas, a missing column or a file
    that is not Parquet. Reads footers only."""
    data = data.resolved()
    if data.dataset == "synthetic":
        return _synthetic_layout(data)
    location = dataset_location(data)
    row_groups, schema, files = scan_files(location, columns_of(data), data.label, "data.dataset")
    if not data.columns_form:
        data_mod.check_column_types(schema, data, location.uri)
    return Layout(location.uri, location, tuple(row_groups), schema, files=tuple(files))


def scan_table(location: storage.Location, field: str) -> Layout:
    """The layout of a table another reader reads whole (a Ray loop's ``datasets``, Ray
    Data's): every column, one schema in every file; SpecError naming ``field`` and the file
    otherwise. Reads footers only."""
    row_groups, schema, files = scan_files(location, None, None, field)
    return Layout(location.uri, location, tuple(row_groups), schema, files=tuple(files))


#: Rows per row group of a dataset relaytrain generates in memory.
MEMORY_ROW_GROUP = 1024


def _synthetic_layout(data: DataSection) -> Layout:
    """The synthetic set as a table (features ``x``, label ``y``), read like Parquet."""
    s = data.synthetic
    arrays = data_mod.synthetic_arrays(s.num_samples, s.num_features, s.noise)
    width = arrays.features.shape[1]
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(arrays.features.reshape(-1)), width),
            "y": pa.array(arrays.labels),
        }
    )
    row_groups = tuple(
        RowGroup("<memory>", i, min(MEMORY_ROW_GROUP, len(arrays) - start), start)
        for i, start in enumerate(range(0, len(arrays), MEMORY_ROW_GROUP))
    )
    return Layout("synthetic", None, row_groups, table.schema, table)


def scan_files(
    location: storage.Location,
    columns: list[str] | None,
    label: str | None,
    field: str,
) -> tuple[list[RowGroup], pa.Schema, list[DataFile]]:
    """Every file's row groups and the schema of ``columns`` (None: all of them), the same in
    every file, and the files; SpecError naming ``field`` and the file otherwise."""
    row_groups: list[RowGroup] = []
    files: list[DataFile] = []
    schema: pa.Schema | None = None
    first_file = ""
    for info in parquet_files(location, field):
        path = info.path
        metadata = read_footer(location, path, field)
        files.append(DataFile(path, info.size, info.mtime_ns, footer_digest(metadata)))
        file_schema = metadata.schema.to_arrow_schema()
        wanted = file_schema.names if columns is None else columns
        missing = [c for c in wanted if c not in file_schema.names]
        if missing:
            named = "data.label" if label in missing else "data.features"
            fix = "data.features / data.label"
            if columns is not None and label is None and field == "data.dataset":
                named = fix = "data.columns"
            raise SpecError(
                f"{field} {location.uri}: file {path!r} has no column(s) {missing}, named by "
                f"{named}; it has {file_schema.names}. Fix {fix}.",
                field=named,
            )
        found = pa.schema([file_schema.field(c) for c in wanted])
        if schema is None:
            schema, first_file = found, path
        elif not found.equals(schema):
            raise SpecError(
                f"{field} {location.uri}: files {first_file!r} and {path!r} have different "
                f"schemas for the columns relaytrain reads ({_types(schema)} against "
                f"{_types(found)}). Rewrite them with one schema, or point {field} at files "
                "that share one.",
                field=field,
            )
        first_row = sum(g.rows for g in row_groups)
        for index in range(metadata.num_row_groups):
            group = metadata.row_group(index)
            row_groups.append(
                RowGroup(
                    path,
                    index,
                    group.num_rows,
                    first_row,
                    _range(group, label),
                    group.total_byte_size,
                )
            )
            first_row += group.num_rows
    assert schema is not None
    return row_groups, schema, files


def read_footer(location: storage.Location, path: str, field: str) -> pq.FileMetaData:
    """A Parquet file's footer; SpecError naming ``field`` and the file when it is not one."""
    try:
        with location.filesystem.open_input_file(path) as f:
            return pq.read_metadata(f)
    except (pa.ArrowInvalid, OSError) as e:
        raise SpecError(
            f"{field} {location.uri}: file {path!r} is not Parquet ({str(e).rstrip('.')}). "
            f"Remove it or convert it: relaytrain reads {DATASET_FORMATS}.",
            field=field,
        ) from e


def footer_digest(metadata: pq.FileMetaData) -> str:
    """sha256 of a footer as Parquet serializes it."""
    out = pa.BufferOutputStream()
    metadata.write_metadata_file(out)
    return hashlib.sha256(out.getvalue().to_pybytes()).hexdigest()


def _range(group: pq.RowGroupMetaData, column: str | None) -> tuple[float, float] | None:
    """(min, max) of ``column`` in a row group, from its statistics (None without them)."""
    for index in range(group.num_columns):
        chunk = group.column(index)
        if chunk.path_in_schema != column:
            continue
        stats = chunk.statistics
        numeric = isinstance(stats.min, int | float) if stats and stats.has_min_max else False
        if stats is None or not numeric or stats.null_count:
            return None  # the label column's type is checked from the schema
        return float(stats.min), float(stats.max)
    return None


def _types(schema: pa.Schema) -> str:
    return ", ".join(f"{f.name}: {f.type}" for f in schema)


def parquet_files(location: storage.Location, field: str) -> list[pafs.FileInfo]:
    """The dataset's files, in name order: the file itself, or every file below a directory
    except hidden ones and markers (``_SUCCESS``, ``.crc``)."""
    info = location.info()
    if info.type == pafs.FileType.NotFound:
        raise SpecError(
            f"{field} {location.uri} does not exist: fix {field} ({DATASET_FORMATS})",
            field=field,
        )
    if info.type == pafs.FileType.File:
        return [info]
    selector = pafs.FileSelector(location.path, recursive=True)
    files = sorted(
        (
            f
            for f in location.filesystem.get_file_info(selector)
            if f.type == pafs.FileType.File
            and not posixpath.basename(f.path).startswith(("_", "."))
        ),
        key=lambda f: f.path,
    )
    if not files:
        raise SpecError(
            f"{field} {location.uri} is an empty directory: no Parquet files below it. Fix "
            f"{field} ({DATASET_FORMATS}).",
            field=field,
        )
    return files
