"""The straggler rule, a window's history fields and the advice, on plain figures."""

from __future__ import annotations

import pytest

from trainer_core.step_time import (
    PARTS,
    Stragglers,
    advice,
    busy,
    own_row,
    window_fields,
)


def figures(wall: float, **parts: float) -> list[float]:
    """A rank's ``[wall, *PARTS]``."""
    return [wall, *(parts.get(name, 0.0) for name in PARTS)]


def test_busy_time_leaves_out_the_waits_for_peers():
    rank = figures(10.0, allreduce_wait=3.0, validation=1.0, checkpoint=0.5, data_wait=2.0)
    assert busy(rank) == pytest.approx(5.5)  # data wait is the rank's own


def test_a_rank_is_a_straggler_after_three_windows_in_a_row_and_until_one_says_otherwise():
    rule = Stragglers(["a", "b", "c", "d"])
    slow = [figures(1.0, allreduce_wait=0.6)] * 3 + [figures(1.0)]  # rank 3 at 2.5x
    even = [figures(1.0, allreduce_wait=0.6)] * 4
    assert rule.update(slow) == ([], [])
    assert rule.update(slow) == ([], [])
    now, new = rule.update(slow)
    assert now == [{"rank": 3, "node": "d", "ratio": 2.5}] and new == [3]
    now, new = rule.update(slow)  # still straggling: named, not new
    assert [s["rank"] for s in now] == [3] and new == []
    assert rule.update(even) == ([], [])  # one window at par resets the streak
    assert rule.update(slow) == ([], [])


def test_a_window_at_the_ratio_is_not_over_it_and_one_rank_has_no_peers():
    rule = Stragglers(["a", "b"], windows=1)
    at_ratio = [figures(1.0), figures(1.25)]
    assert rule.update(at_ratio) == ([], [])
    assert Stragglers(["a"], windows=1).update([figures(9.0)]) == ([], [])


def test_window_fields_gather_every_rank_and_average_per_step():
    world = 2
    rows = [own_row(figures(0.4, forward_backward=0.3), 0, world)]
    rows.append(own_row(figures(0.6, data_wait=0.2), 1, world))
    summed = [a + b for a, b in zip(*rows, strict=True)]  # what the all-reduce gives
    fields, new = window_fields(summed, world, 2, None)
    assert fields["step_time"] == {
        "steps": 2,
        "ranks": [figures(0.2, forward_backward=0.15), figures(0.3, data_wait=0.1)],
    }
    assert fields["time/step"] == pytest.approx(0.25)
    assert fields["time/data_wait"] == pytest.approx(0.05) and new == []


def test_advice_names_each_rule_broken_and_only_those():
    quiet = advice({"data_wait": 0.09, "checkpoint": 0.09, "allreduce_wait": 0.29}, [])
    assert quiet == []
    lines = advice({"data_wait": 0.38, "validation": 0.3}, [], restarts_share=0.25)
    assert lines[0].startswith("data wait is 38% of step time: raise `data.prefetch`")
    assert "validation is 30%" in lines[1] and "restarts cost 25%" in lines[2]
    slow_start = {"detection_s": 1.0, "new_group_s": 9.0, "recompute_s": 2.0}
    retried = {"retry": 9.0, "in_place": 0.0, "code": 0.0, "other": 0.0}
    (line,) = advice({}, [], restarts_share=0.3, restarts=slow_start, new_groups=retried)
    assert "starting new worker groups" in line and "`retries.in_place`" in line
    straggler = {"rank": 3, "node": "10.0.0.7", "ratio": 1.6, "attempt": 1, "windows": 4}
    lines = advice({"allreduce_wait": 0.5}, [{**straggler, "from_step": 30}])
    assert lines == [
        "rank 3 on node 10.0.0.7 is 1.6x slower than its peers (attempt 1, 4 report windows "
        "from step 30): look for contention or a slow device on that node, or drain it"
    ]


def test_a_slow_fault_needs_its_seconds_and_only_it_takes_them():
    from pydantic import ValidationError

    from trainer_core.spec.operations import FaultSection

    assert FaultSection(kind="slow", at_step=1, seconds=0.5).seconds == 0.5
    with pytest.raises(ValidationError, match="a slow fault needs seconds"):
        FaultSection(kind="slow", at_step=1)
    with pytest.raises(ValidationError, match=r"seconds=0\.5"):
        FaultSection(kind="raise", at_step=1, seconds=0.5)


def test_an_own_loops_optimizer_hooks_put_each_wait_in_one_part():
    """A user's loop's optimizer step, timed from its hooks, right after backward launched the
    gradients' all-reduce, while the previous checkpoint's copy still runs (the manager's wait
    for it, counted in ``Timings.checkpoint_s``, sleeps 0.2 s here): the copy's wait is the
    checkpoint's alone, not the all-reduce's too, and the window's parts never sum past its
    wall time (so forward and backward, what they leave, is not squeezed to 0)."""
    import time

    import torch

    from trainer_core.execution.worker_group import Timings
    from trainer_core.step_time import PARTS
    from trainer_core.train.step_clock import StepClock

    copy_s = 0.2
    timings = Timings()

    def wait_for_the_copy() -> None:  # CheckpointManager.before_optimizer_step, as it counts
        time.sleep(copy_s)
        timings.checkpoint_s += copy_s

    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    clock = StepClock(torch.device("cpu"), timings)
    clock.watch_optimizer(optimizer, wait_for_the_copy)
    model(torch.randn(3, 4)).sum().backward()
    clock.launched = clock.start()  # DDP's hook: the last bucket's all-reduce launched now
    optimizer.step()
    wall, *parts = clock.window(rest="forward_backward")
    named = dict(zip(PARTS, parts, strict=True))
    assert named["checkpoint"] == pytest.approx(copy_s)
    assert named["allreduce_wait"] < copy_s / 4, named  # the copy is not counted here again
    assert named["optimizer"] < copy_s / 4, named
    assert sum(parts) == pytest.approx(wall)  # the rest fills the window, and no more
    assert sum(v for k, v in named.items() if k != "forward_backward") <= wall
