import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core import data
from trainer_core.errors import SpecError
from trainer_core.spec import DataSection


def test_digits_are_bundled_and_shaped():
    arrays = data.load_arrays(DataSection(dataset="digits"))
    assert arrays.features.shape == (1797, 64) and arrays.features.max() <= 1.0
    info = data.describe(DataSection(dataset="digits"), arrays)
    assert (info.num_rows, info.num_features, info.num_outputs) == (1797, 64, 10)


def test_synthetic_is_deterministic():
    a = data.synthetic_arrays(100, 4, 0.1)
    b = data.synthetic_arrays(100, 4, 0.1)
    assert np.array_equal(a.features, b.features) and np.array_equal(a.labels, b.labels)


def test_epoch_shards_are_disjoint_equal_and_seeded():
    ranks = [data.epoch_batches(103, 8, seed=1, epoch=2, rank=r, world_size=2) for r in (0, 1)]
    assert [len(b) for b in ranks[0]] == [len(b) for b in ranks[1]]
    seen = np.concatenate([np.concatenate(r) for r in ranks])
    assert len(seen) == len(set(seen.tolist())) == 102
    again = data.epoch_batches(103, 8, seed=1, epoch=2, rank=0, world_size=2)
    assert all(np.array_equal(x, y) for x, y in zip(ranks[0], again, strict=True))
    other_epoch = data.epoch_batches(103, 8, seed=1, epoch=3, rank=0, world_size=2)
    assert not np.array_equal(ranks[0][0], other_epoch[0])
    assert data.batches_per_epoch(103, 8, 2) == len(ranks[0])


def test_cursor_resume_replays_the_remaining_batches():
    full = data.epoch_batches(64, 4, seed=0, epoch=1, rank=1, world_size=2)
    cursor = data.Cursor.from_json(data.Cursor(epoch=1, batch=3).to_json())
    resumed = data.epoch_batches(64, 4, seed=0, epoch=cursor.epoch, rank=1, world_size=2)
    assert all(np.array_equal(a, b) for a, b in zip(full[3:], resumed[cursor.batch :], strict=True))


def test_split_is_deterministic_and_disjoint():
    arrays = data.synthetic_arrays(50, 2, 0.0)
    train, val = data.split(arrays, 0.2, seed=4)
    assert (len(train), len(val)) == (40, 10)
    train2, _ = data.split(arrays, 0.2, seed=4)
    assert np.array_equal(train.features, train2.features)


def write_table(path, **columns):
    pq.write_table(pa.table(columns), path)
    return str(path)


def test_user_parquet_scalar_columns(tmp_path):
    uri = write_table(tmp_path / "d.parquet", a=[1.0, 2.0, 3.0], b=[0.5, 0.1, 0.2], y=[0, 1, 1])
    section = DataSection(dataset=uri, features=["a", "b"], label="y", task="classification")
    arrays = data.load_arrays(section)
    assert arrays.features.shape == (3, 2) and arrays.labels.dtype == np.int64
    assert data.describe(section, arrays).num_outputs == 2


def test_missing_dataset_and_columns_name_the_fix(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        data.load_arrays(
            DataSection(
                dataset=str(tmp_path / "none.parquet"), features="x", label="y", task="regression"
            )
        )
    uri = write_table(tmp_path / "d.parquet", x=[1.0, 2.0], target=[1.0, 2.0])
    with pytest.raises(SpecError, match=r"no column\(s\) \['y'\]") as error:
        data.load_arrays(DataSection(dataset=uri, features="x", label="y", task="regression"))
    assert error.value.field == "data.label"


def test_mistyped_label_column(tmp_path):
    uri = write_table(tmp_path / "d.parquet", x=[1.0, 2.0], y=["cat", "dog"])
    with pytest.raises(SpecError, match="must be integers"):
        data.load_arrays(DataSection(dataset=uri, features="x", label="y", task="classification"))


def test_too_few_rows_for_the_workers():
    with pytest.raises(SpecError, match=r"scaling\.num_workers"):
        data.epoch_batches(3, 2, seed=0, epoch=0, rank=0, world_size=4)
