"""Retry or stop? A pure function of the error and the attempts recorded in the run directory.

Budgets: a spec error is never retried; infrastructure failures, preemptions and training-code
failures each draw on their own budget (``retries.infrastructure``, ``retries.preemption``,
``retries.code``). A training error
that will repeat (NaN loss) stops at once, and the same training error at the same step twice
in a row is a bug, not bad luck: stop.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer_core.run.attempts import AttemptRecord
from trainer_core.spec.operations import RetriesSection


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    reason: str


def decide_retry(
    failure: AttemptRecord, attempts: Sequence[AttemptRecord], budgets: RetriesSection
) -> RetryDecision:
    """Decide whether to retry after ``failure``, the failed attempt's record; ``attempts`` are
    the earlier ones, oldest first."""
    budget, name = failure.error_budget, failure.error_class or "error"
    if budget == "none":
        return RetryDecision(False, f"{name} is not retryable: fix the input and run again")
    if failure.deterministic:
        return RetryDecision(False, f"{name} will repeat on retry: {failure.error_message}")
    failed = [a for a in attempts if a.status == "failed"]
    if budget == "code" and failed and _same_error(failed[-1], failure):
        return RetryDecision(
            False,
            f"the same {failure.error_class} at step {failure.error_step} twice "
            "in a row: a bug, not bad luck; stopping",
        )
    used = 1 + sum(1 for a in failed if a.error_budget == budget)
    if budget == "preemption":  # restarts in place draw on it too
        used += sum(
            1 for a in (*attempts, failure) for r in a.restarts if r.get("reason") == "preemption"
        )
        if budgets.preemption is None:
            return RetryDecision(True, f"preemption {used} (the budget is unlimited): resuming")
    allowed = {
        "infrastructure": budgets.infrastructure,
        "preemption": budgets.preemption or 0,
        "code": budgets.code,
    }[budget]
    if used > allowed:
        return RetryDecision(
            False, f"{budget} retry budget spent ({used - 1} of {allowed} retries used): stopping"
        )
    return RetryDecision(True, f"{budget} failure {used} of {allowed + 1} allowed: resuming")


def _same_error(previous: AttemptRecord, current: AttemptRecord) -> bool:
    return previous.attempt != current.attempt and (
        previous.error_class,
        previous.error_type,
        previous.error_step,
        previous.error_message,
    ) == (current.error_class, current.error_type, current.error_step, current.error_message)
