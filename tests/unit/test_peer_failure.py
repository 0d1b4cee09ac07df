"""A collective that lost its peers is an infrastructure failure, not a bug in the training code:
what torch 2.13 raises for a gloo timeout, an NCCL watchdog timeout, an aborted NCCL
communicator or a lost rendezvous store, by its type where torch gives one.

The gloo and store errors are raised here for real (two gloo ranks in threads of this process,
one of them silent; a rank whose peer process exits). NCCL's need GPUs: they are torch's own
exception types with the messages torch 2.13 builds (``ProcessGroupNCCL.cpp``'s
``WorkNCCL::checkTimeout``, ``NCCLUtils.cpp``'s ``getNcclComm`` and ``C10D_NCCL_CHECK``; the
strings are in ``libtorch_cuda.so`` of the CUDA wheel)."""

from __future__ import annotations

import datetime
import multiprocessing
import os
import threading

import pytest
import ray
import torch
import torch.distributed as dist
from ray.train import WorkerGroupError

from trainer_core.errors import InfrastructureError, TrainingCodeError
from trainer_core.execution.classify import classify
from trainer_core.train.failure import is_peer_failure

TIMEOUT = datetime.timedelta(seconds=30)

WATCHDOG_TIMEOUT = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: "
    "WorkNCCL(SeqNum=42, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for "
    "600031 milliseconds before timing out."
)
NCCL_ERRORS = [
    # The watchdog's verdict, raised on the main thread by Work.wait (blocking wait, or a
    # timeout given to wait) and by the watchdog itself.
    dist.DistBackendError(WATCHDOG_TIMEOUT),
    # Any later collective on the communicator the watchdog (or ProcessGroupNCCL.abort) aborted.
    dist.DistBackendError(
        f"NCCL communicator was aborted on rank 1.  Original reason for failure was: "
        f"{WATCHDOG_TIMEOUT}"
    ),
    # NCCL itself: a peer process exited, or the network failed.
    dist.DistBackendError(
        "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3690, remote "
        "process exited or there was a network error, NCCL version 2.27.7\nncclRemoteError: A "
        "call failed possibly due to a network error or a remote process exiting prematurely.\n"
        "Last error:\nsocketProgress: Connection closed by remote peer"
    ),
    # The rendezvous store's host (rank 0) gone.
    dist.DistNetworkError(
        "The client socket has timed out after 1800000ms while trying to connect to "
        "(10.0.0.4, 29500)."
    ),
]


def gloo_failures() -> list[BaseException]:
    """What rank 0 of two gloo ranks gets when rank 1 never joins its all-reduce: the timeout,
    then, on its next collective, the closed pair."""
    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroupGloo] = {}

    def join(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(
            dist.PrefixStore("peer-failure", store), rank, 2, datetime.timedelta(seconds=0.5)
        )

    threads = [threading.Thread(target=join, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    failures: list[BaseException] = []
    for _ in range(2):
        try:
            groups[0].allreduce([torch.ones(3)]).wait()
        except RuntimeError as e:
            failures.append(e)
    return failures


def _rank_1_dies(port: int) -> None:
    """Rank 1 of two: joins one all-reduce, then its process exits."""
    store = dist.TCPStore("127.0.0.1", port, 2, False, datetime.timedelta(seconds=30))
    group = dist.ProcessGroupGloo(dist.PrefixStore("death", store), 1, 2, TIMEOUT)
    group.allreduce([torch.ones(1)]).wait()
    os._exit(0)


def peer_death() -> BaseException:
    """What rank 0 gets from its next all-reduce after rank 1's process exited."""
    store = dist.TCPStore(
        "127.0.0.1", 0, 2, True, datetime.timedelta(seconds=30), wait_for_workers=False
    )
    peer = multiprocessing.get_context("spawn").Process(target=_rank_1_dies, args=(store.port,))
    peer.start()
    try:
        group = dist.ProcessGroupGloo(dist.PrefixStore("death", store), 0, 2, TIMEOUT)
        group.allreduce([torch.ones(1)]).wait()
        peer.join(timeout=60)
        with pytest.raises(RuntimeError) as caught:
            group.allreduce([torch.ones(1000)]).wait()
        return caught.value
    finally:
        peer.join(timeout=5)
        if peer.is_alive():
            peer.kill()


def store_failures() -> list[BaseException]:
    """A rank waiting on the store for a key its peers never write."""
    failures: list[BaseException] = []
    server = dist.TCPStore(
        "127.0.0.1", 0, 2, True, datetime.timedelta(seconds=5), wait_for_workers=False
    )
    for store in (dist.HashStore(), server):
        try:
            store.wait(["rank-1-ready"], datetime.timedelta(milliseconds=100))
        except dist.DistError as e:
            failures.append(e)
    return failures


def test_gloo_timeouts_are_peer_failures():
    timeout, closed = gloo_failures()
    assert "Timed out waiting 500ms for recv operation to complete" in str(timeout)
    assert str(closed) == "Application timeout caused pair closure"
    for error in (timeout, closed):
        assert type(error) is RuntimeError  # gloo gives no type: the message is its word
        assert is_peer_failure(error), error
        assert isinstance(classify(WorkerGroupError("x", {0: error})), InfrastructureError)


def test_a_peer_process_that_exits_is_a_peer_failure():
    error = peer_death()
    assert "Connection closed by peer" in str(error) and type(error) is RuntimeError
    assert is_peer_failure(error), error
    assert isinstance(classify(WorkerGroupError("x", {0: error})), InfrastructureError)


def test_store_timeouts_are_peer_failures():
    failures = store_failures()
    assert [type(e) for e in failures] == [dist.DistStoreError, dist.DistStoreError]
    assert "wait timeout after 100ms" in str(failures[1])
    for error in failures:
        assert is_peer_failure(error), error


@pytest.mark.parametrize("error", NCCL_ERRORS, ids=["watchdog", "aborted", "remote", "network"])
def test_nccl_timeouts_and_aborts_are_infrastructure_failures(error):
    assert is_peer_failure(error)
    # At the driver too: a rank's raw torch error (a user's loop, Ray Train's process group
    # setup) is an infrastructure failure, with its own retry budget.
    classified = classify(WorkerGroupError("x", {0: error, 1: ray.exceptions.RayActorError()}))
    assert isinstance(classified, InfrastructureError)
    assert isinstance(classify(WorkerGroupError("x", {1: error})), InfrastructureError)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("Read error: unexpected end of record in shard 3"),
        RuntimeError("Broken pipe while writing my cache"),
        RuntimeError("Connection reset by peer (my feature service)"),
        ValueError("Timed out waiting 500ms for recv operation to complete"),
        ZeroDivisionError("division by zero"),
        # gloo's verdict on a collective mismatch (ranks calling different collectives): a bug.
        RuntimeError(
            "[enforce fail at /pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:456] "
            "op.preamble.length <= op.nbytes. 1000 vs 4. Received data size doesn't match "
            "expected size. Is there a distributed collective mismatch in your code?"
        ),
    ],
)
def test_code_errors_that_only_sound_like_a_network_stay_code_errors(error):
    assert not is_peer_failure(error)
    assert isinstance(classify(WorkerGroupError("x", {0: error})), TrainingCodeError)
