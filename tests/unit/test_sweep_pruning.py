"""A sweep's pruning (trainer_core/sweep/pruning.py): Optuna's pruners asked at fixed points,
so what they decide does not depend on which trial reported first."""

from __future__ import annotations

import itertools

import optuna
import pytest

from tests.unit.test_sweep_spec import sweep
from trainer_core.errors import SpecError
from trainer_core.sweep.pruning import goes_on, rung_epochs, stops_at
from trainer_core.sweep.sampling import Finished

HALVING = {"successive_halving": {"reduction_factor": 2}}
#: The metric (val_loss) six trials reached after epoch 1.
AT_EPOCH_1 = {0: 0.5, 1: 0.1, 2: 0.9, 3: 0.3, 4: 0.7, 5: 0.2}


def test_a_trial_pauses_at_each_rung_before_its_last_epoch():
    assert rung_epochs(sweep(pruner=HALVING), 10) == (1, 2, 4, 8)
    assert rung_epochs(sweep(pruner=HALVING), 8) == (1, 2, 4)
    later = {"successive_halving": {"reduction_factor": 3, "min_resource": 2}}
    assert rung_epochs(sweep(pruner=later), 20) == (2, 6, 18)
    assert rung_epochs(sweep(), 10) == ()
    assert rung_epochs(sweep(pruner="median"), 10) == ()


def test_optunas_auto_first_rung_is_refused():
    with pytest.raises(SpecError, match="min_resource") as refused:
        sweep(pruner={"successive_halving": {"min_resource": "auto"}})
    assert refused.value.field == "sweep.pruner"


def test_a_rung_keeps_the_best_half_of_every_trial_that_reached_it():
    """Six trials at epoch 1, halving: the three best (lowest val_loss) go on, whichever
    reported first, as synchronous successive halving keeps them."""
    s = sweep(pruner=HALVING)
    reports = {n: {1: v} for n, v in AT_EPOCH_1.items()}
    on = {n for n in AT_EPOCH_1 if goes_on(s, n, 1, reports)}
    assert on == {1, 3, 5}
    for order in itertools.islice(itertools.permutations(AT_EPOCH_1), 0, 720, 97):
        shuffled = {n: {1: AT_EPOCH_1[n]} for n in order}
        assert {n for n in order if goes_on(s, n, 1, shuffled)} == on


def test_optunas_own_asynchronous_use_would_depend_on_the_order():
    """The pruner asked as each trial reports, the way Optuna's own loop asks it: trial 3
    goes on when it reports before the better trials, and is pruned when it reports after
    them. (What goes_on avoids.)"""

    def asked_in(order: list[int]) -> set[int]:
        study = optuna.create_study(pruner=sweep(pruner=HALVING).pruner())
        trials = {n: study.ask() for n in sorted(order)}
        on = set()
        for n in order:
            trials[n].report(AT_EPOCH_1[n], 1)
            if not trials[n].should_prune():
                on.add(n)
        return on

    assert 3 in asked_in([3, 0, 1, 2, 4, 5])
    assert 3 not in asked_in([1, 5, 0, 3, 2, 4])


def test_the_next_rung_compares_only_the_trials_promoted_to_it():
    s = sweep(pruner=HALVING)
    reports: dict[int, dict[int, float]] = {n: {1: v} for n, v in AT_EPOCH_1.items()}
    # the three promoted at epoch 1 report epoch 2; the pruned three stopped at epoch 1
    reports[1][2], reports[3][2], reports[5][2] = 0.08, 0.05, 0.30
    assert {n for n in (1, 3, 5) if goes_on(s, n, 2, reports)} == {3}
    with pytest.raises(ValueError, match="has not reported"):
        goes_on(s, 0, 2, reports)
    with pytest.raises(ValueError, match="no rung"):
        goes_on(s, 1, 3, reports)


def ended(number: int, curve: list[float]) -> Finished:
    return Finished(
        number,
        {"optimizer.lr": 0.01, "model.kwargs.channels": "[8, 16]", "data.batch_size": 64},
        "complete",
        value=curve[-1],
        intermediate={e + 1: v for e, v in enumerate(curve)},
    )


def test_the_median_stops_a_trial_against_the_batches_before_its_own():
    """Two at a time, median pruning after 2 ended trials: trial 4 (batch 4-5) is measured
    against trials 0-3, never against trial 5 beside it."""
    s = sweep(pruner={"median": {"n_startup_trials": 2}}, concurrent=2)
    before = [
        ended(0, [0.9, 0.8]),
        ended(1, [0.7, 0.6]),
        ended(2, [0.5, 0.4]),
        ended(3, [0.6, 0.5]),
    ]
    assert stops_at(s, 4, {1: 0.75}, before)  # worse than the median at epoch 1 (0.65)
    assert not stops_at(s, 4, {1: 0.55}, before)
    beside = [*before, ended(5, [0.01, 0.01]), ended(4, [0.01])]
    assert stops_at(s, 4, {1: 0.75}, beside) and not stops_at(s, 4, {1: 0.55}, beside)
    assert not stops_at(s, 1, {1: 5.0}, before)  # batch 0-1: nothing ended before it
    assert not stops_at(sweep(pruner=HALVING), 4, {1: 9.0}, before)
