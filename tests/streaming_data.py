"""The dataset the streaming tests train on: 420 rows whose feature 0 is the row id, in 3
Parquet files of uneven row groups, read in global batches of 21 for 2 epochs; the batches an
uninterrupted run reads, from the reader itself on one worker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from trainer_core import storage
from trainer_core.data import footers, rank_stream
from trainer_core.spec.run_spec import RunSpec

ROWS = 420  # 20 global batches of 21: every sample trains once an epoch (none left over)
BATCH = 21  # odd: two workers take slices of 10 and 11, their losses weighted
EPOCHS = 2
REPO = Path(__file__).resolve().parents[1]


def write_dataset(uri: str, page_checksums: bool = False) -> None:
    """Row ids in feature 0, then 4 features and a regression label; 3 files, uneven row
    groups (with each page's CRC32, as Spark writes them, when ``page_checksums``)."""
    location = storage.resolve(uri)
    location.filesystem.create_dir(location.path, recursive=True)
    rng = np.random.default_rng(0)
    for index, (first, last, group) in enumerate([(0, 150, 40), (150, 300, 64), (300, 420, 50)]):
        ids = np.arange(first, last)
        features = np.concatenate(
            [ids[:, None], rng.standard_normal((len(ids), 4))], axis=1
        ).astype(np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), 5),
                "y": pa.array(features[:, 1] - features[:, 2], pa.float32()),
            }
        )
        with location.filesystem.open_output_stream(f"{location.path}/part-{index}.parquet") as f:
            pq.write_table(table, f, row_group_size=group, write_page_checksum=page_checksums)


def expected_batches(spec: RunSpec, epochs: int = EPOCHS) -> list[list[int]]:
    """The uninterrupted run's global batches of ``epochs``, as one worker reads them."""
    assert spec.data is not None
    data = spec.data.resolved()
    one = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    batches: list[list[int]] = []
    for epoch in range(epochs):
        ahead = one.epoch(epoch)
        batches += [ids.tolist() for _, ids, _ in ahead]
        ahead.close()
    return batches


def assert_epochs_cover_every_sample_once(batches: list[list[int]], epochs: int = EPOCHS) -> None:
    per_epoch = ROWS // BATCH
    assert len(batches) == epochs * per_epoch
    for epoch in range(epochs):
        ids = [i for batch in batches[epoch * per_epoch : (epoch + 1) * per_epoch] for i in batch]
        assert sorted(ids) == list(range(ROWS)), f"epoch {epoch}"
        assert ids != sorted(ids)  # shuffled
