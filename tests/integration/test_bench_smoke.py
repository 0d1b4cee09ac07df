"""The benchmark harness works end to end: one cheap benchmark in ``--quick`` mode (its own
local Ray cluster, a real 1-worker run) writes a result of the documented shape into a temporary
directory, and the README tables render from it. No figure is asserted: timings belong in the
benchmarks, not in tests."""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench import common, tables

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def written(results_dir: Path, benchmark: str, before: dt.date) -> tuple[Path, dict]:
    """The one result a quick run wrote: named by the day the benchmark started (read back from
    the result itself), a day between the test's start and now, so a run across midnight reads
    as it should."""
    [path] = results_dir.glob("*.json")
    data = json.loads(path.read_text())
    assert path.name == f"{data['date']}-{benchmark}.json"
    assert before <= dt.date.fromisoformat(data["date"]) <= dt.date.today()
    return path, data


def run_quick(name: str, results_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop(common.RESULTS_ENV, None)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            f"bench.{name}",
            "--quick",
            "--results-dir",
            str(results_dir),
            *extra,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_quick_checkpoints_benchmark_writes_its_result(tmp_path):
    official = set(common.RESULTS_DIR.glob("*.json"))
    before = dt.date.today()
    done = run_quick("checkpoints", tmp_path, "--stores", "local", "--sizes", "1")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    path, data = written(tmp_path, "checkpoints", before)
    assert set(common.RESULTS_DIR.glob("*.json")) == official  # quick runs stay out
    assert data["schema"] == common.SCHEMA_VERSION
    assert data["benchmark"] == "checkpoints" and data["quick"] is True
    assert {"cpu_model", "logical_cores", "ram_gb", "os", "load_average"} <= set(data["machine"])
    assert {"python", "torch", "ray", "prefect", "pyarrow", "relaytrain"} <= set(data["versions"])
    assert "commit" in data["git"]
    expected = {
        f"local/1MB/{v}"
        for v in ("relaytrain", "relaytrain_loop", "raw_stream", "raw_copy_files", "torch_save")
    }
    assert set(data["variants"]) == expected
    for name, variant in data["variants"].items():
        assert variant["available"] and not variant["errors"], name
        assert len(variant["samples"]) == 1, name
        blocked = variant["summary"]["blocked_s"]
        assert blocked["n"] == 1 and blocked["min"] <= blocked["median"] <= blocked["max"]
    targets = {t["name"]: t for t in data["targets"]}
    assert set(targets) == {"local: loop blocked/sync", "local: throughput/raw copy"}
    for target in targets.values():
        assert isinstance(target["value"], float)
        assert target["met"] == (
            target["value"] <= target["threshold"]
            if target["op"] == "<="
            else target["value"] >= target["threshold"]
        )

    # The README renderer shows full results only: promote this one and render a copy.
    full = tmp_path / "full"
    full.mkdir()
    (full / path.name).write_text(json.dumps({**data, "quick": False}))
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{tables.TABLES_START}\nstale tables\n{tables.TABLES_END}\n")
    tables.update_readme(tables.render_tables(tables.newest_results(tmp_path)), readme)
    assert "No full benchmark results yet" in readme.read_text()
    tables.update_readme(tables.render_tables(tables.newest_results(full)), readme)
    text = readme.read_text()
    assert "### checkpoints" in text and "| local/1MB/relaytrain |" in text
    assert "local: loop blocked/sync" in text and "stale tables" not in text


def test_quick_fsdp_checkpoints_benchmark_measures_every_variant(tmp_path):
    before = dt.date.today()
    done = run_quick("fsdp_checkpoints", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, data = written(tmp_path, "fsdp_checkpoints", before)
    assert set(data["variants"]) == {
        f"local/{v}"
        for v in ("relaytrain", "dcp_save", "dcp_async_save", "raw_copy", "relaytrain_loop")
    }
    assert all(v["samples"] and not v["errors"] for v in data["variants"].values())
    assert data["variants"]["local/relaytrain"]["samples"][0]["state_mb"] > 100
    assert [t["value"] is not None for t in data["targets"]] == [True, True, True, True]


def test_quick_restore_benchmark_reads_replicated_files_once_per_node(tmp_path):
    before = dt.date.today()
    done = run_quick("restore", tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, data = written(tmp_path, "restore", before)
    variants = data["variants"]
    assert set(variants) == {
        f"s3/{kind}{how}" for kind in ("", "fsdp/") for how in ("each_rank_reads", "once_per_node")
    }
    read = {name: v["samples"][0]["mb_read"] for name, v in variants.items()}
    # The replicated files (nearly all of the checkpoint) are read once instead of twice.
    assert read["s3/once_per_node"] < 0.55 * read["s3/each_rank_reads"]
    # Under FSDP rank 1 needs part of rank 0's file too: read once for the node instead.
    assert read["s3/fsdp/once_per_node"] < read["s3/fsdp/each_rank_reads"]
