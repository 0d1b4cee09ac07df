"""A run's dataset snapshot (trainer_core.data.dataset_snapshot) on real Parquet files: what it
pins, and what a later attempt finds against it."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core.data import dataset_snapshot, footers, stream
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection


def write(path: Path, values: np.ndarray) -> None:
    pq.write_table(pa.table({"x": values.astype(np.float32), "y": np.arange(len(values))}), path)


@pytest.fixture
def table(tmp_path: Path) -> tuple[Path, DataSection]:
    directory = tmp_path / "table"
    directory.mkdir()
    for i in range(3):
        write(directory / f"part-{i}.parquet", np.arange(10) + 10 * i)
    data = DataSection(dataset=str(directory), features=["x"], label="y", task="regression")
    return directory, data


def test_a_snapshot_round_trips_and_reads_the_same_rows(table) -> None:
    _, data = table
    layout = footers.scan(data)
    again = dataset_snapshot.from_json(dataset_snapshot.to_json(layout), data)
    assert again.row_groups == layout.row_groups and again.files == layout.files
    assert again.schema.equals(layout.schema)
    assert stream.Reader(again, data, 0).read(1).features.tolist() == [
        [float(v)] for v in range(10, 20)
    ]


def test_files_added_later_are_ignored_and_counted(table) -> None:
    directory, data = table
    layout = dataset_snapshot.from_json(dataset_snapshot.to_json(footers.scan(data)), data)
    write(directory / "part-3.parquet", np.arange(5))
    check = dataset_snapshot.verify(layout, data)
    assert [Path(p).name for p in check.added] == ["part-3.parquet"]
    assert layout.num_rows == 30  # the snapshot's rows, not the directory's


def test_a_file_rewritten_with_the_same_size_is_refused_by_its_footer(table) -> None:
    directory, data = table
    layout = footers.scan(data)
    target = directory / "part-1.parquet"
    size = target.stat().st_size
    write(target, np.arange(10) + 11)  # one more in every row: other statistics
    assert target.stat().st_size == size
    os.utime(target, ns=(0, layout.files[1].mtime_ns + 1))
    with pytest.raises(SpecError, match=r"part-1\.parquet.*changed.*run.name"):
        dataset_snapshot.verify(layout, data)


def test_a_file_only_touched_is_accepted(table) -> None:
    """Its footer is unchanged (a copy, a touch). The footer pins sizes, offsets and every
    column's statistics, not the values: a rewrite that keeps all of those is not seen."""
    directory, data = table
    layout = footers.scan(data)
    os.utime(directory / "part-0.parquet", ns=(0, layout.files[0].mtime_ns + 10**9))
    assert dataset_snapshot.verify(layout, data).added == []


def test_a_vanished_file_is_refused(table) -> None:
    directory, data = table
    layout = footers.scan(data)
    (directory / "part-2.parquet").unlink()
    with pytest.raises(SpecError, match=r"part-2\.parquet.*gone"):
        dataset_snapshot.verify(layout, data)


def test_a_worker_refuses_a_file_that_changed_under_it(table) -> None:
    directory, data = table
    layout = footers.scan(data)
    write(directory / "part-2.parquet", np.arange(20))
    with pytest.raises(SpecError, match=r"part-2\.parquet.*changed while the run"):
        stream.Reader(layout, data, 0).read(2)


def test_a_snapshot_is_read_only_where_it_was_taken(table, tmp_path) -> None:
    """The same files at another place (a copy of the table) are not the snapshot's: refused,
    naming both places and the fix."""
    import shutil

    directory, data = table
    record = dataset_snapshot.to_json(footers.scan(data))
    assert dataset_snapshot.at_location(record, data) is record
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    moved = data.model_copy(update={"dataset": str(copy)})
    with pytest.raises(SpecError, match=r"resolves to .*copy, but .*snapshot was taken of") as e:
        dataset_snapshot.at_location(record, moved)
    assert str(directory) in str(e.value) and "new run.name" in str(e.value)
    assert "working directory" not in str(e.value)  # an absolute path: no hint about it


def test_the_bundled_digits_pinned_by_another_installation_read_from_this_one() -> None:
    """``digits`` names relaytrain's own file, not a place: a snapshot taken where another
    installation keeps it is read from this one's copy, checked by its size and footer."""
    data = DataSection(dataset="digits").resolved()
    here = dataset_snapshot.to_json(footers.scan(data))
    (path,) = [f["path"] for f in here["files"]]
    old = "/opt/old-venv/site-packages/trainer_core/builtin_data/digits.parquet"
    elsewhere = {
        **here,
        "uri": old,
        "files": [{**f, "path": old, "mtime_ns": 1} for f in here["files"]],
        "row_groups": [{**g, "file": old} for g in here["row_groups"]],
    }
    rebased = dataset_snapshot.at_location(elsewhere, data)
    layout = dataset_snapshot.from_json(rebased, data)
    assert [f.path for f in layout.files] == [path] and layout.uri == here["uri"]
    assert dataset_snapshot.verify(layout, data).added == []  # its footer read: the same
    damaged = {**elsewhere, "files": [{**f, "size": f["size"] + 1} for f in elsewhere["files"]]}
    with pytest.raises(SpecError, match="changed since this run took its dataset snapshot"):
        dataset_snapshot.verify(
            dataset_snapshot.from_json(dataset_snapshot.at_location(damaged, data), data), data
        )
