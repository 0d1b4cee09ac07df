"""Asynchronous checkpoints: staging copies, the background slot, streamed hashed writes."""

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
    assert background.job is not None and not background.job.done()
    blocker.set()
    background.close()


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
