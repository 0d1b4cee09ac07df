"""A user's own Ray loop's RNG states: saved with each checkpoint it reports, restored when it
reads that checkpoint back.

A loop written as Ray's checkpointing guide writes one saves its model, optimizer and epoch,
not its RNG: resumed, its dropout and shuffling draw other numbers than the uninterrupted run
would have, and the weights part ways. So at every report each rank captures its RNG states
(python, numpy, torch, CUDA's where initialized); the lowest rank that hands Ray a checkpoint
writes them all into it (``ray_checkpoints.RNG_FILE``); and when a resumed loop first calls
``ray.train.get_checkpoint()``, each rank restores its own. That is the point a typical loop
has built its model (from its seed) and goes on to train from: the restored states are the
ones the uninterrupted run had at that report. A resume that cannot be exact says why
(``RngResume.note``): a checkpoint without the states, another world size, a loop that
reported before it read its checkpoint.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from trainer_core.checkpoint.ray_checkpoints import RNG_FILE, add_file, read_added_file
from trainer_core.checkpoint.training_state import (
    capture_rng,
    from_bytes,
    restore_rng,
    rng_received,
    rng_to_send,
    to_bytes,
)
from trainer_core.errors import CheckpointCorruptError

logger = logging.getLogger("relaytrain.user_loop")

#: The version of what ``rng_payload`` writes.
RNG_SCHEMA = 1


def rng_payload(states: list[dict[str, Any]]) -> bytes:
    """What ``RNG_FILE`` holds: every rank's RNG states (``capture_rng``), by rank."""
    return to_bytes({"schema": RNG_SCHEMA, "world_size": len(states), "ranks": states})


@dataclass(frozen=True)
class RngResume:
    """What a rank restores from a checkpoint's RNG states, and whether that makes the resume
    exact (``note``: why not, in words for the log, the attempt record and ``show``)."""

    state: dict[str, Any] | None
    exact: bool
    note: str | None = None


def rng_to_resume(
    payload: dict[str, Any] | None, rank: int, world_size: int, checkpoint: str
) -> RngResume:
    """What rank ``rank`` of ``world_size`` restores from ``payload`` (``rng_payload``'s,
    read back from ``checkpoint``; None: it holds none)."""
    if payload is None or payload.get("schema") != RNG_SCHEMA:
        return RngResume(
            None,
            False,
            f"no RNG states ({RNG_FILE}) in checkpoint {checkpoint}: the resumed loop's "
            "dropout and shuffling draw other numbers than an uninterrupted run's, so its "
            "weights differ from one (save torch.get_rng_state() with the checkpoint)",
        )
    saved = int(payload["world_size"])
    state = payload["ranks"][rank] if rank < saved else None
    if saved != world_size:
        return RngResume(
            state,
            False,
            f"RNG states of {saved} ranks, resumed on {world_size} (checkpoint {checkpoint}): "
            "not the numbers an uninterrupted run would draw",
        )
    return RngResume(state, True)


NOT_READ = (
    "the loop reported before it called ray.train.get_checkpoint(): relaytrain restores each "
    "rank's RNG states there, so they were not restored and the resume is not exact"
)


def gather_states(has_checkpoint: bool) -> tuple[list[dict[str, Any]], int | None]:
    """Every rank's RNG states now, and the lowest rank with a checkpoint to write them into
    (None: no rank has one). A collective of the group's when it has more than one rank: each
    rank calls it at each report (Ray's report is a barrier of the group's too)."""
    state = capture_rng()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state], (0 if has_checkpoint else None)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (has_checkpoint, rng_to_send(state)))
    writer = next((rank for rank, (has, _) in enumerate(gathered) if has), None)
    return [rng_received(sent) for _, sent in gathered], writer


class LoopRng:
    """One rank's side of it, for ``user_loop.ReportHook``. ``tell(exact, note)``: what rank 0
    says to the driver of a resume's RNG."""

    def __init__(self, rank: int, world_size: int, tell: Callable[[bool, str | None], None]):
        self.rank = rank
        self.world_size = world_size
        self.tell = tell
        #: The checkpoint a resumed worker group starts from (None: a fresh start), until
        #: the loop reads it.
        self.resumed_from: str | None = None
        #: Whether the loop runs yet (relaytrain's own reads of the checkpoint restore nothing).
        self.armed = False

    def save(self, checkpoint: Any) -> bool:
        """At a report (``checkpoint``: the one this rank hands Ray, or None): every rank's
        states into the checkpoint of the lowest rank that has one. Whether this rank is that
        one (it writes the rest of what relaytrain adds, once)."""
        if self.resumed_from is not None:  # reported before the loop read its checkpoint
            self._told(False, NOT_READ)
        states, writer = gather_states(checkpoint is not None)
        if writer != self.rank:
            return False
        add_file(checkpoint, RNG_FILE, rng_payload(states), "a resume from it is not exact")
        return True

    def restore(self, checkpoint: Any) -> None:
        """The loop read ``checkpoint`` (``ray.train.get_checkpoint()``): its first read of
        a resumed group's restores this rank's RNG states."""
        if not self.armed or self.resumed_from is None or checkpoint is None:
            return
        resume = rng_to_resume(
            _read_payload(checkpoint), self.rank, self.world_size, self.resumed_from
        )
        if resume.state is not None:
            restore_rng(resume.state)
        self._told(resume.exact, resume.note)

    def _told(self, exact: bool, note: str | None) -> None:
        self.resumed_from = None
        if note is not None and self.rank == 0:
            logger.warning("resume not exact: %s", note)
        self.tell(exact, note)


def _read_payload(checkpoint: Any) -> dict[str, Any] | None:
    """``RNG_FILE`` of a Ray checkpoint, or None when it has none (or not a readable one)."""
    try:
        payload = from_bytes(read_added_file(checkpoint, RNG_FILE))
    except (OSError, CheckpointCorruptError, RuntimeError) as e:
        logger.debug("no RNG states in %s: %s", checkpoint.path, e)
        return None
    return payload if isinstance(payload, dict) else None
