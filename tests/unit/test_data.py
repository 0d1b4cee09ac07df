import json
import shutil
from itertools import islice

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core.data import arrays as data
from trainer_core.data import footers, rank_stream, sample_order, stream
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection


def test_digits_are_bundled_and_shaped():
    section = DataSection(dataset="digits")
    layout = footers.scan(section)
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
    layout = footers.scan(section)
    arrays = stream.Reader(layout, section, seed=0).read(0)
    assert arrays.features.shape == (3, 2) and arrays.labels.dtype == np.int64
    assert stream.describe(layout, section).num_outputs == 2


@pytest.mark.parametrize("statistics", [True, False])
def test_classes_come_from_statistics_or_the_label_column(tmp_path, statistics):
    uri = write_table(tmp_path / "d.parquet", statistics, x=[1.0, 2.0, 3.0], y=[0, 4, 1])
    section = DataSection(dataset=uri, features=["x"], label="y", task="classification")
    assert stream.describe(footers.scan(section), section).num_outputs == 5
    bad = write_table(tmp_path / "n.parquet", statistics, x=[1.0, 2.0], y=[0, -2])
    section = section.model_copy(update={"dataset": bad})
    with pytest.raises(SpecError, match=r"negative classes \(down to -2\)") as error:
        stream.describe(footers.scan(section), section)
    assert error.value.field == "data.label"


def test_missing_dataset_and_columns_name_the_fix(tmp_path):
    with pytest.raises(SpecError, match="does not exist"):
        footers.scan(
            DataSection(
                dataset=str(tmp_path / "none.parquet"), features="x", label="y", task="regression"
            )
        )
    uri = write_table(tmp_path / "d.parquet", x=[1.0, 2.0], target=[1.0, 2.0])
    with pytest.raises(SpecError, match=r"no column\(s\) \['y'\]") as error:
        footers.scan(DataSection(dataset=uri, features="x", label="y", task="regression"))
    assert error.value.field == "data.label"


def test_mistyped_label_column(tmp_path):
    uri = write_table(tmp_path / "d.parquet", x=[1.0, 2.0], y=["cat", "dog"])
    with pytest.raises(SpecError, match="must be integers"):
        footers.scan(DataSection(dataset=uri, features="x", label="y", task="classification"))


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


def rank_batches(section: DataSection, world_size: int, rank: int, count: int) -> list:
    """What the loop's stream gives ``rank``: its first ``count`` batches of epoch 0 (row ids,
    features, labels), then its validation rows."""
    ranks = rank_stream.RankStream(footers.scan(section), section, 0, world_size, rank)
    epoch = ranks.epoch(0)
    try:
        batches = [(ids, rows.features, rows.labels) for _, ids, rows in islice(epoch, count)]
    finally:
        epoch.close()
    validation = list(ranks.validation())
    features = np.concatenate([part.features for part in validation])
    return [*batches, ("validation", features, np.concatenate([p.labels for p in validation]))]


def test_digits_by_name_and_the_same_file_by_path_train_the_same(tmp_path):
    """Feature scaling follows the data: the bundled digits file, named or given by its path
    (a copy elsewhere), gives the loop the same batches, its pixels (0..16) scaled to 0..1."""
    copy = tmp_path / "my-digits.parquet"
    shutil.copyfile(data.digits_uri(), copy)
    by_name = DataSection(dataset="digits", batch_size=64)
    by_path = DataSection(
        dataset=str(copy), features="pixels", label="label", task="classification", batch_size=64
    )
    raw = pq.read_table(copy)  # the file as any Parquet reader sees it: pixels 0..16
    pixels = np.stack(raw.column("pixels").to_numpy(zero_copy_only=False)).astype(np.float32)
    assert pixels.max() == 16.0
    for rank in range(2):
        named = rank_batches(by_name, 2, rank, count=5)
        pathed = rank_batches(by_path, 2, rank, count=5)
        for (ids, features, labels), (path_ids, path_features, path_labels) in zip(
            named, pathed, strict=True
        ):
            assert np.array_equal(features, path_features)
            assert np.array_equal(labels, path_labels)
            if not isinstance(ids, str):
                assert np.array_equal(ids, path_ids)
                assert np.array_equal(features, pixels[ids] / 16)
        assert named[-1][1].max() == 1.0 and named[-1][1].min() == 0.0


def scaling_file(path, metadata: dict | None) -> DataSection:
    table = pa.table({"x": pa.array([[2.0, 4.0], [6.0, 10.0]], pa.list_(pa.float32(), 2))})
    table = table.append_column("y", pa.array([0, 1]))
    if metadata is not None:
        table = table.replace_schema_metadata({data.FEATURE_SCALING_KEY: json.dumps(metadata)})
    pq.write_table(table, path)
    return DataSection(dataset=str(path), features="x", label="y", task="classification")


def read_features(section: DataSection) -> list[list[float]]:
    return stream.Reader(footers.scan(section), section, seed=0).read(0).features.tolist()


def test_a_file_records_how_its_features_scale(tmp_path):
    assert read_features(scaling_file(tmp_path / "plain.parquet", None)) == [[2, 4], [6, 10]]
    scaled = scaling_file(tmp_path / "s.parquet", {"schema": 1, "scale": 0.5, "offset": 2})
    assert read_features(scaled) == [[0, 1], [2, 4]]  # (x - 2) * 0.5
    only_scale = scaling_file(tmp_path / "t.parquet", {"schema": 1, "scale": 0.25})
    assert read_features(only_scale) == [[0.5, 1], [1.5, 2.5]]


@pytest.mark.parametrize(
    "metadata",
    [
        {"scale": 0.5},  # no schema version
        {"schema": 2, "scale": 0.5},
        {"schema": 1, "scale": 0},
        {"schema": 1, "scale": "1/16"},
        {"schema": 1, "offset": float("nan")},
        {"schema": 1, "shift": 1},
        [1, 2],
    ],
)
def test_a_scaling_the_loop_cannot_apply_names_the_key_and_the_fix(tmp_path, metadata):
    section = scaling_file(tmp_path / "bad.parquet", metadata)
    with pytest.raises(SpecError, match=r"'relaytrain\.features' of data\.dataset .*remove") as e:
        read_features(section)
    assert e.value.field == "data.dataset"
