"""Benchmarks whose variants run inside ranks of their own: processes of one gloo group
(``torch.multiprocessing``, no Ray) that build the same model and measure every variant side by
side, alternately; rank 0's records come back to the benchmark process.

Also what those benchmarks share: the model (a stack of linear layers with Adam, replicated or
sharded with FSDP2) and the reductions a figure takes over the ranks (the slowest, the total).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import common
from bench.common import Variant, VariantRecord
from tests.net import free_port

#: The model: ``layers`` linear layers of ``WIDTH`` x ``WIDTH`` (4 MB each in float32), Adam.
WIDTH = 1024
LAYERS = 10


class RankBench(Protocol):
    """One rank's side of a benchmark: its variants, and what to release after them."""

    def variants(self) -> list[Variant]: ...

    def close(self) -> None: ...


def run_ranks(
    make_bench: Callable[[int, int], RankBench],
    repetitions: int,
    scratch: Path,
    world_size: int = 2,
) -> dict[str, VariantRecord]:
    """Start ``world_size`` ranks; each builds ``make_bench(rank, world_size)`` (picklable: a
    module-level class or a ``functools.partial`` of one) and alternates its variants
    ``repetitions`` times. Rank 0's records."""
    out = scratch / "records.pickle"
    mp.start_processes(
        _rank,
        args=(world_size, free_port(), make_bench, repetitions, str(out)),
        nprocs=world_size,
        start_method="spawn",
    )
    return pickle.loads(out.read_bytes())


def settings(world_size: int = 2) -> dict[str, Any]:
    """How ``run_ranks`` sets the ranks up, for a result's settings."""
    return {
        "world_size": world_size,
        "backend": "gloo",
        "torch_threads_per_worker": 1,
        "cpu_count": os.cpu_count(),
    }


def _rank(
    rank: int,
    world_size: int,
    port: int,
    make_bench: Callable[[int, int], RankBench],
    repetitions: int,
    out: str,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on the machine's cores, as two workers would
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    bench = make_bench(rank, world_size)
    log = print if rank == 0 else (lambda text: None)
    records = common.alternate(bench.variants(), repetitions, log=log)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(records))
    dist.barrier()
    bench.close()
    dist.destroy_process_group()


def slowest(seconds: float) -> float:
    """The largest of every rank's ``seconds``."""
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def total(amount: float) -> float:
    """The sum of every rank's ``amount``."""
    value = torch.tensor([amount], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value)


def linear_stack(
    layers: int, world_size: int | None = None
) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    """``layers`` linear layers of ``WIDTH`` (with ``world_size``, each sharded with FSDP2 over
    that many ranks), their Adam optimizer after one step (its state exists), a constant
    schedule. The same weights on every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    if world_size is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world_size,))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
