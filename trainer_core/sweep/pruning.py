"""Which trials go on: Optuna's pruners, asked at points a trial's number fixes, so that what
they decide does not depend on which trial reported first.

Optuna's successive halving is asynchronous: a trial reaching a rung is compared with the
trials that happened to reach it before, so a sweep run 2 at a time, or stopped and run again,
prunes other trials. Here a trial pauses at each of its rungs (a validation epoch, its
checkpoint committed) and the rung is decided once every trial of the sweep that reached it has
reported it: each trial is put to the pruner on a study in which all the others have
(``goes_on``). That is synchronous successive halving, decided by Optuna's own rule.

The median pruner compares a trial with trials that ended; here with those of the batches
before its own (``sampling.batch_start``), which have all ended when it starts, so it needs no
pause (``stops_at``).

The metric's values are reported by epoch (the validation after epoch ``e`` is step ``e``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import optuna
from optuna.distributions import FloatDistribution
from optuna.trial import TrialState, create_trial

from trainer_core.sweep.sampling import Finished, as_trial, batch_start
from trainer_core.sweep.spec import Sweep

#: What a trial reported: trial number -> epoch -> the metric after that epoch's validation.
Reports = Mapping[int, Mapping[int, float]]
#: The key under which Optuna's successive halving records a trial's value at rung ``r``
#: (optuna/pruners/_successive_halving.py, _completed_rung_key; Optuna is pinned below 6).
_RUNG_KEY = "completed_rung_{}"
#: The study's one parameter: the pruners read none, but a trial must hold what it sampled.
_NUMBER = {"trial": FloatDistribution(0, 1e9)}


def halvings(sweep: Sweep) -> list[optuna.pruners.SuccessiveHalvingPruner]:
    """The sweep's successive halvings: one for ``successive_halving``, one per bracket for
    ``hyperband`` (Optuna's own brackets, over the sweep's epochs), none for other pruners."""
    pruner = sweep.pruner()
    if isinstance(pruner, optuna.pruners.SuccessiveHalvingPruner):
        return [pruner]
    if isinstance(pruner, optuna.pruners.HyperbandPruner):
        pruner._try_initialization(_study(sweep, pruner))  # its brackets, max_resource given
        return list(pruner._pruners)
    return []


def bracket(sweep: Sweep, number: int) -> int:
    """Trial ``number``'s hyperband bracket, as Optuna draws it (a hash of the study's name,
    the sweep's, and the number); 0 for successive halving."""
    pruner = sweep.pruner()
    if not isinstance(pruner, optuna.pruners.HyperbandPruner):
        return 0
    study = _study(sweep, pruner)
    pruner._try_initialization(study)
    trial = create_trial(state=TrialState.RUNNING, params={}, distributions={})
    trial.number = number
    return int(pruner._get_bracket_id(study, trial))


def rung_epochs(sweep: Sweep, epochs: int, bracket: int = 0) -> tuple[int, ...]:
    """The epochs before ``epochs`` (the run's last) at which a trial of ``bracket`` pauses for
    its rung to be decided: ``min_resource * reduction_factor ** (min_early_stopping_rate +
    r)``, the bracket's own rate for hyperband."""
    found = halvings(sweep)
    if not found:
        return ()
    halving = found[bracket]
    low = halving._min_resource
    factor = halving._reduction_factor
    rate = halving._min_early_stopping_rate
    rungs = []
    rung = 0
    while (epoch := low * factor ** (rate + rung)) < epochs:
        rungs.append(epoch)
        rung += 1
    return tuple(rungs)


def goes_on(sweep: Sweep, number: int, epoch: int, reports: Reports) -> bool:
    """Whether trial ``number``, paused at its rung ``epoch``, trains on: its bracket's
    successive halving asked on a study in which every other trial of the bracket that reached
    ``epoch`` has reported it."""
    own = bracket(sweep, number)
    rungs = rung_epochs(sweep, epoch + 1, own)
    if epoch not in rungs:
        raise ValueError(f"epoch {epoch} is no rung of this sweep (its rungs: {rungs})")
    if epoch not in reports.get(number, {}):
        raise ValueError(f"trial {number} has not reported epoch {epoch}")
    rung = rungs.index(epoch)
    halving = halvings(sweep)[own]
    study = _study(sweep, halving)
    index = 0
    for n in sorted(reports):
        if bracket(sweep, n) != own:
            continue
        if n == number:
            index = len(study.trials)
        reported = {e: v for e, v in reports[n].items() if e <= epoch}
        # the others' every rung so far; this trial's rungs before this one
        decided = rungs[: rung + (0 if n == number else 1)]
        study.add_trial(
            create_trial(
                state=TrialState.RUNNING,
                params={"trial": float(n)},
                distributions=dict(_NUMBER),
                intermediate_values=reported,
                system_attrs={
                    _RUNG_KEY.format(i): reported[e] for i, e in enumerate(decided) if e in reported
                },
            )
        )
    return not halving.prune(study, study.trials[index])


def _study(sweep: Sweep, pruner: optuna.pruners.BasePruner) -> optuna.Study:
    return optuna.create_study(study_name=sweep.name, direction=sweep.direction, pruner=pruner)


def stops_at(
    sweep: Sweep, number: int, reported: Mapping[int, float], finished: Sequence[Finished]
) -> bool:
    """Whether the median pruner stops trial ``number`` after the last epoch of ``reported``,
    measured against the trials of the batches before its own (as they ended)."""
    pruner = sweep.pruner()
    if not isinstance(pruner, optuna.pruners.MedianPruner) or not reported:
        return False
    study = _study(sweep, pruner)
    distributions = {d.key: d.distribution for d in sweep.dimensions}
    for f in sorted(finished, key=lambda f: f.number):
        if f.number < batch_start(sweep, number) and f.state in ("complete", "pruned"):
            study.add_trial(as_trial(f, distributions))
    study.add_trial(
        create_trial(
            state=TrialState.RUNNING,
            params={"trial": float(number)},
            distributions=dict(_NUMBER),
            intermediate_values=dict(reported),
        )
    )
    return bool(pruner.prune(study, study.trials[-1]))
