"""What a training worker asks of Ray Train: where it stands in the group, its device, the
model's DDP wrapper or FSDP sharding, a drain's notice, and the reports and checkpoint of a
user's own loop.

The loops (``trainer_core.train.loop``, ``trainer_core.train.user_loop``) reach Ray through
this module only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import ray
import ray.train
import ray.train.torch
import torch


def rank_and_world_size() -> tuple[int, int]:
    """This worker's rank in the group, and the group's size."""
    context = ray.train.get_context()
    return context.get_world_rank(), context.get_world_size()


def node_rank() -> int:
    """The index of this worker's node among the group's nodes (workers on one node share it)."""
    return int(ray.train.get_context().get_node_rank())


def node_ip() -> str:
    """This worker's node, by its IP address (as the Ray dashboard names nodes)."""
    return str(ray.util.get_node_ip_address())


def device() -> torch.device:
    """Where this worker's model and batches live (its GPU with ``use_gpu``, else the CPU)."""
    return ray.train.torch.get_device()


def prepare_model(
    model: torch.nn.Module, ddp_kwargs: dict[str, Any] | None = None
) -> torch.nn.Module:
    """The model on its device, wrapped for DDP when the group has more than one worker;
    ``ddp_kwargs`` go to ``DistributedDataParallel`` (``find_unused_parameters``, ...)."""
    return ray.train.torch.prepare_model(model, parallel_strategy_kwargs=dict(ddp_kwargs or {}))


def shard_model(
    model: torch.nn.Module, shard_fn: Callable[[torch.nn.Module, Any], Any] | None = None
) -> torch.nn.Module:
    """FSDP2: the model on its device with its parameters sharded over the group
    (``fully_shard``), before its optimizer is made. ``shard_fn(model, mesh)`` shards it the
    user's way (``fully_shard`` on each block, with ``mesh``); without one, ``default_units``
    are. The model itself is always the root unit."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    target = device()
    model.to(target)
    _, world_size = rank_and_world_size()
    mesh = init_device_mesh(target.type, (world_size,))
    if shard_fn is not None:
        shard_fn(model, mesh)
    else:
        for module in default_units(model):
            fully_shard(module, mesh=mesh)
    if not isinstance(model, FSDPModule):
        fully_shard(model, mesh=mesh)
    return model


def default_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules FSDP shards as units of their own, the root aside.

    A transformer's blocks (torchtitan's rule: the items of a ``ModuleList`` or ``Sequential``
    of two or more modules of one class) when the model has them; else every module holding
    parameters of its own (a linear or convolution layer). A module that shares a parameter
    with another outside it (tied embedding and output weights) stays in its parent's unit,
    which a tied pair then shares."""
    blocks: list[torch.nn.Module] = []
    within: set[int] = set()  # modules inside a block already chosen: the outermost win
    for module in model.modules():
        if id(module) in within or not isinstance(
            module, torch.nn.ModuleList | torch.nn.Sequential
        ):
            continue
        alike = len(module) > 1 and len({type(c) for c in module}) == 1
        if alike and next(module.parameters(), None) is not None:
            blocks += list(module)
            within |= {id(m) for m in module.modules()}
    candidates = blocks or [
        m for m in model.modules() if m is not model and next(m.parameters(False), None) is not None
    ]
    owners: dict[int, set[int]] = {}
    for module in model.modules():
        for parameter in module.parameters(recurse=False):
            owners.setdefault(id(parameter), set()).add(id(module))
    units = []
    for unit in candidates:
        inside = {id(m) for m in unit.modules()}
        if all(owners[id(p)] <= inside for p in unit.parameters()):
            units.append(unit)
    return units


def ask(method: Any, *args: Any) -> Any:
    """Call an actor's method (``handle.method``) and wait for its answer."""
    return ray.get(method.remote(*args))


@dataclass(frozen=True)
class PreemptionNotice:
    """Ray Train's word that a node of this worker group drains for preemption."""

    #: When the node goes (Unix seconds), or None when its drain gave no deadline.
    deadline: float | None
    ranks: list[int]


def preemption_notice() -> PreemptionNotice | None:
    """The notice of a drain of one of the group's nodes, or None. A barrier of Ray Train's:
    every rank asks, the same number of times, and gets rank 0's answer."""
    info = ray.train.get_preemption_info()
    if info is None:
        return None
    deadline = info.deadline_ms / 1000 if info.deadline_ms else None
    return PreemptionNotice(deadline, list(info.preempted_ranks))


def latest_checkpoint_path() -> str | None:
    """Where Ray Train's newest registered checkpoint of the run is (a user's own loop)."""
    checkpoint = ray.train.get_checkpoint()
    return None if checkpoint is None else str(checkpoint.path)


@contextlib.contextmanager
def reports_through(make_hook: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[Any]:
    """``ray.train.report`` replaced, while the block runs, by ``make_hook(original)``; yields
    the hook. A user's loop imported inside the block gets it with ``from ray.train import
    report`` too."""
    with _replaced("report", make_hook) as hook:
        yield hook


@contextlib.contextmanager
def checkpoint_reads_through(read: Callable[[Any], None]) -> Iterator[None]:
    """``ray.train.get_checkpoint`` calling ``read(checkpoint)`` on what it returns, while the
    block runs (as ``from ray.train import get_checkpoint`` inside it too)."""

    def make_hook(original: Callable[..., Any]) -> Callable[..., Any]:
        def get_checkpoint(*args: Any, **kwargs: Any) -> Any:
            checkpoint = original(*args, **kwargs)
            read(checkpoint)
            return checkpoint

        return get_checkpoint

    with _replaced("get_checkpoint", make_hook):
        yield


@contextlib.contextmanager
def _replaced(name: str, make_hook: Callable[[Callable[..., Any]], Any]) -> Iterator[Any]:
    original = getattr(ray.train, name)
    hook = make_hook(original)
    setattr(ray.train, name, hook)
    try:
        yield hook
    finally:
        setattr(ray.train, name, original)
