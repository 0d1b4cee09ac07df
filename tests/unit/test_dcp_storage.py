"""DCP through the run's storage: an FSDP2 model and its Adam state saved by 2 processes (gloo),
committed with the run's manifest, loaded back by 2 and by 1 (DCP reshards), exactly; a damaged
shard refuses to load."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.unit.gloo_group import run_ranks


def _build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def _worker(rank: int, world: int, root: str, mode: str) -> None:
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_state_dict,
    )

    from trainer_core import storage
    from trainer_core.checkpoint import dcp_storage
    from trainer_core.checkpoint.exports import DCP_FORMAT
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.errors import CheckpointCorruptError

    model, optimizer = _build()
    run_dir = RunDirectory(storage.resolve(root))
    location = run_dir.checkpoint_location(3)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    if mode == "stage":
        _check_staging(model, optimizer)
    elif mode == "save":
        for _ in range(3):
            model(torch.randn(8, 16)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        model_state, optimizer_state = get_state_dict(model, optimizer)
        written = dcp_storage.save({"model": model_state, "optim": optimizer_state}, location)
        entries: list = [None] * world
        dist.all_gather_object(entries, written)
        saved_model, saved_optim = get_state_dict(model, optimizer, options=full)
        if rank == 0:
            run_dir.commit_checkpoint(
                3, [e for part in entries for e in part], {"format": DCP_FORMAT}
            )
            torch.save(saved_model, Path(root) / "full.pt")
            torch.save(_flat(saved_optim), Path(root) / "full-optim.pt")
    else:
        checkpoint = run_dir.read_committed(3)
        assert checkpoint is not None
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optim": optimizer_state}
        try:
            dcp_storage.load(state, location, checkpoint.files)
        except CheckpointCorruptError as e:  # on every rank, whichever rank's shard is bad
            (Path(root) / f"error-{rank}.txt").write_text(str(e))
            raise
        set_state_dict(
            model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
        )
        loaded_model, loaded_optim = get_state_dict(model, optimizer, options=full)
        if rank == 0:  # the model and Adam's moments and step counts, whole, resharded or not
            for name, loaded in (("full.pt", loaded_model), ("full-optim.pt", _flat(loaded_optim))):
                saved = torch.load(Path(root) / name)
                assert saved and saved.keys() == loaded.keys(), name
                for key in saved:
                    assert torch.equal(saved[key], loaded[key]), f"{name}: {key}"


def _flat(state: object, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor and number of an optimizer's full state dict, by its dotted path."""
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, (list, tuple)):
        items = enumerate(state)
    else:
        return {prefix: torch.tensor(float(state))} if isinstance(state, (int, float)) else {}
    flat: dict[str, torch.Tensor] = {}
    for key, value in items:
        flat.update(_flat(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def _check_staging(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """The Stager keeps a DTensor's sharding: a copy of each rank's shard, in a wrapper kept
    from one checkpoint to the next; a deferred copy lands at ``copy_deferred``."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    from trainer_core.checkpoint.staging import Stager

    def step() -> None:
        model(torch.randn(8, 16)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    def live() -> dict:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        return {"model": model_state, "optim": optimizer_state}

    step()
    stager = Stager()
    first = stager.stage(live())
    weight = first["model"]["0.weight"]
    assert isinstance(weight, DTensor) and weight.placements == model[0].weight.placements
    # Around the kept host buffer itself, not a copy of it: a copy (``from_local`` makes one
    # of a GPU shard's buffer) would miss what a deferred copy writes into the buffer later.
    assert any(weight._local_tensor is buffer for buffer in stager.buffers.values())
    assert torch.equal(weight._local_tensor, model[0].weight._local_tensor)
    before = weight._local_tensor.clone()
    step()  # the live shard changes; the staged copy must not
    assert torch.equal(weight._local_tensor, before)
    second = stager.stage(live(), defer=lambda tensor: True)
    assert second["model"]["0.weight"] is weight  # the same buffer, the same wrapper
    assert torch.equal(weight._local_tensor, before)  # deferred: not copied yet
    stager.copy_deferred()
    assert torch.equal(weight._local_tensor, model[0].weight._local_tensor)


def _spawn(world: int, root: Path, mode: str) -> None:
    run_ranks(_worker, world, str(root), mode)


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp")
    _spawn(2, root, "save")
    return root


@pytest.fixture(scope="module")
def saved_by_one(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("dcp1")
    _spawn(1, root, "save")
    return root


def test_a_dcp_checkpoint_is_committed_with_every_file_in_its_manifest(saved: Path) -> None:
    import json

    directory = saved / "checkpoint-000000003"
    manifest = json.loads((directory / "manifest.json").read_text())
    on_disk = {p.name for p in directory.iterdir()} - {"manifest.json", "COMMITTED"}
    assert set(manifest["files"]) == on_disk == {".metadata", "__0_0.distcp", "__1_0.distcp"}
    for name, entry in manifest["files"].items():
        assert (directory / name).stat().st_size == entry["size"]


def test_staging_keeps_each_rank_shard_and_its_sharding(tmp_path: Path) -> None:
    _spawn(2, tmp_path, "stage")


@pytest.mark.parametrize("world", [2, 1])
def test_a_dcp_checkpoint_loads_exactly_at_any_world_size(saved: Path, world: int) -> None:
    _spawn(world, saved, "load")


def test_a_dcp_checkpoint_of_one_rank_loads_exactly_on_two(saved_by_one: Path) -> None:
    _spawn(2, saved_by_one, "load")


def test_a_dcp_checkpoint_reads_whole_in_one_process(saved: Path) -> None:
    from trainer_core import storage
    from trainer_core.checkpoint import dcp_storage
    from trainer_core.checkpoint.run_directory import RunDirectory

    run_dir = RunDirectory(storage.resolve(str(saved)))
    checkpoint = run_dir.read_committed(3)
    assert checkpoint is not None
    location = run_dir.checkpoint_location(3)
    model = dcp_storage.read_key(location, checkpoint.files, "model")
    full = torch.load(saved / "full.pt")
    assert model.keys() == full.keys()
    for key in full:
        assert torch.equal(model[key], full[key]), key


def test_a_damaged_dcp_shard_refuses_to_load(saved: Path, tmp_path: Path) -> None:
    import shutil

    damaged = tmp_path / "damaged"
    shutil.copytree(saved, damaged)
    shard = damaged / "checkpoint-000000003" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises((mp.ProcessRaisedException, mp.ProcessExitedException)):
        _spawn(2, damaged, "load")
    said = " ".join(p.read_text() for p in damaged.glob("error-*.txt"))
    assert "__1_0.distcp does not match its manifest" in said


def test_an_export_is_one_torch_file_of_the_whole_model_and_follows_its_checkpoint(
    saved: Path, tmp_path: Path
) -> None:
    import json
    import shutil

    from trainer_core import storage
    from trainer_core.checkpoint import exports
    from trainer_core.checkpoint.run_directory import RunDirectory

    shutil.copytree(saved, tmp_path / "run")
    run_dir = RunDirectory(storage.resolve(str(tmp_path / "run")))
    checkpoint = run_dir.read_committed(3)
    assert checkpoint is not None and exports.is_dcp(checkpoint)
    full = torch.load(saved / "full.pt")

    def same(weights: dict) -> bool:
        return weights.keys() == full.keys() and all(torch.equal(weights[k], full[k]) for k in full)

    assert exports.read(run_dir, checkpoint) is None  # none yet: read the shards
    path = Path(exports.model_location(run_dir, checkpoint).path)
    assert path == tmp_path / "run" / "exports" / "checkpoint-000000003.pt"
    assert same(torch.load(path, weights_only=True))  # what a consumer does with it
    record = path.with_suffix(".json")
    assert json.loads(record.read_text())["file"]["size"] == path.stat().st_size
    assert same(exports.read_model_weights(checkpoint.uri))
    # A damaged export is not used (the shards are), and the next export writes it again.
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 1
    path.write_bytes(bytes(data))
    assert exports.read(run_dir, checkpoint) is None
    assert same(exports.read_model_weights(checkpoint.uri))
    exports.export(run_dir, checkpoint)
    assert same(exports.read(run_dir, checkpoint) or {})
    # Kept while its checkpoint is; gone with it, or when the checkpoint is written again.
    assert exports.prune(run_dir, [checkpoint]) == []
    other = dataclasses.replace(checkpoint, manifest={**checkpoint.manifest, "files": {}})
    assert sorted(exports.prune(run_dir, [other])) == [record.name, path.name]
    exports.export(run_dir, checkpoint)
    assert sorted(exports.prune(run_dir, [])) == [record.name, path.name]
    assert not list((tmp_path / "run" / "exports").iterdir())
    assert checkpoint == run_dir.read_committed(3)  # the checkpoint itself is never touched


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__]))


# -- a file in storage never runs code ----------------------------------------------------------


def test_a_planted_dcp_metadata_never_runs_code(saved: Path, tmp_path: Path) -> None:
    """An attacker's ``.metadata`` (the checkpoint's own, a payload riding in it, the manifest
    and marker made again) is refused by the whole read (export, MLflow) and by a rank's load
    (resume, warm start), naming the file; its payload never runs."""
    import pickle
    import shutil

    from tests.planted import planted_dcp_metadata
    from trainer_core import storage
    from trainer_core.checkpoint import dcp_storage
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.errors import CheckpointCorruptError

    planted = tmp_path / "planted"
    shutil.copytree(saved, planted)
    sentinel = tmp_path / "code-ran"
    data = planted_dcp_metadata(planted / "checkpoint-000000003", sentinel)
    run_dir = RunDirectory(storage.resolve(str(planted)))
    checkpoint = run_dir.read_committed(3)
    assert checkpoint is not None  # committed, its manifest's digests match: no protection
    location = run_dir.checkpoint_location(3)
    with pytest.raises(CheckpointCorruptError, match=r"\.metadata names pathlib\.Path\.touch"):
        dcp_storage.read_key(location, checkpoint.files, "model")
    with pytest.raises((mp.ProcessRaisedException, mp.ProcessExitedException)):
        _spawn(1, planted, "load")
    assert ".metadata names pathlib.Path.touch" in (planted / "error-0.txt").read_text()
    assert not sentinel.exists()
    pickle.loads(data)  # the payload is live: torch's own reader would have run it
    assert sentinel.exists()


def test_a_dcp_item_that_would_run_code_is_refused(tmp_path: Path) -> None:
    """A DCP checkpoint written with DCP's own API whose non-tensor item pickles a payload
    (which DCP's stock planner reads with ``torch.load(weights_only=False)``): refused."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from tests.planted import RunsCode
    from trainer_core import storage
    from trainer_core.checkpoint import dcp_storage
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.errors import CheckpointCorruptError

    sentinel = tmp_path / "code-ran"
    run_dir = RunDirectory(storage.resolve(str(tmp_path / "run")))
    location = run_dir.checkpoint_location(5)
    state = {"model": {"w": torch.ones(3)}, "extra": {"payload": RunsCode(sentinel)}}
    with pytest.warns(UserWarning, match="single process"):
        entries = dcp_storage.save(state, location)
    checkpoint = run_dir.commit_checkpoint(5, entries, {"format": "dcp"})
    model = dcp_storage.read_key(location, checkpoint.files, "model")
    assert torch.equal(model["w"], state["model"]["w"])  # its tensors read as ever
    with pytest.raises(CheckpointCorruptError, match=r"item 'extra\.payload' is not plain tensor"):
        dcp_storage.read_key(location, checkpoint.files, "extra")
    assert not sentinel.exists()
    stock = dcp_storage._Reader(location, checkpoint.files)  # DCP's own planner: the payload ran
    _load_state_dict({}, stock, planner=_EmptyStateDictLoadPlanner(keys={"extra"}), no_dist=True)
    assert sentinel.exists()
