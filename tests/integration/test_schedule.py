"""The LR schedule when a run goes on under another spec, on 1 worker: more epochs asked
for (a finished run continued, and a failed one resumed with more), and a changed
``optimizer.lr``. The oracle is the uninterrupted 2-epoch run's recorded ``lr`` at each step."""

from __future__ import annotations

import itertools

import pytest

from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import run_dir_of
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
TWO_EPOCHS = {"epochs": 2}  # the tiny spec's cosine with warm-up: 26 steps
LAST = 26


def lr_by_step(spec) -> dict[int, float]:
    return {row["step"]: row["lr"] for row in read_metrics_history(run_dir_of(spec))}


@pytest.fixture(scope="module")
def two_epochs(ray_cluster, tmp_path_factory):
    """The uninterrupted 2-epoch run (its directory is continued by one test)."""
    raw = tiny_raw(
        tmp_path_factory.mktemp("schedule"), "two-epochs", schedule=TWO_EPOCHS, scaling=ONE_WORKER
    )
    spec = build_spec(raw)
    assert run_attempt(spec).steps_completed == LAST
    return raw, lr_by_step(spec)


def assert_continues(lrs: dict[int, float], reference: dict[int, float], resumed: int) -> None:
    """``lrs``, a run resumed at step ``resumed`` with 4 epochs (52 steps), goes on from the LR
    the 2-epoch run had there without a jump, and decays to the cosine's end value, 0, at its
    new last step."""
    assert sorted(lrs) == list(range(1, 53))
    assert lrs[resumed] == reference[resumed]
    # No jump: the step after the resume changes the LR by no more than the 2-epoch schedule's
    # own step there did (the same decay, over more steps, is slower).
    own_change = abs(reference[resumed] - reference[resumed - 1])
    assert abs(lrs[resumed + 1] - reference[resumed]) <= own_change, (lrs[resumed + 1], own_change)
    after = [lrs[step] for step in range(resumed, 53)]
    assert all(b <= a for a, b in itertools.pairwise(after))
    assert lrs[52] == pytest.approx(0.0, abs=1e-12)


def test_a_finished_run_continued_to_more_epochs_does_not_jump(two_epochs):
    raw, reference = two_epochs
    spec = build_spec(raw, ["schedule.epochs=4"])
    result = run_attempt(spec)
    assert result.resumed_from_step == LAST and result.steps_completed == 52
    lrs = lr_by_step(spec)
    assert {s: lrs[s] for s in reference} == reference  # the first 2 epochs, as they were
    assert_continues(lrs, reference, LAST)


def test_a_run_resumed_mid_schedule_with_more_epochs_does_not_jump(two_epochs, tmp_path):
    """A 2-epoch run fails at step 17 and is resumed (from step 13) with 4 epochs: the rest of
    its cosine spans the new end, decaying from the LR it had at step 13."""
    raw = tiny_raw(
        tmp_path,
        "more-epochs",
        schedule=TWO_EPOCHS,
        faults=[{"kind": "raise", "at_step": 17}],
        scaling=ONE_WORKER,
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(build_spec(raw))
    spec = build_spec(raw, ["schedule.epochs=4"])
    assert run_attempt(spec).resumed_from_step == 13
    _, reference = two_epochs
    lrs = lr_by_step(spec)
    assert_continues(lrs, reference, 13)
    assert lrs[LAST] > reference[LAST]  # it trains on: its decay is the slower one
    assert lrs[40] > 0


def test_a_changed_lr_applies_from_the_resumed_step(two_epochs, tmp_path):
    """optimizer.lr 0.01, then 0.001 from the checkpoint at step 13: the restored optimizer's
    rate does not override the spec's; the schedule's factor goes on."""
    raw = tiny_raw(
        tmp_path,
        "new-lr",
        schedule=TWO_EPOCHS,
        faults=[{"kind": "raise", "at_step": 17}],
        scaling=ONE_WORKER,
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(build_spec(raw))
    spec = build_spec(raw, ["optimizer.lr=0.001"])
    assert run_attempt(spec).resumed_from_step == 13
    _, reference = two_epochs
    lrs = lr_by_step(spec)
    assert {s: lrs[s] for s in range(1, 14)} == {s: reference[s] for s in range(1, 14)}
    for step in range(14, LAST + 1):
        assert lrs[step] == pytest.approx(reference[step] / 10, rel=1e-9, abs=1e-15), step
