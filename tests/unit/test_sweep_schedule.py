"""What a sweep runs next (trainer_core/sweep/schedule.py): a function of where its trials
stand, nothing else. Trials stand here as their run directories would say (``TrialRun``)."""

from __future__ import annotations

from typing import Any

from tests.unit.test_sweep_spec import raw
from trainer_core.sweep import pruning
from trainer_core.sweep.schedule import Leg, standing
from trainer_core.sweep.spec import Sweep, build_sweep
from trainer_core.sweep.trials import TrialRun

HALVING = {"successive_halving": {"reduction_factor": 2}}


def sweep(epochs: int = 3, **settings: Any) -> Sweep:
    spec = raw(**settings)
    spec["schedule"]["epochs"] = epochs
    return build_sweep(spec)


def runs(s: Sweep, reached: dict[int, dict[int, float]], **status: str) -> dict[int, TrialRun]:
    """Every trial of ``s``: those in ``reached`` paused (or completed at the last epoch) with
    those reports; ``status`` by ``t<n>`` over that (``failed``, ``completed``)."""
    found = {}
    for n in range(s.section.trials):
        reports = reached.get(n, {})
        epochs = max(reports, default=0)
        state = status.get(f"t{n}") or (
            None if not reports else "completed" if epochs >= s.epochs else "paused"
        )
        found[n] = TrialRun(n, s.trial_name(n), f"/runs/{n}", "val_loss", state, epochs, reports)
    return found


#: The metric after epoch 1 of six trials, and after epoch 2 of the best three.
AT_1 = {0: 0.5, 1: 0.1, 2: 0.9, 3: 0.3, 4: 0.7, 5: 0.2}
AT_2 = {1: 0.08, 3: 0.05, 5: 0.3}


def test_successive_halving_goes_rung_by_rung():
    s = sweep(pruner=HALVING)
    first = standing(s, runs(s, {}))
    assert first.legs == tuple(Leg(n, 1) for n in range(6)) and first.pruned == {}
    # half of them reported: the rung waits for the rest, whatever the order they came in
    half = standing(s, runs(s, {n: {1: AT_1[n]} for n in (4, 1, 0)}))
    assert half.legs == (Leg(2, 1), Leg(3, 1), Leg(5, 1)) and half.pruned == {}
    at_1 = {n: {1: v} for n, v in AT_1.items()}
    second = standing(s, runs(s, at_1))
    assert second.legs == (Leg(1, 2), Leg(3, 2), Leg(5, 2))
    assert second.pruned == {0: 1, 2: 1, 4: 1}
    at_2 = {n: ({1: AT_1[n], 2: AT_2[n]} if n in AT_2 else {1: AT_1[n]}) for n in AT_1}
    last = standing(s, runs(s, at_2))
    assert last.legs == (Leg(3, None),)
    assert last.pruned == {0: 1, 2: 1, 4: 1, 1: 2, 5: 2}
    at_2[3][3] = 0.04
    over = standing(s, runs(s, at_2))
    assert over.over and over.pruned == last.pruned
    assert over.values == first.values  # drawn by number, whatever stood


def test_a_failed_trial_is_out_and_the_rung_decided_without_it():
    """Trial 1 (the best at epoch 1 had it reported) failed every retry before: the rung
    compares the other five, and it gets no leg."""
    s = sweep(pruner=HALVING)
    at_1 = {n: {1: v} for n, v in AT_1.items() if n != 1}
    now = standing(s, runs(s, at_1, t1="failed"))
    assert now.legs == (Leg(3, 2), Leg(5, 2))  # the best 2 of 5 (halving keeps 5 // 2)
    assert 1 not in now.pruned and set(now.pruned) == {0, 2, 4}


def test_hyperband_runs_each_bracket_with_its_own_rungs():
    """Optuna's brackets (drawn from the sweep's name and the trial's number): a trial of
    bracket b first pauses at its own first rung, and rungs compare a bracket's trials alone."""
    s = sweep(epochs=9, pruner={"hyperband": {"reduction_factor": 3}}, trials=12)
    brackets = {n: pruning.bracket(s, n) for n in range(12)}
    assert len(set(brackets.values())) > 1
    first = standing(s, runs(s, {}))
    for leg in first.legs:
        rungs = pruning.rung_epochs(s, 9, brackets[leg.number])
        assert leg.until_epoch == (rungs[0] if rungs else None)
    # a bracket's trials compared among themselves: every other bracket's best score
    # cannot prune them
    own = max(set(brackets.values()), key=lambda b: sum(v == b for v in brackets.values()))
    members = [n for n in range(12) if brackets[n] == own]
    rung = pruning.rung_epochs(s, 9, own)[0]
    reports = {n: {rung: 1.0 + n} for n in members}
    reports |= {n: {rung: 0.0} for n in range(12) if brackets[n] != own}
    kept = {n for n in members if pruning.goes_on(s, n, rung, reports)}
    assert kept and min(members) in kept


def test_median_runs_batches_an_epoch_a_leg_and_measures_against_those_before():
    median = {"median": {"n_startup_trials": 2}}
    s = sweep(epochs=3, pruner=median, concurrent=2, trials=4, sampler="random")
    assert standing(s, runs(s, {})).legs == (Leg(0, 1), Leg(1, 1))
    assert standing(s, runs(s, {0: {1: 0.5}, 1: {1: 0.4}})).legs == (Leg(0, 2), Leg(1, 2))
    done = {0: {1: 0.5, 2: 0.4, 3: 0.3}, 1: {1: 0.4, 2: 0.3, 3: 0.2}}
    assert standing(s, runs(s, done)).legs == (Leg(2, 1), Leg(3, 1))
    # trial 2 worse after epoch 1 than the median of trials 0 and 1 then: pruned there
    worse = standing(s, runs(s, {**done, 2: {1: 0.9}, 3: {1: 0.1}}))
    assert worse.pruned == {2: 1} and worse.legs == (Leg(3, 2),)


def test_without_a_pruner_each_batch_trains_whole():
    s = sweep(trials=3, concurrent=2)
    assert standing(s, runs(s, {})).legs == (Leg(0, None), Leg(1, None))
    ended = {0: {3: 0.5}, 1: {3: 0.4}}
    assert standing(s, runs(s, ended)).legs == (Leg(2, None),)
    assert standing(s, runs(s, {**ended, 2: {3: 0.1}})).over
