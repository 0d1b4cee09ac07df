"""The retry decision (``trainer_core.run.retry``): which failures stop, the separate budgets,
their back-off, and that a flow run counts only its own failures."""

from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.retry import decide_retry
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
