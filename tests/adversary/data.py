"""The table a scenario trains on, written as a data writer writes Parquet, and the damage done
to it: a byte flipped in a data page, and files landing beside it (valid, half-written, of
another schema). Plain pyarrow and numpy: nothing of relaytrain's."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from tests.adversary.scenario import Data


def table(data: Data, index: int, seed_offset: int = 0) -> pa.Table:
    """File ``index``'s rows: a list column ``x`` of ``data.features`` floats and a float label
    ``y``, a noisy linear function of ``x`` (a regression the tiny MLP learns)."""
    rng = np.random.default_rng([data.seed, index, seed_offset])
    x = rng.standard_normal((data.rows, data.features)).astype(np.float32)
    weights = np.random.default_rng(data.seed).standard_normal(data.features).astype(np.float32)
    y = (x @ weights + 0.1 * rng.standard_normal(data.rows)).astype(np.float32)
    return pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), data.features),
            "y": pa.array(y),
        }
    )


def write(data: Data, directory: Path) -> list[Path]:
    """The scenario's files, each page with its CRC32 (as Spark writes them)."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(data.files):
        path = directory / f"part-{index:05d}.parquet"
        pq.write_table(
            table(data, index), path, row_group_size=data.row_group, write_page_checksum=True
        )
        paths.append(path)
    return paths


#: The validation file's index among the generator's files (far from the training files').
VALIDATION_INDEX = 10_000


def write_validation(data: Data, directory: Path) -> Path:
    """A validation file of the table's distribution (``data.validation``), rows of its own."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "part-00000.parquet"
    rows = table(data, VALIDATION_INDEX)
    pq.write_table(rows, path, row_group_size=data.row_group, write_page_checksum=True)
    return path


def flip_page_byte(path: Path, rng: random.Random) -> bytes:
    """A byte flipped in the middle of a column chunk's pages (size and footer unchanged, as a
    disk or a copy damages a file); returns the original bytes, to restore it."""
    metadata = pq.ParquetFile(path).metadata
    group = rng.randrange(metadata.num_row_groups)
    chunk = metadata.row_group(group).column(0)
    original = path.read_bytes()
    damaged = bytearray(original)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    damaged[start + chunk.total_compressed_size // 2] ^= 0x5A
    path.write_bytes(bytes(damaged))
    return original


def add_file(data: Data, directory: Path, what: str) -> Path:
    """A file landing in the dataset's directory after the run pinned it: ``valid`` (more rows
    of the same schema), ``half_written`` (a writer still at it: the first half of a valid
    file, no footer), ``other_schema`` (a column renamed)."""
    path = directory / f"part-late-{what}.parquet"
    rows = table(data, data.files, seed_offset=1)
    if what == "other_schema":
        rows = rows.rename_columns(["features", "target"])
    pq.write_table(rows, path, row_group_size=data.row_group, write_page_checksum=True)
    if what == "half_written":
        whole = path.read_bytes()
        path.write_bytes(whole[: len(whole) // 2])
    return path
