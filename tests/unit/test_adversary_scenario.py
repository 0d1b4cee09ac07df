"""The adversary's own machinery, without running a scenario: a seed draws one scenario, the
seeds together reach every action and fault, shrinking only makes scenarios smaller, and the
damage it does to data is damage pyarrow sees."""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import random
import signal
import subprocess
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.adversary import data as tables
from tests.adversary.cover import SUITE_SEEDS, cheapest_cover
from tests.adversary.drive import child_uri, fault_step
from tests.adversary.scenario import ACTIONS, FAULTS, SHAPES, Scenario, draw
from tests.adversary.scoring import mean_squared_error
from tests.adversary.shrink import shrink, smaller
from tests.adversary.world import USER_CODE, USER_MODULE


def test_a_seed_is_one_scenario_that_survives_json():
    for seed in range(50):
        scenario = draw(seed)
        assert draw(seed) == scenario
        assert Scenario.from_json(scenario.to_json()) == scenario
        assert scenario.history[0].kind == "run"
    assert len({draw(seed).to_json() for seed in range(50)}) == 50


def touched(seeds) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {"actions": set(), "faults": set(), "shapes": set()}
    for seed in seeds:
        for what, kinds in draw(seed).kinds().items():
            found[what].update(kinds)
    return found


def test_the_seeds_reach_every_action_fault_and_shape():
    assert touched(range(300)) == {
        "actions": set(ACTIONS),
        "faults": set(FAULTS),
        "shapes": set(SHAPES),
    }


def test_shrinking_drops_actions_and_faults_but_never_the_first_run():
    scenario = next(s for s in map(draw, range(300)) if len(s.history) >= 3)
    for candidate in smaller(scenario):
        assert candidate.history[0].kind == "run"
        dropped = len(scenario.history) - len(candidate.history)
        faults = sum(a.fault is not None for a in candidate.history)
        assert dropped == 1 or faults == sum(a.fault is not None for a in scenario.history) - 1

    # What still "fails" here: any history holding a continue. The shrink ends at the first
    # run and one continue, without its fault.
    if not any(a.kind == "continue" for a in scenario.history):
        return
    smallest, played = shrink(
        scenario, lambda s: any(a.kind == "continue" for a in s.history), budget=100
    )
    assert [a.kind for a in smallest.history] == ["run", "continue"]
    assert all(a.fault is None for a in smallest.history[1:])
    assert 0 < played <= 100


@pytest.mark.parametrize("first,last", [(0, 30), (20, 45), (0, 2), (10, 11)])
def test_a_fault_lands_inside_the_commands_steps(first, last):
    steps = {fault_step(at, first, last) for at in range(1000)}
    assert min(steps) >= min(first + 2, last) and max(steps) <= last


def test_a_child_of_an_s3_storage_keeps_the_endpoint_at_the_end():
    uri = "s3://bucket/runs?endpoint_override=127.0.0.1:9000&scheme=http"
    assert child_uri(uri, "r") == "s3://bucket/runs/r?endpoint_override=127.0.0.1:9000&scheme=http"
    assert child_uri("/tmp/store/", "r") == "/tmp/store/r"


def test_the_damage_is_what_a_parquet_reader_meets(tmp_path):
    spec = draw(3).data
    paths = tables.write(spec, tmp_path / "data")
    assert len(paths) == spec.files
    whole = pq.read_table(paths[0])
    assert whole.num_rows == spec.rows
    assert pq.ParquetFile(paths[0]).metadata.num_row_groups == -(-spec.rows // spec.row_group)

    original = tables.flip_page_byte(paths[0], random.Random(0))
    assert paths[0].stat().st_size == len(original)  # size and footer unchanged
    with pytest.raises(OSError):  # the page's CRC32 no longer matches
        pq.read_table(paths[0], page_checksum_verification=True)
    paths[0].write_bytes(original)
    assert pq.read_table(paths[0], page_checksum_verification=True).equals(whole)

    half = tables.add_file(spec, tmp_path / "data", "half_written")
    with pytest.raises(pa.ArrowInvalid):
        pq.read_metadata(half)
    other = tables.add_file(spec, tmp_path / "data", "other_schema")
    assert pq.read_schema(other).names == ["features", "target"]
    valid = tables.add_file(spec, tmp_path / "data", "valid")
    assert pq.read_schema(valid) == pq.read_schema(paths[0])


def test_the_suites_seeds_are_the_cheapest_to_touch_every_action_fault_and_shape():
    assert touched(SUITE_SEEDS) == {
        "actions": set(ACTIONS),
        "faults": set(FAULTS),
        "shapes": set(SHAPES),
    }
    assert cheapest_cover(range(1, 3000)) == sorted(SUITE_SEEDS)


@pytest.mark.parametrize("bf16", [False, True])
def test_the_score_oracle_reads_an_mlp_from_its_state_dict_as_torch_evaluates_it(bf16):
    # The user's own network (the columns form's, the own loop's): the built-in MLP's layout.
    user = importlib.util.spec_from_file_location(USER_MODULE, USER_CODE / f"{USER_MODULE}.py")
    module = importlib.util.module_from_spec(user)
    user.loader.exec_module(module)
    torch.manual_seed(0)
    net = module.Net(5, [12, 8], dropout=0.1).eval()
    x, y = torch.randn(40, 5), torch.randn(40)
    state = net.state_dict()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        expected = torch.nn.functional.mse_loss(net(x).float().squeeze(-1), y).item()
    assert math.isclose(mean_squared_error(state, x, y, bf16), expected, rel_tol=1e-6)
    state["net.6.bias"] = state["net.6.bias"] + 1.0  # other weights score otherwise
    assert not math.isclose(mean_squared_error(state, x, y, bf16), expected, rel_tol=1e-3)


def test_a_command_past_the_liveness_bound_is_killed_and_judged_hung(tmp_path):
    from tests.adversary.drive import Outcome
    from tests.adversary.oracles import commands
    from tests.adversary.processes import wait_bounded

    # A process that ignores SIGTERM and would sleep far past the bound, in a session of its
    # own as the player's commands are; killed at the end whatever the test found.
    process = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 300"], start_new_session=True)
    try:
        code, hung = wait_bounded(process, time.monotonic(), 0.5)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    assert hung and code == -signal.SIGKILL
    verdicts = commands([Outcome(0, "run", [], code, str(tmp_path / "none.log"), hung=hung)])
    assert [v.invariant for v in verdicts] == ["liveness"]
    # Within the bound (or with none), a command is waited for to its end.
    quick = subprocess.Popen(["sh", "-c", "exit 3"], start_new_session=True)
    assert wait_bounded(quick, time.monotonic(), 600.0) == (3, False)
    unbounded = subprocess.Popen(["sh", "-c", "exit 4"], start_new_session=True)
    assert wait_bounded(unbounded, time.monotonic(), None) == (4, False)
