import contextlib
import json
import pickle
import random

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
