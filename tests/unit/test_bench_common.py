"""The benchmark harness's own logic (no Ray, no runs)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal

from bench import common


def test_only_patterns_that_match_no_variant_fail_the_run_and_write_nothing(tmp_path, capsys):
    ran: list[str] = []
    variants = [
        common.Variant(name, name, lambda rep, name=name: ran.append(name) or {"x": 1.0})
        for name in ("relaytrain_1w", "relaytrain_2w", "plain_2w")
    ]
    records = common.alternate(variants, 1, log=print, only=["relaytrain_*", "plian_2w"])
    assert ran == ["relaytrain_1w", "relaytrain_2w"]
    assert "--only skips plain_2w" in capsys.readouterr().out

    result = common.Result("scaling", quick=False, columns=["x"])
    result.variants = records
    args = argparse.Namespace(only=["relaytrain_*", "plian_2w"], results_dir=tmp_path)
    assert common.finish(result, args) == 2
    err = capsys.readouterr().err
    assert "--only plian_2w matched no variant" in err and "relaytrain_1w" in err
    assert list(tmp_path.iterdir()) == []

    args.only = ["relaytrain_*"]
    assert common.finish(result, args) == 0
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]


def test_unmatched_reads_shell_patterns():
    assert common.unmatched(None, ["a"]) == []
    assert common.unmatched(["plain_*", "x?"], ["plain_1w", "xy"]) == []
    assert common.unmatched(["plain_*", "ray_plain"], ["ray_plain_1w"]) == ["plain_*", "ray_plain"]


def test_the_readme_tables_show_variants_by_repetition_and_one_run_by_rows():
    from bench import tables

    head = {
        "schema": common.SCHEMA_VERSION,
        "date": "2026-11-25",
        "machine": {"cpu_model": "cpu", "logical_cores": 2, "ram_gb": 8.0, "load_average": [1]},
        "git": {"commit": "0123456789abcdef", "dirty": True},
        "targets": [
            {"name": "t", "description": "d", "value": 0.5, "op": "<=", "threshold": 1, "met": True}
        ],
        "notes": ["a note"],
    }
    summary = {"wall_s": {"median": 2.0, "min": 1.0, "max": 3.0, "n": 2}}
    variants = {
        **head,
        "benchmark": "overhead",
        "_file": "o.json",
        "columns": ["wall_s"],
        "variants": {
            "flow": {"available": True, "summary": summary, "errors": ["x"]},
            "gone": {"available": False, "unavailable": "no GPU"},
        },
    }
    rows = {
        **head,
        "benchmark": "chaos",
        "_file": "c.json",
        "columns": ["count"],
        "variants": {},
        "figures": {"row_name": "fault kind", "rows": {"drain": {"count": 3}}},
    }
    text = tables.render_tables({"chaos": rows, "overhead": variants}, ["overhead", "chaos"])
    assert text.index("### overhead") < text.index("### chaos")
    overhead, chaos = text.split("### chaos")
    assert "commit `0123456789` (with local changes)" in overhead
    assert "Median [min-max] of n repetitions." in overhead
    assert "| flow | 2.00 [1.00-3.00] | 2 (1 failed) |" in overhead
    assert "| gone | not available yet: no GPU |" in overhead
    assert "Median" not in chaos and "`c.json`." in chaos
    assert "| fault kind | count |" in chaos and "| drain | 3.00 |" in chaos
    assert "| t: d | 0.5 | <= 1 | met |" in chaos and "- a note" in chaos


def test_ray_trains_split_of_a_group_start_is_read_for_the_run_and_the_start_after_the_failure():
    """``bench.recovery`` reads the resumed group's start from Ray Train's controller log: its
    lines as Ray 2.60 writes them; the first start of the run after the failure counts, not the
    run's first group, nor another run's start, nor a line that is not a record."""
    from bench.recovery import group_phases

    def line(run: str, at: float, message: str) -> str:
        record = {"levelname": "DEBUG", "message": message, "run_name": run}
        return json.dumps({**record, "timestamp_ns": int(at * 1e9)})

    def start(run: str, at: float, actors: float, backend: float) -> list[str]:
        return [
            line(run, at, f"[Worker Group Initialization] 2 worker actors created in {actors}s."),
            line(
                run,
                at + 0.3,
                "[Worker Group Initialization] Train context initialized on workers in 0.41s.",
            ),
            line(
                run,
                at + 2,
                "[Worker Group Initialization] after_worker_group_start callbacks "
                f"completed in {backend}s.\n  Individual callback time breakdown:\n    "
                f"BackendSetupCallback: {backend}s",
            ),
        ]

    lines = [
        *start("run-a", 100.0, 2.18, 1.73),  # the first group, before the failure
        *start("run-b", 120.5, 9.99, 9.99),  # another run's restart, on the same cluster
        "2026-12-01 19:02:13 not a record",
        *start("run-a", 123.0, 2.4, 1.76),  # the group that resumed
        *start("run-a", 140.0, 3.0, 3.0),  # a later restart
    ]
    assert group_phases(lines, "run-a", failed=120.0) == {"actors_s": 2.4, "backend_s": 1.76}
    assert group_phases(lines, "run-a", failed=150.0) == {}


def test_the_resumed_groups_start_is_split_by_rank_0s_marks_after_the_failure():
    """``bench.recovery`` splits the resumed group's start by the probe's marks: those of the
    first group after the failure, not the attempt's first group's, nor a later restart's."""
    from bench.recovery import group_start

    def marks(entered: float, age: float) -> list[dict]:
        return [
            {"event": "loop_entered", "time": entered, "process_age_s": age},
            {"event": "set_up", "time": entered + 1.5},
            {"event": "restored", "time": entered + 1.75},
        ]

    events = [
        *marks(10.0, 4.0),  # the first group
        {"event": "failure", "time": 20.0, "step": 149},
        *marks(26.0, 5.5),  # the group that resumed
        {"event": "first_step", "time": 27.875},
        *marks(40.0, 3.0),  # a later restart
    ]
    assert group_start(events, failed=20.0, first_step=27.875) == {
        "to_loop_s": 6.0,
        "setup_s": 1.5,
        "restore_s": 0.25,
        "to_step_s": 0.125,
        "process_age_s": 5.5,
    }
    assert group_start(events[:5], failed=20.0, first_step=27.875) == {}  # its marks not all in


def test_a_campaigns_processes_end_with_it_even_those_that_ignore_sigterm(tmp_path):
    """A flow process (its own session) that ignores SIGTERM and has started a child that
    ignores it too, as a flow blocked in Ray's or Prefect's shutdown did: both are gone after
    ``end_all``, and a process that already exited is left alone."""
    import subprocess
    import sys

    import psutil

    from bench.processes import Processes

    stubborn = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', "
        "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    processes = Processes(grace_s=1.0)
    leader = processes.track(
        subprocess.Popen(
            [sys.executable, "-c", stubborn], stdout=subprocess.PIPE, start_new_session=True
        )
    )
    done = processes.track(subprocess.Popen([sys.executable, "-c", "pass"]))
    done.wait()
    child = int(leader.stdout.readline())
    assert psutil.pid_exists(child) and leader.poll() is None
    try:
        processes.end_all()
        assert leader.poll() is not None
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    finally:
        for pid in (leader.pid, child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        leader.stdout.close()
