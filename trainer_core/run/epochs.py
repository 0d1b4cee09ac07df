"""How epochs are numbered to a person: from 1, everywhere one is shown (the train task's log,
the per-epoch table of ``relaytrain show`` and of the Prefect artifact, the summary).

Stored data keeps its own indexing: a metric row's ``epoch`` is relaytrain's loops' index from
0 (the built-in loop and an own loop on relaytrain's API), or whatever a loop on Ray's API
reported, which may count from 0 (``for epoch in range(n)``) or from 1 (``epoch + 1``); a
checkpoint manifest's ``epoch`` is the number of epochs done when it was taken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def first_epoch(history: Iterable[dict[str, Any]], ray_loop: bool) -> int:
    """The ``epoch`` value the history's rows give the run's first epoch: 0 for relaytrain's
    loops; for a loop on Ray's API, ``first_reported`` of the values it reported."""
    if not ray_loop:
        return 0
    return first_reported(row.get("epoch") for row in history)


def first_reported(values: Iterable[Any]) -> int:
    """The value a loop on Ray's API gives its first epoch, from the ``epoch`` values it
    reported (the whole run's: a resumed attempt's start later): 1 when the lowest is 1 (it
    reports ``epoch + 1``), else 0 (its index, as in ``for epoch in range(n)``)."""
    reported = [v for v in values if _is_index(v)]
    return 1 if reported and min(reported) == 1 else 0


def number(epoch: int, first: int) -> int:
    """The epoch a row's ``epoch`` value names, counted from 1."""
    return epoch - first + 1


def epochs_done(final: dict[str, Any], history: Sequence[dict[str, Any]]) -> int:
    """Epochs a loop on Ray's API completed by its report ``final`` (0 without an ``epoch``
    metric): the number of the epoch it reported in."""
    epoch = final.get("epoch")
    if not isinstance(epoch, int) or isinstance(epoch, bool):
        return 0
    return number(epoch, first_epoch([*history, final], ray_loop=True))


def _is_index(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
