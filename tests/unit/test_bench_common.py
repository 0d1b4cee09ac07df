"""The benchmark harness's own logic (no Ray, no runs)."""

from __future__ import annotations

import argparse

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


def test_a_chaos_outage_armed_for_the_next_upload_counts_from_when_it_cut():
    """An outage armed for the next checkpoint upload can begin long after it was armed (the
    flow killed meanwhile): the failure it causes is charged to it from the cut, not left with
    "no fault before it" (a CI run of the short campaign failed so, 34 s after the arming)."""
    from bench.chaos import EFFECT_S, Fault, attribute, in_effect

    armed = Fault("s3_outage", 100.0, {"outage_s": 6.8, "when": "the next checkpoint upload"})
    now = Fault("s3_outage", 300.0, {"outage_s": 4.0, "when": "now"})
    kill = Fault("flow_kill", 103.0)
    events = [(90.0, "up"), (100.0 + EFFECT_S + 5, "cut on PUT /relaytrain/checkpoint-360/")]
    failure = {"at": 100.0 + EFFECT_S + 9}
    assert attribute([armed, kill], failure) == []
    placed = in_effect([armed, kill, now], events)
    assert [(f.kind, f.at) for f in placed] == [
        ("flow_kill", 103.0),
        ("s3_outage", 135.0),
        ("s3_outage", 300.0),
    ]
    assert [f.kind for f in attribute(placed, failure)] == ["s3_outage"]
    # never cut (the run ended first): it stays where it was armed
    assert in_effect([armed], [(90.0, "up")])[0].at == 100.0
