"""The built-in loop's entry point on each Ray Train worker: the tabular form's ``BuiltinLoop``,
for ``data.columns`` the columns form's ``ColumnsLoop``, for a torch Dataset ``DatasetLoop``; an
exception out of either
becomes relaytrain's error for the step it was at. A loop of the user's own on relaytrain's API
(``train_loop_api: relaytrain``) runs here too (``own_loop``): it checkpoints alike."""

from __future__ import annotations

from typing import Any

from trainer_core.errors import RelaytrainError
from trainer_core.execution.worker_config import WorkerConfig
from trainer_core.spec.sections import is_dataset_function
from trainer_core.train.columns_loop import ColumnsLoop
from trainer_core.train.dataset_loop import DatasetLoop
from trainer_core.train.failure import wind_down, worker_error
from trainer_core.train.loop import BuiltinLoop
from trainer_core.train.own_loop import own_train_loop
from trainer_core.train.rank_output import rank_output


def builtin_train_loop(config: dict[str, Any]) -> None:
    """Ray Train ``train_loop_per_worker`` of the built-in loop."""
    worker_config = WorkerConfig.from_dict(config)
    if worker_config.spec.get("train_loop") is not None:  # train_loop_api: relaytrain
        own_train_loop(config)
        return
    loop = None
    try:
        loop = _loop_of(worker_config)
        with rank_output(loop.relay):  # what the model, loss or data code prints
            loop.run()
    except Exception as e:
        error = e if isinstance(e, RelaytrainError) else _as_worker_error(e, loop)
        if loop is not None:
            error = wind_down(error, loop.checkpoints, loop.relay)
        if error is e:
            raise
        raise error from e
    finally:
        if loop is not None:
            loop.close()


def _loop_of(config: WorkerConfig) -> BuiltinLoop:
    """The loop for the spec's form of data: a torch Dataset's, the columns form's, or the
    tabular form's."""
    data = config.spec.get("data") or {}
    if is_dataset_function(str(data.get("dataset"))):
        return DatasetLoop(config)
    if data.get("columns") is not None:
        return ColumnsLoop(config)
    return BuiltinLoop(config)


def _as_worker_error(error: BaseException, loop: BuiltinLoop | None) -> RelaytrainError:
    """What an exception out of training code means, at the step the loop was at."""
    step = (loop.current_step or None) if loop is not None else None
    rank = loop.rank if loop is not None else None
    return worker_error(error, where=f"at step {step}", step=step, rank=rank)
