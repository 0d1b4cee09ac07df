"""The columns form without Ray: rows of any Arrow type read as they are (sliced, spilled and
gathered like the tabular form's), each row's transform keyed by (seed, epoch, row id), and
the setup checks that refuse a bad transform, model or loss before any worker starts."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from tests.columns_workloads import write_lm_dataset
from trainer_core.data import footers, rank_stream
from trainer_core.data.transform import Batches, TransformPool, finished_in_order, row_rng
from trainer_core.errors import SpecError
from trainer_core.run.preflight import validate_workload
from trainer_core.spec.overrides import build_spec
from trainer_core.spec.sections import DataSection


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory) -> str:
    return write_lm_dataset(tmp_path_factory.mktemp("lm") / "lm.parquet")


def section(path: str, **changes) -> DataSection:
    return DataSection(dataset=path, columns=["raw", "n"], **changes)


def lm_spec(tmp_path, lm_file: str, **changes) -> object:
    data = {
        "dataset": lm_file,
        "columns": ["raw", "n"],
        "transform": "tests.columns_workloads:decode_raw",
    }
    data.update(changes.pop("data", {}))
    raw = {
        "run": {"name": "lm", "storage": str(tmp_path)},
        "model": {"name": "tests.columns_workloads:tiny_lm", **changes.pop("model", {})},
        "data": {"task": "causal_lm", "batch_size": 8, **data},
        "schedule": {"epochs": 1},
        "scaling": {"num_workers": 1},
        **changes,
    }
    return build_spec(raw)


def test_rows_read_sliced_and_gathered_are_the_rows_their_ids_name(lm_file):
    """Binary and list columns come back as written, for rows spread over row groups and
    slices of a row group (spilled as Arrow), in the order asked."""
    data = section(lm_file)
    table = pq.read_table(lm_file)
    one = rank_stream.RankStream(footers.scan(data), data, seed=1, world_size=1, rank=0)
    one.reader.slices.slice_rows = 30  # row groups of 100 rows: 4 slices each, spilled
    order = one.order(0)
    for index in (0, 5, one.batches_per_epoch - 1):
        groups, within = order.locate(order.rank_positions(index, 1, 0))
        ids, rows = one.reader.take(groups, within)
        assert rows.table.column_names == ["raw", "n"]
        assert rows.table.column("n").to_pylist() == ids.tolist()
        assert rows.table.column("raw").to_pylist() == table.take(ids).column("raw").to_pylist()


def test_each_row_gets_its_own_draw_whatever_the_workers(lm_file):
    """A global batch made on 1 worker is the 2 workers' halves side by side, sample for sample
    and draw for draw, with a thread pool or spawned processes; another epoch draws anew."""
    data = section(lm_file, transform="tests.columns_workloads:noisy", batch_size=10)

    def batch(world_size: int, epoch: int, index: int, pool: str = "threads") -> dict:
        parts = []
        for rank in range(world_size):
            spec = data.model_copy(update={"transform_pool": pool})
            ranks = rank_stream.RankStream(footers.scan(spec), spec, 3, world_size, rank)
            batches = Batches(spec, seed=3)
            ahead = ranks.epoch(epoch, first=index, make_batch=batches.start)
            try:
                parts.append(next(iter(ahead))[2])
            finally:
                ahead.close()
                batches.close()
        return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}

    one, two = batch(1, 0, 4), batch(2, 0, 4)
    assert torch.equal(one["n"], two["n"]) and torch.equal(one["draw"], two["draw"])
    expected = [row_rng(3, 0, int(n)).random() for n in one["n"]]
    assert one["draw"].tolist() == expected
    assert torch.equal(batch(2, 0, 4, pool="processes")["draw"], one["draw"])
    later = batch(1, 1, 4)
    assert not torch.equal(later["draw"], one["draw"])


def test_a_batched_transform_draws_what_the_per_row_one_draws(lm_file):
    """``data.transform_batched``: one call per chunk with a generator per row, the same draws
    as the per-row form; the validation rows keyed by row id alone, the same every epoch."""
    per_row = section(lm_file, transform="tests.columns_workloads:noisy", batch_size=10)
    batched = per_row.model_copy(
        update={"transform": "tests.columns_workloads:noisy_batched", "transform_batched": True}
    )
    ranks = rank_stream.RankStream(footers.scan(per_row), per_row, 3, 1, 0)
    ids, rows = next(ranks.validation_with_ids(chunk=16))
    made = {}
    for name, data in [("row", per_row), ("batched", batched)]:
        for training, epoch in [(True, 2), (False, 0), (False, 5)]:
            batches = Batches(data, seed=3, training=training)
            made[name, training, epoch] = batches(epoch, ids, rows)
            batches.close()
    for key in made:
        assert torch.equal(made[key]["n"], torch.as_tensor(ids))
        assert torch.equal(made[key]["draw"], made[("row", *key[1:])]["draw"])
    assert torch.equal(made["row", False, 0]["draw"], made["row", False, 5]["draw"])
    assert not torch.equal(made["row", True, 2]["draw"], made["row", False, 0]["draw"])


def test_a_binary_column_without_a_transform_names_the_fix(tmp_path, lm_file):
    spec = lm_spec(tmp_path, lm_file, data={"transform": None})
    with pytest.raises(SpecError, match=r"column 'raw' .*decode or pad it with data.transform"):
        validate_workload(spec)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"data": {"transform": "tests.columns_workloads:raises_on_row_2"}},
            r"raised ValueError on row 2 of .*lm.parquet.*cannot decode this row",
        ),
        (
            {"data": {"transform": "tests.columns_workloads:ignores_rng"}},
            r"different values for row \d+ .*called twice with the same rng",
        ),
        (
            {"data": {"transform": "tests.columns_workloads:uneven_lengths"}},
            r"cannot be batched .*give data.collate to pad",
        ),
        (
            {"data": {"transform": "tests.columns_workloads:returns_a_list"}},
            r"returned list .*return a dict of arrays",
        ),
        ({"model": {"inputs": ["tokens"]}}, r"rejected the batch .*KeyError.*model.inputs"),
        (
            {"loss": "tests.columns_workloads:per_token_losses"},
            r"returned Tensor \[\d+\].*summed loss as a scalar",
        ),
        ({"loss": "tests.columns_workloads:sum_without_count"}, r"returned a count str"),
        ({"data": {"columns": ["raw", "pixels"]}}, r"no column\(s\) \['pixels'\].*data.columns"),
        (
            {"metrics": ["tests.columns_workloads:needs_pixels"]},
            r"metrics.0 .*needs_pixels.* raised KeyError .*fn\(outputs, batch\)",
        ),
        (  # validation's own transform: refused now, not after the first epoch
            {"data": {"eval_transform": "tests.columns_workloads:raises_on_row_2"}},
            r"data.eval_transform .*raised ValueError on row 2 of .*cannot decode this row",
        ),
        (
            {"data": {"eval_transform": "tests.columns_workloads:returns_a_list"}},
            r"data.eval_transform .*returned list .*return a dict of arrays",
        ),
    ],
    ids=[
        "raises",
        "ignores-rng",
        "unbatchable",
        "not-a-dict",
        "model-keys",
        "per-sample",
        "count",
        "missing-column",
        "metric",
        "eval-raises",
        "eval-not-a-dict",
    ],
)
def test_a_bad_workload_is_refused_in_setup(tmp_path, lm_file, changes, message):
    spec = lm_spec(tmp_path, lm_file, **changes)
    with pytest.raises(SpecError, match=message):
        validate_workload(spec)
    assert not any(tmp_path.iterdir())  # nothing written


def test_the_lm_example_passes_its_setup_checks(tmp_path, lm_file):
    spec = lm_spec(
        tmp_path,
        lm_file,
        model={"name": "examples.lm_gpt:build", "kwargs": {"block_size": 32, "width": 16}},
        data={"columns": ["tokens"], "transform": "examples.lm_gpt:crop"},
    )
    assert validate_workload(spec) > 30  # about 400 x 0.8 / 8 steps
    assert row_rng(0, 1, 5).random() == row_rng(0, 1, 5).random() != row_rng(0, 2, 5).random()
    assert np.isfinite(row_rng(2**32 - 1, 2**32 - 1, 2**63).random())


@pytest.mark.parametrize("pool", ["threads", "processes"])
def test_an_epoch_transformed_ahead_is_the_epoch_made_a_batch_at_a_time(lm_file, pool):
    """The read-ahead thread starts up to data.prefetch batches behind the one it finishes: the
    epoch's batches are still, in order, each made alone from the rows its positions name.
    The validation batches, made ahead by the same (warmed) pool, are too."""
    data = section(lm_file, transform="tests.columns_workloads:noisy", batch_size=12)
    data = data.model_copy(update={"transform_pool": pool, "prefetch": 3})
    ranks = rank_stream.RankStream(footers.scan(data), data, 5, 2, 1)
    shared = TransformPool(data).warm()
    batches = Batches(data, seed=5, pool=shared)
    validation = Batches(data, seed=5, training=False, pool=shared)
    try:
        ahead = ranks.epoch(1, first=2, make_batch=batches.start)
        made = [(index, batch) for index, _, batch in ahead]
        order = ranks.order(1)
        assert [index for index, _ in made] == list(range(2, ranks.batches_per_epoch))
        for index, batch in made:  # the oracle: this batch's rows, through the transform alone
            groups, within = order.locate(order.rank_positions(index, 2, 1))
            ids, rows = ranks.reader.take(groups, within)
            alone = Batches(data.model_copy(update={"transform_workers": 0}), seed=5)
            expected = alone(1, ids, rows)
            assert torch.equal(batch["n"], expected["n"]) and torch.equal(
                batch["draw"], expected["draw"]
            )
        parts = list(ranks.validation_with_ids(chunk=5))
        validated = list(validation.each(0, parts, ahead=3))
        assert len(validated) == len(parts) > 3
        for (ids, rows), batch in zip(parts, validated, strict=True):
            alone = Batches(data.model_copy(update={"transform_workers": 0}), 5, training=False)
            assert torch.equal(batch["draw"], alone(0, ids, rows)["draw"])
    finally:
        batches.close()
        validation.close()
        shared.close()


def test_batches_finish_in_order_with_the_next_started_and_an_error_in_its_place():
    """``finished_in_order``: item k is finished only once ``ahead`` more are started, in the
    order started; an error starting an item comes after every item before it."""
    log: list[str] = []

    def started(count: int, fail_at: int | None = None):
        for k in range(count):
            if k == fail_at:
                raise OSError(f"reading item {k}")
            log.append(f"start {k}")

            def finish(k: int = k) -> int:
                log.append(f"finish {k}")
                return k * 10

            yield finish, k

    assert list(finished_in_order(started(4), ahead=2)) == [(0, 0), (10, 1), (20, 2), (30, 3)]
    assert log == [
        "start 0", "start 1", "start 2", "finish 0", "start 3", "finish 1", "finish 2", "finish 3"
    ]  # fmt: skip
    log.clear()
    got = []
    with pytest.raises(OSError, match="reading item 3"):
        for result, _ in finished_in_order(started(5, fail_at=3), ahead=2):
            got.append(result)
    assert got == [0, 10, 20]


def test_rows_too_wide_for_data_memory_mb_are_refused_in_setup(tmp_path):
    """Encoded images of 100 KB a row: at the defaults' 8 partitions and a window of 128 rows
    even slices of the fewest rows (256) hold about 1.3 GB, which 512 MB cannot bound; setup
    refuses, naming data.memory_mb and what it would take. Given that much, the same data
    passes. The oracle: the bytes the file's rows decode to, times what a worker holds of
    them (2 windows and 3 slices a partition, 12 slices in passing and 2 reading threads
    decoding at 4x a slice)."""
    import pyarrow as pa

    rng = np.random.default_rng(0)
    width = 100_000
    table = pa.table(
        {
            "raw": pa.array([rng.bytes(width) for _ in range(600)], pa.binary()),
            "n": pa.array(np.arange(600, dtype=np.int64)),
        }
    )
    path = tmp_path / "images.parquet"
    pq.write_table(table, path, row_group_size=300, compression="none")
    windows = {"partitions": 8, "shuffle_window": 128}
    wide = lm_spec(tmp_path / "runs", str(path), data={**windows, "memory_mb": 512})
    with pytest.raises(SpecError, match=r"holds about \d+ MB, more than data.memory_mb \(512\)"):
        validate_workload(wide)
    held = 48 * 2**20 + (8 * (2 * 128 + 3 * 256) + (12 + 2 * 4) * 256) * width
    needed_mb = held / 2**20
    assert needed_mb > 1000  # about 1.3 GB: what a worker would really have held
    enough = lm_spec(
        tmp_path / "runs", str(path), data={**windows, "memory_mb": int(needed_mb * 1.1)}
    )
    assert validate_workload(enough) > 0  # its steps: the model ran on its first rows
