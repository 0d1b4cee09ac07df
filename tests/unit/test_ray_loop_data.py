"""A user's Ray loop's torch Dataset (train.ray_loop_data): where its loader stands goes into
the checkpoint it reports and comes back when it reads that checkpoint; a resumed loop asking
for the same epoch goes on from there, at any world size; misuse is refused naming the fix.
The oracle for the order is ``samples.IndexOrder`` read by one process."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs
import pytest
import torch

from tests.torch_datasets import Augmented, iterable, no_length
from trainer_core.checkpoint.ray_checkpoints import POSITION_FILE
from trainer_core.data.samples import IndexOrder
from trainer_core.errors import IncompatibleRunError, SpecError
from trainer_core.spec.sections import DataSection
from trainer_core.train import ray_loop_data
from trainer_core.train.ray_loop_data import LoopData, Position, first_batch, position_payload


@dataclass
class Checkpoint:  # what the hooks read of a ray.train.Checkpoint
    path: str
    filesystem: pafs.FileSystem


class Indexed(torch.utils.data.Dataset):
    """Sample i is i."""

    def __init__(self, length: int):
        self.length = length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> int:
        return index


def order(length: int, batch_size: int, seed: int, epoch: int) -> list[int]:
    data = DataSection(dataset="tests.torch_datasets:augmented", batch_size=batch_size)
    return IndexOrder(length, data, seed, split=False).epoch(epoch).tolist()


def checkpoint_in(tmp_path: Path, name: str) -> Checkpoint:
    folder = tmp_path / name
    folder.mkdir()
    return Checkpoint(str(folder), pafs.LocalFileSystem())


def test_the_position_round_trips_through_its_versioned_payload(tmp_path: Path):
    position = Position(epoch=2, samples=30, batch_size=10, length=96)
    record = json.loads(position_payload(position))
    assert record["schema"] == 1
    checkpoint = checkpoint_in(tmp_path, "checkpoint_1")
    (Path(checkpoint.path) / POSITION_FILE).write_bytes(position_payload(position))
    data = LoopData(seed=3, rank=0, world_size=1)
    data.pending = data.armed = True
    data.restore(checkpoint)
    assert data.resumed == position
    data.restore(checkpoint)  # a later read of the loop's changes nothing
    assert data.resumed == position and not data.pending


def test_a_position_of_a_newer_release_is_refused_naming_it(tmp_path: Path):
    checkpoint = checkpoint_in(tmp_path, "checkpoint_1")
    record = {"schema": 99, "epoch": 0, "samples": 0, "batch_size": 10, "length": 96}
    (Path(checkpoint.path) / POSITION_FILE).write_text(json.dumps(record))
    data = LoopData(seed=3, rank=0, world_size=1)
    data.pending = data.armed = True
    with pytest.raises(IncompatibleRunError, match="schema 99"):
        data.restore(checkpoint)


@pytest.mark.parametrize(
    "body", [b'{"schema": 1, "epo', b'{"schema": 1, "epoch": 0}', b"[1, 2]", b"\x80\x04"]
)
def test_a_damaged_position_starts_the_epoch_over_and_says_so(tmp_path: Path, caplog, body):
    """A position file cut short, missing a field, or not one at all: the resume goes on from
    the epoch's first sample (the checkpoint's weights are still sound), with a warning."""
    checkpoint = checkpoint_in(tmp_path, "checkpoint_1")
    (Path(checkpoint.path) / POSITION_FILE).write_bytes(body)
    data = LoopData(seed=3, rank=0, world_size=1)
    data.pending = data.armed = True
    data.restore(checkpoint)
    assert data.resumed is None and not data.pending
    assert "is not a loader position" in caplog.text


def test_a_checkpoint_without_a_position_or_read_before_the_loop_runs_restores_none(
    tmp_path: Path,
):
    checkpoint = checkpoint_in(tmp_path, "checkpoint_1")
    data = LoopData(seed=3, rank=0, world_size=1)
    data.pending = True
    (Path(checkpoint.path) / POSITION_FILE).write_bytes(position_payload(Position(1, 10, 10, 40)))
    data.restore(checkpoint)  # relaytrain's own read, before the loop runs
    assert data.resumed is None and data.pending
    empty = checkpoint_in(tmp_path, "checkpoint_2")
    data.armed = True
    data.restore(empty)
    assert data.resumed is None and not data.pending


def test_the_same_epoch_resumes_at_the_saved_sample_and_a_later_one_starts_at_zero():
    saved = Position(epoch=1, samples=30, batch_size=10, length=96)
    assert first_batch(saved, 1, 10, 96) == 3
    assert first_batch(saved, 2, 10, 96) == 0
    assert first_batch(None, 1, 10, 96) == 0
    with pytest.raises(SpecError, match=r"batch_size=12.*10"):
        first_batch(saved, 1, 12, 96)
    with pytest.raises(SpecError, match=r"80 samples.*96"):
        first_batch(saved, 1, 10, 80)


def test_a_report_saves_where_the_loader_stands_and_a_resume_at_another_world_size_goes_on(
    tmp_path: Path,
):
    """Rank 0 of 2 reads 3 batches of epoch 1 and reports; the position is saved; a resumed
    rank 0 of 1 reads the rest of epoch 1: together with rank 1's share of the first 3, the
    epoch's order as one process reads it."""
    length, batch_size, seed = 40, 4, 3
    dataset = Indexed(length)
    first = [LoopData(seed, rank, 2) for rank in (0, 1)]
    seen: list[list[int]] = []
    for epoch_batches in zip(
        *(d.batches(dataset, batch_size=batch_size, epoch=1) for d in first), strict=True
    ):
        seen.append([int(i) for part in epoch_batches for i in part])
        if len(seen) == 3:
            break
    checkpoint = checkpoint_in(tmp_path, "checkpoint_1")
    first[0].save(checkpoint)
    resumed = LoopData(seed, 0, 1)
    resumed.pending = resumed.armed = True
    resumed.restore(checkpoint)
    seen += [b.tolist() for b in resumed.batches(dataset, batch_size=batch_size, epoch=1)]
    assert [i for b in seen for i in b] == order(length, batch_size, seed, 1)
    later = [b.tolist() for b in resumed.batches(dataset, batch_size=batch_size, epoch=2)]
    assert [i for b in later for i in b] == order(length, batch_size, seed, 2)
    for d in (*first, resumed):
        d.close()


def test_an_epoch_read_to_its_end_is_not_read_again_when_the_loop_asks_for_it(tmp_path: Path):
    dataset = Indexed(12)
    data = LoopData(5, 0, 1)
    assert len(list(data.batches(dataset, batch_size=4, epoch=0))) == 3
    checkpoint = checkpoint_in(tmp_path, "checkpoint_1")
    data.save(checkpoint)
    resumed = LoopData(5, 0, 1)
    resumed.pending = resumed.armed = True
    resumed.restore(checkpoint)
    assert list(resumed.batches(dataset, batch_size=4, epoch=0)) == []


def test_misuse_is_refused_naming_the_value_and_the_fix():
    data = LoopData(5, 0, 2)
    with pytest.raises(SpecError, match=r"batch_size=5.*2 workers.*multiple of 2"):
        data.batches(Augmented(20), batch_size=5, epoch=0)
    with pytest.raises(SpecError, match=r"IterableDataset.*Stream"):
        data.batches(iterable(), batch_size=4, epoch=0)
    with pytest.raises(SpecError, match=r"NoLength.*__len__"):
        data.batches(no_length(), batch_size=4, epoch=0)
    with pytest.raises(SpecError, match=r"6 samples.*batch_size=8"):
        data.batches(Augmented(6), batch_size=8, epoch=0)
    with pytest.raises(SpecError, match=r"epoch=-1"):
        data.batches(Augmented(20), batch_size=4, epoch=-1)


def test_dataloader_outside_a_ray_loop_relaytrain_runs_says_where_it_works():
    with pytest.raises(SpecError, match=r"train_loop_api: ray.*session\(\)\.dataloader"):
        ray_loop_data.dataloader(Augmented(20), batch_size=4, epoch=0)


@pytest.mark.parametrize("held", ["validation", "test"])
def test_a_ray_loop_with_a_validation_or_test_set_is_refused_naming_the_fix(tmp_path, held):
    """relaytrain evaluates its held-out sets on checkpoints it can read; a Ray loop's are its
    own format, so such a set would never be scored: refused, not ignored with a warning."""
    from tests.conftest import tiny_raw
    from trainer_core.spec.overrides import build_spec

    raw = tiny_raw(tmp_path, "x", train_loop="examples.ray_train_loop:train_func")
    raw["data"] |= {
        "dataset": "tests.torch_datasets:augmented",
        held: "tests.torch_datasets:augmented",
    }
    with pytest.raises(SpecError, match=rf"data\.{held}.*evaluate it in your loop") as raised:
        build_spec(raw)
    assert raised.value.field == f"data.{held}"
