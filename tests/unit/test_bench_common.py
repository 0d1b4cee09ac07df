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
