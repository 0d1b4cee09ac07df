"""What the driver knows of a running attempt (``trainer_core.run.live_state``), folded from the
events its workers relay: each restart's steps, sizes and resume, whichever event comes first."""

from __future__ import annotations

from dataclasses import replace


def restarting_after(error: str) -> dict:
    """The controller's event for an in-place restart on the infrastructure budget."""
    return {
        "kind": "restarting",
        "time": 5.0,
        "restart": 1,
        "error_budget": "infrastructure",
        "error_class": "InfrastructureError",
        "error_message": error,
    }


def test_a_rank_that_outlived_rank_0_says_the_last_step_whichever_event_comes_first():
    from trainer_core.run.live_state import LiveState

    began = {"kind": "fresh_start", "time": 1.0, "group": 0}
    rows = {"kind": "metrics", "rows": [{"step": 20, "loss": 1.0}]}
    lost = {"kind": "last_step", "rank": 1, "last_step": 22, "group": 0}
    restarting = restarting_after("rank 0 died")
    for order in ([rows, lost, restarting], [rows, restarting, lost]):
        live = LiveState()
        for event in [began, *order]:
            live.apply(event)
        assert live.restarts[0]["last_step"] == 22, order
    # No restart (the attempt ends): the attempt's last step.
    live = LiveState()
    live.apply(began)
    live.apply(rows)
    live.apply(lost)
    assert live.step == 22
    # A later group's loss does not move an earlier restart's record.
    live.apply(restarting)
    live.apply({**lost, "group": 1, "last_step": 30})
    assert live.restarts[0]["last_step"] == 22 and live.step == 30


def test_rows_rank_0_held_back_count_for_the_restart_whichever_event_comes_first():
    """Rank 0 pushes the rows it batched when its group ends (a lost peer, or Ray shutting the
    group down); the controller's restart may reach the driver first."""
    from trainer_core.run.live_state import LiveState

    began = {"kind": "fresh_start", "time": 1.0, "group": 0}
    early = {"kind": "metrics", "group": 0, "rows": [{"step": 20, "loss": 1.0}]}
    held = {"kind": "metrics", "group": 0, "rows": [{"step": 21, "loss": 0.9}]}
    restarting = restarting_after("rank 1 died")
    resumed = {"kind": "resumed", "time": 6.0, "step": 20, "group": 1}
    again = {"kind": "metrics", "group": 1, "rows": [{"step": 21, "loss": 0.9}]}
    for order in ([early, held, restarting], [early, restarting, held]):
        live = LiveState()
        for event in [began, *order, resumed, again]:
            live.apply(event)
        assert live.restarts[0]["last_step"] == 21, order  # step 21 ran twice
        assert live.restarts[0]["resumed_from_step"] == 20 and live.step == 21


def test_a_resume_says_when_the_checkpoint_it_read_was_written():
    """A step's checkpoint may be committed again (a resume fell past it when it was damaged,
    and trained the step anew): the record of each resume, the attempt's and each restart's,
    keeps when the checkpoint it read was written, from its manifest."""
    from trainer_core.run.live_state import LiveState

    live = LiveState()
    for event in [
        {"kind": "resumed", "time": 5.0, "step": 20, "group": 0, "restore_s": 0.5,
         "bytes_read": 10, "checkpoint_created_at": 3.0},
        restarting_after("rank 1 died"),
        {"kind": "resumed", "time": 9.0, "step": 20, "group": 1, "restore_s": 0.4,
         "checkpoint_created_at": 7.5},
    ]:  # fmt: skip
        live.apply(event)
    outcome = live.outcome()
    assert outcome["restore"]["checkpoint_created_at"] == 3.0
    assert outcome["restarts"][0]["checkpoint_created_at"] == 7.5


def test_a_group_that_failed_while_starting_shifts_no_step_onto_another_restart():
    """A fault during a recovery: the group Ray started after restart 1 died before it ran a
    step (before it asked the relay for its number), so the next group to run is the relay's
    group 1, ended by no restart. Its rows are the live step, and the steps the attempt ran
    are what each group ran: 0-30 by the first, 20-100 by the one that finished."""
    from trainer_core.run.attempts import AttemptRecord
    from trainer_core.run.live_state import LiveState
    from trainer_core.run.summary import attempt_summaries, steps_computed

    live = LiveState()
    events = [
        {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 2},
        {"kind": "metrics", "group": 0, "rows": [{"step": 30, "loss": 1.0}]},
        restarting_after("rank 1 died"),
        {**restarting_after("a node died while the group started"), "restart": 2},
        {"kind": "resumed", "time": 9.0, "step": 20, "group": 1, "world_size": 2},
        {"kind": "metrics", "group": 1, "rows": [{"step": 60, "loss": 0.5}]},
        {"kind": "metrics", "group": 1, "rows": [{"step": 100, "loss": 0.4}]},
    ]
    for event in events:
        live.apply(event)
    assert live.step == 100
    assert [r["last_step"] for r in live.restarts] == [30, 30]
    record = AttemptRecord(1, "completed", resumed_from_step=0, last_step=live.step)
    record = replace(record, restarts=live.restarts)
    assert steps_computed(attempt_summaries([record])) == 30 + 80


def test_every_restart_of_a_group_records_its_world_sizes_and_why():
    from trainer_core.run.live_state import LiveState

    live = LiveState()
    events = [
        {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 3},
        {"kind": "metrics", "rows": [{"step": 12, "loss": 1.0}]},
        {"kind": "preemption_notice", "step": 12, "ranks": [2], "seconds_left": 7.5},
        {
            "kind": "restarting",
            "time": 5.0,
            "restart": 1,
            "limit": None,
            "error_budget": "preemption",
            "error_class": "PreemptedError",
            "error_message": "preempted: node reclaimed",
        },
        {"kind": "resumed", "time": 9.0, "step": 12, "group": 1, "world_size": 2},
        {"kind": "metrics", "rows": [{"step": 31, "loss": 1.0}]},
        {"kind": "resizing", "time": 20.0, "world_size": 2, "to": 3},
        {"kind": "resumed", "time": 26.0, "step": 30, "group": 2, "world_size": 3},
    ]
    for event in events:
        live.apply(event)
    preempted, grown = live.restarts
    assert preempted["reason"] == "preemption" and "error_budget" not in preempted
    assert (preempted["world_size_before"], preempted["world_size_after"]) == (3, 2)
    assert (preempted["last_step"], preempted["resumed_from_step"]) == (12, 12)
    assert preempted["just_in_time_step"] == 12 and preempted["seconds_to_deadline"] == 7.5
    assert "just_in_time_step" not in grown_record(live)
    assert grown["reason"] == "capacity" and grown["restart"] == 2
    assert (grown["world_size_before"], grown["world_size_after"]) == (2, 3)
    assert (grown["last_step"], grown["resumed_from_step"], grown["resumed_at"]) == (31, 30, 26.0)
    assert live.world_size == 3


def grown_record(live):
    return live.restarts[1]
