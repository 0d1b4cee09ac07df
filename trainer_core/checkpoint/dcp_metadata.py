"""DCP's ``.metadata`` and its non-tensor items, read as data: storage is not trusted code.

torch's ``FileSystemReader`` reads a checkpoint's ``.metadata`` with plain ``pickle.load``, and
DCP's default load planner reads every non-tensor item (an optimizer's ``param_groups``, a
counter) with ``torch.load(..., weights_only=False)``: either runs whatever a planted file names.
A manifest's digests do not help, since whoever can write the run directory can write the
manifest and its commit marker too. So relaytrain reads both itself:

- ``.metadata`` through an unpickler that resolves only the globals torch's DCP writes there
  (its metadata dataclasses, ``torch.Size``, dtypes, layouts, the path of the checkpoint it
  was saved to), the way torch's own ``weights_only`` unpickler allow-lists what a state dict
  may hold; any other global is refused before it is looked up, so nothing it names is
  imported or called;
- non-tensor items with ``torch.load(..., weights_only=True)`` (tensors and plain containers).

Either refusal is a ``CheckpointCorruptError`` naming the file, so a resume skips the
checkpoint as it skips a damaged one, and an export or a warm start says which file it refused.
"""

from __future__ import annotations

import collections
import io
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata

from trainer_core.errors import CheckpointCorruptError

METADATA_FILE = ".metadata"

#: Every global DCP's ``.metadata`` refers to (torch 2.13, checked against what it writes for
#: DDP, FSDP2 and optimizer state: tests/unit/test_dcp_storage.py), by module and name.
_CLASSES: dict[tuple[str, str], Any] = {
    **{
        (dcp_metadata.__name__, cls.__name__): cls
        for cls in (
            dcp_metadata.Metadata,
            dcp_metadata.MetadataIndex,
            dcp_metadata.StorageMeta,
            dcp_metadata.TensorStorageMetadata,
            dcp_metadata.BytesStorageMetadata,
            dcp_metadata.ChunkStorageMetadata,
            dcp_metadata.TensorProperties,
            dcp_metadata._MEM_FORMAT_ENCODING,
        )
    },
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    # a layout pickles as this function of its name (torch.strided: "torch.strided")
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    # StorageMeta.checkpoint_id: the path the checkpoint was saved to
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("collections", "OrderedDict"): collections.OrderedDict,
}


def _allowed(module: str, name: str) -> Any | None:
    found = _CLASSES.get((module, name))
    if found is None and module == "torch":  # a dtype pickles as torch.<name> (torch.float32)
        value = getattr(torch, name, None)
        found = value if isinstance(value, torch.dtype) else None
    return found


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, where: str):
        super().__init__(io.BytesIO(data))
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = _allowed(module, name)
        if found is None:
            raise CheckpointCorruptError(
                f"{self.where} names {module}.{name}, which DCP metadata never holds: refused "
                "unread (a file in storage is data, never code; docs/security.md). Delete the "
                "checkpoint, or write it again with torch.distributed.checkpoint."
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise CheckpointCorruptError(
            f"{self.where} holds a persistent reference ({str(pid)[:60]!r}), which DCP metadata "
            "never holds: refused"
        )


def read_metadata(data: bytes, where: str) -> dcp_metadata.Metadata:
    """The ``Metadata`` that ``data`` (a ``.metadata`` file's bytes; ``where`` names it)
    pickles, or CheckpointCorruptError if it names anything DCP's metadata does not hold."""
    try:
        metadata = _MetadataUnpickler(data, where).load()
    except CheckpointCorruptError:
        raise
    except Exception as e:  # truncated, not a pickle, or a class given arguments it refuses
        raise CheckpointCorruptError(
            f"{where} is not DCP metadata ({type(e).__name__}: {e})"
        ) from e
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointCorruptError(
            f"{where} holds a {type(metadata).__name__}, not DCP's Metadata: refused"
        )
    return metadata


def read_item(data: io.BytesIO, where: str) -> Any:
    """A non-tensor item of a DCP checkpoint (``where`` names it): tensors and plain
    containers only."""
    try:
        return torch.load(data, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as e:
        raise CheckpointCorruptError(
            f"{where} is not plain tensor data (torch.load(weights_only=True) refused it: "
            f"{str(e).splitlines()[0][:200]}): refused unread (docs/security.md)"
        ) from e
