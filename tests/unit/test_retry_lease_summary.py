import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest

from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import lease
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.report import epoch_table, render_markdown
from trainer_core.run.retry import decide_retry
from trainer_core.run.summary import attempt_summaries, steps_computed
from trainer_core.spec.operations import RetriesSection

BUDGETS = RetriesSection(infrastructure=2, code=1)


def failed(attempt, budget, step=5, message="boom", cls="TrainingCodeError", **extra):
    return AttemptRecord(
        attempt=attempt,
        status="failed",
        error_budget=budget,
        error_class=cls,
        error_step=step,
        error_message=message,
        **extra,
    )


def summaries_of(records):
    """``attempt_summaries`` of records as stored (JSON)."""
    return attempt_summaries([AttemptRecord.from_json(r) for r in records])


def test_spec_errors_and_deterministic_failures_stop():
    assert not decide_retry(failed(1, "none", cls="SpecError"), [], BUDGETS).retry
    nan = failed(1, "code", deterministic=True, message="loss became nan")
    decision = decide_retry(nan, [], BUDGETS)
    assert not decision.retry and "will repeat" in decision.reason


def test_budgets_are_separate():
    history = [failed(1, "infrastructure"), failed(2, "infrastructure", step=9)]
    assert not decide_retry(failed(3, "infrastructure", step=12), history, BUDGETS).retry
    assert decide_retry(failed(3, "code", step=12), history, BUDGETS).retry
    code_history = [failed(1, "code", step=3, message="a")]
    assert not decide_retry(failed(2, "code", step=8, message="b"), code_history, BUDGETS).retry
    assert decide_retry(failed(2, "infrastructure"), code_history, BUDGETS).retry


def test_same_error_same_step_twice_stops_even_with_budget_left():
    generous = RetriesSection(infrastructure=0, code=5)
    history = [failed(1, "code", step=15)]
    decision = decide_retry(failed(2, "code", step=15), history, generous)
    assert not decision.retry and "twice in a row" in decision.reason
    assert decide_retry(failed(2, "code", step=16), history, generous).retry


def test_preemptions_draw_on_their_own_budget_unlimited_by_default():
    history = [failed(1, "infrastructure"), failed(2, "infrastructure", step=9)]
    preempted = failed(3, "preemption", cls="PreemptedError")
    assert decide_retry(preempted, history, BUDGETS).retry  # infrastructure's is spent
    one = RetriesSection(infrastructure=2, code=1, preemption=1)
    assert decide_retry(failed(1, "preemption"), [], one).retry
    restarted = {"reason": "preemption"}
    in_place = failed(1, "preemption", restarts=[restarted])  # one spent in place already
    decision = decide_retry(in_place, [], one)
    assert not decision.retry and "preemption retry budget spent" in decision.reason
    assert not decide_retry(failed(1, "preemption"), [], RetriesSection(preemption=0)).retry


def test_retry_delays_back_off():
    assert RetriesSection(infrastructure=2, code=1, delay_s=5, backoff=2).delays() == [5, 10, 20]
    assert RetriesSection(infrastructure=0, code=0).delays() == []
    # Prefect refuses more than 50 delays and repeats the last one: a budget of 100 must run.
    many = RetriesSection(infrastructure=100, code=0, delay_s=0, jitter=0).delays()
    assert many == [0.0] * 50


@pytest.fixture
def run_location(tmp_path):
    return storage.resolve(str(tmp_path / "run"))


def test_lease_is_exclusive_while_its_holder_lives(run_location):
    held = lease.acquire(run_location, owner="a", settle_s=0)
    assert lease.acquire(run_location, owner="a", settle_s=0).owner == "a"  # re-entrant
    with pytest.raises(lease.LeaseHeldError, match="held by a"):
        lease.acquire(run_location, owner="b", settle_s=0)
    lease.release(run_location, held.owner)
    assert lease.acquire(run_location, owner="b", settle_s=0).owner == "b"


def test_expired_or_dead_leases_are_taken_over(run_location):
    lease.acquire(run_location, owner="a", ttl_s=0.01, settle_s=0)
    time.sleep(0.05)
    assert lease.acquire(run_location, owner="b", settle_s=0).owner == "b"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    record = run_location.child("lock.json").read_json()
    record.update(owner="gone", pid=int(dead.stdout), expires_at=time.time() + 3600)
    run_location.child("lock.json").write_json(record)
    assert lease.acquire(run_location, owner="c", settle_s=0).owner == "c"
    assert os.getpid() == lease.acquire(run_location, owner="c", settle_s=0).pid


def test_a_lease_read_mid_write_is_read_again_not_the_readers_error(run_location, monkeypatch):
    """A store that overwrites lock.json in place (the moto S3 server did, under a full suite's
    load) can be read mid-write: the workers' fence, renew, acquire and release read it again
    until it is whole, and call one that stays torn an outage (retried), never a parse error
    (which the workers would report as the training code's)."""
    from trainer_core.errors import StorageUnavailableError
    from trainer_core.storage import conditional_write, locations

    held = lease.acquire(run_location, owner="a", settle_s=0)
    path = run_location.child("lock.json")
    whole = path.read_bytes()
    torn = whole[:-20] + b"\xa5" + whole  # a shorter write over a longer one, and a cut byte

    def heal_later() -> None:
        time.sleep(0.3)
        path.write_bytes(whole)

    for read in (
        lambda: RunDirectory(run_location).check_lease("a"),
        lambda: lease.renew(run_location, held),
        lambda: conditional_write.read(path),
        lambda: lease.release(run_location, "b"),  # not b's: nothing is deleted
    ):
        path.write_bytes(torn)
        healer = threading.Thread(target=heal_later)
        healer.start()
        read()
        healer.join()
    assert path.read_json()["owner"] == "a"
    monkeypatch.setattr(locations, "TORN_READ_PATIENCE_S", 0.2)
    path.write_bytes(torn)
    with pytest.raises(StorageUnavailableError, match="stayed unreadable"):
        RunDirectory(run_location).check_lease("a")
    with pytest.raises(StorageUnavailableError, match="stayed unreadable"):
        lease.renew(run_location, held)


def test_attempt_records_read_mid_write_are_read_again(run_location):
    """attempts.jsonl is rewritten whole at each attempt's end, and read meanwhile by the
    retry decision, the catalog, and the lease tests' own polling (which saw it torn on the
    moto server in a full-suite run of d679fd6): a torn read is read again until it parses."""
    run_dir = RunDirectory(run_location)
    run_dir.record_attempt({"attempt": 1, "status": "failed"})
    path = run_location.child("attempts.jsonl")
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])

    def heal_later() -> None:
        time.sleep(0.3)
        path.write_bytes(whole)

    healer = threading.Thread(target=heal_later)
    healer.start()
    assert [r["status"] for r in run_dir.read_attempts()] == ["failed"]
    healer.join()


def test_renew_refuses_a_lease_taken_over(run_location):
    held = lease.acquire(run_location, owner="a", ttl_s=0.01, settle_s=0)
    time.sleep(0.05)
    lease.acquire(run_location, owner="b", settle_s=0)
    with pytest.raises(lease.LeaseHeldError, match="taken over"):
        lease.renew(run_location, held)


def _race(location, owners: int) -> list[str]:
    """``owners`` threads acquire the free lease at the same moment; the winners."""
    start = threading.Barrier(owners)
    won: list[str] = []

    def contend(name: str) -> None:
        start.wait()
        with contextlib.suppress(lease.LeaseHeldError):
            won.append(lease.acquire(location, owner=name, settle_s=0).owner)

    threads = [threading.Thread(target=contend, args=(f"flow-{i}",)) for i in range(owners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won


def test_of_flows_racing_for_a_free_lease_exactly_one_wins(tmp_path):
    """Compare-and-swap on a local disk: however the reads and writes of 8 racing acquires
    interleave, one owner wins and lock.json names it (20 races)."""
    for race in range(20):
        location = storage.resolve(str(tmp_path / f"run-{race}"))
        won = _race(location, 8)
        assert len(won) == 1, (race, won)
        assert location.child("lock.json").read_json()["owner"] == won[0]


def test_attempt_summaries_count_steps_lost():
    records = [
        {
            "attempt": 1,
            "status": "failed",
            "last_step": 27,
            "resumed_from_step": 0,
            "started_at": 10.0,
            "ended_at": 15.0,
            "error_class": "InfrastructureError",
        },
        {"attempt": 2, "status": "completed", "last_step": 60, "resumed_from_step": 20},
    ]
    first, second = summaries_of(records)
    assert first.steps_lost == 7 and first.duration_s == 5.0
    assert second.steps_lost is None
    assert first.restarts == []


def test_steps_computed_count_every_step_run_again():
    restart = {"last_step": 33, "resumed_from_step": 30}
    records = [
        {"attempt": 1, "status": "failed", "last_step": 27, "resumed_from_step": 0},
        {
            "attempt": 2,
            "status": "completed",
            "last_step": 60,
            "resumed_from_step": 20,
            "restarts": [restart],
        },
    ]
    # 27 steps, then 20 -> 60 (40) with 3 of them (31-33) run twice: 70 computed, 60 kept
    assert steps_computed(summaries_of(records)) == 27 + 40 + 3
    assert steps_computed(summaries_of(records[:1])) == 27
    unknown = [{"attempt": 1, "status": "completed", "last_step": 10, "resumed_from_step": None}]
    assert steps_computed(summaries_of(unknown)) is None
    never_ran = [{"attempt": 1, "status": "failed", "last_step": None, "resumed_from_step": 0}]
    assert steps_computed(summaries_of(never_ran)) == 0
    # a group that failed again while starting (no resume) rewound nothing: the next group's
    # resume counts from the same last step
    restarts = [
        {"last_step": 50, "resumed_from_step": 40},
        {"last_step": 55},
        {"last_step": 55, "resumed_from_step": 40},
    ]
    twice = [
        {
            "attempt": 1,
            "status": "completed",
            "last_step": 80,
            "resumed_from_step": 0,
            "restarts": restarts,
        }
    ]
    assert steps_computed(summaries_of(twice)) == 80 + 10 + 15


def test_in_place_restarts_are_summarized_under_their_attempt():
    restart = {
        "restart": 1,
        "failed_at": 100.0,
        "last_step": 23,
        "error_class": "InfrastructureError",
        "error_message": "rank 1 died",
        "resumed_from_step": 20,
        "resumed_at": 112.5,
    }
    records = [{"attempt": 1, "status": "completed", "last_step": 39, "restarts": [restart]}]
    (summary,) = summaries_of(records)
    (summarized,) = summary.restarts
    assert summarized.steps_lost == 3 and summarized.recovery_s == 12.5
    assert summarized.error_class == "InfrastructureError"


def test_resizes_say_their_world_sizes_and_reason():
    shrink = {
        "restart": 1,
        "reason": "infrastructure",
        "failed_at": 100.0,
        "last_step": 23,
        "world_size_before": 3,
        "error_class": "InfrastructureError",
        "error_message": "node lost",
        "resumed_from_step": 20,
        "resumed_at": 104.0,
        "world_size_after": 2,
    }
    grow = {"restart": 2, "reason": "capacity", "failed_at": 150.0, "last_step": 61}
    grow |= {"world_size_before": 2, "resumed_from_step": 60, "resumed_at": 160.0}
    grow["world_size_after"] = 3
    records = [{"attempt": 1, "status": "completed", "last_step": 80, "restarts": [shrink, grow]}]
    (summary,) = summaries_of(records)
    first, second = summary.restarts
    assert (first.world_size_before, first.world_size_after, first.steps_lost) == (3, 2, 3)
    assert (second.reason, second.world_size_after, second.recovery_s) == ("capacity", 3, 10.0)


def test_epoch_table_and_markdown(tmp_path):
    history = [
        {"step": s, "epoch": (s - 1) // 2, "loss": float(s), "lr": 0.1} for s in (1, 2, 3, 4)
    ]
    history[1]["val_loss"] = 0.5
    history[3].update(val_loss=0.25, val_accuracy=0.9)
    table = epoch_table(history)
    assert table == [
        {"epoch": 0, "last_step": 2, "train_loss": 1.5, "val_loss": 0.5, "lr": 0.1},
        {
            "epoch": 1,
            "last_step": 4,
            "train_loss": 3.5,
            "val_loss": 0.25,
            "val_accuracy": 0.9,
            "lr": 0.1,
        },
    ]
    from flows.pytest_plugin import tiny_spec_dict
    from trainer_core.run.summary import build_result
    from trainer_core.spec.overrides import build_spec

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


def test_an_acquire_racing_its_own_keeper_keeps_the_lease(run_location, monkeypatch):
    """The train task re-acquires the lease the flow's keeper renews: when the renewal lands
    between the acquire's read and its write, the lease is still this owner's, not lost."""
    held = lease.acquire(run_location, owner="a", settle_s=0)
    real_write = lease.conditional_write.write
    calls = []

    def renewed_in_between(location, value, version):
        if not calls:  # the keeper renews after the acquire read the record
            calls.append(1)
            real_write(location, {**held.to_json(), "expires_at": time.time() + 60}, version)
        return real_write(location, value, version)

    monkeypatch.setattr(lease.conditional_write, "write", renewed_in_between)
    assert lease.acquire(run_location, owner="a", settle_s=0).owner == "a"
    assert run_location.child("lock.json").read_json()["owner"] == "a"


def test_retry_budgets_count_this_flow_runs_failures_only(tmp_path):
    """A long run relaunched after maintenance: its first flow run spent both infrastructure
    retries (attempts 1-3 failed); the relaunch's first failure (attempt 4) is retried, as
    Prefect's ``retries`` are per flow run. Within one flow run the budget still binds."""
    from tasks.train import _decide
    from tests.conftest import tiny_raw
    from trainer_core.errors import InfrastructureError
    from trainer_core.run import attempts
    from trainer_core.spec.overrides import build_spec

    spec = build_spec(tiny_raw(tmp_path, "relaunched", retries={"infrastructure": 2}))
    run_dir = RunDirectory.of(str(tmp_path), "relaunched")
    for number in (1, 2, 3):  # the first flow run's attempts, as the engine records them
        attempts.write(run_dir, failed(number, "infrastructure", step=10 * number))
    first_flow = _decide(spec, run_dir, InfrastructureError("node lost"), 4, first_attempt=1)
    assert not first_flow.retry and "budget spent" in first_flow.reason

    attempts.write(run_dir, failed(4, "infrastructure", step=40))  # the relaunch's first
    relaunch = _decide(spec, run_dir, _at(InfrastructureError("node lost"), 4), 5, first_attempt=4)
    assert relaunch.retry, relaunch.reason
    for number in (5, 6):
        attempts.write(run_dir, failed(number, "infrastructure", step=10 * number))
    spent = _decide(spec, run_dir, _at(InfrastructureError("node lost"), 6), 7, first_attempt=4)
    assert not spent.retry and "2 of 2 retries used" in spent.reason
    # The verdicts are recorded on the attempts they decided.
    recorded = {r.attempt: r.retry_decision for r in attempts.read(run_dir)}
    assert recorded[4] == relaunch.reason and recorded[6] == spent.reason


def _at(error, attempt):
    error.attempt = attempt
    return error


def test_a_finalize_whose_lease_lapsed_takes_it_back_only_over_the_summary_setup_saw(
    run_location,
):
    """This flow's lease lapsed and another flow took the run: when that flow wrote no
    summary, finalize takes the freed lease back; when it wrote one, finalize is refused (the
    lease stays free, the other summary's bytes as they were)."""
    summary = RunDirectory(run_location).summary_file
    for other_wrote in (False, True):
        lease.acquire(run_location, owner="this", ttl_s=0.01, settle_s=0)
        seen = lease.summary_version(run_location)  # setup
        time.sleep(0.02)
        lease.acquire(run_location, owner="other", settle_s=0)
        if other_wrote:
            summary.write_json({"schema": 1, "status": "completed", "owner": "other"})
        lease.release(run_location, "other")
        theirs = summary.read_bytes() if other_wrote else None
        if not other_wrote:
            assert lease.acquire_to_finalize(run_location, "this", seen).owner == "this"
            lease.release(run_location, "this")
            continue
        with pytest.raises(lease.LeaseHeldError, match=r"summary\.json was written since"):
            lease.acquire_to_finalize(run_location, "this", seen)
        assert summary.read_bytes() == theirs
        assert not RunDirectory(run_location).lease_file.exists()
