"""The step-time breakdown's vocabulary, shared by the workers and the driver: the parts of a
report window (``train.step_clock`` measures them), the straggler rule, and what a run's
windows add up to.

The straggler rule (the README states it): a rank whose busy time per step (its step time less
what it spent waiting for its peers: the gradients' all-reduce, validation and checkpoints,
which end in collectives) is over ``RATIO`` times the median of its peers' for ``WINDOWS``
report windows in a row is a straggler, until a window says otherwise.
"""

from __future__ import annotations

import statistics
from typing import Any

#: The parts of a window, in the order every record of them keeps (after the window's wall
#: time: a rank's figures are ``[wall, *PARTS]``).
PARTS = (
    "data_wait",
    "h2d",
    "forward_backward",
    "allreduce_wait",
    "optimizer",
    "checkpoint",
    "validation",
    "other",
)
#: Parts a rank spends waiting for its peers rather than on its own work.
PEER_WAITS = ("allreduce_wait", "checkpoint", "validation")

#: A straggler's busy time per step is over RATIO times its peers' median, WINDOWS in a row.
RATIO = 1.25
WINDOWS = 3


def busy(figures: list[float]) -> float:
    """A rank's busy time from its ``[wall, *PARTS]``: less its waits for peers."""
    return figures[0] - sum(figures[1 + PARTS.index(name)] for name in PEER_WAITS)


class Stragglers:
    """The straggler rule over a worker group's windows; every rank holds one and reaches the
    same verdicts (it sees the same all-reduced figures)."""

    def __init__(self, nodes: list[str], ratio: float = RATIO, windows: int = WINDOWS):
        self.nodes = nodes
        self.ratio = ratio
        self.windows = windows
        self.streaks = [0] * len(nodes)

    def update(self, ranks: list[list[float]]) -> tuple[list[dict[str, Any]], list[int]]:
        """Take a window's per-rank ``[wall, *PARTS]``: the ranks straggling now (rank, node,
        ratio to the median of its peers), and those that became stragglers in this window."""
        if len(ranks) < 2 or len(ranks) != len(self.streaks):
            return [], []
        times = [busy(r) for r in ranks]
        now, new = [], []
        for rank, own in enumerate(times):
            peers = statistics.median(times[:rank] + times[rank + 1 :])
            ratio = own / peers if peers > 0 else 0.0
            self.streaks[rank] = self.streaks[rank] + 1 if ratio > self.ratio else 0
            if self.streaks[rank] >= self.windows:
                now.append({"rank": rank, "node": self.nodes[rank], "ratio": round(ratio, 3)})
                if self.streaks[rank] == self.windows:
                    new.append(rank)
        return now, new


def own_row(times: list[float], rank: int, world_size: int) -> list[float]:
    """This rank's ``[wall, *PARTS]`` as its row of the ranks' matrix, zeros elsewhere: summed
    over the ranks (one all-reduce), the matrix holds every rank's."""
    width = len(times)
    return [0.0] * (rank * width) + list(times) + [0.0] * ((world_size - rank - 1) * width)


def _microseconds(seconds: float) -> float:
    """``seconds`` (not negative) to the nearest microsecond: what ``round(seconds, 6)`` gives
    but for ties, in a tenth of its time (it formats the float as a string), which counts at
    every report window."""
    return int(seconds * 1e6 + 0.5) / 1e6


def window_fields(
    matrix: list[float], world_size: int, steps: int, stragglers: Stragglers | None
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A window's history fields from its ranks' summed matrix of seconds (``own_row``) over
    ``steps`` steps: ``time/<part>`` (the mean over ranks, per step), ``step_time`` (every
    rank's, per step) and ``stragglers``; and the ranks that became stragglers in it."""
    width = len(matrix) // world_size
    ranks = [
        [_microseconds(v / steps) for v in matrix[r * width : (r + 1) * width]]
        for r in range(world_size)
    ]
    means = [_microseconds(sum(column) / world_size) for column in zip(*ranks, strict=True)]
    fields: dict[str, Any] = {
        "time/step": means[0],
        **{f"time/{name}": mean for name, mean in zip(PARTS, means[1:], strict=True)},
        "step_time": {"steps": steps, "ranks": ranks},
    }
    if stragglers is None:
        return fields, []
    now, new = stragglers.update(ranks)
    if now:
        fields["stragglers"] = now
    return fields, [found for found in now if found["rank"] in new]


# -- what a run's windows add up to (the driver's views) ---------------------------------------

#: How a part is named to a person.
LABELS = {
    "data_wait": "waiting for data",
    "h2d": "host-to-device copy",
    "forward_backward": "forward and backward",
    "allreduce_wait": "waiting for the all-reduce",
    "optimizer": "optimizer step",
    "checkpoint": "blocked on checkpoints",
    "validation": "validation",
    "other": "other (the step's Python, metrics)",
}


def windows(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The history's window rows (those that carry every rank's figures)."""
    return [r for r in history if isinstance(r.get("step_time"), dict)]


def per_rank(history: list[dict[str, Any]]) -> dict[tuple[int, int], tuple[int, list[float]]]:
    """By (attempt, rank), over the history's windows: the steps measured and their seconds
    ``[wall, *PARTS]``."""
    totals: dict[tuple[int, int], tuple[int, list[float]]] = {}
    for row in windows(history):
        steps = row["step_time"]["steps"]
        for rank, figures in enumerate(row["step_time"]["ranks"]):
            key = (int(row.get("attempt", 1)), rank)
            counted, total = totals.get(key, (0, [0.0] * len(figures)))
            totals[key] = (
                counted + steps,
                [t + v * steps for t, v in zip(total, figures, strict=True)],
            )
    return dict(sorted(totals.items()))


def run_totals(history: list[dict[str, Any]]) -> tuple[int, list[float]]:
    """Steps in the history's windows, and their seconds ``[wall, *PARTS]`` (each the mean over
    the window's ranks)."""
    steps, total = 0, [0.0] * (1 + len(PARTS))
    for row in windows(history):
        n = row["step_time"]["steps"]
        ranks = row["step_time"]["ranks"]
        steps += n
        for i in range(len(total)):
            total[i] += n * sum(r[i] for r in ranks) / len(ranks)
    return steps, total


def stragglers_seen(history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each rank the rule named, per attempt: its node, in how many windows, from which step,
    and its largest ratio to its peers' median."""
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for row in windows(history):
        for found in row.get("stragglers") or []:
            key = (int(row.get("attempt", 1)), int(found["rank"]))
            entry = seen.setdefault(
                key,
                {
                    "attempt": key[0],
                    "rank": key[1],
                    "node": found["node"],
                    "from_step": row["step"],
                    "windows": 0,
                    "ratio": 0.0,
                },
            )
            entry["windows"] += 1
            entry["ratio"] = max(entry["ratio"], float(found["ratio"]))
    return [seen[k] for k in sorted(seen)]


#: A part's share of the step time over which advice names it, and the advice.
ADVICE = {
    "data_wait": (
        0.10,
        "data wait is {share} of step time: raise `data.prefetch`, or `data.transform_workers` "
        "(with `data.transform_pool: processes` for a transform that holds the GIL; "
        "`data.loader_workers` for a torch Dataset)",
    ),
    "checkpoint": (
        0.10,
        "checkpoints block {share} of step time: raise `checkpoint.every`, or write to faster "
        "storage",
    ),
    "allreduce_wait": (
        0.30,
        "waiting for the gradients' all-reduce is {share} of step time: raise the batch per "
        "worker (`data.batch_size`) or `optimizer.grad_accumulation`, or use fewer workers",
    ),
    "validation": (
        0.25,
        "validation is {share} of step time: validate fewer samples (lower "
        "`data.validation_fraction`, or a smaller `data.validation` set)",
    ),
}
#: Time lost to restarts, as a share of the wall time, over which advice names it.
RESTARTS_SHARE = 0.20


def advice(
    shares: dict[str, float],
    stragglers: list[dict[str, Any]],
    restarts_share: float = 0.0,
    restarts: dict[str, float] | None = None,
    new_groups: dict[str, float] | None = None,
) -> list[str]:
    """One line per rule a run's figures break (the README lists the rules); ``shares``: each
    part's share of the step time; ``restarts``: the seconds restarts cost by part
    (``detection_s``, ``new_group_s``, ``recompute_s``); ``new_groups``: the new worker groups'
    seconds by what they answered (``NEW_GROUP_ADVICE``'s keys)."""
    lines = [
        f"rank {s['rank']} on node {s['node']} is {s['ratio']:.1f}x slower than its peers "
        f"(attempt {s['attempt']}, {s['windows']} report windows from step {s['from_step']}): "
        "look for contention or a slow device on that node, or drain it"
        for s in stragglers
    ]
    for part, (threshold, text) in ADVICE.items():
        if part == "allreduce_wait" and stragglers:
            continue  # the peers wait for the straggler: the line above names the cause
        share = shares.get(part, 0.0)
        if share >= threshold:
            lines.append(text.format(share=f"{share:.0%}"))
    if restarts_share >= RESTARTS_SHARE:
        costs = restarts or {}
        most = max(costs, key=costs.__getitem__) if costs else "recompute_s"
        fix = {
            "recompute_s": "most of it steps run again: checkpoint more often (`checkpoint.every`)",
            "new_group_s": _new_group_advice(new_groups or {}),
            "detection_s": "most of it noticing the failure: a lower "
            "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S notices a lost worker sooner",
        }[most]
        lines.append(
            f"restarts cost {restarts_share:.0%} of the wall time, {fix}; the attempts say "
            "what failed"
        )
    return lines


#: What most of the seconds of new worker groups answered, and the advice: an in-place
#: restart only for a lost worker that a Prefect retry answered (one in place already is not
#: helped by another, nor an error in the training code, which fails again however restarted).
NEW_GROUP_ADVICE = {
    "retry": "most of it starting new worker groups: let Ray Train restart the group in place "
    "(`retries.in_place`) rather than a Prefect retry",
    "in_place": "most of it starting worker groups again, in place already (each restart starts "
    "its workers and restores the newest checkpoint)",
    "code": "most of it retries after errors in the training code, which no restart mends: fix "
    "the error",
    "other": "most of it starting new worker groups",
}


def _new_group_advice(new_groups: dict[str, float]) -> str:
    most = max(new_groups, key=new_groups.__getitem__) if any(new_groups.values()) else "other"
    return NEW_GROUP_ADVICE[most]
