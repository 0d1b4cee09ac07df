"""The adversary's fixed seeds (``SUITE_SEEDS``, tests/adversary): scenarios that together touch
every operator action and every fault kind, and those that found a defect (``FOUND_SEEDS``).
Each is played against the `relaytrain` command on a cluster of `ray start`, a `prefect server
start` and a moto S3 server, and judged by the adversary's oracles. A failure names the seed
and the command that replays it; the campaign (`make adversary`) draws many more."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.adversary.cover import FOUND_SEEDS, SUITE_SEEDS
from tests.adversary.scenario import draw
from tests.adversary.world import World, world
from tools.adversary import play_one

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def adversary_world(tmp_path_factory) -> Iterator[World]:
    with world(tmp_path_factory.mktemp("adversary")) as w:
        yield w


@pytest.mark.parametrize("seed", sorted({*SUITE_SEEDS, *FOUND_SEEDS}))
def test_a_fixed_seed_breaks_no_guarantee(adversary_world, seed):
    scenario = draw(seed)
    record = play_one(scenario, adversary_world, adversary_world.root)
    replay = f"replay: python -m tools.adversary --seed {seed}"
    assert "error" not in record, f"{scenario.describe()}\n{record['error']}\n{replay}"
    violated = [f"{v['invariant']}: {v['what']}" for v in record["violations"]]
    assert not violated, "\n".join([scenario.describe(), *violated, replay])
    assert len(record["checks"]) >= 9  # every oracle judged it
