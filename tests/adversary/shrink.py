"""The smallest history that still breaks a guarantee: a failing scenario's actions (all but the
first run) and faults taken away one at a time, each smaller scenario played again, kept while
it still fails the same invariant (as QuickCheck and Hypothesis shrink, here greedily)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

from tests.adversary.scenario import Scenario


def smaller(scenario: Scenario) -> Iterator[Scenario]:
    """Each scenario one step smaller: an action dropped (never the first run), or an action's
    fault dropped."""
    history = scenario.history
    for index in range(len(history) - 1, 0, -1):
        yield dataclasses.replace(scenario, history=history[:index] + history[index + 1 :])
    for index, action in enumerate(history):
        if action.fault is not None:
            plain = dataclasses.replace(action, fault=None)
            yield dataclasses.replace(
                scenario, history=(*history[:index], plain, *history[index + 1 :])
            )


def shrink(
    scenario: Scenario, fails: Callable[[Scenario], bool], budget: int = 12
) -> tuple[Scenario, int]:
    """The smallest scenario reached from ``scenario`` that ``fails`` (at most ``budget``
    scenarios played), and how many were played."""
    played = 0
    current = scenario
    progress = True
    while progress and played < budget:
        progress = False
        for candidate in smaller(current):
            if played >= budget:
                break
            played += 1
            if fails(candidate):
                current, progress = candidate, True
                break
    return current, played
