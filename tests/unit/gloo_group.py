"""Unit tests in a real gloo group: ``run_ranks`` spawns one process per rank and runs a function
on each inside the group. A rank that fails shows its own stderr, kept in a file per rank (the
spawned processes would otherwise interleave theirs into the test's captured output); a crash
there also prints every thread's Python stack (``faulthandler``). A rank that succeeds leaves
without the interpreter's teardown, which gloo's threads could abort (``_rank``)."""

from __future__ import annotations

import faulthandler
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp

from tests.net import free_port


def run_ranks(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``fn(rank, world, *args)`` in ``world`` spawned processes, the ranks of one gloo group.
    A rank that raises or dies fails the call (``mp.ProcessRaisedException`` or
    ``mp.ProcessExitedException``) with every rank's stderr attached as a note."""
    with tempfile.TemporaryDirectory(prefix="gloo-ranks-") as logs:
        try:
            mp.start_processes(
                _rank,
                args=(fn, world, free_port(), logs, args),
                nprocs=world,
                start_method="spawn",
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as e:
            for rank in range(world):
                e.add_note(f"--- rank {rank}'s stderr ---\n{_read(Path(logs, f'rank{rank}.log'))}")
            raise


def _rank(rank: int, fn: Callable[..., None], world: int, port: int, logs: str, args: Any) -> None:
    log = os.open(Path(logs, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    os.dup2(log, 2)  # Python's and native code's own (gloo, libstdc++'s terminate) alike
    faulthandler.enable(all_threads=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    fn(rank, world, *args)
    dist.barrier()  # every rank's collectives done before any rank's sockets close
    dist.destroy_process_group()
    # Then out without the interpreter's teardown, as a forked multiprocessing child leaves. A
    # work that gloo's worker threads ran holds the tensors of the collective (and a barrier's
    # the works before it), and the thread lets go of it only after the rank's wait returned: a
    # thread that drops a tensor Python made while the interpreter finalizes cannot take the
    # GIL, Python ends the thread (pthread_exit), and that unwinding through the work's noexcept
    # destructor is std::terminate: "terminate called without an active exception", SIGABRT.
    # destroy_process_group joins those threads only if nothing else holds the group, and after
    # fully_shard something does. A rank that raised has written its error for the parent first.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else "(nothing written)"
