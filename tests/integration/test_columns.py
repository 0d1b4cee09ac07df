"""The columns form on the shared local Ray cluster: the GPT example (examples/lm_gpt.py) on
byte tokens of the pydoc corpus, random-cropped by its transform from each row's own
generator, with dropout, per-token loss, 2 gloo DDP workers. A run that fails mid-epoch and
resumes ends bit for bit where the uninterrupted run does."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import yaml

from flows.training import training
from tests.columns_workloads import write_lm_dataset
from tests.conftest import reference_of
from tests.recovery import (
    assert_records_what_it_measures,
    assert_same_tensors,
    final_state,
    losses,
    measure_checkpoints,
    recorded_batches,
    run_dir_of,
)
from trainer_core.checkpoint.exports import DCP_FORMAT
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


def lm_raw(root, dataset: str, name: str, **sections) -> dict:
    raw = {
        "run": {"name": name, "storage": str(root), "seed": 5},
        "model": {
            "name": "examples.lm_gpt:build",
            "kwargs": {"block_size": 32, "layers": 1, "heads": 2, "width": 16, "dropout": 0.1},
        },
        "data": {
            "dataset": dataset,
            "columns": ["tokens"],
            "transform": "examples.lm_gpt:crop",
            "eval_transform": "examples.lm_gpt:tokens",
            "task": "causal_lm",
            "batch_size": 16,
            "shuffle_window": 64,
            "partitions": 2,
        },
        "optimizer": {"name": "adamw", "lr": 0.01, "weight_decay": 0.0, "clip_grad_norm": 1.0},
        "schedule": {"epochs": 2, "lr_schedule": "cosine", "warmup_steps": 3},
        "scaling": {"num_workers": 2},
        "checkpoint": {
            "every": 4,
            "keep_last": None,
            "best_metric": "val_perplexity",
            "best_mode": "min",
        },
        "report": {"every": 2},
        "retries": {"infrastructure": 1, "code": 1, "delay_s": 0, "jitter": 0},
    }
    raw.update(sections)
    return raw


@pytest.fixture(scope="module")
def lm_dataset(tmp_path_factory) -> str:
    return write_lm_dataset(tmp_path_factory.mktemp("lm") / "lm.parquet", count=200, group=50)


@pytest.fixture(scope="module")
def lm_reference(relaytrain_ray, lm_dataset, tmp_path_factory):
    return reference_of(
        build_spec(lm_raw(tmp_path_factory.mktemp("lm-reference"), lm_dataset, "reference"))
    )


def test_the_lm_trains_and_measures_perplexity(lm_reference):
    result = lm_reference["result"]
    # 2 epochs of 9 global batches of 16 (150 of the 200 rows are training rows)
    assert result.status == "completed" and result.steps_completed == 2 * 9
    metrics = result.final_metrics
    assert math.isclose(metrics["val_perplexity"], math.exp(metrics["val_loss"]), rel_tol=1e-9)
    # Bytes of English: a trained model beats the uniform 256-way guess by far.
    assert metrics["val_perplexity"] < 100 and 0 < metrics["val_accuracy"] < 1
    first, last = lm_reference["losses"][0][1], lm_reference["losses"][-1][1]
    assert first > math.log(256) * 0.9 and last < first * 0.8
    # Each validated checkpoint records what its weights score when the driver evaluates them
    # on the holdout (val_loss, val_perplexity, val_accuracy per labelled token).
    validated = {
        s: m for s, m in lm_reference["checkpoints"].items() if "val_loss" in m["recorded"]
    }
    assert sorted(validated) == [9, 18]
    assert_records_what_it_measures(lm_reference["checkpoints"])


def test_an_lm_run_that_fails_mid_epoch_resumes_bit_for_bit(lm_reference, lm_dataset, tmp_path):
    spec = build_spec(
        lm_raw(tmp_path, lm_dataset, "faulted", faults=[{"kind": "raise", "at_step": 14}])
    )
    with pytest.raises(TrainingCodeError):
        run_attempt(spec)
    second = run_attempt(spec)
    assert second.status == "completed" and second.resumed_from_step == 12
    run_dir = run_dir_of(spec)
    assert_same_tensors(final_state(run_dir), lm_reference["state"])
    assert losses(run_dir) == lm_reference["losses"]


def test_the_vision_example_runs_through_the_flow_and_resumes_after_a_fault(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """examples/vision_resnet.yaml as a user runs it, 1 epoch on 1 worker: PNG bytes decoded
    and augmented in the transform processes, transformers' ResNet, a stateful metric (macro F1),
    a code fault at step 9 and a Prefect retry that resumes from step 8."""
    raw = yaml.safe_load((REPO / "examples" / "vision_resnet.yaml").read_text())
    raw["run"] = {"name": "vision", "storage": str(tmp_path)}
    raw["data"]["dataset"] = str(REPO / raw["data"]["dataset"])
    raw["schedule"]["epochs"] = 1
    raw["scaling"]["num_workers"] = 1
    raw["checkpoint"] |= {"every": 4, "keep_last": None}
    raw["retries"] = {"code": 1, "delay_s": 0, "jitter": 0}
    raw["faults"] = [{"kind": "raise", "at_step": 9}]
    spec = build_spec(raw)
    state = training(spec, return_state=True)
    assert state.is_completed()
    result = state.result()
    assert [a.status for a in result.attempts] == ["failed", "completed"]
    assert result.attempts[1].resumed_from_step == 8
    # 1,797 images, about 80% for training: 22 global batches of 64
    assert result.steps_completed == 22
    trained = losses(run_dir_of(spec))
    assert trained[-1][1] < trained[0][1] * 0.9 and 0 < result.final_metrics["val_accuracy"] < 1
    # The stateful macro F1 is recorded, and (below) is what the driver computes from the
    # checkpoint's weights over the whole holdout.
    assert 0 < result.final_metrics["val_MacroF1"] < 1
    measured = measure_checkpoints(spec, run_dir_of(spec))
    assert_records_what_it_measures(measured)


def test_hf_gpt2_under_fsdp_resumes_where_ddp_ends_and_reshards(
    relaytrain_ray, lm_dataset, tmp_path
):
    """transformers' GPT-2 from its config (tied head, dropout, attention mask) sharded with
    FSDP2 over 2 workers, one unit per block: a fault at step 14 resumes from the DCP
    checkpoint at 12 and ends bit for bit where a DDP run of the same spec ends (2 gloo ranks
    average gradients to the same bits either way; no clipping, whose norm FSDP sums over the
    shards in another order); the run then continues on 1 worker, its
    DCP checkpoint resharded."""
    sections = {
        "model": {
            "name": "examples.lm_gpt:gpt2",
            "kwargs": {"block_size": 32, "layers": 2, "heads": 2, "width": 16, "dropout": 0.1},
        },
    }
    raw = lm_raw(tmp_path / "fsdp", lm_dataset, "gpt2", **sections)
    raw["data"] |= {"transform": "examples.lm_gpt:masked", "eval_transform": None}
    raw["scaling"] |= {"strategy": "fsdp"}
    # Clipping would sum the gradients' squares over shards under FSDP, in another order.
    raw["optimizer"] = {"name": "adamw", "lr": 0.01, "weight_decay": 0.0}
    ddp = build_spec(
        {**raw, "run": {**raw["run"], "storage": str(tmp_path / "ddp")}}
        | {"scaling": {"num_workers": 2}}
    )
    assert run_attempt(ddp).status == "completed"
    fsdp = build_spec({**raw, "faults": [{"kind": "raise", "at_step": 14}]})
    with pytest.raises(TrainingCodeError):
        run_attempt(fsdp)
    second = run_attempt(fsdp)
    assert second.resumed_from_step == 12
    run_dir = run_dir_of(fsdp)
    assert run_dir.scan().newest.manifest["format"] == DCP_FORMAT
    assert_same_tensors(final_state(run_dir), final_state(run_dir_of(ddp)))
    assert losses(run_dir) == losses(run_dir_of(ddp))
    more = build_spec(
        {**raw, "schedule": {**raw["schedule"], "epochs": 3}}
        | {"scaling": {"num_workers": 1, "strategy": "fsdp"}}
        | {"faults": []}
    )
    third = run_attempt(more)
    assert third.resumed_from_step == 18 and third.steps_completed == 27


def test_half_precision_accumulation_clipping_and_uneven_tokens_stop_early_and_resume_exactly(
    relaytrain_ray, lm_dataset, tmp_path
):
    """The LM under fp16 autocast and its gradient scaler (bf16 is the same precision object's
    autocast in another dtype, without the scaler: test_training_options resumes it), 2
    micro-batches a step whose samples carry uneven counts of labelled tokens
    (tests.columns_workloads:crop_some_labels), clipping, and early stopping on val_perplexity
    (patience 1, min_delta 1e6: it stops after epoch 2 of 4). A fault at step 8 (epoch 2) and
    a resume from step 5 end bit for bit where the uninterrupted run does, stopped after the
    same epoch."""

    def spec_of(name: str, faults: list) -> object:
        raw = lm_raw(
            tmp_path,
            lm_dataset,
            name,
            precision="fp16",
            optimizer={
                "name": "adamw",
                "lr": 0.01,
                "weight_decay": 0.0,
                "clip_grad_norm": 0.5,
                "grad_accumulation": 2,
            },
            schedule={
                "epochs": 4,
                "lr_schedule": "cosine",
                "warmup_steps": 2,
                "early_stopping": {"metric": "val_perplexity", "patience": 1, "min_delta": 1e6},
            },
            faults=faults,
        )
        raw["data"]["transform"] = "tests.columns_workloads:crop_some_labels"
        return build_spec(raw)

    reference = spec_of("reference", [])
    assert run_attempt(reference).status == "completed"
    faulted = spec_of("faulted", [{"kind": "raise", "at_step": 8}])
    with pytest.raises(TrainingCodeError):
        run_attempt(faulted)
    second = run_attempt(faulted)
    assert second.status == "completed" and second.resumed_from_step == 5
    for spec in (reference, faulted):
        newest = run_dir_of(spec).scan().newest
        # 9 global batches an epoch in steps of 2 micro-batches: 5 steps; stopped after 2.
        assert newest.step == 10 and newest.manifest["early_stopping"]["stopped"]
        assert "val_perplexity" in newest.metrics
    assert_same_tensors(final_state(run_dir_of(faulted)), final_state(run_dir_of(reference)))
    assert losses(run_dir_of(faulted)) == losses(run_dir_of(reference))


def test_lm_samples_and_their_crops_survive_two_workers_then_one_then_two(
    relaytrain_ray, lm_dataset, tmp_path
):
    """2 workers fail at step 6 (resume from 4), 1 worker fails at step 13 (resume from 12), 2
    workers finish: every global batch the run kept holds the samples, each cropped as its
    own generator says, that one process reads for it (the oracle: the stream and transform
    in this process, at 1 worker)."""
    from tests.columns_workloads import sample_digest
    from trainer_core.data import footers, rank_stream
    from trainer_core.data.transform import Batches

    logs = tmp_path / "logs"
    logs.mkdir()
    plan = [(2, 6), (1, 13), (2, None)]
    faults = [
        {"kind": "raise", "at_step": at, "attempt": n + 1} for n, (_, at) in enumerate(plan) if at
    ]
    model = {
        "name": "tests.columns_workloads:recording_lm",
        "kwargs": {"log_dir": str(logs), "block_size": 32, "layers": 1, "heads": 2, "width": 16},
    }
    kept: list[list[str]] = []
    resumed = 0
    for workers, fails_at in plan:
        spec = build_spec(
            lm_raw(tmp_path, lm_dataset, "elastic", model=model, faults=faults),
            [f"scaling.num_workers={workers}"],
        )
        if fails_at is not None:
            with pytest.raises(TrainingCodeError):
                run_attempt(spec)
        else:
            assert run_attempt(spec).status == "completed"
        kept = kept[:resumed] + recorded_batches(logs, "rows")
        resumed = run_dir_of(spec).scan().newest.step
    assert [a["world_size"] for a in run_dir_of(spec).read_attempts()] == [2, 1, 2]
    assert [a.get("resumed_from_step") for a in run_dir_of(spec).read_attempts()] == [0, 4, 12]
    data = spec.data.resolved()
    one = rank_stream.RankStream(footers.scan(data), data, spec.run.seed, 1, 0)
    batches = Batches(data, spec.run.seed)
    expected = []
    for epoch in range(2):
        ahead = one.epoch(epoch, make_batch=batches.start)
        expected += [[sample_digest(row) for row in b["input_ids"]] for _, _, b in ahead]
        ahead.close()
    batches.close()
    assert len(expected) == 18 and kept == expected


def test_the_lm_retrains_nightly_warm_started_and_compared_on_perplexity(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """Scheduled retraining of the columns form: night 1's LM is promoted; night 2's starts from
    its weights (a first loss far below night 1's) and both are evaluated on night 2's holdout
    on val_perplexity, the spec's best_metric; a margin no model meets keeps the champion."""
    from datetime import UTC, datetime

    from flows.retraining import retraining
    from trainer_core import storage
    from trainer_core.checkpoint.registry import Registry

    lake = tmp_path / "lake"
    lake.mkdir()
    for day in ("2026-01-01", "2026-01-02"):
        write_lm_dataset(lake / f"{day}.parquet", count=100, group=50)
    raw = lm_raw(tmp_path / "runs", str(lake / "{date}.parquet"), "unused")
    raw["run"].pop("name")
    raw["scaling"] = {"num_workers": 1}
    raw["schedule"]["epochs"] = 1
    spec = build_spec(raw)
    first = retraining(spec, model_name="nightly-lm", slot=datetime(2026, 1, 1, 2, tzinfo=UTC))
    assert first.warm_started_from is None and first.comparison.promoted
    assert first.comparison.metric == "val_perplexity"
    champion = Registry(storage.resolve(str(tmp_path / "runs")), "nightly-lm").champion()
    second = retraining(
        spec, model_name="nightly-lm", promote_margin=1e9, slot=datetime(2026, 1, 2, 2, tzinfo=UTC)
    )
    assert second.warm_started_from == champion.checkpoint_uri
    assert not second.comparison.promoted and "not better" in second.comparison.reason
    for metrics in (second.comparison.challenger_metrics, second.comparison.champion_metrics):
        assert math.isclose(metrics["val_perplexity"], math.exp(metrics["val_loss"]))
    nights = [
        losses(RunDirectory(storage.resolve(str(tmp_path / "runs")).child(r.training.run_name)))
        for r in (first, second)
    ]
    assert nights[1][0][1] < nights[0][0][1] * 0.9  # the warm start's weights, trained
