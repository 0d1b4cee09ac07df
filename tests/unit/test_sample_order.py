"""The epoch order from metadata: the same global batches for every worker count."""

from __future__ import annotations

import numpy as np
import pytest

from trainer_core.data.sample_order import (
    batch_shares,
    epoch_order,
    is_validation,
    rank_slice,
    rank_weight,
)

#: Row groups of uneven sizes, as files written by different jobs have.
COUNTS = [100, 37, 250, 1, 64, 0, 180, 99]


def order(epoch: int = 0, **settings):
    values = {"seed": 5, "epoch": epoch, "batch_size": 24, "partitions": 6, "window": 16}
    return epoch_order(COUNTS, **{**values, **settings})


def test_an_epoch_trains_every_sample_at_most_once_and_all_but_the_remainder():
    o = order()
    total = sum(COUNTS)
    assert o.steps == total // 24
    seen = np.concatenate([o.batch_positions(step) for step in range(o.steps)])
    assert len(seen) == len(set(seen.tolist())) == o.steps * 24
    assert seen.min() >= 0 and seen.max() < total
    # Positions map to (row group, training row) pairs that exist, each once.
    groups, rows = o.locate(seen)
    assert all(0 <= r < COUNTS[g] for g, r in zip(groups, rows, strict=True))
    assert len(set(zip(groups.tolist(), rows.tolist(), strict=True))) == len(seen)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 5, 7, 24, 30])
def test_ranks_split_the_same_global_batches_whatever_the_worker_count(world_size):
    o = order()
    for step in (0, 1, o.steps - 1):
        whole = o.batch_positions(step)
        parts = [o.rank_positions(step, world_size, r) for r in range(world_size)]
        assert np.array_equal(np.concatenate(parts), whole)
        sizes = [len(p) for p in parts]
        assert max(sizes) - min(sizes) <= 1
    # DDP averages the ranks' gradients: weighted so, the mean of the whole global batch.
    losses = np.random.default_rng(0).random(24)
    averaged = np.mean(
        [
            rank_weight(24, world_size, r) * losses[slice(*rank_slice(24, world_size, r))].mean()
            if rank_slice(24, world_size, r)[1] > rank_slice(24, world_size, r)[0]
            else 0.0
            for r in range(world_size)
        ]
    )
    assert averaged == pytest.approx(losses.mean())


def test_a_rank_reads_only_the_partitions_its_slice_overlaps():
    o = order(partitions=8, batch_size=32)
    assert [o.partitions_of(4, r) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert o.partitions_of(3, 0) == [0, 1, 2]  # 32 // 3: a partition shared at each cut
    assert batch_shares(10, 4).tolist() == [3, 3, 2, 2]


def test_the_order_depends_on_seed_and_epoch_and_is_recomputed_identically():
    a, b = order(epoch=0), order(epoch=1)
    assert not np.array_equal(a.batch_positions(0), b.batch_positions(0))
    assert np.array_equal(order(epoch=1).batch_positions(3), b.batch_positions(3))
    assert not np.array_equal(order(seed=6).batch_positions(0), a.batch_positions(0))
    # A resumed reader computes any step directly, without replaying the ones before it.
    late = order().batch_positions(a.steps - 2)
    assert np.array_equal(late, a.batch_positions(a.steps - 2))


def test_shuffling_mixes_row_groups_within_a_batch():
    o = order(window=64)
    groups, _ = o.locate(o.batch_positions(0))
    assert len(set(groups.tolist())) >= 3


def test_validation_rows_are_chosen_per_row_id_without_reading_data():
    ids = np.arange(100_000)
    chosen = is_validation(ids, seed=3, fraction=0.2)
    assert 0.19 < chosen.mean() < 0.21
    assert np.array_equal(chosen[500:900], is_validation(ids[500:900], 3, 0.2))
    assert not np.array_equal(chosen, is_validation(ids, 4, 0.2))
    assert not is_validation(ids, 3, 0.0).any()
