"""Which seeds `make test` plays: the cheapest set of scenarios that together touch every action
and fault kind and every shape (``SHAPES``: the columns form, a loop of one's own, bf16), by what
each costs to play (``commands_cost``), among the scenarios every oracle can judge
(``fully_judged``)."""

from __future__ import annotations

import functools

from tests.adversary.scenario import ACTIONS, FAULTS, SHAPES, Scenario, draw

#: The seeds `make test` plays (tests/integration/test_adversary_seeds.py): together they touch
#: every action and fault kind and every shape. Picked by ``cheapest_cover`` over seeds 1-2999:
#: the set of the fewest training commands (their references' included) that covers every kind,
#: among the scenarios every oracle can judge (``fully_judged``).
SUITE_SEEDS = (21, 50, 195, 398, 455, 1733, 2570, 2650)
#: Seeds whose scenarios found a defect in relaytrain, played by `make test` whatever the cover
#: picks (each its smallest failing history): 398, an elastic run ``[1, 2]`` started while other
#: work held every CPU of the cluster but one, never started (Ray's elastic policy sized the
#: group to the nodes, not to what was free: three 60-s group start timeouts an attempt, every
#: retry spent, 0 steps).
FOUND_SEEDS = (398,)


def commands_cost(scenario: Scenario) -> float:
    """About what playing ``scenario`` costs, in training commands: each run or continue and
    its reference's, each rerun, the command again after a kill or a repair, a reference that
    cannot run beside its crowded scenario; reads count less,
    and more workers, more epochs and object storage (moto's server in every read and write)
    make each command longer."""
    cost = 0.0
    for a in scenario.history:
        if a.kind in ("run", "continue"):
            cost += 2
        elif a.kind == "rerun":
            cost += 1
        else:
            cost += 0.4
        # a crowd's reference runs before its scenario, not beside it
        if a.fault and a.fault.kind in ("kill_flow", "flip_data", "store_full", "crowd"):
            cost += 1
        elif a.fault and a.fault.kind == "second_flow":
            cost += 0.5
        elif a.fault and a.fault.kind == "lose_node":  # Ray's health checks, the node away
            cost += 3
    shape = scenario.shape
    longer = 1 + 0.3 * (shape.workers - 1) + 0.2 * (shape.epochs - 2)
    return cost * longer * (1.1 if shape.storage == "s3" else 1.0)


def fully_judged(scenario: Scenario) -> bool:
    """Whether every oracle can judge ``scenario``: not when a checkpoint damaged before a
    continue may move its resume back under a cosine schedule (the final state is then not the
    reference's by the schedule's rule: ``departures.retrained_toward_another_end``)."""
    history = scenario.history
    damaged = any(
        a.fault
        and a.fault.kind in ("flip_checkpoint", "flip_best")
        and any(later.kind == "continue" for later in history[i:])
        for i, a in enumerate(history)
    )
    return not (damaged and scenario.shape.cosine)


def cheapest_cover(seeds: range) -> list[int]:
    """The fully judged seeds among ``seeds`` whose scenarios together touch every action and
    fault kind (and shape: ``SHAPES``) at the least ``commands_cost`` (a set cover, exact:
    memoized over the kinds touched; equal costs go to the lower seeds)."""
    kinds = [*ACTIONS, *FAULTS, *SHAPES]
    full = (1 << len(kinds)) - 1
    cheapest: dict[int, tuple[float, int]] = {}  # kinds touched -> the cheapest seed touching them
    for seed in seeds:
        scenario = draw(seed)
        if not fully_judged(scenario):
            continue
        touched = scenario.kinds()
        mask = sum(1 << i for i, k in enumerate(kinds) if any(k in t for t in touched.values()))
        cost = commands_cost(scenario) + seed * 1e-9  # ties to the lower seed
        if mask not in cheapest or cheapest[mask][0] > cost:
            cheapest[mask] = (cost, seed)
    # A seed that touches no more than a cheaper one touches is in no cheapest cover.
    cheapest = {
        mask: (cost, seed)
        for mask, (cost, seed) in cheapest.items()
        if not any(
            other != mask and other | mask == other and c <= cost
            for other, (c, _) in cheapest.items()
        )
    }
    by_kind = [[m for m in cheapest if m >> i & 1] for i in range(len(kinds))]
    if not all(by_kind):
        raise ValueError(f"seeds {seeds} do not touch every action and fault kind")

    @functools.cache
    def cover(touched: int) -> tuple[float, tuple[int, ...]]:
        """The cheapest seeds that touch what ``touched`` lacks: every cover has a seed that
        touches the missing kind fewest seeds touch, so branch on that kind's seeds alone."""
        if touched == full:
            return 0.0, ()
        missing = [i for i in range(len(kinds)) if not touched >> i & 1]
        kind = min(missing, key=lambda i: len(by_kind[i]))
        options = []
        for mask in by_kind[kind]:
            rest, seeds_after = cover(touched | mask)
            options.append((cheapest[mask][0] + rest, (cheapest[mask][1], *seeds_after)))
        return min(options)

    picked = list(cover(0)[1])
    return sorted(picked)
