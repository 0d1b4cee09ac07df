"""Where a played run parts from its reference by a documented rule, not a broken guarantee:
from that step its bits cannot be the reference's, so the oracles judge the final state not at
all and the losses only up to it (``parted``)."""

from __future__ import annotations

from typing import Any

import yaml

from tests.adversary.drive import Player


def parted(player: Player) -> int | None:
    """The first step from which the run cannot be its reference's bits, None where it never
    parts."""
    steps = [
        s for s in (retrained_toward_another_end(player), fewer_workers(player)) if s is not None
    ]
    return min(steps, default=None)


def retrained_toward_another_end(player: Player) -> int | None:
    """The step a continue resumed from when a damaged checkpoint moved its resume before the
    step its run had reached, under a cosine schedule; None when no continue did.

    The steps between are then trained again toward the continue's new total: relaytrain's
    schedule starts a segment at the step resumed from, where the reference's (undamaged)
    history started it at the step the run had reached. From that step on the two cannot agree,
    which is the schedule's documented rule, not a broken resume."""
    if not player.scenario.shape.cosine:
        return None
    attempts = player.files.attempts()
    for o in player.outcomes:
        if player.scenario.history[o.index].kind != "continue" or o.kind not in (
            "continue",
            "again",
        ):
            continue
        before = attempts[: o.attempts_before]
        reached = max(
            [a.get("last_step") or 0 for a in before]
            + [r.get("last_step") or 0 for a in before for r in a.get("restarts") or []],
            default=0,
        )
        first = next(
            (
                a["resumed_from_step"]
                for a in attempts[o.attempts_before : o.attempts_after]
                if a.get("resumed_from_step") is not None
            ),
            None,
        )
        if first is not None and first < reached:  # else a later continue may have moved back
            return first
    return None


def fewer_workers(player: Player) -> int | None:
    """The step an elastic group smaller than its command asked for (``[1, N]``: as many as the
    cluster held then, after a worker was killed or while another group's workers still held
    their CPUs) resumed from; None when every group had N.

    A step's bits depend on the world size (each rank draws its own dropout, the gradients are
    summed in another order), and the reference trains on N: from that step the two differ by
    the rule of elastic capacity, not a broken resume. Each group's size is read from the
    attempt records (a restart's sizes before and after it)."""
    attempts = player.files.attempts()
    parted_at: list[int] = []
    for o in player.outcomes:
        if o.argv[:1] != ["run"] or o.attempts_after <= o.attempts_before:
            continue
        asked = _workers_asked(o.argv[2])
        for record in attempts[o.attempts_before : o.attempts_after]:
            parted_at += [
                step for step, size in _groups(record) if size is not None and size < asked
            ]
    return min(parted_at, default=None)


def _workers_asked(spec_path: str) -> int:
    with open(spec_path) as f:
        workers = yaml.safe_load(f)["scaling"]["num_workers"]
    return max(workers) if isinstance(workers, list) else int(workers)


def _groups(record: dict[str, Any]) -> list[tuple[int, int | None]]:
    """Each worker group of an attempt: the step it resumed from, and its size."""
    restarts = record.get("restarts") or []
    first = restarts[0].get("world_size_before") if restarts else record.get("world_size")
    groups = [(record.get("resumed_from_step") or 0, first)]
    groups += [
        (r.get("resumed_from_step") or 0, r.get("world_size_after"))
        for r in restarts
        if "resumed_at" in r
    ]
    return groups
