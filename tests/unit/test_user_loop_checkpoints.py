"""A user's own loop's Ray checkpoints, read from a run directory alone (no Ray): which ones
count, their report numbers and metrics, and the weights ``export`` finds in them."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

from trainer_core import storage
from trainer_core.checkpoint import exports
from trainer_core.checkpoint.ray_checkpoints import (
    RAY_SNAPSHOT_FILE,
    REPORT_FILE,
    ray_checkpoints,
    report_record,
)
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import SpecError


def ray_checkpoint(run: Path, name: str, files: dict[str, bytes], record: bytes | None) -> None:
    """A checkpoint directory as Ray leaves it, with relaytrain's record when given one."""
    folder = run / name
    folder.mkdir(parents=True)
    for file, data in files.items():
        (folder / file).write_bytes(data)
    if record is not None:
        (folder / REPORT_FILE).write_bytes(record)


def snapshot(run: Path, names: list[str], latest: str | None) -> None:
    """Ray Train's checkpoint manager snapshot, as much of it as relaytrain reads."""
    results = [{"checkpoint_dir_name": n, "metrics": {}} for n in names]
    latest_result = {"checkpoint_dir_name": latest, "metrics": {}} if latest else None
    (run / RAY_SNAPSHOT_FILE).write_text(
        json.dumps({"checkpoint_results": results, "latest_checkpoint_result": latest_result})
    )


def saved(obj: object) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def test_only_registered_checkpoints_with_a_record_count_in_report_order(tmp_path):
    run = tmp_path / "run"
    weights = {"w": torch.ones(2)}
    for name, report in (("checkpoint_b", 2), ("checkpoint_a", 4)):
        record = report_record(report, report, 1, {"loss": 1.0 / report, "epoch": report - 1})
        ray_checkpoint(run, name, {"model.pt": saved(weights)}, record)
    ray_checkpoint(run, "checkpoint_unregistered", {"model.pt": saved(weights)}, b"{}")
    ray_checkpoint(run, "checkpoint_no_record", {"model.pt": saved(weights)}, None)
    snapshot(run, ["checkpoint_a", "checkpoint_no_record"], latest="checkpoint_b")

    found = ray_checkpoints(RunDirectory(storage.resolve(str(run))))

    assert [(c.name, c.step) for c in found] == [("checkpoint_b", 2), ("checkpoint_a", 4)]
    assert found[1].metrics == {"loss": 0.25, "epoch": 3}
    assert found[1].manifest["epoch"] == 4  # epochs done: the loop's index + 1
    assert set(found[1].files) == {"model.pt"}  # the record is relaytrain's, not the loop's
    assert found[1].uri == str(run / "checkpoint_a")


def test_no_snapshot_no_checkpoints(tmp_path):
    assert ray_checkpoints(RunDirectory(storage.resolve(str(tmp_path)))) == []


@pytest.mark.parametrize(
    "content",
    [
        {"layer.weight": torch.arange(3.0)},
        {"model": {"layer.weight": torch.arange(3.0)}, "optimizer": {}, "epoch": 4},
        {"model_state_dict": {"layer.weight": torch.arange(3.0)}},
        {"module.layer.weight": torch.arange(3.0)},  # a DDP wrapper's state dict
    ],
)
def test_export_finds_the_state_dict_the_loop_saved(tmp_path, content):
    run = tmp_path / "run"
    ray_checkpoint(run, "checkpoint_x", {"model.pt": saved(content)}, report_record(1, 1, 1, {}))
    snapshot(run, ["checkpoint_x"], latest="checkpoint_x")
    run_dir = RunDirectory(storage.resolve(str(run)))
    (checkpoint,) = ray_checkpoints(run_dir)

    weights = exports.model_weights(run_dir, checkpoint)

    assert list(weights) == ["layer.weight"]
    assert torch.equal(weights["layer.weight"], torch.arange(3.0))
    exported = exports.model_location(run_dir, checkpoint)
    assert exported.path.startswith(str(run / exports.EXPORTS_DIR))
    on_disk = torch.load(exported.path, weights_only=True)
    assert torch.equal(on_disk["layer.weight"], torch.arange(3.0))


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ({"model.pt": saved({"epoch": 3, "net": [1, 2]})}, "a dict of 2 entries (epoch, net)"),
        ({"model.pt": saved([torch.ones(1)])}, "holds a list"),
        ({"weights.npy": b"\x93NUMPY"}, "has no model.pt to export (it holds weights.npy)"),
        ({"model.pt": b"not a torch file"}, "is not a file torch.load(weights_only=True) reads"),
    ],
)
def test_export_says_what_it_found_when_there_is_no_state_dict(tmp_path, files, said):
    run = tmp_path / "run"
    ray_checkpoint(run, "checkpoint_x", files, report_record(1, 1, 1, {}))
    snapshot(run, ["checkpoint_x"], latest="checkpoint_x")
    run_dir = RunDirectory(storage.resolve(str(run)))
    (checkpoint,) = ray_checkpoints(run_dir)

    with pytest.raises(SpecError) as raised:
        exports.model_weights(run_dir, checkpoint)
    assert said in str(raised.value) and checkpoint.uri in str(raised.value)
