"""The chaos campaign's verdict (bench/chaos_analysis.py): each failure judged by the faults that
may have caused it, on the budget they call for, and no resume reading a damaged checkpoint;
each recovery split into its phases."""

from __future__ import annotations


def test_a_chaos_outage_armed_for_the_next_upload_counts_from_when_it_cut():
    """An outage armed for the next checkpoint upload can begin long after it was armed (the
    flow killed meanwhile): the failure it causes is charged to it from the cut, not left with
    "no fault before it" (a CI run of the short campaign failed so, 34 s after the arming)."""
    from bench.chaos_analysis import EFFECT_S, attribute, in_effect
    from bench.chaos_kinds import Fault

    armed = Fault("s3_outage", 100.0, {"outage_s": 6.8, "when": "the next checkpoint upload"})
    now = Fault("s3_outage", 300.0, {"outage_s": 4.0, "when": "now"})
    kill = Fault("flow_kill", 103.0)
    events = [(90.0, "up"), (100.0 + EFFECT_S + 5, "cut on PUT /relaytrain/checkpoint-360/")]
    failure = {"at": 100.0 + EFFECT_S + 9}
    assert attribute([armed, kill], failure) == []
    placed = in_effect([armed, kill, now], events)
    assert [(f.kind, f.at) for f in placed] == [
        ("flow_kill", 103.0),
        ("s3_outage", 135.0),
        ("s3_outage", 300.0),
    ]
    assert [f.kind for f in attribute(placed, failure)] == ["s3_outage"]
    # never cut (the run ended first): it stays where it was armed
    assert in_effect([armed], [(90.0, "up")])[0].at == 100.0


def test_a_chaos_failure_is_judged_by_the_faults_before_it():
    """A failure on a budget none of its causes calls for, one with no cause, and a resume from
    a damaged checkpoint are each a problem; the recovery counts for the newest cause."""
    from bench.chaos_analysis import EFFECT_S, judge_failures
    from bench.chaos_kinds import Fault

    kill = Fault("worker_kill", 100.0)
    corrupt = Fault("corrupt", 101.0, {"step": 40, "file": "model.pt"})
    drain = Fault("drain", 200.0)
    found = [
        {"at": 105.0, "budget": "infrastructure", "error_class": "E", "resumed_at": 112.0,
         "resumed_from_step": 40},
        {"at": 205.0, "budget": "code", "error_class": "TrainingCodeError", "resumed_at": None,
         "resumed_from_step": None},
        {"at": 200.0 + EFFECT_S + 10, "budget": "infrastructure", "error_class": "E",
         "resumed_at": None, "resumed_from_step": None},
    ]  # fmt: skip
    faults = [kill, corrupt, drain]
    problems, per_kind = judge_failures(faults, faults, found)
    assert _seconds(per_kind["worker_kill"]) == [12.0] and per_kind["drain"] == []
    assert len(problems) == 3
    assert "damaged checkpoint of step 40" in problems[0]
    assert "['drain'] at 200.0 was followed by a failure on the code budget" in problems[1]
    assert f"no fault in the {EFFECT_S:g} s before it" in problems[2]


def test_a_damaged_file_and_a_lost_head_answer_the_failures_they_cause():
    """A damaged data file lasts until it is restored: the flow's failure of it, met when its
    rows are read again, is charged to the newest damage however long before, and no other
    failure is. A lost head's failure comes once a new head answers without the job: charged to
    it up to ``EFFECT_S`` after that (``back_at``), not only after the kill."""
    from bench.chaos_analysis import EFFECT_S, attribute, judge_failures
    from bench.chaos_kinds import Fault

    old, newest = Fault("data_damaged", 10.0), Fault("data_damaged", 100.0)
    kill = Fault("worker_kill", 150.0)
    met = {"at": 160.0, "budget": "none", "error_class": "DataFileDamagedError",
           "resumed_at": 200.0, "resumed_from_step": 40}  # fmt: skip
    assert attribute([old, newest, kill], met) == [newest]
    killed = {"at": 155.0, "budget": "infrastructure", "error_class": "E"}
    assert attribute([newest, kill], killed) == [kill]
    problems, per_kind = judge_failures([newest, kill], [newest, kill], [met])
    assert problems == [] and _seconds(per_kind["data_damaged"]) == [100.0]

    head = Fault("head_restart", 300.0, {"down_s": 10.0, "back_at": 330.0})
    lost = {"at": 300.0 + EFFECT_S + 20, "budget": "infrastructure", "error_class": "E",
            "resumed_at": 380.0, "resumed_from_step": 60}  # fmt: skip
    assert attribute([head], lost) == [head]
    assert attribute([Fault("head_restart", 300.0, {"down_s": 10.0})], lost) == []
    problems, per_kind = judge_failures([head], [head], [lost])
    assert problems == [] and _seconds(per_kind["head_restart"]) == [80.0]  # from the kill
    assert judge_failures([head], [head], [dict(lost, budget="none")])[0]  # it is retried


def test_only_an_attempt_that_resumed_is_judged_to_have_read_a_damaged_checkpoint():
    """An attempt that failed before its workers resumed holds its plan's step (the newest
    commit), not one it read: the 40-fault campaign of 2026-11-29 took two such attempts, 12 s
    and 8 s old, for resumes of a damaged step 3040 (those that did resume read 3020)."""
    from bench.chaos_analysis import judge_failures
    from bench.chaos_kinds import Fault

    corrupt = Fault("corrupt", 100.0, {"step": 3040, "file": "optimizer.pt"})
    kill = Fault("flow_kill", 110.0)
    planned = {"at": 115.0, "budget": "infrastructure", "error_class": "E", "resumed_at": None,
               "resumed_from_step": 3040}  # fmt: skip
    assert judge_failures([corrupt, kill], [corrupt, kill], [planned])[0] == []
    read = dict(planned, resumed_at=140.0)
    (problem,) = judge_failures([corrupt, kill], [corrupt, kill], [read])[0]
    assert "damaged checkpoint of step 3040" in problem


def test_a_resume_that_began_reading_before_the_damage_read_it_whole():
    """A resume is judged against the damage by when its read began, not when the failure
    before it came: CI's chaos campaign (2026-12-05) flagged a resume of step 20 whose failure
    came 6 s after the damage, its final state bit-identical to the uninterrupted run's (a
    read of the damaged optimizer state would have broken it, or been refused by its
    digest)."""
    from bench.chaos_analysis import judge_failures
    from bench.chaos_kinds import Fault

    corrupt = Fault("corrupt", 100.0, {"step": 20, "file": "optimizer.pt"})
    kill = Fault("worker_kill", 106.0)
    failure = {"at": 106.0, "budget": "infrastructure", "error_class": "E",
               "resumed_from_step": 20}  # fmt: skip
    before = dict(failure, resumed_at=95.0)  # resumed, then failed after the damage
    during = dict(failure, resumed_at=102.0, restore_s=4.0)  # its read began before it
    after = dict(failure, resumed_at=110.0, restore_s=4.0)
    assert judge_failures([corrupt, kill], [corrupt, kill], [before])[0] == []
    assert judge_failures([corrupt, kill], [corrupt, kill], [during])[0] == []
    (problem,) = judge_failures([corrupt, kill], [corrupt, kill], [after])[0]
    assert "damaged checkpoint of step 20" in problem


def test_a_resume_of_the_damaged_step_written_again_read_the_new_commit():
    """A resume that fell past the damaged checkpoint trains its step again and commits it
    anew: a later resume of that step reads the new commit, written after the damage. CI's
    chaos campaign (2026-12-07, stop 75) flagged such a resume of step 20: its optimizer.pt
    was damaged at 02:16:56, a worker killed at 02:17:18 made the group start over from the
    beginning and commit step 20 again, and the flow run after a damaged data file resumed
    from that commit, its final state bit-identical to the uninterrupted run's. Judged by when
    the checkpoint read was written (``checkpoint_created_at``); unknown, by its step."""
    from bench.chaos_analysis import judge_failures
    from bench.chaos_kinds import Fault

    corrupt = Fault("corrupt", 100.0, {"step": 20, "file": "optimizer.pt"})
    damaged = Fault("data_damaged", 150.0, {"file": "part-3.parquet"})
    failure = {"at": 160.0, "budget": "none", "error_class": "DataFileDamagedError",
               "resumed_at": 200.0, "restore_s": 1.0, "resumed_from_step": 20}  # fmt: skip
    faults = [corrupt, damaged]
    rewritten = dict(failure, checkpoint_created_at=140.0)
    assert judge_failures(faults, faults, [rewritten])[0] == []
    for read in (dict(failure, checkpoint_created_at=90.0), failure):
        (problem,) = judge_failures(faults, faults, [read])[0]
        assert "damaged checkpoint of step 20" in problem


def test_a_lost_driver_failed_when_its_flow_went():
    """An attempt whose record a later launch closed (DriverLost, no end time) counted as
    failing when it started: the 40-fault campaign of 2026-11-28 found no fault in the 30 s
    before an attempt that had run for 4 minutes before a full store failed its flow. It is
    placed at the last flow exit between its start and the next attempt's."""
    from bench.chaos_analysis import judge_failures, place_lost_drivers
    from bench.chaos_kinds import Fault

    full = Fault("disk_full", 300.0)
    lost = {"at": 60.0, "budget": "infrastructure", "error_class": "DriverLost",
            "resumed_at": 330.0, "resumed_from_step": 2480, "between": (60.0, 325.0)}  # fmt: skip
    assert judge_failures([full], [full], [dict(lost)])[0]  # placed at its start: a problem
    found = [dict(lost)]
    place_lost_drivers(found, [250.0, 311.0, 400.0])  # a kill before, its exit, a later one
    assert found[0]["at"] == 311.0
    problems, per_kind = judge_failures([full], [full], found)
    assert problems == [] and _seconds(per_kind["disk_full"]) == [30.0]


def test_a_flow_failed_of_a_full_store_is_one_whose_launch_saw_the_store_full():
    """The suite's seeded campaign of 2026-11-29 (CI) filled the store for 7 s; the flow's
    StorageFullError reached its exit 68 s after the fill (behind a node's death and a Prefect
    server that was down), past the 60 s a failure was then given, and was taken for a failure
    of the flow's own. A launch that lived while the store was full failed of it, however late;
    one launched after the store was freed did not."""
    from bench.chaos_faults import full_during
    from bench.chaos_kinds import Fault

    fill = Fault("disk_full", 100.0, {"full_s": 7.0})
    assert full_during([fill], start=60.0, end=168.0)  # launched before, failed 68 s later
    assert full_during([fill], start=104.0, end=120.0)  # launched while full
    assert not full_during([fill], start=108.0, end=200.0)  # launched once freed
    assert not full_during([fill], start=20.0, end=90.0)  # exited before the fill
    assert not full_during([Fault("s3_outage", 100.0, {"outage_s": 6.0})], 60.0, 168.0)


def _seconds(recoveries):
    return [r["recovery_s"] for r in recoveries]


def test_a_recovery_is_split_into_detection_relaunch_and_start():
    """Where a recovery's seconds went: a worker killed at 100 s, its attempt's record closed at
    110 s, the Prefect retry's driver up at 125 s, its workers resumed at 140 s; and a node
    killed at 200 s whose group restarted in place at 205 s and resumed at 212 s (no relaunch).
    The phases read from the attempt records as the campaign keeps them."""
    from bench.chaos_analysis import failures, judge_failures
    from bench.chaos_kinds import Fault
    from trainer_core.run.attempts import AttemptRecord

    restart = {"reason": "infrastructure", "failed_at": 205.0, "resumed_at": 212.0,
               "resumed_from_step": 80, "error_class": "E"}  # fmt: skip
    records = [
        AttemptRecord(
            1,
            "failed",
            50.0,
            110.0,
            resumed_from_step=0,
            resumed_at=60.0,
            error_budget="infrastructure",
            error_class="E",
        ),
        AttemptRecord(
            2, "completed", 125.0, 300.0, resumed_from_step=40, resumed_at=140.0, restarts=[restart]
        ),
    ]
    kill, node = Fault("worker_kill", 100.0), Fault("node_kill", 200.0)
    found = failures(records)
    problems, per_kind = judge_failures([kill, node], [kill, node], found)
    assert problems == []
    assert per_kind["worker_kill"] == [
        {"recovery_s": 40.0, "detect_s": 10.0, "relaunch_s": 15.0, "start_s": 15.0}
    ]
    assert per_kind["node_kill"] == [
        {"recovery_s": 12.0, "detect_s": 5.0, "relaunch_s": 0.0, "start_s": 7.0}
    ]
