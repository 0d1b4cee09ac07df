"""FSDP checkpoints: how long training is blocked per checkpoint of an FSDP2-sharded model and
its Adam state over 2 gloo workers (about 120 MB in all), and how fast the shards are written.

The 2 worker processes (``torch.multiprocessing``, one process group) build the same sharded
model once and run every variant on it, alternately:

- ``relaytrain``: the built-in loop's ``CheckpointManager`` with ``scaling.strategy: fsdp``
  (``relaytrain.dcp/1``), asynchronous as by default: ``save`` stages every rank's shards into
  kept buffers, then DCP writes them through the run's storage on the checkpoint thread (digest
  of every file, manifest, ``COMMITTED``, retention). ``blocked_s`` is ``save`` plus the wait
  before the next optimizer step for the deferred copy, with no forward and backward between
  them to hide it (the loop runs them there): the most training can wait.
- ``dcp_save``: ``torch.distributed.checkpoint.save`` to the same store, synchronously: what a
  checkpoint costs without staging (``FileSystemWriter(sync_files=False)``, as relaytrain's:
  DCP's default would fsync every file).
- ``dcp_async_save``: DCP's own ``async_save`` (its default stager, the same writer):
  ``blocked_s`` is until it returns, ``background_s`` until its future is done.
- ``raw_copy``: every rank copies its share of ``dcp_save``'s files (its shard; rank 0 the
  metadata too) into the store with ``pyarrow.fs.copy_files``.
- ``relaytrain_loop``: a real 2-worker ``fsdp`` run (``engine.run_attempt`` on a local Ray
  cluster) of an MLP of 10 hidden layers of 1024 with Adam (about 126 MB of state), checkpoint
  every 10 steps: the loop's own timings per checkpoint, where forward and backward run between
  ``save`` and the optimizer step that waits for the deferred copy, as in training.

Each figure is the slowest rank's (``relaytrain_loop``: rank 0's). Targets: relaytrain blocked /
dcp_save <= 0.10 (for the direct call and for the loop); relaytrain blocked <= dcp_async_save
blocked; relaytrain write throughput / raw copy >= 0.8. Local writes
land in the page cache (no fsync on any side).
"""

from __future__ import annotations

import functools
import tempfile
import time
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from bench import common, harness, ranks
from bench.common import MB, Result, Sample, Target, Variant
from bench.ranks import LAYERS, WIDTH, linear_stack, run_ranks, slowest, total

NAME = "fsdp_checkpoints"
COLUMNS = ["blocked_s", "save_s", "copy_wait_s", "background_s", "mb_per_s", "state_mb"]
BLOCKED_TARGET = 0.10
THROUGHPUT_TARGET = 0.8


class Bench:
    """One rank's side: the sharded model, the store, and the variants."""

    def __init__(self, rank: int, world_size: int, store: str):
        from trainer_core import storage
        from trainer_core.checkpoint.manager import CheckpointManager, TrainingState
        from trainer_core.checkpoint.run_directory import RunDirectory
        from trainer_core.execution.worker_group import Relay, Timings
        from trainer_core.spec.operations import CheckpointSection

        self.rank = rank
        self.store = Path(store)
        self.model, self.optimizer, scheduler = linear_stack(LAYERS, world_size)
        self.timings = Timings()
        self.manager = CheckpointManager(
            RunDirectory(storage.resolve(str(self.store / "relaytrain"))),
            CheckpointSection(keep_last=1, keep_best=0, asynchronous=True),
            TrainingState(self.model, self.optimizer, scheduler),
            rank=rank,
            world_size=world_size,
            attempt=1,
            relay=Relay(None, rank),  # no driver: events go nowhere
            timings=self.timings,
            dcp=True,
        )
        self.manager.reserve()
        self.manager.wait()
        self.step = 0
        self.state_mb = total(sum(local_bytes(t) for t in self.state().values()) / MB)

    def state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def variants(self) -> list[Variant]:
        return [
            Variant("local/relaytrain", "CheckpointManager, fsdp (DCP through the run's "
                    "storage), asynchronous", lambda rep: self.relaytrain()),
            Variant("local/dcp_save", "torch.distributed.checkpoint.save, synchronous",
                    lambda rep: self.dcp_save(rep)),
            Variant("local/dcp_async_save", "torch.distributed.checkpoint.async_save",
                    lambda rep: self.dcp_async_save(rep)),
            Variant("local/raw_copy", "each rank's share of dcp_save's files, "
                    "pyarrow.fs.copy_files", lambda rep: self.raw_copy(rep)),
        ]  # fmt: skip

    def relaytrain(self) -> Sample:
        self.step += 1
        written = self.timings.checkpoint_write_s
        dist.barrier()
        started = time.perf_counter()
        meta = {"epoch": 0, "cursor": {"epoch": 0, "batch": self.step}, "metrics": {}}
        self.manager.save(self.step, meta, [{"step": self.step, "epoch": 0, "loss": 0.0}])
        saved = time.perf_counter()
        self.manager.before_optimizer_step()
        blocked = time.perf_counter() - started
        self.manager.wait()
        background = self.timings.checkpoint_write_s - written
        return {
            "blocked_s": slowest(blocked),
            "save_s": slowest(saved - started),
            "copy_wait_s": slowest(started + blocked - saved),
            "background_s": slowest(background),
            "mb_per_s": self.state_mb / slowest(background),
            "state_mb": self.state_mb,
        }

    def close(self) -> None:
        self.manager.close()

    def dcp_save(self, rep: int) -> Sample:
        import torch.distributed.checkpoint as dcp

        target = self.store / f"dcp-{rep}"
        dist.barrier()
        started = time.perf_counter()
        dcp.save(self.state(), storage_writer=FileSystemWriter(str(target), sync_files=False))
        blocked = slowest(time.perf_counter() - started)
        return {"blocked_s": blocked, "mb_per_s": self.state_mb / blocked}

    def dcp_async_save(self, rep: int) -> Sample:
        import torch.distributed.checkpoint as dcp

        target = self.store / f"dcp-async-{rep}"
        dist.barrier()
        started = time.perf_counter()
        writer = FileSystemWriter(str(target), sync_files=False)
        future = dcp.async_save(self.state(), storage_writer=writer)
        blocked = time.perf_counter() - started
        future.result()
        done = time.perf_counter() - started
        return {
            "blocked_s": slowest(blocked),
            "background_s": slowest(done - blocked),
            "mb_per_s": self.state_mb / slowest(done),
        }

    def raw_copy(self, rep: int) -> Sample:
        source = self.store / f"dcp-{rep}"
        target = self.store / f"raw-{rep}"
        target.mkdir(exist_ok=True)
        mine = [f"__{self.rank}_0.distcp", *([".metadata"] if self.rank == 0 else [])]
        local = pafs.LocalFileSystem()
        dist.barrier()
        started = time.perf_counter()
        for name in mine:
            pafs.copy_files(
                str(source / name),
                str(target / name),
                source_filesystem=local,
                destination_filesystem=local,
            )
        seconds = slowest(time.perf_counter() - started)
        return {"blocked_s": seconds, "mb_per_s": self.state_mb / seconds}


def local_bytes(value: Any) -> int:
    """The bytes of this rank's part of the tensors in ``value`` (nested)."""
    from torch.distributed.tensor import DTensor

    if isinstance(value, DTensor):
        value = value.to_local()
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(local_bytes(v) for v in value.values())
    if isinstance(value, list | tuple):
        return sum(local_bytes(v) for v in value)
    return 0


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=5)
    args = cli.parse_args(argv)
    result = Result(NAME, args.quick, columns=COLUMNS)
    repetitions = common.repetitions_of(args)
    with tempfile.TemporaryDirectory(prefix="relaytrain-bench-fsdp-") as tmp:
        store = Path(tmp) / "store"
        store.mkdir()
        result.settings.update(
            ranks.settings(),
            model=f"{LAYERS} x Linear({WIDTH}, {WIDTH}), FSDP2 per layer, Adam",
            store="local",
        )
        make_bench = functools.partial(Bench, store=str(store))
        result.variants.update(run_ranks(make_bench, repetitions, Path(tmp)))
        with harness.local_ray() as ray_info:
            result.settings.update(ray_info)
            loop = Variant(
                "local/relaytrain_loop",
                "the built-in loop's own timings per checkpoint, 2-worker fsdp engine attempt",
                lambda rep: relaytrain_loop(store, f"loop-{rep}", args.quick),
            )
            result.variants.update(common.alternate([loop], repetitions))
    summarize(result)
    return common.finish(result, args)


def relaytrain_loop(store: Path, name: str, quick: bool) -> Sample:
    from bench.workload import mlp_spec

    hidden = (256,) * 2 if quick else (WIDTH,) * LAYERS
    spec = mlp_spec(
        store,
        name,
        epochs=1,
        num_workers=2,
        num_samples=16 * 2 * 31,  # 31 steps: checkpoints at 10, 20, 30
        hidden=hidden,
        batch_size=16,
        checkpoint_every=10,
        scaling={"strategy": "fsdp"},
        checkpoint={"keep_last": 1, "keep_best": 0},
    )
    timings, count = harness.checkpoint_timings(spec)
    state_mb = sum(h * w for h, w in zip((64, *hidden), (*hidden, 1), strict=True)) * 12 / MB
    write_s = timings.get("checkpoint_write_s", 0.0) / count
    return {
        "blocked_s": timings["checkpoint_s"] / count,
        "copy_wait_s": timings.get("checkpoint_copy_wait_s", 0.0) / count,
        "background_s": write_s,
        "mb_per_s": state_mb / write_s if write_s else float("nan"),
        "state_mb": state_mb,
    }


def summarize(result: Result) -> None:
    records = result.variants
    state = (
        records["local/relaytrain"].median("state_mb") if "local/relaytrain" in records else None
    )
    note = f"{state:.0f} MB of FSDP state over 2 workers" if state else ""
    checks = [
        ("blocked/dcp_save", "dcp_save", "blocked_s", "<=", BLOCKED_TARGET,
         "training blocked per checkpoint / synchronous dcp.save"),
        ("blocked/dcp_async_save", "dcp_async_save", "blocked_s", "<=", 1.0,
         "training blocked per checkpoint / DCP async_save's blocked"),
        ("throughput/raw copy", "raw_copy", "mb_per_s", ">=", THROUGHPUT_TARGET,
         "relaytrain write MB/s (DCP, digests, commit) / raw copy_files MB/s of the shards"),
    ]  # fmt: skip
    loop = (
        "loop blocked/dcp_save", "dcp_save", "blocked_s", "<=", BLOCKED_TARGET,
        "training blocked per checkpoint, 2-worker fsdp run / synchronous dcp.save",
    )  # fmt: skip
    for name, other, metric, op, threshold, description in [*checks, loop]:
        mine = "local/relaytrain_loop" if name.startswith("loop") else "local/relaytrain"
        value = common.ratio(records, mine, f"local/{other}", metric)
        result.targets.append(
            Target(f"local: {name}", description, op, threshold).check(value, note)
        )  # type: ignore[arg-type]
    result.notes.append(
        "blocked_s: relaytrain's is save() (save_s: the state dict, staging what is not deferred) "
        "plus the next optimizer step's wait for the deferred copy (copy_wait_s), nothing between "
        "them (the loop overlaps that copy with forward and backward); "
        "dcp_async_save's is until async_save returns. mb_per_s: state MB / the write (for "
        "relaytrain, its checkpoint thread: DCP planning, digests, commit, retention)"
    )


if __name__ == "__main__":
    raise SystemExit(main())
