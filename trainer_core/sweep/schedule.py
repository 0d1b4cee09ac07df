"""What a sweep runs next, decided from where its trials stand (``trials.TrialRun``) and
nothing else: no clock, no order of arrival, no memory of the process that ran it before. A
sweep stopped at any point and run again asks ``standing`` and goes on from the same place.

The sweep runs in waves of legs. A leg trains one trial to an epoch (``until_epoch``; None:
to its end), resuming it from its newest checkpoint. A wave's legs may run in any order and
any number at once; the next wave is decided once all of them have ended:

- successive halving and hyperband: every trial of a bracket trains to the bracket's first
  rung; the rung is decided (``pruning.goes_on``); the promoted train to the next rung, and so
  on; those promoted past the last rung train to the end.
- median and no pruner: trials run in batches of ``concurrent``; a batch starts once every
  trial before it has ended (so TPE and the median learn from those). With the median a
  trial trains an epoch a leg and is measured after each (``pruning.stops_at``).

A trial whose run failed every retry is out of the sweep (``failed``); the others go on.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from trainer_core.sweep import pruning, sampling
from trainer_core.sweep.spec import Sweep
from trainer_core.sweep.trials import TrialRun


@dataclass(frozen=True)
class Leg:
    """Train trial ``number`` to the end of ``until_epoch`` (None: its last epoch)."""

    number: int
    until_epoch: int | None


@dataclass(frozen=True)
class Standing:
    """Where the sweep stands: the next wave (empty once the sweep is over), each trial's
    values (for the trials drawn so far), and the trials pruned (number -> epoch)."""

    legs: tuple[Leg, ...]
    values: Mapping[int, Mapping[str, Any]]
    pruned: Mapping[int, int] = field(default_factory=dict)

    @property
    def over(self) -> bool:
        return not self.legs


def standing(sweep: Sweep, runs: Mapping[int, TrialRun]) -> Standing:
    """The next wave of ``sweep``, its trials' runs as ``runs`` (every number) has them."""
    if pruning.halvings(sweep):
        return _halving(sweep, runs)
    return _batches(sweep, runs)


def _halving(sweep: Sweep, runs: Mapping[int, TrialRun]) -> Standing:
    """Synchronous successive halving, bracket by bracket in step: each rung decided once
    every trial of its bracket that is still in has reported it."""
    values = {n: sampling.trial_values(sweep, n) for n in runs}
    brackets = {n: pruning.bracket(sweep, n) for n in runs}
    reports = {n: dict(run.reports) for n, run in runs.items()}
    pruned: dict[int, int] = {}
    legs: list[Leg] = []
    for own in sorted(set(brackets.values())):
        members = [n for n in sorted(runs) if brackets[n] == own]
        for epoch in pruning.rung_epochs(sweep, sweep.epochs, own):
            members = [n for n in members if not runs[n].ended]
            behind = [n for n in members if epoch not in reports[n]]
            if behind:
                legs.extend(Leg(n, epoch) for n in behind)
                members = []
                break
            cut = {n for n in members if not pruning.goes_on(sweep, n, epoch, reports)}
            pruned.update((n, epoch) for n in cut)
            members = [n for n in members if n not in cut]
        legs.extend(Leg(n, None) for n in members if not runs[n].ended)
    return Standing(tuple(sorted(legs, key=lambda leg: leg.number)), values, pruned)


def _batches(sweep: Sweep, runs: Mapping[int, TrialRun]) -> Standing:
    """Batches of ``concurrent`` trials in number order; with the median, an epoch a leg."""
    size = sweep.section.concurrent or 1
    median = sweep.pruner_name() == "median"
    values: dict[int, Mapping[str, Any]] = {}
    pruned: dict[int, int] = {}
    finished: list[sampling.Finished] = []
    for start in range(0, len(runs), size):
        batch = range(start, min(start + size, len(runs)))
        legs = []
        for n in batch:
            values[n] = sampling.trial_values(sweep, n, finished)
            run = runs[n]
            if median and (at := _median_cut(sweep, run, finished)) is not None:
                pruned[n] = at
            elif not run.ended:
                pause = median and run.epochs + 1 < sweep.epochs  # measured after each epoch
                legs.append(Leg(n, run.epochs + 1 if pause else None))
        if legs:
            return Standing(tuple(legs), values, pruned)
        finished.extend(ended(sweep, runs[n], values[n], pruned.get(n)) for n in batch)
    return Standing((), values, pruned)


def _median_cut(sweep: Sweep, run: TrialRun, finished: list[sampling.Finished]) -> int | None:
    """The first committed epoch after which the median pruner stops ``run`` (None: none)."""
    if run.ended:
        return None
    for epoch in sorted(run.reports):
        reported = {e: v for e, v in run.reports.items() if e <= epoch}
        if pruning.stops_at(sweep, run.number, reported, finished):
            return epoch
    return None


def ended(
    sweep: Sweep, run: TrialRun, values: Mapping[str, Any], pruned_at: int | None
) -> sampling.Finished:
    """An ended trial as TPE and the median learn from it."""
    dimensions = {d.key: d for d in sweep.dimensions}
    stored = {key: dimensions[key].stored(value) for key, value in values.items()}
    if pruned_at is not None:
        reports = {e: v for e, v in run.reports.items() if e <= pruned_at}
        return sampling.Finished(run.number, stored, "pruned", None, reports)
    if run.status == "completed" and run.last_value is not None:
        return sampling.Finished(run.number, stored, "complete", run.last_value, run.reports)
    return sampling.Finished(run.number, stored, "failed", None, run.reports)
