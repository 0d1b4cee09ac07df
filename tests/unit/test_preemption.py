"""How long a drain's notice holds training (``DrainWatch.hold``), on a fake clock: no Ray, no
sleeping. The hold waits for the just-in-time checkpoint to commit, then for the drain's
deadline: it must end soon after the deadline, and never hang on a far or absent one."""

from __future__ import annotations

from typing import Any

import pytest

from trainer_core.execution.worker_api import PreemptionNotice
from trainer_core.execution.worker_group import Relay, Timings
from trainer_core.train import preemption

#: What "a small margin" past the deadline means to a user: the node is gone by then.
SMALL_MARGIN_S = 10.0
#: What "never hang" means: the hold ends within a few minutes of the notice, whatever it says.
A_FEW_MINUTES_S = 300.0
NOTICE_AT = 1_700_000_000.0  # Unix seconds


class FakeClock:
    """Wall time, a performance counter and sleep for ``preemption``'s ``time``: sleeping
    moves both clocks and is recorded."""

    def __init__(self, now: float):
        self.now = now
        self.slept: list[float] = []

    def time(self) -> float:
        return self.now

    def perf_counter(self) -> float:
        return self.now - NOTICE_AT

    def monotonic(self) -> float:
        return self.now - NOTICE_AT

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.slept.append(seconds)
        self.now += seconds


class Checkpoints:
    """The just-in-time checkpoint: committing takes ``commit_s`` on the clock."""

    def __init__(self, clock: FakeClock, commit_s: float):
        self.clock, self.commit_s = clock, commit_s
        self.committed_at: float | None = None

    def wait(self) -> None:
        self.clock.now += self.commit_s
        self.committed_at = self.clock.now


class Driver:
    """The driver's relay actor: records what rank 0 pushes."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.push = self

    def remote(self, event: dict[str, Any]) -> None:
        self.events.append(event)


def hold(
    monkeypatch, deadline_in_s: float | None, commit_s: float = 2.0
) -> tuple[FakeClock, Checkpoints, Driver, Timings]:
    """Answer a notice given at NOTICE_AT whose drain is due ``deadline_in_s`` later."""
    clock = FakeClock(NOTICE_AT)
    monkeypatch.setattr(preemption, "time", clock)
    checkpoints = Checkpoints(clock, commit_s)
    driver = Driver()
    timings = Timings()
    watch = preemption.DrainWatch(True, 0, Relay(driver, rank=0), checkpoints, timings)
    deadline = None if deadline_in_s is None else NOTICE_AT + deadline_in_s
    watch.hold(12, PreemptionNotice(deadline, [1]))
    return clock, checkpoints, driver, timings


@pytest.mark.parametrize("deadline_in_s", [25.0, 90.0])
def test_the_hold_ends_at_the_drains_deadline_plus_a_small_margin(monkeypatch, deadline_in_s):
    clock, checkpoints, driver, timings = hold(monkeypatch, deadline_in_s)
    deadline = NOTICE_AT + deadline_in_s
    # The checkpoint committed first, and the driver heard of the notice after it.
    assert checkpoints.committed_at == NOTICE_AT + 2.0
    assert [e["kind"] for e in driver.events] == ["preemption_notice"]
    assert driver.events[0]["step"] == 12 and driver.events[0]["deadline"] == deadline
    # Training waits for the node to go (steps trained before would be lost with it) ...
    assert clock.now >= deadline
    # ... and not long after: the node is gone by then, or not going.
    assert clock.now <= deadline + SMALL_MARGIN_S
    assert timings.preemption_hold_s == pytest.approx(clock.now - NOTICE_AT)


def test_a_far_deadline_does_not_hold_training_for_it(monkeypatch):
    clock, checkpoints, _, _ = hold(monkeypatch, deadline_in_s=3600.0)
    assert clock.now - NOTICE_AT <= A_FEW_MINUTES_S
    # Waiting part of the way would save no step (the node still goes at the deadline, taking
    # what was trained since): training goes on at once, its regular checkpoints bound the loss.
    assert clock.now == checkpoints.committed_at


def test_a_deadline_already_past_does_not_hold(monkeypatch):
    clock, checkpoints, _, _ = hold(monkeypatch, deadline_in_s=-10.0, commit_s=0.5)
    assert clock.now == checkpoints.committed_at  # no sleep after the commit
    assert clock.slept in ([], [0.0])


def test_a_slow_commit_counts_toward_the_deadline(monkeypatch):
    clock, checkpoints, _, _ = hold(monkeypatch, deadline_in_s=30.0, commit_s=28.0)
    assert checkpoints.committed_at == NOTICE_AT + 28.0
    assert NOTICE_AT + 30.0 <= clock.now <= NOTICE_AT + 30.0 + SMALL_MARGIN_S


def test_no_deadline_means_no_wait_after_the_commit(monkeypatch):
    clock, checkpoints, driver, _ = hold(monkeypatch, deadline_in_s=None)
    assert clock.now == checkpoints.committed_at
    assert driver.events[0]["seconds_left"] is None
