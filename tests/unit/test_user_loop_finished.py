"""When a completed run of a user's own loop is finished: for the train_loop_config it completed
with (tasks.setup.is_finished), as its summary records it."""

from __future__ import annotations

from typing import Any

import pytest

from tasks.setup import check_until_epoch, is_finished
from trainer_core.errors import SpecError
from trainer_core.run.summary import TrainingResult
from trainer_core.spec.overrides import build_spec


def own_loop(config: dict[str, Any]) -> Any:
    return build_spec(
        {
            "scaling": {"num_workers": 2},
            "train_loop": "examples.ray_train_loop:train_func",
            "train_loop_config": config,
        }
    )


def stored(status: str = "completed", config: dict[str, Any] | None = None) -> TrainingResult:
    return TrainingResult(
        run_name="r",
        storage_uri="/s",
        run_uri="/s/r",
        status=status,  # type: ignore[arg-type]
        attempts=[],
        steps_completed=4,
        epochs_completed=4,
        final_metrics={},
        best_metrics={},
        best_checkpoint_uri=None,
        latest_checkpoint_uri=None,
        wall_time_s=1.0,
        storage_bytes=0,
        train_loop_config=config,
    )


def test_the_same_config_is_finished_another_is_not():
    config = {"num_epochs": 4, "lr": 0.01}
    assert is_finished(own_loop(config), stored(config=config))
    assert not is_finished(own_loop({**config, "num_epochs": 6}), stored(config=config))
    assert not is_finished(own_loop({"num_epochs": 4}), stored(config=config))


def test_a_failed_run_is_never_finished_and_an_old_summary_stays_finished():
    config = {"num_epochs": 4}
    assert not is_finished(own_loop(config), stored("failed", config))
    assert not is_finished(own_loop(config), None)
    assert is_finished(own_loop({"num_epochs": 6}), stored(config=None))  # before configs


#: The rest of a built-in loop's spec.
BUILT_IN = {
    "scaling": {"num_workers": 1},
    "model": {"name": "mlp"},
    "data": {"dataset": "synthetic"},
    "schedule": {"epochs": 10},
}


@pytest.mark.parametrize("status", ["paused", "pruned"])
def test_a_paused_run_is_finished_only_for_a_call_that_pauses_it_there_or_before(status):
    """Paused after epoch 4 (``until_epoch``), or pruned there by a sweep: a call for epoch 4
    or an earlier one returns it; a later epoch, or the run's end, trains on."""
    spec = build_spec({"run": {"name": "r"}, **BUILT_IN})
    paused = stored(status)
    assert is_finished(spec, paused, until_epoch=4) and is_finished(spec, paused, until_epoch=2)
    assert not is_finished(spec, paused, until_epoch=5)
    assert not is_finished(spec, paused)


def test_a_loop_of_ones_own_cannot_be_paused_and_epochs_count_from_1():
    with pytest.raises(SpecError, match="cannot be paused") as refused:
        check_until_epoch(own_loop({"num_epochs": 4}), 2)
    assert refused.value.field == "until_epoch"
    with pytest.raises(SpecError, match="count from 1"):
        check_until_epoch(build_spec({"run": {"name": "r"}, **BUILT_IN}), 0)
    check_until_epoch(build_spec({"run": {"name": "r"}, **BUILT_IN}), 1)
