import contextlib
import json
import pickle
import random
from dataclasses import replace

import numpy as np
import pytest
import ray
import torch
from ray.train import ControllerError, WorkerGroupError

from trainer_core.checkpoint import schedules, training_state
from trainer_core.errors import (
    ClusterCapacityError,
    IncompatibleRunError,
    InfrastructureError,
    PreemptedError,
    SpecError,
    TrainingCodeError,
)
from trainer_core.execution.classify import classify
from trainer_core.spec.optimization import ScheduleSection
from trainer_core.spec.sections import ModelSection
from trainer_core.train import workloads


def test_errors_pickle_with_their_fields():
    error = TrainingCodeError("boom", error_type="ValueError", step=7, rank=1, deterministic=True)
    clone = pickle.loads(pickle.dumps(error))
    assert (clone.error_type, clone.step, clone.rank, clone.deterministic) == (
        "ValueError",
        7,
        1,
        True,
    )
    assert str(clone) == "boom" and clone.is_repeat_of(error)
    spec_error = pickle.loads(pickle.dumps(ClusterCapacityError("x", field="scaling")))
    assert spec_error.field == "scaling" and spec_error.budget == "none"
    assert InfrastructureError("y", step=3).budget == "infrastructure"


def test_repeat_detection_needs_same_step():
    a = TrainingCodeError("boom", error_type="ValueError", step=7)
    assert not a.is_repeat_of(TrainingCodeError("boom", error_type="ValueError", step=8))


def test_classify_worker_group_failures():
    code = TrainingCodeError("bad", error_type="KeyError", step=4)
    peer = InfrastructureError("lost a peer")
    assert classify(WorkerGroupError("x", {0: peer, 1: code})) is code
    spec = SpecError("bad kwargs")
    assert classify(WorkerGroupError("x", {0: code, 1: spec})) is spec
    died = classify(WorkerGroupError("x", {1: ray.exceptions.ActorDiedError()}))
    assert isinstance(died, InfrastructureError)
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    health = WorkerHealthCheckFailedError("health check failed", ray.exceptions.ActorDiedError())
    assert isinstance(classify(WorkerGroupError("x", {1: health})), InfrastructureError)
    plain = classify(WorkerGroupError("x", {0: ZeroDivisionError("z")}))
    assert isinstance(plain, TrainingCodeError) and plain.error_type == "ZeroDivisionError"


def test_a_preempted_rank_makes_the_attempt_a_preemption():
    from ray.train.v2._internal.exceptions import WorkerHealthCheckFailedError

    reclaimed = ray.exceptions.RayActorError(preempted=True)
    health = WorkerHealthCheckFailedError("health check failed", reclaimed)
    collateral = RuntimeError("Connection reset by peer")  # the surviving rank's collective
    error = classify(WorkerGroupError("x", {0: collateral, 1: health}))
    assert isinstance(error, InfrastructureError) and "preempted" in str(error)
    assert "[1]" in str(error) and error.budget == "preemption"
    not_preempted = classify(WorkerGroupError("x", {1: ray.exceptions.RayActorError()}))
    assert "preempted" not in str(not_preempted)
    assert not_preempted.budget == "infrastructure"


def test_a_preemption_is_blamed_once(monkeypatch):
    """A node drains and is reclaimed: the failure then is a preemption. A node killed later in
    the same attempt is not (a chaos run saw it charged to the preemption budget)."""
    from trainer_core.execution import classify as module

    cluster = {"draining": {"n1"}, "reclaimed": set()}
    monkeypatch.setattr(module, "draining_nodes", lambda due_only=True: set(cluster["draining"]))
    monkeypatch.setattr(module, "preempted_nodes", lambda: set(cluster["reclaimed"]))
    first, blamed = module.name_preemption_now(InfrastructureError("peer lost"), set())
    assert first.budget == "preemption" and blamed == {"n1"}
    cluster.update(draining=set(), reclaimed={"n1"})  # the drained node is gone now
    later, again = module.name_preemption_now(InfrastructureError("node lost"), blamed)
    assert later.budget == "infrastructure" and again == set()
    # the attempt's end, deciding with what the in-place restarts answered, agrees
    ended = module.name_preemption(InfrastructureError("node lost"), blamed, settle_s=0)
    assert ended.budget == "infrastructure"
    assert module.name_preemption(InfrastructureError("x"), set(), settle_s=0).budget == (
        "preemption"
    )
    # Ray's watcher named the preemption itself (a chaos run: a node killed afterwards was
    # charged to it, as the drained node was not marked answered)
    cluster.update(draining={"n2"}, reclaimed={"n1"})
    named, answered = module.name_preemption_now(PreemptedError("preempted: n2"), blamed)
    assert named.budget == "preemption" and answered == {"n2"}
    cluster.update(draining=set(), reclaimed={"n1", "n2"})
    killed, none = module.name_preemption_now(InfrastructureError("n3 lost"), blamed | answered)
    assert killed.budget == "infrastructure" and none == set()


def test_classify_controller_death_as_incompatible_run():
    error = classify(ControllerError(ray.exceptions.ActorDiedError()))
    assert isinstance(error, IncompatibleRunError) and "run.name" in str(error)


def test_cancellation_passes_through():
    interrupt = KeyboardInterrupt()
    assert classify(interrupt) is interrupt


def test_rng_roundtrip_is_exact_and_safe_to_load():
    training_state.seed_everything(5)
    state = training_state.from_bytes(training_state.to_bytes(training_state.capture_rng()))
    expected = (random.random(), np.random.rand(), torch.rand(1))
    training_state.restore_rng(state)
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])
    # across ranks (pickled, as dist.gather_object does), then written, it still restores exactly
    training_state.seed_everything(6)
    sent = pickle.loads(pickle.dumps(training_state.rng_to_send(training_state.capture_rng())))
    expected = (random.random(), np.random.rand(), torch.rand(1))
    received = training_state.rng_received(sent)
    training_state.restore_rng(training_state.from_bytes(training_state.to_bytes(received)))
    assert (random.random(), np.random.rand()) == expected[:2]
    assert torch.equal(torch.rand(1), expected[2])


def test_lr_schedule_shapes():
    cosine = ScheduleSection(epochs=1, lr_schedule="cosine", warmup_steps=10)
    assert schedules.lr_factor(0, cosine, 110) == pytest.approx(0.1)
    assert schedules.lr_factor(10, cosine, 110) == pytest.approx(1.0)
    assert schedules.lr_factor(110, cosine, 110) == pytest.approx(0.0)
    step = ScheduleSection(epochs=1, lr_schedule="step", step_size=5, gamma=0.5)
    assert schedules.lr_factor(12, step, 100) == pytest.approx(0.25)


def test_models_build_and_bad_ones_are_spec_errors():
    cnn = workloads.build_model(ModelSection(name="cnn"), 64, 10)
    assert cnn(torch.zeros(3, 64)).shape == (3, 10)
    mlp = workloads.build_model(ModelSection(name="mlp", kwargs={"hidden": [4]}), 5, 1)
    assert mlp(torch.zeros(2, 5)).shape == (2, 1)
    with pytest.raises(SpecError, match="image_shape"):
        workloads.build_model(ModelSection(name="cnn"), 10, 2)
    with pytest.raises(SpecError, match=r"rejected model\.kwargs"):
        workloads.build_model(ModelSection(name="mlp", kwargs={"depth": 3}), 5, 1)
    with pytest.raises(SpecError, match="no attribute"):
        workloads.build_model(ModelSection(name="trainer_core.train.workloads:nothing"), 5, 1)
    with pytest.raises(SpecError, match=r"not a torch\.nn\.Module"):
        workloads.build_model(ModelSection(name="operator:add"), 5, 1)


def test_user_model_import_path():
    model = workloads.build_model(ModelSection(name="trainer_core.train.workloads:MLP"), 3, 2)
    assert isinstance(model, torch.nn.Module)


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


def test_restart_limits_follow_the_spec(tmp_path):
    from tests.conftest import tiny_raw
    from trainer_core.execution.trainer import restart_limits
    from trainer_core.spec.overrides import build_spec

    fixed = build_spec(tiny_raw(tmp_path, "r"))  # the default: one restart in place
    assert restart_limits(fixed) == {"infrastructure": 1, "preemption": None}
    every_failure_retried = build_spec(tiny_raw(tmp_path, "r"), ["retries.in_place=0"])
    assert restart_limits(every_failure_retried) == {"infrastructure": 0, "preemption": None}
    elastic = build_spec(
        tiny_raw(tmp_path, "r"), ["scaling.num_workers=[1, 3]", "retries.preemption=4"]
    )
    limits = restart_limits(elastic)
    infrastructure = elastic.retries.infrastructure  # tiny_raw sets its own
    assert limits == {"infrastructure": infrastructure, "preemption": 4, "startup": infrastructure}


def test_early_stopping_counts_epochs_without_improvement_and_survives_json():
    from trainer_core.checkpoint.training_state import EarlyStopping
    from trainer_core.spec.optimization import EarlyStoppingSection

    section = EarlyStoppingSection(metric="val_loss", mode="min", patience=2, min_delta=0.1)
    state = EarlyStopping()
    assert not state.update(section, 1, 1.0)  # the first measure is the best so far
    assert not state.update(section, 2, 0.95)  # better, but not by more than min_delta
    assert state.bad_epochs == 1 and state.best == 1.0
    restored = EarlyStopping.from_json(json.loads(json.dumps(state.to_json())))
    assert restored == state
    assert not restored.update(section, 3, None)  # not measured: no verdict
    assert not restored.update(section, 3, 0.8)  # improved: patience starts again
    assert (restored.best, restored.best_epoch, restored.bad_epochs) == (0.8, 3, 0)
    assert not restored.update(section, 4, float("nan"))  # not a number: no improvement
    assert restored.update(section, 5, 0.75) and restored.stopped
    assert "after epoch 5" in restored.stopped and "best 0.8 after epoch 3" in restored.stopped
    rising = EarlyStoppingSection(metric="val_accuracy", mode="max", patience=1)
    state = EarlyStopping()
    assert not state.update(rising, 1, 0.5) and not state.update(rising, 2, 0.6)
    assert state.update(rising, 3, 0.6)  # equal is not better


def test_gradients_accumulated_over_micro_batches_equal_one_batch_of_them_all():
    from trainer_core.train.steps import accumulate_gradients

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    features, labels = torch.randn(13, 5), torch.randint(0, 3, (13,))
    loss_fn = torch.nn.functional.cross_entropy

    def gradients(parts: list[tuple[int, int]]) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        batches = [(features[a:b], labels[a:b]) for a, b in parts]
        loss = accumulate_gradients(model, batches, loss_fn)
        return float(loss), [p.grad.clone() for p in model.parameters()]

    whole_loss, whole = gradients([(0, 13)])
    assert whole_loss == float(loss_fn(model(features), labels).detach())
    for parts in ([(0, 8), (8, 13)], [(0, 4), (4, 8), (8, 12), (12, 13)]):
        loss, grads = gradients(parts)  # unequal micro-batches weigh by their samples
        assert abs(loss - whole_loss) < 1e-6
        for a, b in zip(grads, whole, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    class Replica(torch.nn.Module):
        """Records which backward passes ran under no_sync, as DDP would skip their all-reduce."""

        def __init__(self) -> None:
            super().__init__()
            self.inner, self.synced, self.syncing = model, [], True

        @contextlib.contextmanager
        def no_sync(self):
            self.syncing = False
            yield
            self.syncing = True

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.synced.append(self.syncing)
            return self.inner(x)

    replica = Replica()
    accumulate_gradients(replica, [(features[:4], labels[:4])] * 3, loss_fn)
    assert replica.synced == [False, False, True]


def test_the_optimizer_step_clips_the_gradients_total_norm():
    from trainer_core.train.steps import optimizer_step

    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    model.weight.grad = torch.tensor([[3.0, 4.0, 0.0]])  # norm 5
    assert optimizer_step(optimizer, model, 0.5) == pytest.approx(5.0)
    # SGD with lr 1 moves the weights by the clipped gradient: norm 0.5, same direction.
    assert torch.allclose(model.weight, torch.tensor([[-0.3, -0.4, 0.0]]))
    model.weight.grad = torch.tensor([[0.3, 0.4, 0.0]])  # within the bound: untouched
    assert optimizer_step(optimizer, model, 0.5) == pytest.approx(0.5)
    assert torch.allclose(model.weight, torch.tensor([[-0.6, -0.8, 0.0]]))
    assert optimizer_step(optimizer, model, None) is None  # no clipping: no norm
