"""DDP when the workers do not divide the global batch: 33 samples on 2 workers are slices of
16 and 17, each rank's loss weighted by its share, so the gradient is the whole batch's mean.
The oracle is the same spec on one worker, which takes all 33 at once."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_raw
from tests.recovery import final_state, losses, run_dir_of
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


def test_a_batch_the_workers_do_not_divide_trains_as_one_worker_does(ray_cluster, tmp_path):
    """Two batches of 33 a step: an epoch's 13 batches make 6 steps of two and, at its end, one
    step of one batch, the shape of every step without accumulation (the same code: a step's
    micro-batches, the last one synchronized)."""
    accumulation = 2
    raw = tiny_raw(
        tmp_path,
        "uneven",
        # No dropout: per-rank RNG would differ between 1 and 2 workers.
        model={"name": "mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.0}},
        data={"batch_size": 33},
        optimizer={"grad_accumulation": accumulation},
    )
    two = build_spec(raw)
    one = build_spec(raw, ["run.name=uneven-one", "scaling.num_workers=1"])
    for spec in (two, one):
        assert run_attempt(spec).status == "completed"
    assert [a["world_size"] for a in run_dir_of(two).read_attempts()] == [2]
    # 429 training rows: 13 batches of 33 an epoch (12 rows sit out), in steps of
    # `accumulation` batches.
    steps = 3 * -(-13 // accumulation)
    expected = losses(run_dir_of(one))
    assert [step for step, _ in expected] == list(range(1, steps + 1))
    # The same samples, the same gradients but for the order floats are summed in (a rank sums
    # 16 or 17 samples, the one worker 33; measured: at most 7e-8 in a weight, 1.7e-7 relative
    # in a loss), which Adam carries on: tolerances 10 to 20 times that. Unweighted slices
    # (16 of 33 samples counted as half the batch) are off by 1% in step 1's loss already.
    got = losses(run_dir_of(two))
    assert [step for step, _ in got] == [step for step, _ in expected]
    for (step, loss), (_, reference_loss) in zip(got, expected, strict=True):
        assert loss == pytest.approx(reference_loss, rel=2e-6), step
    final, reference = final_state(run_dir_of(two))["model"], final_state(run_dir_of(one))["model"]
    assert final.keys() == reference.keys()
    for name, value in reference.items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6, msg=name)
