import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core import data, sample_order, stream
from trainer_core.errors import SpecError
from trainer_core.spec import DataSection


def test_digits_are_bundled_and_shaped():
    section = DataSection(dataset="digits")
    layout = stream.scan(section)
    info = stream.describe(layout, section)
    assert (info.num_rows, info.num_features, info.num_outputs) == (1797, 64, 10)
    assert len(layout.row_groups) > 1  # validation is shared by the workers
    rows = stream.Reader(layout, section, seed=0).read(0)
    assert rows.features.shape[1] == 64 and 0 <= rows.features.min() <= rows.features.max() <= 1


def test_synthetic_is_deterministic():
    a = data.synthetic_arrays(100, 4, 0.1)
    b = data.synthetic_arrays(100, 4, 0.1)
    assert np.array_equal(a.features, b.features) and np.array_equal(a.labels, b.labels)


def test_cursor_counts_global_samples_and_names_the_next_batch():
    cursor = data.Cursor(epoch=1, samples=96)
    assert data.Cursor.from_json(cursor.to_json()) == cursor
    assert cursor.batch(32) == 3


def write_table(path, write_statistics=True, **columns):
    pq.write_table(pa.table(columns), path, write_statistics=write_statistics)
    return str(path)


def test_user_parquet_scalar_columns(tmp_path):
    uri = write_table(tmp_path / "d.parquet", a=[1.0, 2.0, 3.0], b=[0.5, 0.1, 0.2], y=[0, 1, 1])
    section = DataSection(dataset=uri, features=["a", "b"], label="y", task="classification")
    layout = stream.scan(section)
    arrays = stream.Reader(layout, section, seed=0).read(0)
    assert arrays.features.shape == (3, 2) and arrays.labels.dtype == np.int64
    assert stream.describe(layout, section).num_outputs == 2


@pytest.mark.parametrize("statistics", [True, False])
def test_classes_come_from_statistics_or_the_label_column(tmp_path, statistics):
    uri = write_table(tmp_path / "d.parquet", statistics, x=[1.0, 2.0, 3.0], y=[0, 4, 1])
    section = DataSection(dataset=uri, features=["x"], label="y", task="classification")
    assert stream.describe(stream.scan(section), section).num_outputs == 5
    bad = write_table(tmp_path / "n.parquet", statistics, x=[1.0, 2.0], y=[0, -2])
    section = section.model_copy(update={"dataset": bad})
    with pytest.raises(SpecError, match=r"negative classes \(down to -2\)") as error:
        stream.describe(stream.scan(section), section)
    assert error.value.field == "data.label"


def test_missing_dataset_and_columns_name_the_fix(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        stream.scan(
            DataSection(
                dataset=str(tmp_path / "none.parquet"), features="x", label="y", task="regression"
            )
        )
    uri = write_table(tmp_path / "d.parquet", x=[1.0, 2.0], target=[1.0, 2.0])
    with pytest.raises(SpecError, match=r"no column\(s\) \['y'\]") as error:
        stream.scan(DataSection(dataset=uri, features="x", label="y", task="regression"))
    assert error.value.field == "data.label"


def test_mistyped_label_column(tmp_path):
    uri = write_table(tmp_path / "d.parquet", x=[1.0, 2.0], y=["cat", "dog"])
    with pytest.raises(SpecError, match="must be integers"):
        stream.scan(DataSection(dataset=uri, features="x", label="y", task="classification"))


def test_no_sample_is_left_out_of_every_epoch_even_in_one_row_group():
    """The N % batch positions an epoch leaves out move with the epoch's offset."""
    trained: set[int] = set()
    for epoch in range(12):
        order = sample_order.epoch_order(
            [103], seed=1, epoch=epoch, batch_size=10, partitions=3, window=8
        )
        _, rows = order.locate(
            np.concatenate([order.batch_positions(s) for s in range(order.steps)])
        )
        assert len(set(rows.tolist())) == 100
        trained.update(rows.tolist())
    assert trained == set(range(103))
