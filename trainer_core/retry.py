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
from typing import Any

from trainer_core.spec import RetriesSection


@dataclass(frozen=True)
class RetryDecision:
    retry: bool
    reason: str


def decide_retry(
    failure: dict[str, Any], attempts: Sequence[dict[str, Any]], budgets: RetriesSection
) -> RetryDecision:
    """Decide whether to retry after ``failure``.

    ``failure`` and ``attempts`` are attempt records (``attempts.jsonl``): ``error_budget``
    ("none" | "infrastructure" | "preemption" | "code"), ``error_class``, ``error_message``,
    ``error_step``, ``deterministic``, ``restarts``. ``attempts`` are the earlier ones, oldest
    first (``failure`` excluded).
    """
    budget = failure.get("error_budget", "none")
    name = failure.get("error_class", "error")
    if budget == "none":
        return RetryDecision(False, f"{name} is not retryable: fix the input and run again")
    if failure.get("deterministic"):
        return RetryDecision(False, f"{name} will repeat on retry: {failure.get('error_message')}")
    failed = [a for a in attempts if a.get("status") == "failed"]
    if budget == "code" and failed and _same_error(failed[-1], failure):
        return RetryDecision(
            False,
            f"the same {failure.get('error_class')} at step {failure.get('error_step')} twice "
            "in a row: a bug, not bad luck; stopping",
        )
    used = 1 + sum(1 for a in failed if a.get("error_budget") == budget)
    if budget == "preemption":  # restarts in place draw on it too
        used += sum(
            1
            for a in (*attempts, failure)
            for r in a.get("restarts") or []
            if r.get("error_budget") == "preemption"
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


def _same_error(previous: dict[str, Any], current: dict[str, Any]) -> bool:
    keys = ("error_class", "error_type", "error_step", "error_message")
    return previous.get("attempt") != current.get("attempt") and all(
        previous.get(k) == current.get(k) for k in keys
    )
