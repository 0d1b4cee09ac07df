"""The streaming reader's metadata scan and row reads, on Parquet files written here."""

from __future__ import annotations

import gc
import time
import weakref
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from trainer_core.data import arrays as data_mod
from trainer_core.data import footers, rank_stream, read_ahead, row_slices, sample_order, stream
from trainer_core.errors import SpecError
from trainer_core.spec.sections import DataSection


def write(path: Path, first_id: int, rows: int, row_group_size: int, **extra) -> None:
    """A file whose features hold each row's id (x = [id, -id]) and label id % 3."""
    ids = np.arange(first_id, first_id + rows)
    columns = {
        "x": pa.array(list(np.stack([ids, -ids], axis=1).astype(np.float32))),
        "y": pa.array(ids % 3),
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path, row_group_size=row_group_size)


def section(path: Path, **changes) -> DataSection:
    values = {"dataset": str(path), "features": "x", "label": "y", "task": "classification"}
    return DataSection(**{**values, **changes})


@pytest.fixture
def dataset(tmp_path) -> Path:
    root = tmp_path / "table"
    write(root / "part-0.parquet", 0, 300, 64)
    write(root / "part-1.parquet", 300, 130, 50)
    (root / "_SUCCESS").write_text("")
    return root


def test_scan_reads_the_layout_from_footers(dataset):
    layout = footers.scan(section(dataset))
    assert layout.num_rows == 430
    assert [g.rows for g in layout.row_groups] == [64, 64, 64, 64, 44, 50, 50, 30]
    assert [g.first_row for g in layout.row_groups][:6] == [0, 64, 128, 192, 256, 300]


def test_every_epoch_sample_is_the_row_its_position_names(dataset):
    data = section(dataset, validation_fraction=0.25)
    layout = footers.scan(data)
    readers = [stream.Reader(layout, data, seed=4, cache_rows=4 * 64) for _ in range(3)]
    reader = readers[0]
    counts = reader.train_counts()
    order = sample_order.epoch_order(
        counts, seed=4, epoch=1, batch_size=20, partitions=4, window=32
    )
    trained = []
    for step in range(order.steps):
        for rank in range(3):
            groups, index = order.locate(order.rank_positions(step, 3, rank))
            ids, rows = readers[rank].take(groups, index)
            assert np.array_equal(rows.features[:, 0], ids.astype(np.float32))  # x holds the id
            assert np.array_equal(rows.labels, ids % 3)
            trained += ids.tolist()
    validation = {
        int(reader.layout.row_groups[g].first_row + r)
        for g in range(len(counts))
        for r in reader.validation_rows(g)
    }
    assert len(trained) == len(set(trained)) == order.steps * 20
    assert not validation & set(trained)
    assert len(set(trained)) + len(validation) > 430 - 20  # all but the epoch's remainder
    # Each rank reads the row groups of its own partitions (once each, its windows in order),
    # not the dataset: 8 row groups, read 14 times by 3 ranks when this was written.
    reads = [r.row_groups_read for r in readers]
    assert max(reads) < len(counts) and sum(reads) <= 2 * len(counts)


def test_bad_datasets_are_refused_from_metadata(tmp_path, dataset):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SpecError, match="is an empty directory"):
        footers.scan(section(empty))
    with pytest.raises(SpecError, match="does not exist"):
        footers.scan(section(tmp_path / "nowhere"))
    with pytest.raises(SpecError, match=r"no column\(s\) \['label'\]") as error:
        footers.scan(section(dataset, label="label"))
    assert error.value.field == "data.label"
    mixed = tmp_path / "mixed"
    write(mixed / "a.parquet", 0, 10, 5)
    ids = np.arange(10, 20)
    pq.write_table(
        pa.table({"x": pa.array(list(np.stack([ids, ids], 1).astype(np.float64))), "y": ids % 3}),
        mixed / "b.parquet",
    )
    with pytest.raises(SpecError, match="have different schemas") as error:
        footers.scan(section(mixed))
    assert "a.parquet" in str(error.value) and "b.parquet" in str(error.value)
    (dataset / "part-2.parquet").write_text("x,y\n1,2\n")
    with pytest.raises(SpecError, match=r"part-2\.parquet' is not Parquet"):
        footers.scan(section(dataset))


def test_the_synthetic_set_is_read_like_parquet():
    data = DataSection(dataset="synthetic", synthetic={"num_samples": 2500, "num_features": 6})
    layout = footers.scan(data)
    assert [g.rows for g in layout.row_groups] == [1024, 1024, 452]
    reader = stream.Reader(layout, data, seed=1)
    whole = data_mod.synthetic_arrays(2500, 6, 0.1)
    groups = np.array([2, 0, 1, 2])
    ids, rows = reader.take(groups, np.array([0, 5, 7, 3]))
    assert np.array_equal(rows.features, whole.features[ids])
    assert np.array_equal(rows.labels, whole.labels[ids])


def test_the_prefetcher_yields_what_direct_reads_give_and_stops_cleanly(dataset):
    data = section(dataset, validation_fraction=0.1)
    layout = footers.scan(data)
    direct = stream.Reader(layout, data, seed=2)
    order = sample_order.epoch_order(
        direct.train_counts(), seed=2, epoch=0, batch_size=16, partitions=4, window=40
    )
    ahead = read_ahead.Prefetcher(stream.Reader(layout, data, seed=2), order, 2, 1, first=3)
    seen = []
    for index, ids, rows in ahead:
        groups, positions = order.locate(order.rank_positions(index, 2, 1))
        expected_ids, expected = direct.take(groups, positions)
        assert np.array_equal(ids, expected_ids)
        assert np.array_equal(rows.features, expected.features)
        seen.append(index)
    assert seen == list(range(3, order.steps))  # resumed at batch 3
    early = read_ahead.Prefetcher(stream.Reader(layout, data, seed=2), order, 2, 0, depth=1)
    next(iter(early))
    early.close()  # mid-epoch: the thread ends although the queue is full
    assert not early._thread.is_alive()


def test_a_read_error_reaches_the_consumer(dataset):
    data = section(dataset)
    layout = footers.scan(data)
    reader = stream.Reader(layout, data, seed=0)
    order = sample_order.epoch_order(
        reader.train_counts(), seed=0, epoch=0, batch_size=8, partitions=2, window=8
    )
    (dataset / "part-1.parquet").unlink()  # gone after the scan: a storage failure mid-epoch
    with pytest.raises(FileNotFoundError, match=r"part-1\.parquet"):
        for _ in read_ahead.Prefetcher(reader, order, 1, 0):
            pass


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_ranks_train_the_global_batches_and_share_validation(dataset, world_size):
    """Whatever the worker count, the ranks' slices joined are the one-worker global batches;
    each rank validates its share of the validation rows, and together on each row once."""
    data = section(dataset, validation_fraction=0.2, batch_size=24, partitions=4)
    layout = footers.scan(data)
    ranks = [rank_stream.RankStream(layout, data, 7, world_size, r) for r in range(world_size)]
    one = rank_stream.RankStream(layout, data, 7, 1, 0)
    assert ranks[0].batches_per_epoch == one.batches_per_epoch == one.train_rows // 24
    readers = [r.epoch(1, first=2) for r in ranks]
    ahead = one.epoch(1, first=2)
    batches = 0
    for parts, (index, ids, _) in zip(zip(*readers, strict=True), ahead, strict=True):
        assert [p[0] for p in parts] == [index] * world_size
        assert np.array_equal(np.concatenate([p[1] for p in parts]), ids)
        batches += 1
    assert batches == one.batches_per_epoch - 2  # resumed at global batch 2
    assert sum(r.weight * (r.slice[1] - r.slice[0]) for r in ranks) == pytest.approx(24)
    validated = np.concatenate(
        [np.concatenate([p.features[:, 0] for p in r.validation()]) for r in ranks]
    )
    expected = np.concatenate([p.features[:, 0] for p in one.validation(chunk=1000)])
    assert sorted(validated.tolist()) == sorted(expected.tolist())
    assert len(expected) == layout.num_rows - one.train_rows


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_ranks_share_validation_within_a_row_group(tmp_path, world_size):
    """A file as pyarrow or Spark writes it (one big row group): every rank validates a near
    equal share of its validation rows, each row once (no rank validates the whole set while
    the others wait), and reads only the slices its share lies in."""
    write(tmp_path / "big.parquet", 0, 1000, 1000)
    data = section(tmp_path / "big.parquet", validation_fraction=0.2)
    layout = footers.scan(data)
    one = rank_stream.RankStream(layout, data, 7, 1, 0)
    expected = sorted(row for p in one.validation() for row in p.features[:, 0].tolist())
    shares = []
    for rank in range(world_size):
        stream_ = rank_stream.RankStream(layout, data, 7, world_size, rank)
        stream_.reader.slices.slice_rows = 100  # ten slices of the row group
        read: list[int] = []
        original = stream_.reader.slices.read

        def watch(group, index, original=original, read=read):
            read.append(index)
            return original(group, index)

        stream_.reader.slices.read = watch  # type: ignore[method-assign]
        ids = [row for p in stream_.validation(chunk=16) for row in p.features[:, 0].tolist()]
        shares.append(ids)
        assert len(set(read)) <= 10 // world_size + 2
    sizes = [len(share) for share in shares]
    assert max(sizes) - min(sizes) <= 1, sizes
    assert sorted(row for share in shares for row in share) == expected and len(expected) > 150


def test_a_rank_holds_the_row_groups_of_its_windows_not_the_dataset(dataset):
    data = section(dataset, validation_fraction=0, batch_size=16, partitions=4, shuffle_window=32)
    layout = footers.scan(data)
    rank = rank_stream.RankStream(layout, data, 3, 2, 1)
    ahead = rank.epoch(0)
    for _ in ahead:
        held = sum(len(a) for a in rank.reader._decoded.values())
        assert held <= rank.reader.cache_rows < layout.num_rows
    assert rank.reader.row_groups_read <= len(layout.row_groups)


def _epoch(rank: rank_stream.RankStream, epoch: int = 0, first: int = 0) -> list:
    ahead = rank.epoch(epoch, first)
    try:
        return [(index, ids.tolist(), rows.features.tolist()) for index, ids, rows in ahead]
    finally:
        ahead.close()


def test_big_row_groups_are_read_in_slices_with_the_same_rows(tmp_path, monkeypatch):
    """Two files of one 3000-row row group each (pyarrow's default groups are this whole):
    read in slices of 256 rows, a rank trains on exactly the rows, in the order, that whole
    row groups give, validates on the same rows, and never holds more than its cache
    (windows + a slice each side), far below a row group."""
    monkeypatch.setenv("RELAYTRAIN_SPILL_DIR", str(tmp_path / "spill"))
    write(tmp_path / "big" / "part-0.parquet", 0, 3000, 1_000_000)
    write(tmp_path / "big" / "part-1.parquet", 3000, 3000, 1_000_000)
    data = section(tmp_path / "big", batch_size=30, partitions=2, shuffle_window=128)
    layout = footers.scan(data)
    assert [g.rows for g in layout.row_groups] == [3000, 3000]
    whole = rank_stream.RankStream(layout, data, 5, 2, 1)
    whole.reader.slices.slice_rows = 3000  # the oracle: whole row groups
    whole.reader.cache_rows = 6000
    sliced = rank_stream.RankStream(layout, data, 5, 2, 1)
    sliced.reader.slices.slice_rows = 256
    sliced.reader.cache_rows = 2 * (128 + 2 * 256)
    held = []
    original = sliced.reader.slice

    def watch(group: int, index: int):
        found = original(group, index)
        held.append(sum(len(a) for a in sliced.reader._decoded.values()))
        return found

    sliced.reader.slice = watch  # type: ignore[method-assign]
    assert _epoch(sliced, 1) == _epoch(whole, 1)
    assert _epoch(sliced, 2, first=17) == _epoch(whole, 2, first=17)  # a resumed epoch
    assert max(held) <= sliced.reader.cache_rows < 3000
    spilled = list((tmp_path / "spill").glob("relaytrain-spill-*/*-features.npy"))
    assert spilled and all(np.load(p).shape[0] <= 256 for p in spilled)

    def validated(rank: rank_stream.RankStream) -> list:
        return sorted(row for part in rank.validation() for row in part.features[:, 0].tolist())

    assert validated(sliced) == validated(whole) and validated(whole)


def test_slices_fit_the_memory_bound():
    """What a rank holds at the slice size chosen (per partition: the live window and the
    next, three slices at their ends; slices in passing, the reading threads' decoding among
    them; the reader's fixed overhead) stays within data.memory_mb."""
    row = 1024.0  # bytes: 256 float32 features
    for partitions, window, largest in [(8, 8192, 1_000_000), (4, 1024, 400_000), (1, 64, 10)]:
        rows = row_slices.slice_rows_for(512, row, partitions, window, largest)
        assert rows <= largest
        in_passing = 12 + 2 * 4  # twelve measured, and 2 threads decoding at 4x a slice
        held = (partitions * (2 * window + 3 * rows) + in_passing * rows) * row
        held += row_slices.READER_OVERHEAD_MB * 2**20
        assert held == row_slices.held_bytes(row, partitions, window, rows)
        # Within the bound, or past it only at the fewest rows a slice holds: setup refuses
        # those specs (test_columns: rows too wide for data.memory_mb).
        assert held <= 512 * 2**20 or rows == min(largest, row_slices.MIN_SLICE_ROWS)


def test_epochs_read_the_next_epoch_ahead_and_give_each_epochs_own_batches(dataset):
    """Against each epoch read alone (the oracle): the same batches, epoch by epoch, from a
    resume point in the first. The next epoch's first batches are read while this epoch's end
    is still being worked on: once its last batch is taken, they are waiting."""
    data = section(dataset, validation_fraction=0.2, batch_size=16, partitions=2, prefetch=2)
    layout = footers.scan(data)
    alone = rank_stream.RankStream(layout, data, 4, 2, 1)
    expected = [_epoch(alone, 1, first=3), _epoch(alone, 2), _epoch(alone, 3)]
    chained = rank_stream.RankStream(layout, data, 4, 2, 1)
    epochs = chained.epochs(1, 3, 4)
    seen = []
    try:
        for epoch, ahead in epochs:
            rows = [(i, ids.tolist(), r.features.tolist()) for i, ids, r in ahead]
            seen.append(rows)
            if epoch < 3:  # the reading thread ended after starting the next epoch's
                following = ahead.finish()
                assert following is not None
                deadline = time.monotonic() + 10
                while following._queue.qsize() < 2 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert following._queue.qsize() == 2  # data.prefetch batches ready
    finally:
        epochs.close()
    assert seen == expected


def test_epochs_closed_mid_epoch_stop_reading(dataset):
    data = section(dataset, validation_fraction=0, batch_size=16, partitions=2)
    epochs = rank_stream.RankStream(footers.scan(data), data, 4, 1, 0).epochs(0, 0, 5)
    for _, ahead in epochs:
        next(iter(ahead))
        break
    epochs.close()
    assert epochs.current is None


def test_a_stream_let_go_frees_its_rows_without_the_cycle_collector(dataset):
    """A worker drops a rank's stream (its epochs closed) and the decoded rows go with it, at
    once: not when Python's cycle collector next runs, which may be epochs later, while the
    next stream holds its own windows beside them."""
    data = section(dataset, validation_fraction=0.2, batch_size=16, partitions=2)
    layout = footers.scan(data)
    gc.disable()
    try:
        rank = rank_stream.RankStream(layout, data, 4, 1, 0)
        epochs = rank.epochs(0, 0, 2)
        assert sum(len(rows.labels) for _, ahead in epochs for _, _, rows in ahead) > 0
        epochs.close()
        assert rank.reader._decoded  # what it held
        reader, decoded = weakref.ref(rank.reader), weakref.ref(rank.reader._decoded)
        del rank, epochs
        assert reader() is None and decoded() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_windows_gathered_by_plan_give_each_positions_rows(tmp_path, monkeypatch, world_size):
    """Against the rows each batch's positions name, read one batch at a time (the oracle): the
    same ids and features, for every rank, with windows that end mid-share (7 rows against
    shares of 4 and 3), row groups read in slices, and a resume from batch 9."""
    monkeypatch.setenv("RELAYTRAIN_SPILL_DIR", str(tmp_path / "spill"))
    write(tmp_path / "t" / "part-0.parquet", 0, 200, 80)
    write(tmp_path / "t" / "part-1.parquet", 200, 90, 90)
    data = section(tmp_path / "t", validation_fraction=0.1, batch_size=10, partitions=3)
    layout = footers.scan(data)
    for rank in range(world_size):
        stream_ = rank_stream.RankStream(layout, data, 6, world_size, rank)
        stream_.reader.slices.slice_rows = 32
        order = sample_order.epoch_order(
            stream_.train_counts, seed=6, epoch=2, batch_size=10, partitions=3, window=7
        )
        oracle = stream.Reader(layout, data, 6, cache_rows=10**6, slice_rows=32)
        expected = []
        for index in range(9, order.steps):
            ids, rows = oracle.take(*order.locate(order.rank_positions(index, world_size, rank)))
            expected.append((index, ids.tolist(), rows.features.tolist()))
        ahead = read_ahead.Prefetcher(stream_.reader, order, world_size, rank, first=9)
        try:
            got = [(i, ids.tolist(), rows.features.tolist()) for i, ids, rows in ahead]
        finally:
            ahead.close()
        assert got == expected and len(expected) > 10


def test_row_groups_the_budget_streams_are_named_with_the_budget_that_reads_them_whole(
    tmp_path, monkeypatch, caplog
):
    """One 120,000-row row group under data.memory_mb 64: setup warns that it is streamed and
    spilled, naming the data.memory_mb that reads it whole. The oracle is the reader itself:
    an epoch at 64 spills slices to disk, an epoch at the figure named spills nothing."""
    from trainer_core.run import preflight

    write(tmp_path / "big" / "part-0.parquet", 0, 120_000, 1_000_000)
    for budget in ("64", None):
        data = section(tmp_path / "big", batch_size=1000, partitions=2, shuffle_window=256)
        if budget is None:
            said = [r.getMessage() for r in caplog.records if "streamed and spilled" in r.message]
            assert len(said) == 1 and "data.memory_mb (64)" in said[0], said
            budget = said[0].rsplit("data.memory_mb ", 1)[1].split()[0]
        data = data.model_copy(update={"memory_mb": int(budget)})
        layout = footers.scan(data)
        with caplog.at_level("WARNING", logger="relaytrain.data"):
            preflight._check_reader_memory(data, layout)
        spill = tmp_path / f"spill-{budget}"
        monkeypatch.setenv("RELAYTRAIN_SPILL_DIR", str(spill))
        rank = rank_stream.RankStream(layout, data, 5, 1, 0)
        assert _epoch(rank)  # an epoch read
        spilled = list(spill.glob("relaytrain-spill-*/*"))
        assert bool(spilled) == (budget == "64"), (budget, len(spilled))
