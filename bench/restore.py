"""Restore: the seconds and the bytes read from storage to resume 2 workers on one node from a
checkpoint of a model and its Adam state (about 120 MB) on S3, replicated (DDP) and sharded
(FSDP).

A real S3-compatible server on loopback (moto's server mode) holds the run. 2 worker processes
(``torch.multiprocessing``, one gloo group) build the same model, and rank 0's
``CheckpointManager`` commits one checkpoint of it (``model.pt``, ``optimizer.pt``, the schedule,
every rank's RNG state). Then, alternately:

- ``s3/each_rank_reads``: every rank reads and verifies the replicated files itself (the
  manager does not know the ranks' nodes): what relaytrain did before.
- ``s3/once_per_node``: the node's first rank reads them and hands them to the other rank
  (``CheckpointManager(node_rank=...)``, as the built-in loop makes it).
- ``s3/fsdp/each_rank_reads`` and ``s3/fsdp/once_per_node``: the same model sharded with FSDP2
  over the 2 ranks, its DCP checkpoint: each rank reads every file its share is in (rank 0's
  file also holds what DCP saved once for both), or each file is read once for the node.

``restore_s`` is the slowest rank's ``load`` (read, verify, deserialize, apply); ``mb_read`` the
bytes both ranks read from storage.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench import common
from bench.common import Result, Sample, Variant
from tests.net import free_port

NAME = "restore"
MB = 2**20
COLUMNS = ["restore_s", "mb_read", "state_mb"]
#: The model: ``LAYERS`` linear layers of ``WIDTH`` x ``WIDTH`` (4 MB each in float32), Adam.
WIDTH = 1024
LAYERS = 10


def build(layers: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(layers)])
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    return model, optimizer, scheduler


def reduce(value: float, op: Any = None) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=op or dist.ReduceOp.SUM)
    return float(tensor)


def build_sharded(layers: int, world_size: int) -> tuple[torch.nn.Module, Any, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model, _, _ = build(layers)
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    model(torch.randn(4, WIDTH)).sum().backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)


class Bench:
    def __init__(self, rank: int, world_size: int, stores: tuple[str, str], layers: int):
        from trainer_core import storage
        from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
        from trainer_core.checkpoint.run_directory import RunDirectory
        from trainer_core.execution.worker_group import Relay, Timings
        from trainer_core.spec.run_spec import CheckpointSection

        model, optimizer, scheduler = build(layers)
        self.state_mb = (
            sum(p.numel() * 4 for p in model.parameters()) * 3 / MB
        )  # weights, exp_avg, exp_avg_sq

        sharded = build_sharded(layers, world_size)

        def manager(node_rank: int | None, dcp: bool = False) -> Any:
            return CheckpointManager(
                RunDirectory(storage.resolve(stores[1] if dcp else stores[0])),
                CheckpointSection(keep_last=1, keep_best=0, asynchronous=False),
                TrainingState(*sharded) if dcp else TrainingState(model, optimizer, scheduler),
                rank=rank,
                world_size=world_size,
                attempt=1,
                relay=Relay(None, rank),  # no driver: events go nowhere
                timings=Timings(),
                node_rank=node_rank,
                dcp=dcp,
            )

        self.alone = manager(None)
        self.shared = manager(0)  # both ranks on node 0
        self.fsdp_alone = manager(None, dcp=True)
        self.fsdp_shared = manager(0, dcp=True)
        meta = {"epoch": 0, "cursor": {"epoch": 0, "batch": 1}, "metrics": {}}
        for saving in (self.alone, self.fsdp_alone):
            saving.save(1, meta, [{"step": 1, "epoch": 0, "loss": 0.0}])
            saving.wait()

    def variants(self) -> list[Variant]:
        return [
            Variant("s3/each_rank_reads", "every rank reads the replicated files itself",
                    lambda rep: self.restore(self.alone)),
            Variant("s3/once_per_node", "the node's first rank reads them for both",
                    lambda rep: self.restore(self.shared)),
            Variant("s3/fsdp/each_rank_reads", "every rank reads each DCP file its share is in",
                    lambda rep: self.restore(self.fsdp_alone)),
            Variant("s3/fsdp/once_per_node", "each DCP file read once for the node",
                    lambda rep: self.restore(self.fsdp_shared)),
        ]  # fmt: skip

    def restore(self, manager: Any) -> Sample:
        dist.barrier()
        started = time.perf_counter()
        loaded = manager.load([1])
        assert loaded.checkpoint is not None and loaded.checkpoint.step == 1
        seconds = reduce(time.perf_counter() - started, dist.ReduceOp.MAX)
        return {
            "restore_s": seconds,
            "mb_read": reduce(loaded.bytes_read) / MB,
            "state_mb": self.state_mb,
        }


def _worker(
    rank: int,
    world_size: int,
    port: int,
    stores: tuple[str, str],
    repetitions: int,
    out: str,
    layers: int,
) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two processes on the machine's cores, as two workers would
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    bench = Bench(rank, world_size, stores, layers)
    log = print if rank == 0 else (lambda text: None)
    records = common.alternate(bench.variants(), repetitions, log=log)
    if rank == 0:
        Path(out).write_bytes(pickle.dumps(records))
    dist.barrier()
    for manager in (bench.alone, bench.shared, bench.fsdp_alone, bench.fsdp_shared):
        manager.close()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    from tests.s3 import moto_s3

    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    args = cli.parse_args(argv)
    result = Result(NAME, args.quick, columns=COLUMNS)
    repetitions = common.repetitions_of(args)
    layers = 2 if args.quick else LAYERS  # --quick: a smoke test, not a figure
    with (
        tempfile.TemporaryDirectory(prefix="relaytrain-bench-restore-") as tmp,
        contextlib.ExitStack() as stack,
    ):
        server = stack.enter_context(moto_s3(Path(tmp)))
        before = dict(os.environ)
        os.environ.update(server.credential_env())  # the spawned workers inherit them
        stack.callback(lambda: (os.environ.clear(), os.environ.update(before)))
        out = Path(tmp) / "records.pickle"
        stores = (server.uri("restore/ddp"), server.uri("restore/fsdp"))
        result.settings.update(
            world_size=2,
            nodes=1,
            backend="gloo",
            model=f"{layers} x Linear({WIDTH}, {WIDTH}), replicated (DDP's rank-0 files), Adam",
            store="s3 (moto server on loopback)",
            torch_threads_per_worker=1,
            cpu_count=os.cpu_count(),
        )
        mp.start_processes(
            _worker,
            args=(2, free_port(), stores, repetitions, str(out), layers),
            nprocs=2,
            start_method="spawn",
        )
        result.variants.update(pickle.loads(out.read_bytes()))
    summarize(result)
    return common.finish(result, args)


def summarize(result: Result) -> None:
    records = result.variants
    for kind in ("s3", "s3/fsdp"):
        after, before = f"{kind}/once_per_node", f"{kind}/each_rank_reads"
        time_ratio = common.ratio(records, after, before, "restore_s")
        read_ratio = common.ratio(records, after, before, "mb_read")
        if time_ratio is not None and read_ratio is not None:
            result.notes.append(
                f"{after} / {before}: restore_s {time_ratio:.2f}, mb_read {read_ratio:.2f} "
                "(the issue names no target: measured before and after)"
            )
    result.notes.append(
        "mb_read: what both ranks read from storage; the replicated files are handed from rank 0 "
        "to rank 1 over a gloo group of the node's ranks (a copy through loopback TCP)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
