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

import functools
import tempfile
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bench import common, harness, ranks
from bench.common import MB, Result, Sample, Variant
from bench.ranks import LAYERS, WIDTH, linear_stack, run_ranks, slowest, total
from trainer_core import storage

NAME = "restore"
COLUMNS = ["restore_s", "mb_read", "state_mb"]


class Bench:
    """One rank's side: a checkpoint of the replicated model and one of the sharded model, each
    restored by a manager that reads alone and by one that reads once for the node."""

    def __init__(self, rank: int, world_size: int, stores: tuple[str, str], layers: int):
        from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
        from trainer_core.checkpoint.run_directory import RunDirectory
        from trainer_core.execution.worker_group import Relay, Timings
        from trainer_core.spec.operations import CheckpointSection

        model, optimizer, scheduler = linear_stack(layers)
        self.state_mb = (
            sum(p.numel() * 4 for p in model.parameters()) * 3 / MB
        )  # weights, exp_avg, exp_avg_sq

        sharded = linear_stack(layers, world_size)

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
        seconds = slowest(time.perf_counter() - started)
        return {
            "restore_s": seconds,
            "mb_read": total(loaded.bytes_read) / MB,
            "state_mb": self.state_mb,
        }

    def close(self) -> None:
        for manager in (self.alone, self.shared, self.fsdp_alone, self.fsdp_shared):
            manager.close()


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    args = cli.parse_args(argv)
    result = Result(NAME, args.quick, columns=COLUMNS)
    repetitions = common.repetitions_of(args)
    layers = 2 if args.quick else LAYERS  # --quick: a smoke test, not a figure
    with (
        tempfile.TemporaryDirectory(prefix="relaytrain-bench-restore-") as tmp,
        # the credentials in the environment: the spawned ranks inherit them
        harness.stores(["s3"], Path(tmp), s3_prefix="restore") as chosen,
    ):
        stores = (storage.join_uri(chosen["s3"], "ddp"), storage.join_uri(chosen["s3"], "fsdp"))
        result.settings.update(
            ranks.settings(),
            nodes=1,
            model=f"{layers} x Linear({WIDTH}, {WIDTH}), replicated (DDP's rank-0 files), Adam",
            store="s3 (moto server on loopback)",
        )
        make_bench = functools.partial(Bench, stores=stores, layers=layers)
        result.variants.update(run_ranks(make_bench, repetitions, Path(tmp)))
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
