"""What a run's result says it cost and kept (``trainer_core.run.summary``, ``report``): steps
lost, steps computed, goodput, recompute time, epochs, the best and latest checkpoints, and the
markdown summary.

The expected figures come from each scenario's own facts, never from the summary's rules: a
fault fires as a known step begins, so the steps before it completed and the step itself did
not; a resume starts after a known checkpoint; the steps each worker group ran are listed one
by one and counted. The records are made the way the engine makes them: the workers' events
folded by ``LiveState``, then the attempt record's verbs, stored in a run directory and read
back."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from flows.pytest_plugin import tiny_spec_dict
from trainer_core import storage
from trainer_core.checkpoint.history import write_metrics_segment
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import InfrastructureError, InjectedFault
from trainer_core.run import attempts
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.live_state import LiveState
from trainer_core.run.report import epoch_table, render_markdown
from trainer_core.run.summary import attempt_summaries, build_result, steps_computed
from trainer_core.run.time_account import time_account
from trainer_core.spec.overrides import build_spec
from trainer_core.train.failure import worker_error

#: The seconds every step of the scenarios takes, on every rank (its step-time window).
STEP_S = 0.5


def rows(first: int, last: int) -> list[dict[str, Any]]:
    """Metric rows of steps ``first..last``, each a one-step window of ``STEP_S`` seconds on
    each of two ranks (all of it forward and backward)."""
    figures = [STEP_S, 0.0, 0.0, STEP_S, 0.0, 0.0, 0.0, 0.0, 0.0]  # wall, then step_time.PARTS
    return [
        {"step": s, "loss": 1.0 / s, "step_time": {"steps": 1, "ranks": [figures, figures]}}
        for s in range(first, last + 1)
    ]


def relayed(live: LiveState, events: list[dict[str, Any]]) -> LiveState:
    for event in events:
        live.apply(event)
    return live


def metrics(group: int, first: int, last: int, report_every: int) -> list[dict[str, Any]]:
    """Rank 0's relayed rows of steps ``first..last``: one event a report window, each sent as
    its window closes (the rows of an unfinished window are never sent)."""
    ends = [s for s in range(first, last + 1) if s % report_every == 0 or s == last]
    starts = [first, *(end + 1 for end in ends[:-1])]
    return [
        {"kind": "metrics", "group": group, "rows": rows(a, b)}
        for a, b in zip(starts, ends, strict=True)
    ]


def fault_at_17_then_resume_from_13(run_dir: RunDirectory) -> None:
    """A ``raise`` fault fires on rank 0 of attempt 1 as step 17 begins (before its forward
    pass). Rank 0 reports every 5 steps: the driver has rows up to 15, and rank 0 tells it the
    last step it completed, 16, as it winds down (``failure.wind_down``). Attempt 2 resumes
    from the checkpoint at 13 and completes at 39 (3 epochs of 13 steps). The attempts are
    recorded as ``engine.run_attempt`` records them; the metric segments and checkpoints at
    13, 26 and 39 as the commits write them."""
    first = AttemptRecord.opened(1, "fresh start", 0)
    attempts.write(run_dir, first)
    live = relayed(
        LiveState(step=0, resumed_from=0),
        [
            {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 2},
            *metrics(group=0, first=1, last=15, report_every=5),
            {"kind": "last_step", "group": 0, "last_step": 16},
        ],
    )
    # What the worker raises: builtin._as_worker_error at the loop's current step, 17.
    error = worker_error(InjectedFault("injected fault"), where="at step 17", step=17, rank=0)
    attempts.write(run_dir, first.failed(error, live.outcome(), live.step))
    second = AttemptRecord.opened(2, "resume from checkpoint 13", 13)
    attempts.write(run_dir, second)
    live = relayed(
        LiveState(step=13, resumed_from=13),
        [
            {"kind": "resumed", "time": 30.0, "step": 13, "group": 0, "world_size": 2},
            *metrics(group=0, first=14, last=39, report_every=5),
        ],
    )
    attempts.write(run_dir, second.completed(live.outcome(), 39))
    val_loss = {13: 0.5, 26: 0.3, 39: 0.4}  # the best is not the newest
    for attempt, first_step, step in ((1, 1, 13), (2, 14, 26), (2, 27, 39)):
        write_metrics_segment(run_dir, attempt, rows(first_step, step))
        entry = run_dir.write_checkpoint_file(step, "model.pt", b"weights")
        meta = {"epoch": step // 13, "metrics": {"val_loss": val_loss[step]}}
        run_dir.commit_checkpoint(step, [entry], meta)


@pytest.fixture
def run_location(tmp_path):
    return storage.resolve(str(tmp_path / "run"))


def test_attempt_summaries_count_steps_lost(run_location):
    """Steps 1-16 completed before the fault at 17; the resume from 13 threw 14, 15 and 16
    away: 3 steps lost (the fault's step less one, less the resume step). The attempt that
    completed lost none."""
    fault_at_17_then_resume_from_13(RunDirectory(run_location))
    first, second = attempt_summaries(attempts.read(RunDirectory(run_location)))
    assert (first.status, first.error_step, first.resumed_from_step) == ("failed", 17, 0)
    assert first.steps_lost == 3
    assert second.steps_lost is None and first.restarts == []


def test_an_attempt_lasts_from_its_start_to_its_end_as_recorded():
    stored = {"attempt": 1, "status": "failed", "started_at": 10.0, "ended_at": 15.0}
    (summary,) = attempt_summaries([AttemptRecord.from_json(stored)])
    assert summary.duration_s == 5.0


def test_steps_computed_count_every_step_run_again(run_location):
    """Counted from the steps each worker group ran, listed: attempt 1 ran 1-16 (the fault
    fired before step 17 ran), attempt 2 ran 14-39."""
    fault_at_17_then_resume_from_13(RunDirectory(run_location))
    ran = [*range(1, 17), *range(14, 40)]
    assert len(ran) == 42
    assert steps_computed(attempt_summaries(attempts.read(RunDirectory(run_location)))) == 42
    # A resume point unknown (a user's loop that Ray resumed): no count rather than a wrong one.
    unknown = [{"attempt": 1, "status": "completed", "last_step": 10, "resumed_from_step": None}]
    assert steps_computed(attempt_summaries([AttemptRecord.from_json(r) for r in unknown])) is None
    # An attempt that failed before its first step ran none.
    never_ran = AttemptRecord.opened(1, "fresh start", 0)
    error = worker_error(InjectedFault("injected fault"), where="at step 1", step=1, rank=0)
    failed = never_ran.failed(error, LiveState(step=0, resumed_from=0).outcome(), 0)
    assert steps_computed(attempt_summaries([failed])) == 0


def test_the_result_counts_what_the_run_directory_holds(tmp_path):
    """The result of the scenario, built from its run directory: 39 steps and 3 epochs kept
    (the newest commit), the best checkpoint the one of the lowest val_loss (26), the latest
    39; 42 steps computed (listed above), so a goodput of 39/42 = 0.9286; the recompute time
    is the 3 lost steps at 0.5 s each, 1.5 s; the history's 39 windows of 0.5 s, 19.5 s."""
    spec = build_spec(tiny_spec_dict(tmp_path, "faulted"))
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child("faulted"))
    fault_at_17_then_resume_from_13(run_dir)
    result = build_result(spec, run_dir, str(tmp_path), "completed")
    assert (result.steps_completed, result.epochs_completed) == (39, 3)
    assert result.latest_checkpoint_uri == run_dir.checkpoint_location(39).uri
    assert result.best_checkpoint_uri == run_dir.checkpoint_location(26).uri
    assert result.best_metrics == {"val_loss": 0.3}
    assert result.steps_computed == 42 and result.goodput == 0.9286
    assert result.time is not None
    assert (result.time.steps_measured, result.time.training_s) == (39, 19.5)
    assert result.time.restarts.recompute_s == 1.5


def test_in_place_restarts_are_summarized_under_their_attempt():
    """Rank 1 is killed as step 23 begins, while rank 0 waits for it in step 23's all-reduce.
    Rank 0 reports every 10 steps, so the driver has rows up to 20, and rank 0 tells it 22 as
    it winds down. The group fails at t=100 and the restarted one resumes from the checkpoint
    at 20 at t=112.5, then completes at 40. Truth: 21 and 22 were completed and lost (2
    steps); the groups ran 1-22 and 21-40 (42 steps); recovery took 12.5 s."""
    live = relayed(
        LiveState(step=0, resumed_from=0),
        [
            {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 2},
            *metrics(group=0, first=1, last=20, report_every=10),
            {"kind": "last_step", "group": 0, "last_step": 22},
            {
                "kind": "restarting",
                "time": 100.0,
                "error_budget": "infrastructure",
                "error_class": "InfrastructureError",
                "error_message": "rank 1 died",
            },
            {"kind": "resumed", "time": 112.5, "step": 20, "group": 1, "world_size": 2},
            *metrics(group=1, first=21, last=40, report_every=10),
        ],
    )
    record = AttemptRecord.opened(1, "fresh start", 0).completed(live.outcome(), 40)
    (summary,) = attempt_summaries([record])
    (restart,) = summary.restarts
    assert restart.steps_lost == 2 and restart.recovery_s == 12.5
    assert restart.error_class == "InfrastructureError"
    ran = [*range(1, 23), *range(21, 41)]
    assert steps_computed([summary]) == len(ran) == 42


def test_resizes_say_their_world_sizes_and_reason():
    """Three workers; a node is lost as step 24 begins (rows relayed every step, so the driver
    has 23): two resume from 20 at t=104, 4 s after. At step 61 the elastic policy finds room
    for a third again (t=150): three resume from 60 at t=160 and run to 80. Truth: 21-23 lost
    (3 steps), then 61 (1 step); the groups ran 1-23, 21-61 and 61-80."""
    live = relayed(
        LiveState(step=0, resumed_from=0),
        [
            {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 3},
            *metrics(group=0, first=1, last=23, report_every=1),
            {
                "kind": "restarting",
                "time": 100.0,
                "error_budget": "infrastructure",
                "error_class": "InfrastructureError",
                "error_message": "node lost",
            },
            {"kind": "resumed", "time": 104.0, "step": 20, "group": 1, "world_size": 2},
            *metrics(group=1, first=21, last=61, report_every=1),
            {"kind": "resizing", "time": 150.0, "world_size": 2},
            {"kind": "resumed", "time": 160.0, "step": 60, "group": 2, "world_size": 3},
            *metrics(group=2, first=61, last=80, report_every=1),
        ],
    )
    record = AttemptRecord.opened(1, "fresh start", 0).completed(live.outcome(), 80)
    (summary,) = attempt_summaries([record])
    first, second = summary.restarts
    assert (first.reason, first.world_size_before, first.world_size_after) == (
        "infrastructure",
        3,
        2,
    )
    assert (first.steps_lost, first.recovery_s) == (3, 4.0)
    assert (second.reason, second.world_size_before, second.world_size_after) == ("capacity", 2, 3)
    assert (second.steps_lost, second.recovery_s) == (1, 10.0)
    ran = [*range(1, 24), *range(21, 62), *range(61, 81)]
    assert steps_computed([summary]) == len(ran) == 84


def test_epoch_table_and_markdown(tmp_path):
    history = [
        {"step": s, "epoch": (s - 1) // 2, "loss": float(s), "lr": 0.1} for s in (1, 2, 3, 4)
    ]
    history[1]["val_loss"] = 0.5
    history[3].update(val_loss=0.25, val_accuracy=0.9)
    table = epoch_table(history)
    assert table == [  # the mean of each epoch's losses: (1 + 2) / 2, (3 + 4) / 2
        {"epoch": 1, "last_step": 2, "train_loss": 1.5, "val_loss": 0.5, "lr": 0.1},
        {
            "epoch": 2,
            "last_step": 4,
            "train_loss": 3.5,
            "val_loss": 0.25,
            "val_accuracy": 0.9,
            "lr": 0.1,
        },
    ]
    spec = build_spec(tiny_spec_dict(tmp_path, "md"))
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child("md"))
    run_dir.record_attempt(
        {
            "attempt": 1,
            "status": "failed",
            "error_class": "X",
            "error_message": "a | b\nc",
            "started_at": 1.0,
            "ended_at": 2.0,
        }
    )
    # restarted in place after steps 6-9 ran past the checkpoint at 5: 4 steps lost
    run_dir.record_attempt(
        {
            "attempt": 2,
            "status": "completed",
            "restarts": [
                {"last_step": 9, "resumed_from_step": 5, "error_class": "Y", "error_message": "z"}
            ],
        }
    )
    result = build_result(spec, run_dir, str(tmp_path), "failed")
    text = render_markdown(spec, result, "fresh start")
    assert "| 1 | failed | - | - | - | 1.0 | X: a / b c |" in text and "fresh start" in text
    assert "| 2.1 | restarted in place | 5 | 9 | 4 |  | Y: z |" in text
    essentials = build_spec(
        tiny_spec_dict(
            tmp_path,
            "md",
            optimizer={"grad_accumulation": 4, "clip_grad_norm": 1.0},
            precision="bf16",
            metrics=["tests.own_functions:mean_abs_error"],
        )
    )
    stopped = result.model_copy(update={"stop_reason": "early stopping after epoch 2: why"})
    text = render_markdown(essentials, stopped)
    assert "global batch 32 x 4 per optimizer step" in text
    assert "gradients clipped to norm 1.0, bf16" in text
    assert "metrics ['tests.own_functions:mean_abs_error']" in text
    assert "- stopped early: early stopping after epoch 2: why" in text


def restart_advice(attempts_: list[AttemptRecord], wall_s: float) -> list[str]:
    """The advice lines on restarts of a run of 40 measured steps of ``STEP_S`` each."""
    account = time_account(rows(1, 40), attempt_summaries(attempts_), wall_s)
    assert account is not None
    return [line for line in account.advice if line.startswith("restarts cost")]


def retried_after(error: BaseException) -> list[AttemptRecord]:
    """Attempt 1 fails as step 17 begins (rows up to 15, its last completed step 16) at t=20;
    attempt 2 resumes from 13 at t=60 (40 s starting a new worker group) and completes at 40."""
    live = relayed(
        LiveState(step=0, resumed_from=0),
        [
            {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 2},
            *metrics(group=0, first=1, last=15, report_every=5),
            {"kind": "last_step", "group": 0, "last_step": 16},
        ],
    )
    first = AttemptRecord.opened(1, "fresh start", 0).failed(error, live.outcome(), live.step)
    first = dataclasses.replace(first, started_at=0.0, ended_at=20.0)
    live = relayed(
        LiveState(step=13, resumed_from=13),
        [{"kind": "resumed", "time": 60.0, "step": 13, "group": 0, "world_size": 2}],
    )
    second = AttemptRecord.opened(2, "resume from checkpoint 13", 13).completed(live.outcome(), 40)
    return [first, dataclasses.replace(second, started_at=50.0, ended_at=100.0)]


def test_advice_names_an_in_place_restart_only_where_it_would_help():
    """40 s of a 100 s run went to starting a new worker group. After a lost worker retried
    as a new attempt (``retries.in_place`` 0), restarting in place is the advice; not when the
    group was restarted in place already, nor after an error in the training code (which
    Ray Train does not restart in place: it would fail the same way)."""
    lost = InfrastructureError("rank 1 lost a peer during a collective at step 17", step=17)
    (line,) = restart_advice(retried_after(lost), wall_s=100.0)
    assert "restart the group in place (`retries.in_place`)" in line

    code = worker_error(ValueError("bad shape"), where="at step 17", step=17, rank=0)
    (line,) = restart_advice(retried_after(code), wall_s=100.0)
    assert "retries.in_place" not in line and "training code" in line, line

    live = relayed(
        LiveState(step=0, resumed_from=0),
        [
            {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 2},
            *metrics(group=0, first=1, last=20, report_every=10),
            {"kind": "last_step", "group": 0, "last_step": 22},
            {
                "kind": "restarting",
                "time": 20.0,
                "error_budget": "infrastructure",
                "error_class": "InfrastructureError",
                "error_message": "rank 1 died",
            },
            {"kind": "resumed", "time": 60.0, "step": 20, "group": 1, "world_size": 2},
            *metrics(group=1, first=21, last=40, report_every=10),
        ],
    )
    in_place = AttemptRecord.opened(1, "fresh start", 0).completed(live.outcome(), 40)
    (line,) = restart_advice([in_place], wall_s=100.0)
    assert "retries.in_place" not in line and "in place already" in line, line
