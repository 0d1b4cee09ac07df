"""What an exception out of a training worker means, and how a failing worker winds down.

``worker_error`` tells a lost peer (``is_peer_failure``, ``execution.classify``'s rule: the
driver's too) from the code's own error; ``wind_down`` lets the checkpoint in flight finish and
tells the driver where the worker got before the error ends it."""

from __future__ import annotations

import logging
import traceback

from trainer_core.checkpoint.manager import CheckpointManager
from trainer_core.errors import InfrastructureError, RelaytrainError, TrainingCodeError
from trainer_core.execution.classify import is_peer_failure as is_peer_failure  # the driver's too
from trainer_core.execution.worker_group import Relay

logger = logging.getLogger("relaytrain.worker")


def worker_error(
    error: BaseException, *, where: str, step: int | None, rank: int | None
) -> TrainingCodeError | InfrastructureError:
    """What an exception out of training code means: a collective that lost its peer is the
    infrastructure's (``where``: the step or report it was at, in words); anything else is the
    code's, with its type, step, rank and traceback."""
    if is_peer_failure(error):
        return InfrastructureError(
            f"rank {rank} lost a peer during a collective {where}: {type(error).__name__}: {error}",
            step=step,
        )
    return TrainingCodeError(
        f"{type(error).__name__}: {error}",
        error_type=type(error).__name__,
        step=step,
        rank=rank,
        traceback="".join(traceback.format_exception(error)),
    )


#: How long a failing worker lets its checkpoint in flight finish before it exits.
SETTLE_S = 60.0


def wind_down(
    error: RelaytrainError,
    checkpoints: CheckpointManager,
    relay: Relay,
) -> RelaytrainError:
    """Before an error ends the worker: finish the checkpoint in flight (``checkpoints.settle``:
    what it commits is work not lost), then push the buffered metric rows and the last step
    this rank completed (``relay.completed``), for its group (``relay.joined``). Returns the
    error to raise: the checkpoint's own, when it is the training code failing at an earlier
    step (the weights a checkpoint was refused for went bad before the loss did)."""
    earlier = checkpoints.settle(SETTLE_S)
    try:
        relay.flush()
        relay.tell_last_step(relay.completed_step, relay.group)  # rank 0's rows may lag it
    except Exception:  # the relay is best effort; the error being raised matters more
        logger.debug("relay flush failed", exc_info=True)
    if (
        isinstance(earlier, TrainingCodeError)
        and isinstance(error, TrainingCodeError)
        and (earlier.step or 0) < (error.step or 0)
    ):
        return earlier
    return error
