"""The LR schedule across a checkpoint, as the loop restores it (the optimizer's state, then the
schedule's, each through the checkpoint's bytes): a resume with the same spec goes on exactly;
a resume that asks for more epochs (another ``total_steps``) goes on from the LR the run had,
without a jump, and ends where the schedule ends; a changed ``optimizer.lr`` applies from the
resumed step on. The oracle is the LR an uninterrupted scheduler recorded at each step."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from trainer_core.checkpoint import optimizers, schedules, training_state
from trainer_core.spec.optimization import OptimizerSection, ScheduleSection

COSINE = ScheduleSection(epochs=2, lr_schedule="cosine", warmup_steps=5)


def train(
    total_steps: int,
    last_step: int,
    resume: dict[str, Any] | None = None,
    lr: float = 0.01,
    schedule: ScheduleSection = COSINE,
) -> tuple[dict[int, float], dict[str, Any]]:
    """Optimizer steps to ``last_step`` (from ``resume``'s step, or 0) under a schedule to
    ``total_steps``: the LR after each step, by step, and the checkpoint after the last one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = optimizers.make_optimizer(model.parameters(), OptimizerSection(lr=lr))
    scheduler = schedules.make_scheduler(optimizer, schedule, total_steps)
    first = 1
    lrs: dict[int, float] = {}
    if resume is not None:
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        first = resume["step"] + 1
        lrs[resume["step"]] = optimizer.param_groups[0]["lr"]  # as restored
    for step in range(first, last_step + 1):
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
        lrs[step] = optimizer.param_groups[0]["lr"]
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    checkpoint = training_state.from_bytes(training_state.to_bytes(state))  # weights_only
    return lrs, {**checkpoint, "step": last_step}


def test_a_resume_with_the_same_spec_keeps_the_schedule_exactly():
    whole, _ = train(26, 26)
    _, checkpoint = train(26, 13)
    resumed, _ = train(26, 26, resume=checkpoint)
    assert [resumed[s] for s in range(13, 27)] == [whole[s] for s in range(13, 27)]


@pytest.mark.parametrize("resume_step", [13, 26])
def test_more_steps_continue_from_the_lr_the_run_had(resume_step):
    """A 2-epoch run of 26 steps continued to 52 (4 epochs): from the middle of its decay (13)
    and from its end (26)."""
    whole, _ = train(26, 26)
    _, checkpoint = train(26, resume_step)
    continued, _ = train(52, 52, resume=checkpoint)
    had = whole[resume_step]
    assert continued[resume_step] == had  # the restored LR is the one the run had there
    # No jump: the first step after the resume changes the LR by no more than the 2-epoch
    # schedule's own step there did (a decay over more steps is slower).
    own_change = abs(whole[resume_step] - whole[resume_step - 1])
    assert abs(continued[resume_step + 1] - had) <= own_change
    assert continued[resume_step + 1] <= had
    # It decays, never rising, to the cosine's end value (0) at the new last step.
    lrs = [continued[s] for s in range(resume_step, 53)]
    assert all(b <= a for a, b in itertools.pairwise(lrs))
    assert continued[52] == pytest.approx(0.0, abs=1e-12)
    if resume_step == 13:  # from the middle, the longer run trains on (a slower decay)
        assert continued[26] > whole[26] and continued[40] > 0
        # and a resume of the continued run keeps its schedule exactly
        _, again = train(52, 40, resume=checkpoint)
        resumed, _ = train(52, 52, resume=again)
        assert [resumed[s] for s in range(40, 53)] == [continued[s] for s in range(40, 53)]


def test_a_changed_lr_applies_from_the_resumed_step():
    """optimizer.lr 0.01, then 0.001 from a checkpoint at step 13: the restored optimizer's
    rate does not override the new one; the schedule's factor goes on."""
    whole, _ = train(26, 26, lr=0.01)
    _, checkpoint = train(26, 13, lr=0.01)
    resumed, _ = train(26, 26, resume=checkpoint, lr=0.001)
    for step in range(13, 27):
        assert resumed[step] == pytest.approx(whole[step] / 10, rel=1e-12), step
