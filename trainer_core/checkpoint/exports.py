"""The model's whole weights from a committed checkpoint of any format, for what runs outside
training: finalize, evaluation, the champion registry and warm starts.

A checkpoint's ``format`` (its manifest's) says where the weights are. ``relaytrain.torch/1``
holds them as one ``torch.load(..., weights_only=True)`` file (``model.pt``; ``model-rank0.pt``
when sharded: every DDP rank holds a replica). ``relaytrain.dcp/1`` (``scaling.strategy: fsdp``)
holds them as every rank's shards; ``export`` gathers them once into such a file (DCP's
``dcp_to_torch_save``, through the run's storage) beside the checkpoints. A user's own loop's
Ray checkpoint (``ray.train/1``) holds what the loop saved: ``ray_model_weights`` finds the
state dict in its ``model.pt`` (``export`` writes it alone)::

    {run}/exports/checkpoint-000000040.pt     the model's state dict, plain tensors
    {run}/exports/checkpoint-000000040.json   its size and digest, and the checkpoint it is of

The record is written after the file, so a file without one is a write that did not finish. It
names the checkpoint by a digest of its manifest's file entries: a checkpoint written again at
the same step (after a fallback to an older one) does not inherit the old export. Checkpoints
are never changed: an export is a copy, and ``prune`` follows retention's deletions.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import torch

from trainer_core import storage
from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.files import FILE_DIGEST, CheckpointInfo, HashingWriter, matches
from trainer_core.checkpoint.ray_checkpoints import RAY_FORMAT
from trainer_core.checkpoint.run_directory import CHECKPOINT_PATTERN, SCHEMA_VERSION, RunDirectory
from trainer_core.errors import CheckpointCorruptError, SpecError
from trainer_core.storage.locations import Location

logger = logging.getLogger("relaytrain.exports")

#: The checkpoint formats (the manifest's ``format``): torch files, or the model and optimizer
#: as a DCP checkpoint (``scaling.strategy: fsdp``).
FORMAT = "relaytrain.torch/1"
DCP_FORMAT = "relaytrain.dcp/1"
EXPORTS_DIR = "exports"
#: Where a user loop's checkpoint file may hold the model's state dict besides its top level:
#: Ray's guides save it with the optimizer and the epoch, under "model".
STATE_DICT_KEYS = ("model", "model_state_dict", "state_dict")


def is_dcp(checkpoint: CheckpointInfo) -> bool:
    """Whether ``checkpoint`` holds its model and optimizer as a DCP checkpoint."""
    return checkpoint.manifest.get("format") == DCP_FORMAT


def is_ray(checkpoint: CheckpointInfo) -> bool:
    """Whether ``checkpoint`` is a user loop's Ray checkpoint (files of the loop's choosing)."""
    return checkpoint.manifest.get("format") == RAY_FORMAT


def model_file(checkpoint: CheckpointInfo) -> str:
    """The file of a torch-format checkpoint holding the whole model's weights (rank 0's, for a
    sharded DDP checkpoint: every rank holds a replica)."""
    return "model.pt" if "model.pt" in checkpoint.files else "model-rank0.pt"


def read_model_weights(checkpoint_uri: str) -> dict[str, torch.Tensor]:
    """The model's whole state dict of a committed checkpoint, verified, in this process: a
    DCP checkpoint's export when it has a sound one, else its shards, gathered here."""
    return model_weights(*open_checkpoint(checkpoint_uri))


def model_weights(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> dict[str, torch.Tensor]:
    """``read_model_weights`` of a checkpoint found through its run directory (whose location
    keeps the storage's options, such as an S3 endpoint, which a checkpoint's URI does not)."""
    if is_dcp(checkpoint):
        exported = read(run_dir, checkpoint)
        if exported is not None:
            return exported
        location = run_dir.checkpoint_location(checkpoint.step)
        weights: dict[str, torch.Tensor] = _dcp_model(location, checkpoint)
        return weights
    if is_ray(checkpoint):
        return ray_model_weights(run_dir, checkpoint)
    state: dict[str, torch.Tensor] = training_state.from_bytes(
        run_dir.read_verified(checkpoint, model_file(checkpoint))
    )
    return state


def _dcp_model(location: Location, checkpoint: CheckpointInfo) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's whole model (DCP is imported by what reads one only: a worker of a
    run without it never pays for the import, ``trainer_core.tensors``)."""
    from trainer_core.checkpoint import dcp_storage

    weights: dict[str, torch.Tensor] = dcp_storage.read_key(location, checkpoint.files, "model")
    return weights


def model_location(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> Location:
    """Where ``checkpoint``'s whole model is one ``torch.load`` file: its own model file, or its
    export (made here if it is missing or stale)."""
    if not is_dcp(checkpoint) and not is_ray(checkpoint):
        return run_dir.checkpoint_location(checkpoint.step).child(model_file(checkpoint))
    return export(run_dir, checkpoint)


def export(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> Location:
    """The export of a DCP checkpoint, or of a user loop's Ray checkpoint (the state dict
    alone): written unless a sound, current one is there."""
    target, record = _locations(run_dir, checkpoint)
    if _sound_bytes(target, record, checkpoint) is not None:
        return target
    if is_ray(checkpoint):
        weights = ray_model_weights(run_dir, checkpoint)
    else:
        weights = _dcp_model(run_dir.checkpoint_location(checkpoint.step), checkpoint)

    def write(stream: Any) -> Any:
        writer = HashingWriter(stream)
        training_state.save(weights, writer)
        return writer.entry(target.path.rsplit("/", 1)[-1])

    entry = target.write_stream(write)
    record.write_json(
        {
            "schema": SCHEMA_VERSION,
            "step": checkpoint.step,
            "checkpoint": checkpoint.name,
            "source": source_digest(checkpoint),
            "file": entry.manifest_entry(),
        }
    )
    logger.info("exported %s to %s (%d bytes)", checkpoint.uri, target.uri, entry.size)
    return target


def ray_model_weights(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> dict[str, torch.Tensor]:
    """The model's state dict in a user loop's Ray checkpoint: its ``model.pt`` (else its one
    ``.pt``/``.pth`` file at the top), when that is a state dict or holds one under
    ``STATE_DICT_KEYS`` (``find_state_dict``). SpecError saying what the checkpoint holds when
    it is neither."""
    names = sorted(checkpoint.files)
    torch_files = [n for n in names if "/" not in n and n.endswith((".pt", ".pth"))]
    name = "model.pt" if "model.pt" in torch_files else None
    if name is None and len(torch_files) == 1:
        name = torch_files[0]
    if name is None:
        raise SpecError(
            f"checkpoint {checkpoint.uri} has no model.pt to export (it holds "
            f"{', '.join(names) or 'no files'}): save the model's state_dict in a model.pt of "
            "the checkpoint your loop reports, alone or under 'model'"
        )
    try:
        content = training_state.from_bytes(
            run_dir.location.child(checkpoint.name, name).read_bytes()
        )
    except (CheckpointCorruptError, RuntimeError) as e:
        raise SpecError(
            f"checkpoint {checkpoint.uri}: {name} is not a file torch.load(weights_only=True) "
            f"reads ({str(e).splitlines()[0]}): save the model's state_dict with torch.save"
        ) from e
    weights = find_state_dict(content)
    if weights is None:
        raise SpecError(
            f"checkpoint {checkpoint.uri}: {name} holds {_describe(content)}, and no model "
            f"state_dict (names to tensors) itself or under {', '.join(STATE_DICT_KEYS)}: save "
            f"the model's state_dict as {name}, or under 'model'"
        )
    return weights


def find_state_dict(content: Any) -> dict[str, torch.Tensor] | None:
    """A model's state dict in what a checkpoint file holds: the content itself or its entry
    under one of ``STATE_DICT_KEYS``; keys without the ``module.`` prefix that every key has
    when the loop saved its DDP wrapper's. None when there is none."""
    found = None
    if _is_state_dict(content):
        found = content
    elif isinstance(content, dict):
        found = next((content[k] for k in STATE_DICT_KEYS if _is_state_dict(content.get(k))), None)
    if found is None:
        return None
    prefix = "module."
    if all(key.startswith(prefix) for key in found):
        return {key[len(prefix) :]: value for key, value in found.items()}
    return dict(found)


def _is_state_dict(content: Any) -> bool:
    return (
        isinstance(content, dict)
        and bool(content)
        and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in content.items())
    )


def _describe(content: Any) -> str:
    if isinstance(content, dict):
        keys = sorted(str(k) for k in content)
        shown = ", ".join(keys[:8]) + (", ..." if len(keys) > 8 else "")
        return f"a dict of {len(keys)} entries ({shown})"
    return f"a {type(content).__name__}"


def read(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> dict[str, torch.Tensor] | None:
    """The weights in a DCP checkpoint's export, verified, or None when it has no sound,
    current one (the caller reads the shards instead)."""
    data = _sound_bytes(*_locations(run_dir, checkpoint), checkpoint)
    if data is None:
        return None
    try:
        weights: dict[str, torch.Tensor] = training_state.from_bytes(data)
    except CheckpointCorruptError:
        return None
    return weights


def prune(run_dir: RunDirectory, committed: list[CheckpointInfo]) -> list[str]:
    """Remove the exports of checkpoints that are gone (retention) or were written again, and
    half-written ones; return the names removed."""
    current = {c.name: c for c in committed}
    removed = []
    folder = run_dir.location.child(EXPORTS_DIR)
    for info in folder.list():
        stem, _, suffix = info.base_name.rpartition(".")
        checkpoint = current.get(stem)
        current_export = (
            suffix in ("pt", "json")
            and checkpoint is not None
            and _record_of(folder.child(f"{stem}.json"), checkpoint) is not None
        )
        if current_export:
            continue
        folder.child(info.base_name).delete_file()
        removed.append(info.base_name)
    return removed


def source_digest(checkpoint: CheckpointInfo) -> str:
    """What an export is of: a digest of the checkpoint's file entries (sizes and digests)."""
    files = json.dumps(checkpoint.files, sort_keys=True).encode()
    return hashlib.sha256(files).hexdigest()


def _locations(run_dir: RunDirectory, checkpoint: CheckpointInfo) -> tuple[Location, Location]:
    folder = run_dir.location.child(EXPORTS_DIR)
    return folder.child(f"{checkpoint.name}.pt"), folder.child(f"{checkpoint.name}.json")


def _sound_bytes(target: Location, record: Location, checkpoint: CheckpointInfo) -> bytes | None:
    """The export's bytes when its record is of ``checkpoint`` as it is now and they match it."""
    entry = _record_of(record, checkpoint)
    if entry is None:
        return None
    try:
        data = target.read_bytes()
    except FileNotFoundError:
        return None
    if not matches(entry, data):
        logger.warning("export %s does not match its record: not used", target.uri)
        return None
    return data


def _record_of(record: Location, checkpoint: CheckpointInfo) -> dict[str, Any] | None:
    """The file entry of ``record`` when it is of ``checkpoint`` as it is now, else None."""
    try:
        data = record.read_json()
    except (FileNotFoundError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("source") != source_digest(checkpoint):
        return None
    entry = data.get("file")
    if not isinstance(entry, dict) or FILE_DIGEST not in entry:
        return None
    return entry


def open_checkpoint(uri: str) -> tuple[RunDirectory, CheckpointInfo]:
    """The committed checkpoint at ``uri`` (a ``.../checkpoint-NNNNNNNNN`` directory)."""
    run_location, name = storage.parent(storage.resolve(uri))
    match = CHECKPOINT_PATTERN.fullmatch(name)
    if not match:
        raise SpecError(
            f"run.init_from {uri!r} is not a checkpoint directory: point it at a committed "
            "{run}/checkpoint-NNNNNNNNN directory",
            field="run.init_from",
        )
    run_dir = RunDirectory(run_location)
    try:
        info = run_dir.read_committed(int(match.group(1)))
    except CheckpointCorruptError as e:
        raise SpecError(
            f"run.init_from checkpoint {uri} is damaged: {e}. Point it at another committed "
            "checkpoint.",
            field="run.init_from",
        ) from e
    if info is None:
        raise SpecError(
            f"run.init_from checkpoint {uri} does not exist or is not committed (no valid "
            "marker): point it at a committed {run}/checkpoint-NNNNNNNNN directory",
            field="run.init_from",
        )
    if is_dcp(info):  # its metadata read as data here, before any worker reads the shards
        from trainer_core.checkpoint import dcp_metadata

        name = dcp_metadata.METADATA_FILE
        try:
            dcp_metadata.read_metadata(run_dir.read_verified(info, name), f"{info.uri}/{name}")
        except CheckpointCorruptError as e:
            raise SpecError(
                f"run.init_from checkpoint {uri} cannot be read: {e}. Point it at another "
                "committed checkpoint.",
                field="run.init_from",
            ) from e
    return run_dir, info
