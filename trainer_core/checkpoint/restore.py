"""Restoring a checkpoint into the built-in loop's live objects (``Restorer``): the newest
checkpoint every rank can read and verify, of either format, into either strategy.

What every rank restores alike (rank 0's model and optimizer, the schedule, fp16's scaler) is
read once per node, by the node's first rank, and handed to the node's other ranks; what is a
rank's own (its RNG state) it reads itself. A DCP checkpoint's files are read once per node
too, each by one of the ranks that need a part of it. A DDP checkpoint's whole tensors are
sharded as they load under FSDP; a DCP one is gathered whole for DDP. A warm start
(``load_weights``) takes only another run's model weights.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from trainer_core.checkpoint import training_state, verification
from trainer_core.checkpoint.exports import is_dcp, read_model_weights
from trainer_core.checkpoint.files import CheckpointInfo, file_names
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import CheckpointCorruptError
from trainer_core.execution.worker_group import all_ok

logger = logging.getLogger("relaytrain.worker")


#: State keys every rank restores alike: read once per node (``model`` and ``optimizer`` only
#: when one rank saved them).
REPLICATED = ("model", "optimizer", "scheduler", "scaler")


@dataclass
class Loaded:
    """What ``load`` restored: the checkpoint (its manifest has the cursor, metrics and early
    stopping), and the newer ones it skipped, with why."""

    checkpoint: CheckpointInfo | None
    skipped: list[dict[str, Any]] = field(default_factory=list)
    #: Bytes this rank read from storage, and the seconds the load took.
    bytes_read: int = 0
    seconds: float = 0.0


@dataclass
class TrainingState:
    """What a checkpoint saves and restores, by reference (the loop's live objects)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    #: fp16's gradient scaler (None otherwise).
    scaler: Any = None


class Restorer:
    """Loads one rank's checkpoints into ``state``."""

    def __init__(
        self,
        run_dir: RunDirectory,
        state: TrainingState,
        *,
        rank: int,
        world_size: int,
        dcp: bool,
        node_rank: int | None,
    ):
        self.run_dir = run_dir
        self.state = state
        self.rank = rank
        self.world_size = world_size
        #: Model and optimizer as DCP (``scaling.strategy: fsdp``: the model is sharded).
        self.dcp = dcp
        #: This worker's node among the group's (None: unknown, so every rank reads alone).
        self.node_rank = node_rank
        #: Bytes this rank read from storage in its last ``load``.
        self.bytes_read = 0
        #: This node's group and its first rank, once made (empty: this rank reads alone).
        self._node: tuple[Any, ...] | None = None

    def load(self, candidates: list[int]) -> Loaded:
        """Restore the newest of ``candidates`` (committed steps, newest first) that every rank
        can read and verify; ``Loaded.checkpoint`` is None when none could be.

        What every rank restores alike (rank 0's model and optimizer, the schedule) is read once
        per node, by the node's first rank, and handed to the node's other ranks; what is a
        rank's own (its RNG state) it reads itself. A DCP checkpoint's files are read once per
        node too, each by one of the ranks that need a part of it, for the others."""
        started = time.perf_counter()
        skipped: list[dict[str, Any]] = []
        self.bytes_read = 0
        node = self._node_group()
        for step in candidates:
            states: dict[str, Any] | None = None
            checkpoint = None
            data: dict[str, bytes] = {}
            shared: dict[str, str] = {}
            error: BaseException | None = None
            try:
                checkpoint = self.run_dir.read_committed(step)
                if checkpoint is None:
                    raise CheckpointCorruptError(f"checkpoint at step {step} is not committed")
                names = self._files_to_read(checkpoint)
                shared = _replicated(checkpoint, names)
                mine = {k: v for k, v in names.items() if k not in shared}
                if node is None or node[1] == self.rank:
                    mine.update(shared)
                data = {key: self._read(checkpoint, name) for key, name in mine.items()}
            except (CheckpointCorruptError, FileNotFoundError, RuntimeError, ValueError) as e:
                error = e
            if node is not None:  # every rank of the node, whatever its own read did
                data, error = self._share_on_node(node, data, error, shared)
            try:
                if error is not None:
                    raise error
                states = {key: training_state.from_bytes(value) for key, value in data.items()}
            except (CheckpointCorruptError, FileNotFoundError, RuntimeError, ValueError) as e:
                logger.warning("rank %d cannot use checkpoint %d: %s", self.rank, step, e)
                skipped.append({"step": step, "reason": str(e)})
                states = None
                if isinstance(e, CheckpointCorruptError) and checkpoint is not None:
                    self._condemn(checkpoint, e)
            if not all_ok(states is not None):
                if states is not None:
                    skipped.append({"step": step, "reason": "another rank could not verify it"})
                continue
            assert states is not None and checkpoint is not None
            if is_dcp(checkpoint):
                try:  # a collective: every rank reads its share, and fails with the others
                    states["dcp"] = self._load_dcp(checkpoint)
                except CheckpointCorruptError as e:
                    logger.warning("rank %d cannot use checkpoint %d: %s", self.rank, step, e)
                    skipped.append({"step": step, "reason": str(e)})
                    self._condemn(checkpoint, e)
                    continue
            self._apply(states)
            seconds = time.perf_counter() - started
            return Loaded(checkpoint, skipped, self.bytes_read, seconds)
        return Loaded(None, skipped, self.bytes_read, time.perf_counter() - started)

    def _condemn(self, checkpoint: CheckpointInfo, error: CheckpointCorruptError) -> None:
        """Keep what this rank found beside the checkpoint (each rank that found it writes the
        verdict whole, atomically): retention and the result no longer count it
        (``verification``)."""
        verification.condemn(self.run_dir.checkpoint_location(checkpoint.step), str(error))

    def _read(self, checkpoint: CheckpointInfo, name: str) -> bytes:
        data = self.run_dir.read_verified(checkpoint, name)
        self.bytes_read += len(data)
        return data

    def _node_group(self) -> tuple[Any, int] | None:
        """This node's ranks as a process group of their own, and its first rank (the one that
        reads for the others); None when this rank is alone on its node, or nodes are unknown.
        A collective (every rank makes every node's group)."""
        if self.node_rank is None or self.world_size == 1:
            return None
        if self._node is not None:
            return self._node or None
        nodes: list[Any] = [None] * self.world_size
        dist.all_gather_object(nodes, self.node_rank)
        ranks = [[r for r, n in enumerate(nodes) if n == node] for node in sorted(set(nodes))]
        self._node = ()
        if any(len(group) > 1 for group in ranks):
            group, _ = dist.new_subgroups_by_enumeration(ranks, backend="gloo")
            own = next(group for group in ranks if self.rank in group)
            if len(own) > 1:
                self._node = (group, own[0])
        return self._node or None

    def _share_on_node(
        self,
        node: tuple[Any, int],
        data: dict[str, bytes],
        error: BaseException | None,
        shared: dict[str, str],
    ) -> tuple[dict[str, bytes], BaseException | None]:
        """The node's first rank hands what it read of ``shared`` (or why it could not) to the
        node's other ranks."""
        group, first = node
        if self.rank == first:
            said = {"error": str(error)} if error else {k: data[k] for k in shared}
            dist.broadcast_object_list([said], src=first, group=group)
            return data, error
        got: list[Any] = [None]
        dist.broadcast_object_list(got, src=first, group=group)
        if error is not None:
            return data, error
        if "error" in got[0]:
            return data, CheckpointCorruptError(
                f"rank {first} read for this node: {got[0]['error']}"
            )
        return {**data, **got[0]}, None

    def load_weights(self, checkpoint_uri: str) -> None:
        """A warm start: the model's weights of another run's checkpoint (whole tensors, of
        either format; under FSDP each rank keeps its own shard of them)."""
        weights: dict[str, Any] = dict(read_model_weights(checkpoint_uri))
        if self.dcp:
            api = _state_dict_api()
            options = api.StateDictOptions(full_state_dict=True)
            api.set_model_state_dict(self.state.model, weights, options=options)
        else:
            self.state.model.load_state_dict(weights)

    def _files_to_read(self, checkpoint: CheckpointInfo) -> dict[str, str]:
        """This rank's files of ``checkpoint``: the model and optimizer (its own shard of a
        sharded one), the schedule, fp16's scaler if saved, and its RNG state when the world
        size is the same (at another size the ranks are not the same processes). A DCP
        checkpoint's model and optimizer are read by ``_load_dcp``."""
        names = file_names(checkpoint.manifest.get("sharded", False), self.rank)
        keys = ("scheduler",) if is_dcp(checkpoint) else ("model", "optimizer", "scheduler")
        wanted = {key: names[key] for key in keys}
        if self.state.scaler is not None and names["scaler"] in checkpoint.files:
            wanted["scaler"] = names["scaler"]  # else a new scaler: a checkpoint of fp32 or bf16
        if checkpoint.manifest.get("world_size") == self.world_size:
            wanted["rng"] = names["rng"]
        return wanted

    def _load_dcp(self, checkpoint: CheckpointInfo) -> dict[str, Any]:
        """Model and optimizer of a DCP checkpoint, laid out as this group holds them (its own
        shards under FSDP, whole tensors under DDP), read into new tensors: a load that fails
        part-way leaves the live ones as they were."""
        from trainer_core.checkpoint import dcp_storage

        optimizer = self.state.optimizer
        fresh = not optimizer.state
        model_state, optimizer_state = _state_dict_api().get_state_dict(self.state.model, optimizer)
        if fresh:
            # get_state_dict made the state it lays out by a step of zero gradients at lr 0 (Adam's
            # step count 1): keep its layout, not the state, so that if no checkpoint loads,
            # training starts from the optimizer as it was built (set_state_dict makes it again)
            optimizer.state.clear()
        target = {"model": _empty_like(model_state), "optimizer": _empty_like(optimizer_state)}
        location = self.run_dir.checkpoint_location(checkpoint.step)
        node = self._node_group()
        self.bytes_read += dcp_storage.load(target, location, checkpoint.files, node)
        return target

    def _apply(self, states: dict[str, Any]) -> None:
        model, optimizer = self.state.model, self.state.optimizer
        if "dcp" in states:
            _state_dict_api().set_state_dict(
                model,
                optimizer,
                model_state_dict=states["dcp"]["model"],
                optim_state_dict=states["dcp"]["optimizer"],
            )
        elif self.dcp:  # a DDP checkpoint's whole tensors, sharded as they load
            api = _state_dict_api()
            api.set_state_dict(
                model,
                optimizer,
                model_state_dict=states["model"],
                optim_state_dict=_optimizer_by_name(states["optimizer"], model),
                options=api.StateDictOptions(full_state_dict=True),
            )
        else:
            model.load_state_dict(states["model"])
            optimizer.load_state_dict(states["optimizer"])
        self.state.scheduler.load_state_dict(states["scheduler"])
        if "scaler" in states and self.state.scaler is not None:
            self.state.scaler.load_state_dict(states["scaler"])
        if "rng" in states:
            training_state.restore_rng(states["rng"])


def _state_dict_api() -> Any:
    """torch's DCP state-dict functions: imported by the runs that use DCP only (what
    ``trainer_core.tensors`` says of DTensor)."""
    import torch.distributed.checkpoint.state_dict as api

    return api


def _replicated(checkpoint: CheckpointInfo, names: dict[str, str]) -> dict[str, str]:
    """Of ``names`` (state key: file), the files every rank restores alike."""
    own = ("model", "optimizer") if checkpoint.manifest.get("sharded") else ()
    return {k: v for k, v in names.items() if k in REPLICATED and k not in own}


def _empty_like(value: Any) -> Any:
    """``value`` (nested dicts and lists of tensors) with new, uninitialized tensors of the same
    shapes and layouts (a DTensor's sharding included); other values as they are."""
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value)
    if isinstance(value, dict):
        return {k: _empty_like(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_empty_like(v) for v in value]
    return value


def _optimizer_by_name(state: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """A ``torch.optim`` state dict (parameters by position) keyed by parameter name, as
    ``set_state_dict`` takes it. The built-in loop's optimizer holds the model's parameters in
    ``parameters()`` order, which FSDP keeps."""
    names = [name for name, _ in model.named_parameters()]
    return {
        "state": {names[index]: value for index, value in state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in state["param_groups"]
        ],
    }
