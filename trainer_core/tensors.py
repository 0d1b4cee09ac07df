"""What the core asks of a tensor that may be a DTensor (an FSDP shard), without importing
``torch.distributed.tensor``: that import is half a second of every worker's start, and a run
with no FSDP or DCP has no use for it. No value is a DTensor before something (FSDP, DCP) has
imported the class, so until then every tensor is a plain one."""

from __future__ import annotations

import sys
from typing import Any

import torch


def is_dtensor(value: Any) -> bool:
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None) if module is not None else None
    return dtensor is not None and isinstance(value, dtensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``tensor`` (its shard of a DTensor; a plain tensor itself)."""
    return tensor._local_tensor if is_dtensor(tensor) else tensor  # type: ignore[attr-defined]  # no autograd


def is_fsdp_module(model: Any) -> bool:
    """Whether ``model`` was sharded by FSDP2's ``fully_shard``."""
    module = sys.modules.get("torch.distributed.fsdp")
    fsdp_module = getattr(module, "FSDPModule", None) if module is not None else None
    return fsdp_module is not None and isinstance(model, fsdp_module)
