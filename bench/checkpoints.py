"""Checkpoints: how long training is blocked per checkpoint, and upload throughput, for states
of 10, 100 and 500 MB on local disk and on an S3 server (moto on loopback, ``tests/s3.py``).

Variants, alternated per (store, size):
- ``relaytrain``: what the built-in loop's ``_checkpoint`` does today on rank 0 of one worker,
  called directly: ``prepare_checkpoint_dir``, ``training_state.to_bytes`` (serialize),
  ``write_checkpoint_file`` (upload + sha256), the RNG file, metrics segment, manifest and
  commit marker, then retention (keep the newest). All synchronous: ``blocked_s`` is the sum.
- ``relaytrain_loop``: the same through a real run (``engine.run_attempt``, 1 worker, a model
  carrying the state as a buffer, SGD without momentum): the loop's own ``checkpoint_s`` per
  checkpoint.
- ``raw_stream``: the same serialized bytes through ``filesystem.open_output_stream().write()``.
- ``raw_copy_files``: the same bytes from a local file with ``pyarrow.fs.copy_files``.
- ``torch_save``: plain ``torch.save(state, local file)``, plus ``copy_files`` to the store when
  it is remote: the synchronous save + upload a checkpoint costs without staging.

Targets (at 100 MB, per store): relaytrain blocked / torch_save (synchronous save+upload) <=
0.10, which needs asynchronous staging and upload; relaytrain upload throughput / raw stream
write >= 0.8. Local writes land in the page cache (no fsync on either side).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs
import torch

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from bench.workload import mlp_spec, random_state
from trainer_core import storage, training_state
from trainer_core.checkpoints import RunDirectory, sha256_hex
from trainer_core.spec import CheckpointSection, RunSpec

NAME = "checkpoints"
MB = 2**20
COLUMNS = [
    "blocked_s",
    "mb_per_s",
    "serialize_s",
    "write_s",
    "hash_s",
    "commit_s",
    "retention_s",
    "upload_s",
]
BLOCKED_TARGET = 0.10
THROUGHPUT_TARGET = 0.8
KEEP_NEWEST = CheckpointSection(keep_last=1, keep_best=0)


@dataclass
class Store:
    """Where checkpoints go: a storage URI and the scratch directory for local files."""

    name: str
    uri: str
    scratch: Path

    def __post_init__(self) -> None:
        self.location = storage.resolve(self.uri)
        self.location.ensure_dir()


# -- the variants ---------------------------------------------------------------------------------


def relaytrain_checkpoint(run_dir: RunDirectory, step: int, state: dict[str, Any]) -> Sample:
    """The built-in loop's checkpoint sequence for rank 0 of a 1-worker run, timed by phase."""
    clock = time.perf_counter
    started = clock()
    run_dir.prepare_checkpoint_dir(step)
    prepared = clock()
    data = training_state.to_bytes(state)
    serialized = clock()
    entries = [run_dir.write_checkpoint_file(step, "model.pt", data)]
    written = clock()
    rng = training_state.to_bytes(training_state.capture_rng())
    entries.append(run_dir.write_checkpoint_file(step, "rng-rank0.pt", rng))
    run_dir.write_metrics_segment(1, [{"step": step, "epoch": 0, "loss": 0.0}])
    run_dir.commit_checkpoint(
        step, entries, {"epoch": 0, "cursor": {"epoch": 0, "batch": step}, "metrics": {}}
    )
    committed = clock()
    run_dir.apply_retention(KEEP_NEWEST, protected_steps={0}, in_flight_from_step=step + 1)
    retained = clock()
    hash_started = clock()
    sha256_hex(data)  # not part of blocked_s: how much of write_s is hashing
    return {
        "blocked_s": retained - started,
        "mb_per_s": len(data) / MB / (written - serialized),
        "prepare_s": prepared - started,
        "serialize_s": serialized - prepared,
        "write_s": written - serialized,
        "hash_s": clock() - hash_started,
        "commit_s": committed - written,
        "retention_s": retained - committed,
        "bytes": float(len(data)),
    }


def raw_stream(location: storage.Location, data: bytes) -> Sample:
    target = location.child("raw-stream.bin")
    started = time.perf_counter()
    with location.filesystem.open_output_stream(target.path) as f:
        f.write(data)
    seconds = time.perf_counter() - started
    location.filesystem.delete_file(target.path)
    return {"blocked_s": seconds, "mb_per_s": len(data) / MB / seconds}


def raw_copy_files(location: storage.Location, source: Path, size: int) -> Sample:
    target = location.child("raw-copy.bin")
    started = time.perf_counter()
    pafs.copy_files(
        str(source),
        target.path,
        source_filesystem=pafs.LocalFileSystem(),
        destination_filesystem=location.filesystem,
    )
    seconds = time.perf_counter() - started
    location.filesystem.delete_file(target.path)
    return {"blocked_s": seconds, "mb_per_s": size / MB / seconds}


def torch_save(store: Store, state: dict[str, Any]) -> Sample:
    """torch.save to a local file; for a remote store, then copy it up (synchronously)."""
    location = store.location
    local = store.scratch / "torch-save.pt"
    if location.is_local:
        local = Path(location.child("torch-save.pt").path)
    started = time.perf_counter()
    torch.save(state, local)
    saved = time.perf_counter()
    if not location.is_local:
        pafs.copy_files(
            str(local),
            location.child("torch-save.pt").path,
            source_filesystem=pafs.LocalFileSystem(),
            destination_filesystem=location.filesystem,
        )
        location.child("torch-save.pt").delete_file()
    ended = time.perf_counter()
    size = local.stat().st_size
    local.unlink()
    return {
        "blocked_s": ended - started,
        "mb_per_s": size / MB / (ended - started),
        "serialize_s": saved - started,
        "upload_s": ended - saved,
    }


def loop_spec(store: Store, name: str, megabytes: float) -> RunSpec:
    """One worker, a model carrying ``megabytes`` of state, three checkpoints."""
    return mlp_spec(
        store.uri,
        name,
        epochs=2,
        num_workers=1,
        num_samples=2048,
        checkpoint_every=10,
        model={"name": "bench.workload:ballast_model", "kwargs": {"megabytes": megabytes}},
        optimizer={"name": "sgd", "lr": 0.01, "momentum": 0.0},
        checkpoint={"keep_last": 1, "keep_best": 0},
    )


def relaytrain_loop(store: Store, name: str, megabytes: float) -> Sample:
    spec = loop_spec(store, name, megabytes)
    _, events = harness.run_engine(spec)
    timings = harness.finished_timings(events)
    count = timings.get("num_checkpoints") or 0
    if not count:
        raise RuntimeError(f"{name}: the loop reported no checkpoint timings")
    blocked = timings["checkpoint_s"] / count
    _delete_run(store, name)
    return {
        "blocked_s": blocked,
        "mb_per_s": megabytes / blocked,
        "checkpoints": float(count),
    }


def _delete_run(store: Store, name: str) -> None:
    location = store.location.child(name)
    if location.exists():
        location.filesystem.delete_dir(location.path)


# -- one (store, size) group ----------------------------------------------------------------------


def group(store: Store, megabytes: float) -> list[Variant]:
    """The variants for one store and state size (they share one state and its bytes)."""
    state = random_state(megabytes)
    data = training_state.to_bytes(state)
    source = store.scratch / f"source-{megabytes:g}.bin"
    source.write_bytes(data)
    run_dir = RunDirectory(store.location.child(f"direct-{megabytes:g}mb"))
    steps = iter(range(1, 10**6))
    prefix = f"{store.name}/{megabytes:g}MB"
    return [
        Variant(
            f"{prefix}/relaytrain",
            "RunDirectory checkpoint path of the built-in loop, called directly",
            lambda rep: relaytrain_checkpoint(run_dir, next(steps), state),
        ),
        Variant(
            f"{prefix}/relaytrain_loop",
            "the built-in loop's checkpoint_s per checkpoint, 1-worker engine attempt",
            lambda rep: relaytrain_loop(store, f"loop-{megabytes:g}mb-{rep}", megabytes),
        ),
        Variant(
            f"{prefix}/raw_stream",
            "the same bytes via filesystem.open_output_stream().write()",
            lambda rep: raw_stream(store.location, data),
        ),
        Variant(
            f"{prefix}/raw_copy_files",
            "the same bytes from a local file via pyarrow.fs.copy_files",
            lambda rep: raw_copy_files(store.location, source, len(data)),
        ),
        Variant(
            f"{prefix}/torch_save",
            "torch.save to a local file (+ copy_files upload for a remote store)",
            lambda rep: torch_save(store, state),
        ),
    ]


@contextmanager
def stores(names: list[str], scratch: Path) -> Iterator[list[Store]]:
    """The stores asked for: ``local`` (a directory) and ``s3`` (a moto server)."""
    with ExitStack() as stack:
        found = []
        for name in names:
            if name == "local":
                found.append(Store("local", str(scratch / "local-store"), scratch))
            elif name == "s3":
                from tests.s3 import moto_s3

                server = stack.enter_context(moto_s3(scratch))
                stack.enter_context(harness.env(**server.credential_env()))
                found.append(Store("s3", server.uri("bench"), scratch))
            else:
                raise SystemExit(f"unknown store {name!r}: use local and/or s3")
        yield found


def main(argv: list[str] | None = None) -> int:
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--sizes", default=None, help="state sizes in MB (default 10,100,500)")
    cli.add_argument("--stores", default="local,s3", help="local and/or s3")
    args = cli.parse_args(argv)
    sizes = [float(s) for s in (args.sizes or ("2" if args.quick else "10,100,500")).split(",")]
    result = Result(NAME, args.quick, columns=COLUMNS)
    repetitions = common.repetitions_of(args)
    with (
        harness.local_ray() as ray_info,
        tempfile.TemporaryDirectory(prefix="relaytrain-bench-ckpt-") as tmp,
        stores(args.stores.split(","), Path(tmp)) as chosen,
    ):
        result.settings.update(
            ray_info,
            sizes_mb=sizes,
            stores={s.name: s.uri.split("?")[0] for s in chosen},
            scratch=tmp,
            torch_threads=torch.get_num_threads(),
            cpu_count=os.cpu_count(),
        )
        for store in chosen:
            for megabytes in sizes:
                result.variants.update(common.alternate(group(store, megabytes), repetitions))
        summarize(result, [s.name for s in chosen], sizes)
    return common.finish(result, args)


def summarize(result: Result, store_names: list[str], sizes: list[float]) -> None:
    """Targets at 100 MB (or the largest size measured), and every size's ratios."""
    records = result.variants
    at = 100.0 if 100.0 in sizes else sizes[-1]
    note = "" if at == 100.0 else f"measured at {at:g} MB, not 100 MB"
    ratios: dict[str, Any] = {}
    for store in store_names:
        for megabytes in sizes:
            prefix = f"{store}/{megabytes:g}MB"
            ratios[prefix] = {
                "blocked/sync": common.ratio(
                    records, f"{prefix}/relaytrain", f"{prefix}/torch_save", "blocked_s"
                ),
                "loop blocked/sync": common.ratio(
                    records, f"{prefix}/relaytrain_loop", f"{prefix}/torch_save", "blocked_s"
                ),
                "throughput/raw stream": common.ratio(
                    records, f"{prefix}/relaytrain", f"{prefix}/raw_stream", "mb_per_s"
                ),
                "throughput/raw copy_files": common.ratio(
                    records, f"{prefix}/relaytrain", f"{prefix}/raw_copy_files", "mb_per_s"
                ),
            }
        figures = ratios[f"{store}/{at:g}MB"]
        result.targets.append(
            Target(
                f"{store}: blocked/sync",
                f"training blocked per checkpoint / synchronous torch.save+upload, {at:g} MB",
                "<=",
                BLOCKED_TARGET,
            ).check(figures["blocked/sync"], note)
        )
        result.targets.append(
            Target(
                f"{store}: throughput/raw",
                f"relaytrain upload MB/s / raw output-stream write MB/s, {at:g} MB",
                ">=",
                THROUGHPUT_TARGET,
            ).check(figures["throughput/raw stream"], note)
        )
    result.figures["ratios"] = ratios
    result.notes.append(
        "mb_per_s: upload throughput of the serialized bytes (relaytrain: write incl. sha256; "
        "raw_*: the write or copy); for relaytrain_loop and torch_save: state MB / blocked_s"
    )
    result.notes.append(
        "relaytrain checkpoints synchronously today: blocked_s is serialize + upload + sha256 + "
        "commit + retention; the blocked/sync target needs staging to memory and an "
        "asynchronous upload and commit"
    )


if __name__ == "__main__":
    raise SystemExit(main())
