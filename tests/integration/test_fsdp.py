"""FSDP2 on a real local Ray cluster, 2 gloo workers: sharded training, DCP checkpoints in the
committed format, exact resume, resharding to another worker count, and DDP <-> FSDP resume
(a worker SIGKILLed under fsdp: the fault matrix's row 2f).

On 2 gloo ranks FSDP's reduce-scatter averages gradients to the same bits as DDP's all-reduce
(halving is exact), so every FSDP run here must end exactly where the DDP reference run does.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_raw
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.checkpoint import exports
from trainer_core.checkpoint.exports import DCP_FORMAT, FORMAT, read_model_weights
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import finalize_run
from trainer_core.spec.overrides import build_spec
from trainer_core.train import evaluate

pytestmark = pytest.mark.integration
FSDP = {"strategy": "fsdp"}


def formats(run_dir) -> dict[int, str]:
    return {c.step: c.manifest["format"] for c in run_dir.scan().committed}


def test_fsdp_resumes_exactly_and_consumers_read_its_checkpoint(uninterrupted, tmp_path):
    spec = build_spec(
        tiny_raw(tmp_path, "fsdp", scaling=FSDP, faults=[{"kind": "raise", "at_step": 17}])
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    run_dir = run_dir_of(spec)
    newest = run_dir.scan().newest
    assert newest.step == 13 and newest.manifest["format"] == DCP_FORMAT
    sizes = {name: entry["size"] for name, entry in newest.files.items()}
    # Every rank's shard file and DCP's metadata are in the manifest, digests and all.
    assert {".metadata", "__0_0.distcp", "__1_0.distcp", "scheduler.pt"} <= set(newest.files)
    assert not {"model.pt", "optimizer.pt"} & set(newest.files)
    second = run_attempt(spec)
    assert second.resumed_from_step == 13
    # Each file read once for the node's 2 ranks (rank 0's shard file also holds what DCP saved
    # once for both, so rank 1 needs part of it too: handed on, not read again), but DCP's
    # .metadata, which every rank reads itself.
    read = run_dir.read_attempts()[1]["restore"]["bytes_read"]
    assert read == sum(sizes.values()) + sizes[".metadata"]
    assert_same_tensors(final_state(run_dir), uninterrupted["state"])
    assert losses(run_dir) == uninterrupted["losses"]
    # Consumers get whole weights: one torch state dict, as from a DDP checkpoint.
    latest = run_dir.scan().newest
    weights = read_model_weights(latest.uri)
    assert_same_tensors(weights, uninterrupted["state"]["model"])
    rows = evaluate.holdout(spec)
    reference_uri = uninterrupted["result"].latest_checkpoint_uri
    assert evaluate.evaluate(spec, latest.uri, rows) == evaluate.evaluate(spec, reference_uri, rows)
    # Finalize gives the best and latest checkpoints one torch.load file each, which consumers
    # then read instead of gathering the shards.
    result = finalize_run(spec, run_dir, spec.run.storage, "completed")
    assert result.latest_model_uri.endswith(f"/exports/{latest.name}.pt")
    exported = torch.load(result.latest_model_uri, weights_only=True)
    assert_same_tensors(exported, uninterrupted["state"]["model"])
    best = result.best_checkpoint_uri.rsplit("/", 1)[-1]
    assert result.best_model_uri.endswith(f"/exports/{best}.pt")
    assert_same_tensors(exports.read(run_dir, latest), exported)


#: The tiny spec's MLP without dropout: no per-rank RNG, so a run's arithmetic does not depend on
#: its worker count, but for the order floats are summed in.
NO_DROPOUT = {"name": "mlp", "kwargs": {"hidden": [16, 16], "dropout": 0.0}}


@pytest.fixture(scope="module")
def no_dropout_reference(ray_cluster, tmp_path_factory):
    """The tiny spec without dropout, uninterrupted on 2 DDP workers: final state and losses."""
    spec = build_spec(tiny_raw(tmp_path_factory.mktemp("ddp"), "no-dropout", model=NO_DROPOUT))
    assert run_attempt(spec).steps_completed == 39
    return {"state": final_state(run_dir_of(spec)), "losses": losses(run_dir_of(spec))}


def test_fsdp_reshards_from_2_workers_to_1_and_back(no_dropout_reference, tmp_path):
    raw = tiny_raw(
        tmp_path,
        "reshard",
        model=NO_DROPOUT,
        scaling={**FSDP, "shard_fn": "tests.own_functions:shard"},  # a user's own sharding
        faults=[{"kind": "raise", "at_step": 12}],
    )
    spec = build_spec(raw)
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    one = build_spec(
        raw, ["scaling.num_workers=1", 'faults=[{"kind": "raise", "at_step": 25, "attempt": 2}]']
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(one, attempt=2)
    third = run_attempt(build_spec(raw, ["faults=[]"]), attempt=3)
    assert third.status == "completed" and third.steps_completed == 39
    run_dir = run_dir_of(spec)
    attempts = run_dir.read_attempts()
    assert [a["world_size"] for a in attempts] == [2, 1, 2]
    assert [a["resumed_from_step"] for a in attempts] == [0, 10, 20]
    assert set(formats(run_dir).values()) == {DCP_FORMAT}
    # The same samples as the DDP run on 2 workers, step for step. Steps 11-20 ran on one
    # worker, whose loss is the mean of the batch's 32 samples at once where 2 workers average
    # two means of 16: the sums differ in the order floats are added, about 1 ulp (measured: at
    # most 6e-8 in a weight, 1.4e-7 relative in a loss), and Adam carries that into the later
    # steps. The tolerances are 10 to 20 times that; a step lost, repeated or resumed with
    # another optimizer or schedule state moves the weights by 1e-3 or more.
    reference = no_dropout_reference
    steps = losses(run_dir)
    assert [step for step, _ in steps] == list(range(1, 40))
    assert steps[:10] == reference["losses"][:10]  # the first 10 steps ran on 2 workers: exact
    for (step, loss), (_, expected) in zip(steps, reference["losses"], strict=True):
        assert loss == pytest.approx(expected, rel=2e-6), step
    final = final_state(run_dir)["model"]
    assert final.keys() == reference["state"]["model"].keys()
    for name, expected in reference["state"]["model"].items():
        torch.testing.assert_close(final[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_ddp_checkpoint_resumes_under_fsdp_and_back_exactly(uninterrupted, tmp_path):
    raw = tiny_raw(tmp_path, "switch", faults=[{"kind": "raise", "at_step": 12}])
    with pytest.raises(TrainingCodeError):
        run_attempt(build_spec(raw))
    fsdp = build_spec(
        raw, ["scaling.strategy=fsdp", 'faults=[{"kind": "raise", "at_step": 25, "attempt": 2}]']
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(fsdp, attempt=2)
    spec = build_spec(raw, ["faults=[]"])
    assert run_attempt(spec, attempt=3).resumed_from_step == 20
    run_dir = run_dir_of(spec)
    assert formats(run_dir)[20] == DCP_FORMAT and formats(run_dir)[39] == FORMAT
    assert_same_tensors(final_state(run_dir), uninterrupted["state"])
    assert losses(run_dir) == uninterrupted["losses"]


def test_warm_starts_cross_strategies(uninterrupted, tmp_path):
    """run.init_from into an fsdp run loads a DDP checkpoint's whole weights into its shards,
    and trains as a DDP run warm-started alike does; the fsdp run's export holds the weights
    the DDP run's model.pt does."""
    reference = uninterrupted["result"].latest_checkpoint_uri
    short = {"epochs": 1}
    fsdp = build_spec(
        tiny_raw(tmp_path, "warm-fsdp", scaling=FSDP, run={"init_from": reference}, schedule=short)
    )
    ddp = build_spec(tiny_raw(tmp_path, "warm-ddp", run={"init_from": reference}, schedule=short))
    assert run_attempt(fsdp).status == run_attempt(ddp).status == "completed"
    warm = losses(run_dir_of(fsdp))
    assert warm == losses(run_dir_of(ddp))  # 2 gloo ranks: FSDP's bits are DDP's
    assert warm[0][1] < uninterrupted["losses"][0][1] / 2  # trained weights, not new ones
    result = finalize_run(fsdp, run_dir_of(fsdp), fsdp.run.storage, "completed")
    assert_same_tensors(
        torch.load(result.latest_model_uri, weights_only=True),
        read_model_weights(run_dir_of(ddp).scan().newest.uri),
    )
