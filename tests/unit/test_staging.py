"""Asynchronous checkpoints: staging copies, the background queue, streamed hashed writes."""

from __future__ import annotations

import collections
import threading

import pytest
import torch

from trainer_core.checkpoint import training_state
from trainer_core.checkpoint.files import file_digest
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.checkpoint.staging import Background, Stager
from trainer_core.storage.uris import resolve


def test_staged_state_is_a_copy_that_reuses_its_buffers():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    stager = Stager()
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    first = stager.stage(state)
    weight = first["model"]["weight"]
    assert torch.equal(weight, model.weight)
    assert weight.data_ptr() != model.weight.data_ptr()
    assert first["optimizer"]["param_groups"] == optimizer.state_dict()["param_groups"]
    assert first["optimizer"]["param_groups"] is not state["optimizer"]["param_groups"]

    with torch.no_grad():
        model.weight.add_(1.0)  # training goes on: the staged copy must not move
    assert not torch.equal(weight, model.weight)

    second = stager.stage({"model": model.state_dict(), "optimizer": optimizer.state_dict()})
    assert second["model"]["weight"].data_ptr() == weight.data_ptr()  # buffer kept
    assert torch.equal(second["model"]["weight"], model.weight)


def test_deferred_tensors_are_copied_when_asked_the_rest_at_once():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.BatchNorm1d(3))
    model(torch.randn(5, 4))  # batch norm's running statistics move in a forward pass
    parameters = {p.data_ptr() for p in model.parameters()}
    stager = Stager()
    staged = stager.stage(model.state_dict(), defer=lambda t: t.data_ptr() in parameters)
    assert len(stager.deferred) == 4  # linear and batch-norm weights and biases
    running_mean = model[1].running_mean.clone()

    model(torch.randn(5, 4))  # the next step's forward: buffers change
    assert torch.equal(staged["1.running_mean"], running_mean)  # copied at stage()
    assert not torch.equal(model[1].running_mean, running_mean)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a change before copy_deferred is in the copy: it is late
    stager.copy_deferred()  # the checkpoint thread
    weight = model[0].weight.detach().clone()
    assert torch.equal(staged["0.weight"], weight)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the optimizer step, after the copy
    assert torch.equal(staged["0.weight"], weight)
    assert stager.deferred == []


def test_staging_keeps_containers_and_reallocates_on_a_new_shape():
    Pair = collections.namedtuple("Pair", "a b")
    stager = Stager()
    staged = stager.stage({"t": (torch.ones(2), 3), "p": Pair(torch.zeros(1), "x"), "n": None})
    assert isinstance(staged["t"], tuple) and staged["t"][1] == 3
    assert isinstance(staged["p"], Pair) and staged["p"].b == "x"
    again = stager.stage({"t": (torch.ones(5), 3), "p": Pair(torch.zeros(1), "x"), "n": None})
    assert again["t"][0].shape == (5,)


def test_background_raises_the_jobs_error_on_the_waiting_thread():
    background = Background()
    release = threading.Event()

    def fail() -> None:
        release.wait(5)
        raise OSError("disk gone")

    background.submit(fail)
    assert not background.failed()
    release.set()
    with pytest.raises(OSError, match="disk gone"):
        background.wait()
    background.wait()  # raised once
    background.close()


def test_background_settle_swallows_and_bounds():
    background = Background()
    background.submit(lambda: (_ for _ in ()).throw(ValueError("late")))
    assert isinstance(background.settle(5), ValueError)  # returned, not raised
    blocker = threading.Event()
    background.submit(lambda: blocker.wait(10))
    assert background.settle(0.1) is None  # gives up waiting
    assert background.in_flight() == 1 and not background.jobs[0].done()
    blocker.set()
    background.close()


def test_background_queues_up_to_its_depth_and_runs_nothing_behind_a_failure():
    background = Background(depth=2)
    release = threading.Event()
    ran: list[str] = []

    def first() -> None:
        release.wait(60)  # a hang guard only: the test releases it
        ran.append("first")
        raise OSError("disk gone")

    background.submit(first)
    background.submit(lambda: ran.append("second"))  # queued: returns while first still runs
    assert background.in_flight() == 2 and ran == []
    release.set()
    with pytest.raises(OSError, match="disk gone"):
        background.wait()
    assert ran == ["first"]  # the one behind the failed write never ran
    background.wait()  # raised once
    background.close()


def test_a_checkpoint_queued_behind_a_held_write_keeps_its_own_state(tmp_path):
    """Two checkpoints in flight: the second is staged while the first is still being written
    (held here), into buffers of its own. Oracle: the weights as they were at each save, cloned
    by the test, against what each committed checkpoint's file holds."""
    model, optimizer, run_dir, manager = _one_rank_manager(tmp_path)
    held, released = threading.Event(), threading.Event()
    stream = run_dir.stream_checkpoint_file

    def held_stream(step, name, produce):
        if step == 1 and name == "model.pt":
            held.set()
            released.wait(60)  # a hang guard only: the test releases it
        return stream(step, name, produce)

    run_dir.stream_checkpoint_file = held_stream  # type: ignore[method-assign]
    saved = {}
    for step in (1, 2):
        model(torch.randn(4, 64)).sum().backward()
        manager.before_optimizer_step()
        optimizer.step()
        optimizer.zero_grad()
        saved[step] = model.weight.detach().clone()
        manager.save(step, {"metrics": {}, "cursor": {}}, [])
        if step == 1:
            held.wait(60)
    # save(2) returned with the write of 1 still held: both are in flight
    assert manager.background.in_flight() == 2 and not released.is_set()
    model(torch.randn(4, 64)).sum().backward()
    manager.before_optimizer_step()
    optimizer.step()  # training goes on while both are in flight
    released.set()
    manager.wait()
    manager.close()
    for step in (1, 2):
        info = run_dir.read_committed(step)
        assert info is not None, f"checkpoint {step} not committed"
        weights = training_state.from_bytes(run_dir.read_verified(info, "model.pt"))["weight"]
        assert torch.equal(weights, saved[step]), f"checkpoint {step} holds other weights"


def test_streamed_digest_matches_the_bytes_written(tmp_path):
    run_dir = RunDirectory(resolve(str(tmp_path)).child("run"))
    big = torch.arange(2**19, dtype=torch.float64)  # 4 MiB: torch.save writes it in one chunk
    for name, value in [("small.pt", {"x": torch.ones(3)}), ("big.pt", {"x": big})]:
        entry = run_dir.stream_checkpoint_file(
            7, name, lambda stream, value=value: training_state.save(value, stream)
        )
        data = run_dir.checkpoint_location(7).child(name).read_bytes()
        assert entry.size == len(data)
        assert entry.xxh3_128 == file_digest(data)
        assert torch.equal(training_state.from_bytes(data)["x"], value["x"])


def test_a_streamed_write_returns_what_it_produced_and_leaves_no_temporary(tmp_path):
    location = resolve(str(tmp_path)).child("file.bin")
    calls = []

    def produce(stream):
        calls.append(1)
        stream.write(b"abc")
        return len(calls)

    assert location.write_stream(produce) == 1
    assert location.read_bytes() == b"abc"
    assert [p.name for p in tmp_path.iterdir()] == ["file.bin"]  # no temporary left behind


def test_reserve_allocates_the_buffers_stage_then_fills():
    model = torch.nn.Linear(8, 4)
    stager = Stager()
    stager.reserve({"model": model.state_dict(), "note": "x"})
    reserved = stager.buffers[("model", "weight")]
    assert not torch.equal(reserved, model.weight)  # allocated, not filled
    staged = stager.stage({"model": model.state_dict(), "note": "x"})
    assert staged["model"]["weight"].data_ptr() == reserved.data_ptr()
    assert torch.equal(staged["model"]["weight"], model.weight) and staged["note"] == "x"


@pytest.mark.parametrize(
    ("wait_s", "since_s", "slow"),
    [
        (0.0, 2.0, False),  # the previous write was done: nothing to say
        (0.01, 0.05, False),  # a fifth of the interval, but too short to notice
        (0.1, 2.0, False),  # 5% of the interval
        (0.3, 2.0, True),  # 15%: the writes take longer than the interval
        (1.2, 0.4, True),  # S3 at a short interval: training waits most of the time
    ],
)
def test_training_waiting_on_writes_is_said_when_it_is_a_tenth_of_the_interval(
    wait_s, since_s, slow
):
    from trainer_core.checkpoint.manager import writes_outlast_interval

    assert writes_outlast_interval(wait_s, since_s) is slow


def _one_rank_manager(tmp_path):
    """A 1-rank run's checkpoint manager (SGD over a Linear), checkpoints kept."""
    from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
    from trainer_core.execution.worker_group import Relay, Timings
    from trainer_core.spec.operations import CheckpointSection

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    run_dir = RunDirectory(resolve(str(tmp_path)).child("run"))
    manager = CheckpointManager(
        run_dir,
        CheckpointSection(every=1, keep_last=None, keep_best=0),
        TrainingState(model, optimizer, scheduler),
        rank=0,
        world_size=1,
        attempt=1,
        relay=Relay(None, 0),
        timings=Timings(),
    )
    return model, optimizer, run_dir, manager


def test_the_next_optimizer_step_waits_for_every_copy_in_flight(tmp_path):
    """Two checkpoints saved with no optimizer step between them (their copies queued on the
    copy thread): the first copy ends while a timer still holds the second, and the next
    optimizer step must wait for the second, so checkpoint 2 holds the weights as they were
    at its save (cloned by the test), not the step's. Were the first copy's end taken for
    all of them, the step would run first and checkpoint 2 would hold the stepped weights."""
    model, optimizer, run_dir, manager = _one_rank_manager(tmp_path)
    model(torch.randn(4, 64)).sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    before = model.weight.detach().clone()
    releases = [threading.Event(), threading.Event()]
    for stager, release in zip(manager.stagers, releases, strict=True):

        def held_copy(copy=stager.copy_deferred, release=release) -> None:
            release.wait(60)  # a hang guard only: the test releases it
            copy()

        stager.copy_deferred = held_copy  # type: ignore[method-assign]
    manager.save(1, {"metrics": {}, "cursor": {}}, [])
    manager.save(2, {"metrics": {}, "cursor": {}}, [])
    releases[0].set()  # the first copy ends while the second is still held
    threading.Timer(0.5, releases[1].set).start()
    model(torch.randn(4, 64)).sum().backward()
    manager.before_optimizer_step()
    optimizer.step()
    manager.wait()
    manager.close()
    info = run_dir.read_committed(2)
    assert info is not None
    weights = training_state.from_bytes(run_dir.read_verified(info, "model.pt"))["weight"]
    assert torch.equal(weights, before), "checkpoint 2 holds the weights of a later step"
