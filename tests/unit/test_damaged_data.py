"""A dataset file with damaged bytes the run's snapshot cannot see (same size, same footer): the
reader names the file and row group, and says it is not worth a retry; storage failing while
it reads is not called damage."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core import errors
from trainer_core.data import damage, footers, rank_stream, stream
from trainer_core.spec.sections import DataSection

ROWS, GROUP = 400, 100


def write(path, checksums: bool) -> None:
    """Random float features (pages that barely compress, as real ones) and a label, in row
    groups of 100, as Spark writes them (page checksums) or as pyarrow does by default."""
    rng = np.random.default_rng(0)
    features = rng.standard_normal((ROWS, 4)).astype(np.float32)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 4),
            "y": pa.array(features[:, 0] - features[:, 1]),
        }
    )
    pq.write_table(table, path, row_group_size=GROUP, write_page_checksum=checksums)


def flip(path, group: int, where: str) -> None:
    """One byte of row group ``group``'s feature column flipped in place (the file keeps its
    size and footer): in the middle of its data (``page``) or in its first page header."""
    chunk = pq.ParquetFile(path).metadata.row_group(group).column(0)
    start = chunk.dictionary_page_offset or chunk.data_page_offset
    offset = start + (chunk.total_compressed_size // 2 if where == "page" else 1)
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x5A
    path.write_bytes(bytes(data))


def section_of(path) -> DataSection:
    return DataSection(
        dataset=str(path), features="x", label="y", task="regression", validation_fraction=0
    )


def test_a_flipped_byte_in_a_checksummed_page_is_named_and_not_retried(tmp_path):
    path = tmp_path / "part-0.parquet"
    write(path, checksums=True)
    section = section_of(path)
    layout = footers.scan(section)  # the run's snapshot, taken before the damage
    clean = stream.Reader(layout, section, seed=0).read(2)
    flip(path, 2, "page")
    # Without the checksums pyarrow reads the damaged page without a word: other values.
    silent = pq.ParquetFile(path).read_row_group(2).column("x").to_pylist()
    assert silent != clean.features.tolist()
    reader = stream.Reader(layout, section, seed=0)
    assert reader.read(1).features.shape == (GROUP, 4)  # the other row groups read as before
    with pytest.raises(errors.DataFileDamagedError) as raised:
        reader.read(2)
    error = raised.value
    assert isinstance(error, errors.SpecError) and error.budget == "none"
    assert error.file == str(path) and error.row_group == 2
    assert "part-0.parquet" in str(error) and "row group 2" in str(error)
    assert "rows 200..299" in str(error) and "CRC checksum" in str(error)
    # It crosses a Ray job's log as itself, with where.
    again = errors.from_json(errors.to_json(error))
    assert type(again) is errors.DataFileDamagedError and again.row_group == 2


def test_a_page_header_that_no_longer_decodes_is_named_without_checksums(tmp_path):
    path = tmp_path / "part-0.parquet"
    write(path, checksums=False)
    section = section_of(path)
    layout = footers.scan(section)
    flip(path, 3, "header")
    with pytest.raises(errors.DataFileDamagedError, match="row group 3"):
        stream.Reader(layout, section, seed=0).read(3)
    # A row group read in slices (streamed, spilled) names it too.
    sliced = stream.Reader(layout, section, seed=0, slice_rows=30)
    assert sliced.slices.is_sliced(3)
    with pytest.raises(errors.DataFileDamagedError, match="row group 3"):
        sliced.slices.read(3, 0)


def test_a_rank_reading_ahead_hands_the_damage_to_its_training_thread(tmp_path):
    path = tmp_path / "part-0.parquet"
    write(path, checksums=True)
    section = section_of(path).model_copy(update={"batch_size": 50, "shuffle_window": 100})
    layout = footers.scan(section)
    flip(path, 1, "page")
    ranks = rank_stream.RankStream(layout, section, 0, 1, 0)
    epoch = ranks.epoch(0)
    with pytest.raises(errors.DataFileDamagedError, match="row group 1"):
        for _ in epoch:
            pass
    epoch.close()


@pytest.mark.parametrize(
    "error",
    [
        OSError("AWS Error NETWORK_CONNECTION during GetObject operation: curlCode: 7"),
        OSError("When reading information for key 'part-0.parquet' in bucket 'data': timeout"),
        ConnectionResetError(104, "Connection reset by peer"),
    ],
)
def test_storage_failing_mid_read_is_not_damage(error):
    """What pyarrow's S3 client and the OS raise when the connection fails: retried as
    before (the classifier's storage rules), never called damage."""
    with pytest.raises(type(error)) as raised, damage.named("s3://data/t", "t/p", 0, 0, 10):
        raise error
    assert raised.value is error


@pytest.mark.parametrize("codec", ["snappy", "zstd", "gzip", "none"])
def test_every_byte_flipped_in_a_row_group_reads_or_is_named(tmp_path, codec):
    """Byte after byte of a row group's pages flipped, each in its own copy of a file of
    floats, strings and lists: the read returns rows (the damage went unseen: no checksums) or
    raises DataFileDamagedError, never one of pyarrow's own errors (which would spend retries
    on a file that cannot heal)."""
    rng = np.random.default_rng(1)
    table = pa.table(
        {
            "x": pa.FixedSizeListArray.from_arrays(pa.array(rng.standard_normal(800)), 4),
            "y": rng.standard_normal(200),
            "s": pa.array([f"token-{i % 13}" for i in range(200)]),
            "l": pa.array([list(range(i % 4)) for i in range(200)]),
        }
    )
    path = tmp_path / "part-0.parquet"
    pq.write_table(table, path, row_group_size=100, compression=codec)
    section = DataSection(dataset=str(path), columns=["x", "y", "s", "l"], validation_fraction=0)
    layout = footers.scan(section)
    original = path.read_bytes()
    meta = pq.ParquetFile(path).metadata.row_group(1)
    chunks = [meta.column(i) for i in range(meta.num_columns)]
    start = min(c.dictionary_page_offset or c.data_page_offset for c in chunks)
    damaged = 0
    for offset in range(start, start + sum(c.total_compressed_size for c in chunks), 5):
        data = bytearray(original)
        data[offset] ^= 0x5A
        path.write_bytes(bytes(data))
        try:
            stream.Reader(layout, section, seed=0).read(1)
        except errors.DataFileDamagedError:
            damaged += 1
    assert damaged > 10  # most flips of a page header or a compressed stream show
