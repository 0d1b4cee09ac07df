"""Data: the streaming reader against a raw ``pyarrow.dataset`` scan of the same files, and a
reading worker's peak memory on a small and a large dataset.

Datasets are generated once per run: Parquet files of ``x`` (64 float32 features, a
fixed-size list) and ``y`` (int64), 65,536-row row groups, 4 files per dataset.

Variants, per store (``local``: a directory; ``s3``: a moto server on loopback):
- ``<store>/reader``: ``trainer_core.data.rank_stream.RankStream``, what feeds the built-in loop,
  reading one epoch of every global batch (batch 1024, 8 partitions, one rank of one; row groups
  read ahead a window at a time), rows as numpy arrays;
- ``<store>/reader_rank0of2``: rank 0 of 2: what one worker of two reads;
- ``<store>/raw_scan``: ``pyarrow.dataset(...).to_batches()`` over the same columns, each
  batch turned into the same arrays (``data.table_arrays``): the storage and decode ceiling.

``rss/<MB>``: a fresh process reads one epoch with the reader (rank 0 of 1) and reports its
peak resident memory (VmHWM), for a small and a large dataset, at ``data.memory_mb`` 1024;
``rss/<MB>-big-groups`` the large one as pyarrow writes it by default (one row group of up to
a million rows), which the reader decodes in slices within that budget. The reader keeps
decoded slices up to its budget, so at 1024 MB it holds most of a 200 MB dataset and a 2 GB
one's budget: the two differ by the budget, not by the dataset. ``rss/<MB>-budget<B>`` reads
the small and the large dataset under a budget both exceed (``--rss-budget``, 256 MB, with
windows of 8,192 rows): what the reader holds as a dataset grows.

Targets: reader samples/s / raw scan >= 0.8 (per store); peak RSS of the large dataset within
10 % of the small one's, both over the reader's budget (``-budget<B>``); with big row groups,
at most ``data.memory_mb`` above an idle reader's (``rss/1MB``: the imports and a dataset it
hardly holds).
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from bench import common, harness
from bench.common import Result, Sample, Target, Variant
from trainer_core import storage
from trainer_core.data import arrays as data_mod
from trainer_core.data import footers, rank_stream
from trainer_core.spec.sections import DataSection

NAME = "data"
FEATURES = 64
ROW_GROUP = 65_536
FILES = 4
BATCH = 1024
PARTITIONS = 8
WINDOW = 65_536
COLUMNS = ["samples_per_s", "mb_per_s", "seconds", "peak_rss_mb"]
THROUGHPUT_TARGET = Target(
    "reader/raw scan", "streaming reader samples/s / raw pyarrow.dataset scan", ">=", 0.8
)
RSS_TARGET = Target(
    "rss large/small",
    "reader peak RSS, large dataset / small dataset, both over the reader's data.memory_mb",
    "<=",
    1.10,
)
#: The shuffle window of the ``-budget`` variants: their windows (8 partitions x 8,192 rows,
#: two of them: 35 MB) within half of a budget under the small dataset.
BUDGET_WINDOW = 8192
#: data.memory_mb for the reader here: its windows (8 partitions x 65,536 rows, the live one
#: and the next, of 264 bytes) take 277 MB, more than half of the default 512, which setup
#: would refuse.
MEMORY_MB = 1024
BIG_GROUPS_TARGET = Target(
    "rss big groups - idle",
    "reader peak RSS, large dataset in pyarrow's default row groups, minus an idle reader's "
    "(a 1 MB dataset) (MB)",
    "<=",
    MEMORY_MB,
)


def write_dataset(uri: str, megabytes: float, row_group: int | None = ROW_GROUP) -> int:
    """Generated Parquet files at ``uri`` of about ``megabytes`` in row groups of
    ``row_group`` rows (None: pyarrow's default); returns the rows."""
    location = storage.resolve(uri)
    rows = int(megabytes * 2**20 / (FEATURES * 4 + 8))
    per_file = -(-rows // FILES)
    rng = np.random.default_rng(0)
    location.filesystem.create_dir(location.path, recursive=True)
    for index, start in enumerate(range(0, rows, per_file)):
        count = min(per_file, rows - start)
        features = rng.standard_normal((count, FEATURES), dtype=np.float32)
        table = pa.table(
            {
                "x": pa.FixedSizeListArray.from_arrays(pa.array(features.reshape(-1)), FEATURES),
                "y": pa.array(rng.integers(0, 10, count)),
            }
        )
        path = f"{location.path}/part-{index:03d}.parquet"
        with location.filesystem.open_output_stream(path) as f:
            pq.write_table(table, f, row_group_size=row_group)
    return rows


def section(uri: str, memory_mb: int = MEMORY_MB, window: int = WINDOW) -> DataSection:
    return DataSection(
        dataset=uri,
        features="x",
        label="y",
        task="classification",
        batch_size=BATCH,
        validation_fraction=0.0,
        partitions=PARTITIONS,
        shuffle_window=window,
        memory_mb=memory_mb,
    )


def read_epoch(
    uri: str, world_size: int = 1, rank: int = 0, memory_mb: int = MEMORY_MB, window: int = WINDOW
) -> Sample:
    """One rank's epoch as the built-in loop reads it: ``rank_stream.RankStream`` (which sizes its
    row group cache to the windows it reads), read ahead."""
    data = section(uri, memory_mb, window)
    started = time.perf_counter()
    ranks = rank_stream.RankStream(footers.scan(data), data, 0, world_size, rank)
    samples = 0
    ahead = ranks.epoch(0)
    try:
        for _, _, rows in ahead:
            samples += len(rows.labels)
    finally:
        ahead.close()
    return _rate(samples, time.perf_counter() - started)


def raw_scan(uri: str) -> Sample:
    """The same files through ``pyarrow.dataset``'s own scanner, to the same arrays."""
    data = section(uri)
    location = storage.resolve(uri)
    started = time.perf_counter()
    dataset = pads.dataset(location.path, filesystem=location.filesystem, format="parquet")
    samples = 0
    for batch in dataset.to_batches(columns=["x", "y"], batch_size=BATCH):
        arrays = data_mod.table_arrays(pa.Table.from_batches([batch]), data)
        samples += len(arrays.labels)
    return _rate(samples, time.perf_counter() - started)


def _rate(samples: int, seconds: float) -> Sample:
    return {
        "samples_per_s": samples / seconds,
        "mb_per_s": samples * (FEATURES * 4 + 8) / 2**20 / seconds,
        "seconds": seconds,
        "samples": samples,
    }


def peak_rss(uri: str, memory_mb: int = MEMORY_MB, window: int = WINDOW) -> Sample:
    """A fresh process reads one epoch; its peak RSS (and its rate)."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.data", "--child-read", uri, str(memory_mb), str(window)],
        capture_output=True,
        text=True,
        check=True,
        cwd=common.REPO,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def _child_read(uri: str, memory_mb: int, window: int) -> None:
    sample = read_epoch(uri, memory_mb=memory_mb, window=window)
    sample["peak_rss_mb"] = _peak_rss_mb()
    print(json.dumps(sample))


def _peak_rss_mb() -> float:
    """This process's peak resident memory: its address space's high-water mark (VmHWM).
    Not ``ru_maxrss``, which Linux keeps across fork and exec, so a child started by a parent
    holding a large dataset reports the parent's size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def throughput_variants(
    stores: dict[str, str], megabytes: float
) -> tuple[list[Variant], dict[str, Any]]:
    """Per store, a dataset of ``megabytes`` and the variants that read it; the rows written."""
    variants: list[Variant] = []
    rows: dict[str, Any] = {}
    for name, prefix in stores.items():
        uri = storage.join_uri(prefix, "throughput")
        rows[name] = write_dataset(uri, megabytes)
        variants += [
            Variant(f"{name}/reader", "RankStream, rank 0 of 1", lambda r, u=uri: read_epoch(u)),
            Variant(
                f"{name}/reader_rank0of2",
                "RankStream, rank 0 of 2",
                lambda r, u=uri: read_epoch(u, 2, 0),
            ),
            Variant(f"{name}/raw_scan", "pyarrow.dataset scan", lambda r, u=uri: raw_scan(u)),
        ]
    return variants, rows


def rss_variants(
    root: str, small: float, large: float, budget: int
) -> tuple[list[Variant], dict[str, Any]]:
    """The datasets under ``root`` that a fresh process reads for its peak RSS, and their
    variants (``budget``: the ``data.memory_mb`` of the ``-budget`` ones); the rows written."""
    variants: list[Variant] = []
    rows: dict[str, Any] = {}
    for megabytes, groups, suffix in (
        (1, ROW_GROUP, ""),  # the idle reader: imports and a dataset it hardly holds
        (small, ROW_GROUP, ""),
        (large, ROW_GROUP, ""),
        (large, None, "-big-groups"),
    ):
        uri = f"{root}/{megabytes:g}mb{suffix}"
        rows[f"rss/{megabytes:g}{suffix}"] = write_dataset(uri, megabytes, groups)
        variants.append(
            Variant(
                f"rss/{megabytes:g}MB{suffix}",
                "a fresh process reading one epoch"
                + (" (pyarrow's default row groups)" if suffix else ""),
                lambda r, u=uri: peak_rss(u),
            )
        )
        if megabytes in (small, large) and not suffix:
            variants.append(
                Variant(
                    f"rss/{megabytes:g}MB-budget{budget}",
                    f"the same at data.memory_mb {budget}, shuffle window {BUDGET_WINDOW}",
                    lambda r, u=uri: peak_rss(u, budget, BUDGET_WINDOW),
                )
            )
    return variants, rows


def main(argv: list[str] | None = None) -> int:
    if argv is None and sys.argv[1:2] == ["--child-read"]:
        _child_read(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
        return 0
    cli = common.parser(NAME, __doc__ or "", repetitions=3)
    cli.add_argument("--stores", default="local,s3", help="local and/or s3")
    cli.add_argument("--megabytes", type=float, default=None, help="throughput dataset (256)")
    cli.add_argument("--rss-sizes", default=None, help="small,large in MB (200,2048)")
    cli.add_argument(
        "--rss-budget", type=int, default=None, help="data.memory_mb under both (256; quick 128)"
    )
    args = cli.parse_args(argv)
    size = args.megabytes or (8 if args.quick else 256)
    small, large = common.floats(args.rss_sizes or ("4,16" if args.quick else "200,2048"))
    budget = args.rss_budget or (128 if args.quick else 256)
    result = Result(NAME, args.quick, columns=COLUMNS)
    with (
        tempfile.TemporaryDirectory(prefix="relaytrain-bench-data-") as tmp,
        harness.stores(args.stores.split(","), Path(tmp), s3_prefix="bench-data") as chosen,
    ):
        variants, rows = throughput_variants(chosen, size)
        rss, rss_rows = rss_variants(str(Path(tmp) / "rss"), small, large, budget)
        result.settings.update(
            dataset_mb=size,
            rows={**rows, **rss_rows},
            features=FEATURES,
            row_group=ROW_GROUP,
            batch=BATCH,
            partitions=PARTITIONS,
            window=WINDOW,
            rss_sizes_mb=[small, large],
            rss_budget_mb=budget,
            rss_budget_window=BUDGET_WINDOW,
        )
        result.variants = common.measure(variants + rss, args)
    summarize(result, list(chosen), small, large, budget)
    return common.finish(result, args)


def summarize(
    result: Result, store_names: list[str], small: float, large: float, budget: int
) -> None:
    for name in store_names:
        value = common.ratio(result.variants, f"{name}/reader", f"{name}/raw_scan", "samples_per_s")
        result.targets.append(THROUGHPUT_TARGET.check(value, name))
    under = f"-budget{budget}"
    rss = common.ratio(
        result.variants, f"rss/{large:g}MB{under}", f"rss/{small:g}MB{under}", "peak_rss_mb"
    )
    result.targets.append(
        RSS_TARGET.check(rss, f"{large:g} MB vs {small:g} MB, data.memory_mb {budget}")
    )
    # At MEMORY_MB (1024) the small dataset fits: the reader holds most of it, and up to its
    # budget of the large one. A figure, not the target.
    result.figures[f"rss large/small at data.memory_mb {MEMORY_MB}"] = common.ratio(
        result.variants, f"rss/{large:g}MB", f"rss/{small:g}MB", "peak_rss_mb"
    )
    big = result.variants.get(f"rss/{large:g}MB-big-groups")
    base = result.variants.get("rss/1MB")
    above = None
    if big is not None and base is not None:
        top, bottom = big.median("peak_rss_mb"), base.median("peak_rss_mb")
        above = None if top is None or bottom is None else round(top - bottom, 1)
    result.targets.append(BIG_GROUPS_TARGET.check(above, f"{large:g} MB vs an idle reader's"))


if __name__ == "__main__":
    raise SystemExit(main())
