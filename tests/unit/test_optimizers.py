"""The optimizer and LR scheduler a spec names: torch's own by import path with their kwargs,
no default of relaytrain's that changes the math (the oracle: the optimizer torch builds with
the same arguments), and an imported scheduler stepped per step or per epoch (on a validation
metric for ReduceLROnPlateau) that resumes exactly through the checkpoint's bytes (the oracle:
the uninterrupted run, and the rates the scheduler's rule gives in closed form)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import tiny_raw
from trainer_core.checkpoint import optimizers, schedules, training_state
from trainer_core.errors import SpecError
from trainer_core.spec.optimization import OptimizerSection, ScheduleSection
from trainer_core.spec.overrides import build_spec


def params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    return list(torch.nn.Linear(3, 1).parameters())


def test_sgd_is_plain_sgd_unless_momentum_is_asked_for():
    """Porting ``torch.optim.SGD(params, lr=0.1)`` gives that SGD: no momentum of relaytrain's."""
    built = optimizers.make_optimizer(params(), OptimizerSection(name="sgd", lr=0.1))
    assert (
        built.param_groups[0]["momentum"] == torch.optim.SGD(params(), lr=0.1).defaults["momentum"]
    )
    asked = optimizers.make_optimizer(params(), OptimizerSection(name="sgd", momentum=0.9))
    assert asked.param_groups[0]["momentum"] == 0.9


def test_adamw_keeps_its_own_weight_decay_and_lr():
    built = optimizers.make_optimizer(params(), OptimizerSection(name="adamw"))
    torch_own = torch.optim.AdamW(params()).defaults
    assert built.defaults["weight_decay"] == torch_own["weight_decay"]
    assert built.defaults["lr"] == torch_own["lr"]


def test_an_imported_optimizer_gets_its_kwargs_and_its_own_defaults():
    section = OptimizerSection(name="torch.optim:Adadelta", kwargs={"rho": 0.8})
    built = optimizers.make_optimizer(params(), section)
    assert type(built) is torch.optim.Adadelta
    expected = torch.optim.Adadelta(params(), rho=0.8).defaults
    assert built.defaults == expected  # lr 1.0: Adadelta's, not relaytrain's 1e-3


def test_short_names_take_kwargs_too():
    section = OptimizerSection(name="adam", kwargs={"betas": [0.8, 0.9], "eps": 1e-6})
    built = optimizers.make_optimizer(params(), section)
    assert tuple(built.defaults["betas"]) == (0.8, 0.9) and built.defaults["eps"] == 1e-6


@pytest.mark.parametrize(
    ("section", "field", "says"),
    [
        (OptimizerSection(name="torch.optim:Adadelta", momentum=0.9), "optimizer.momentum", "rho"),
        (OptimizerSection(name="torch.optim:Adam", kwargs={"rhoo": 1}), "optimizer.kwargs", "rhoo"),
        (OptimizerSection(name="torch.optim:LBFGS"), "optimizer.name", "closure"),
        (OptimizerSection(name="torch.optim:Nope"), "optimizer.name", "Nope"),
    ],
)
def test_what_an_imported_optimizer_cannot_take_is_a_spec_error(section, field, says):
    with pytest.raises(SpecError, match=says) as error:
        optimizers.make_optimizer(params(), section)
    assert error.value.field == field


def spec_error(tmp_path, **sections: Any) -> SpecError:
    with pytest.raises(SpecError) as error:
        build_spec(tiny_raw(tmp_path, "x", **sections))
    return error.value


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_momentum_for_adam_is_refused_not_ignored(tmp_path, name):
    error = spec_error(tmp_path, optimizer={"name": name, "momentum": 0.9})
    assert error.field == "optimizer.momentum" and "betas" in str(error)


def test_lr_weight_decay_and_momentum_go_in_their_own_keys(tmp_path):
    error = spec_error(tmp_path, optimizer={"name": "sgd", "kwargs": {"momentum": 0.9}})
    assert error.field == "optimizer.kwargs" and "optimizer.momentum" in str(error)


PLATEAU = "torch.optim.lr_scheduler:ReduceLROnPlateau"


@pytest.mark.parametrize(
    ("schedule", "field"),
    [
        # two schedules of one rate
        ({"scheduler": PLATEAU, "lr_schedule": "cosine"}, "schedule.lr_schedule"),
        (
            {"scheduler": PLATEAU, "warmup_steps": 5, "lr_schedule": "constant"},
            "schedule.warmup_steps",
        ),
        # a metric is measured at the end of an epoch only
        (
            {"scheduler": PLATEAU, "scheduler_metric": "val_loss", "scheduler_interval": "step"},
            "schedule.scheduler_interval",
        ),
        # a metric the run does not measure
        ({"scheduler": PLATEAU, "scheduler_metric": "val_accuracy"}, "schedule.scheduler_metric"),
        # kwargs, an interval or a metric without a scheduler do nothing
        ({"scheduler_kwargs": {"step_size": 2}}, "schedule.scheduler_kwargs"),
    ],
)
def test_a_scheduler_with_what_it_cannot_go_with_is_refused(tmp_path, schedule, field):
    schedule = {"lr_schedule": "constant", "warmup_steps": 0, **schedule}
    assert spec_error(tmp_path, schedule=schedule).field == field


def test_a_spec_with_a_scheduler_validates_again_as_the_workers_read_it(tmp_path):
    """A worker validates the spec's dump, where every key is set (to its default)."""
    schedule = {"lr_schedule": "constant", "warmup_steps": 0, "scheduler": PLATEAU}
    spec = build_spec(
        tiny_raw(tmp_path, "x", schedule={**schedule, "scheduler_metric": "val_loss"})
    )
    assert type(spec).model_validate(spec.model_dump(mode="json")) == spec


def test_step_size_without_the_step_schedule_says_it_does_nothing(tmp_path):
    with pytest.warns(UserWarning, match="schedule.step_size does nothing"):
        build_spec(tiny_raw(tmp_path, "x", schedule={"lr_schedule": "cosine", "step_size": 7}))


def test_an_own_loop_is_told_the_scheduler_is_its_own(tmp_path):
    raw = tiny_raw(
        tmp_path,
        "x",
        train_loop="tests.own_functions:unused_layer_loop",
        train_loop_api="relaytrain",
        schedule={"lr_schedule": "constant", "warmup_steps": 0, "scheduler": PLATEAU},
    )
    del raw["model"], raw["optimizer"]
    with pytest.raises(SpecError, match=r"setup\(model, optimizer, scheduler\)") as error:
        build_spec(raw)
    assert error.value.field == "schedule.scheduler"


# -- an imported scheduler across a checkpoint ----------------------------------------------

STEPS_PER_EPOCH, EPOCHS = 4, 4


def train(
    optimizer_section: OptimizerSection,
    schedule: ScheduleSection,
    last_step: int,
    resume: dict[str, Any] | None = None,
) -> tuple[dict[int, float], dict[str, Any]]:
    """Steps to ``last_step`` as the built-in loop takes them (the scheduler after each
    optimizer step, then at an epoch's end with the epoch's val_loss, always 1.0: a plateau),
    from ``resume``'s step or 0: the LR each step trained with, and the checkpoint after the
    last step."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = optimizers.make_optimizer(model.parameters(), optimizer_section)
    scheduler = schedules.make_scheduler(optimizer, schedule, STEPS_PER_EPOCH * EPOCHS)
    first = 1
    if resume is not None:
        model.load_state_dict(resume["model"])
        optimizer.load_state_dict(resume["optimizer"])
        scheduler.load_state_dict(resume["scheduler"])
        first = resume["step"] + 1
    lrs: dict[int, float] = {}
    for step in range(first, last_step + 1):
        lrs[step] = optimizer.param_groups[0]["lr"]
        model(torch.ones(4, 3)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.after_optimizer_step()
        if step % STEPS_PER_EPOCH == 0:
            scheduler.at_epoch_end({"val_loss": 1.0})
    state = {
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
    }
    checkpoint = training_state.from_bytes(training_state.to_bytes(state))  # weights_only
    return lrs, {**checkpoint, "step": last_step}


RMSPROP = OptimizerSection(name="torch.optim:RMSprop", lr=0.01, momentum=0.5)


@pytest.mark.parametrize(
    ("schedule", "factor_in_epoch"),
    [
        # StepLR stepped once an epoch: its step_size counts epochs
        (
            ScheduleSection(
                epochs=EPOCHS,
                scheduler="torch.optim.lr_scheduler:StepLR",
                scheduler_kwargs={"step_size": 1, "gamma": 0.5},
                scheduler_interval="epoch",
            ),
            lambda epoch: 0.5**epoch,
        ),
        # a plateau from the first epoch on, patience 0: halved after every epoch but the first
        (
            ScheduleSection(
                epochs=EPOCHS,
                scheduler=PLATEAU,
                scheduler_kwargs={"factor": 0.5, "patience": 0},
                scheduler_metric="val_loss",
            ),
            lambda epoch: 0.5 ** max(epoch - 1, 0),
        ),
    ],
    ids=["step_lr_per_epoch", "plateau_on_val_loss"],
)
@pytest.mark.parametrize("resume_step", [6, 8])  # mid-epoch, and just after an epoch's end
def test_an_epoch_stepped_scheduler_resumes_exactly(schedule, factor_in_epoch, resume_step):
    last = STEPS_PER_EPOCH * EPOCHS
    whole, whole_end = train(RMSPROP, schedule, last)
    for step, lr in whole.items():
        epoch = (step - 1) // STEPS_PER_EPOCH
        assert lr == pytest.approx(0.01 * factor_in_epoch(epoch), rel=1e-12), step
    _, checkpoint = train(RMSPROP, schedule, resume_step)
    resumed, resumed_end = train(RMSPROP, schedule, last, resume=checkpoint)
    assert resumed == {s: whole[s] for s in range(resume_step + 1, last + 1)}
    for name, tensor in whole_end["model"].items():
        assert torch.equal(resumed_end["model"][name], tensor), name


def test_a_scheduler_whose_step_needs_a_metric_needs_schedule_scheduler_metric():
    schedule = ScheduleSection(epochs=1, scheduler=PLATEAU, scheduler_interval="epoch")
    optimizer = optimizers.make_optimizer(params(), OptimizerSection())
    with pytest.raises(SpecError, match="scheduler_metric") as error:
        schedules.make_scheduler(optimizer, schedule, 4)
    assert error.value.field == "schedule.scheduler_metric"


def test_scheduler_kwargs_it_does_not_take_are_a_spec_error():
    schedule = ScheduleSection(
        epochs=1, scheduler="torch.optim.lr_scheduler:StepLR", scheduler_kwargs={"gama": 0.5}
    )
    optimizer = optimizers.make_optimizer(params(), OptimizerSection())
    with pytest.raises(SpecError, match="gama") as error:
        schedules.make_scheduler(optimizer, schedule, 4)
    assert error.value.field == "schedule.scheduler_kwargs"


class KeepsAnObject(torch.optim.lr_scheduler.LambdaLR):
    """A scheduler whose state holds an object a checkpoint's weights_only load refuses."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer, lambda step: 1.0)
        self.where = torch.device("cpu")
        self.kind = KeepsAnObject  # a class: pickled by reference, refused on load


def test_a_scheduler_whose_state_a_checkpoint_cannot_load_back_is_refused_at_setup():
    schedule = ScheduleSection(epochs=1, scheduler="tests.unit.test_optimizers:KeepsAnObject")
    with pytest.raises(SpecError, match="weights_only") as error:
        optimizers.check_optimizer_and_schedule(OptimizerSection(), schedule, total_steps=4)
    assert error.value.field == "schedule.scheduler"
    plain = ScheduleSection(
        epochs=1, scheduler="torch.optim.lr_scheduler:StepLR", scheduler_kwargs={"step_size": 2}
    )
    optimizers.check_optimizer_and_schedule(OptimizerSection(), plain, total_steps=4)


def test_a_resume_says_which_optimizer_settings_the_checkpoint_kept():
    """torch's load_state_dict restores each group's settings: a changed momentum does not
    apply to a resumed run, and the loop says so (the rate is the schedule's)."""
    checkpoint = optimizers.make_optimizer(params(), OptimizerSection(name="sgd", momentum=0.9))
    resumed = optimizers.make_optimizer(params(), OptimizerSection(name="sgd", lr=0.5))
    built = optimizers.hyperparameters(resumed)
    assert optimizers.kept_by_checkpoint(built, resumed) is None
    resumed.load_state_dict(checkpoint.state_dict())
    kept = optimizers.kept_by_checkpoint(built, resumed)
    assert kept is not None and "momentum 0.9 (the spec's 0)" in kept and "lr" not in kept
