"""A Ray Train loop of a user's own, run through the training flow (issue 29, item 5).

The loops below are written as Ray's checkpointing guide writes one: ``ray.train.report`` with a
``Checkpoint.from_directory`` of a ``model.pt`` on rank 0, ``ray.train.get_checkpoint`` to
resume. Rank 0 also appends to ``config["log"]`` one JSON line per epoch it trained, before it
reports it: the loop's own account of what it ran, which the tests hold relaytrain's result
against.

Ray workers import this module to run the loops: its top level imports no Prefect.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.integration
REPO = Path(__file__).resolve().parents[2]


# -- the loops (run by Ray's workers) --------------------------------------------------------


def counting_loop(config: dict[str, Any]) -> None:
    """One report an epoch with ``loss`` and ``score`` (highest at ``best_epoch``), and no
    ``step`` metric (nor ``epoch``, unless ``report_epoch``); a checkpoint every
    ``checkpoint_every`` epochs. Each of ``peer_kills`` (``{"epoch", "start", "registered",
    "rank_0_computing"}``) kills rank 1 of the worker group that started at epoch ``start``, at
    ``epoch``, once Ray registered ``registered`` checkpoints, while rank 0 waits for it in a
    collective or, with ``rank_0_computing``, computes something long (until Ray ends the
    group); ``marker`` (a file per kill) makes each once."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "model.pt"), weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["epoch"] + 1
    model = ray.train.torch.prepare_model(model)
    rank = ray.train.get_context().get_world_rank()
    generator = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(64, 4, generator=generator)
    y = x.sum(dim=1, keepdim=True)
    for epoch in range(start, config["num_epochs"]):
        kills = enumerate(config.get("peer_kills", ()))
        kill = next(((i, k) for i, k in kills if (k["epoch"], k["start"]) == (epoch, start)), None)
        if kill is not None and rank == 1:
            marker = Path(f"{config['marker']}-{kill[0]}")
            if not marker.exists():
                registered(Path(config["run_dir"]), kill[1]["registered"])
                marker.write_text("killed")
                os.kill(os.getpid(), signal.SIGKILL)
        if kill is not None and rank == 0:
            while kill[1]["rank_0_computing"]:
                time.sleep(1)  # until Ray ends the group: rank 1 died meanwhile
        dist.all_reduce(torch.ones(1))  # rank 0 waits here for a rank 1 that died
        optimizer.zero_grad()
        # Dropout draws from torch's global RNG, which the loop's checkpoint does not save
        loss = nn.functional.mse_loss(model(nn.functional.dropout(x, 0.5)), y)
        loss.backward()
        optimizer.step()
        metrics: dict[str, Any] = {
            "loss": loss.item(),
            "score": -float(abs(epoch - config.get("best_epoch", 0))),
        }
        if config.get("report_epoch"):
            metrics["epoch"] = epoch
        if config.get("step_per_epochs"):  # a `step` that stays put across reports
            metrics["step"] = epoch // config["step_per_epochs"]
        saved = rank == 0 and (epoch + 1) % config["checkpoint_every"] == 0
        if rank == 0:
            with open(config["log"], "a") as log:
                weights = {k: v.tolist() for k, v in model.state_dict().items()}
                line = {"epoch": epoch, "checkpoint": saved, "pid": os.getpid(), **metrics}
                line["weights"] = weights  # after the epoch's step (floats round-trip JSON)
                log.write(json.dumps(line) + "\n")
        with tempfile.TemporaryDirectory() as tmp:
            if saved:
                state = {
                    "model": getattr(model, "module", model).state_dict(),  # DDP from 2 ranks
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(tmp, "model.pt"))
            ray.train.report(
                metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp) if saved else None
            )


def loud_failing_loop(config: dict[str, Any]) -> None:
    """Each rank prints ``config["marker"]`` and reports once; then rank 1 fails two calls deep
    in a function of its own (``_read_sample``)."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    print(f"{config['marker']} from the loop")
    ray.train.report({"loss": 1.0})
    if rank == 1:
        _prepare_batch(rank)


def _prepare_batch(rank: int) -> int:
    return _read_sample(rank) + 1


def _read_sample(rank: int) -> int:
    raise ValueError(f"no sample for rank {rank}")


def registered(run_dir: Path, count: int) -> None:
    """Wait until Ray Train's snapshot lists ``count`` checkpoints of the run (all are kept):
    its controller registers a reported checkpoint when it next polls the workers, and a group
    lost before that loses the checkpoint with it (Ray's registry; on a loaded machine the kill
    outran the poll, and the run restarted from scratch). A kill is meant to land after its
    group's registered checkpoint. No clock bounds it: this runs in a worker, which lives no
    longer than the controller whose poll it waits for."""
    snapshot = run_dir / "checkpoint_manager_snapshot.json"
    while True:
        try:
            if len(json.loads(snapshot.read_text()).get("checkpoint_results") or ()) >= count:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)


# -- what the loop says it ran ----------------------------------------------------------------


def loop_log(path: Path) -> list[dict[str, Any]]:
    """Every epoch the loop trained (and went on to report), in order, across attempts."""
    return [json.loads(line) for line in path.read_text().splitlines()]


def final_timeline(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The reports the run keeps: for each epoch, the last time the loop reported it (a resumed
    attempt runs again the epochs after its checkpoint)."""
    last = {line["epoch"]: line for line in log}
    return [last[epoch] for epoch in sorted(last)]


def checkpoint_dirs(run_path: Path) -> dict[int, Path]:
    """The run's Ray checkpoint directories by the epoch their model.pt holds, read with torch."""
    found = {}
    for folder in sorted(p for p in run_path.glob("checkpoint_*") if p.is_dir()):
        state = torch.load(folder / "model.pt", weights_only=True)
        found[int(state["epoch"])] = folder
    return found


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def own_loop_spec(storage: Path, name: str, workers: int = 1, **loop_config: Any) -> Any:
    from trainer_core.spec.overrides import build_spec

    return build_spec(
        {
            "run": {"name": name, "storage": str(storage)},
            "scaling": {"num_workers": workers},
            "train_loop": "tests.integration.test_user_loop:counting_loop",
            "train_loop_config": {"log": str(storage / f"{name}.log.jsonl"), **loop_config},
            "checkpoint": {"keep_last": None, "best_metric": "score", "best_mode": "max"},
            "retries": {"delay_s": 0, "jitter": 0},
        }
    )


def with_faults(spec: Any, *faults: dict[str, Any]) -> Any:
    from trainer_core.spec.run_spec import RunSpec

    raw = spec.model_dump(mode="json")
    raw["faults"] = list(faults)
    return RunSpec.model_validate(raw)


# -- a run with a fault and a resume ------------------------------------------------------------


@pytest.fixture(scope="module")
def faulted(relaytrain_ray, relaytrain_prefect, tmp_path_factory):
    """6 epochs, a checkpoint every 2, a raised fault at the 4th report: the first attempt
    reports epochs 0-2 (checkpoint at epoch 1) and trains epoch 3, the second resumes from
    epoch 1's checkpoint and reports epochs 2-5 (checkpoints at 3 and 5)."""
    from flows.training import training

    storage = tmp_path_factory.mktemp("own-loop")
    spec = own_loop_spec(storage, "own-loop", num_epochs=6, checkpoint_every=2, best_epoch=3)
    spec = with_faults(spec, {"kind": "raise", "at_step": 4})
    state = training(spec, return_state=True)
    assert state.is_completed(), state
    log = loop_log(storage / "own-loop.log.jsonl")
    return state.result(), log, storage / "own-loop"


def test_history_keeps_every_report_once(faulted):
    """The loop reports no step or epoch: relaytrain numbers its reports across attempts, and
    the resumed attempt's rows replace the failed one's after the checkpoint it resumed from."""
    from trainer_core.checkpoint.history import read_metrics_history
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.storage.uris import resolve

    _, log, run_path = faulted
    kept = final_timeline(log)
    assert [line["epoch"] for line in log] == [0, 1, 2, 3, 2, 3, 4, 5]  # the loop's account
    history = read_metrics_history(RunDirectory(resolve(str(run_path))))
    assert [row["loss"] for row in history] == [line["loss"] for line in kept]
    assert [row["step"] for row in history] == list(range(1, len(kept) + 1))


def test_result_counts_reports_checkpoints_best_and_goodput(faulted):
    result, log, run_path = faulted
    kept = final_timeline(log)
    assert [a.status for a in result.attempts] == ["failed", "completed"]
    assert result.steps_completed == len(kept)
    assert result.steps_computed == len(log)
    assert result.goodput == round(len(kept) / len(log), 4)
    # The run's Ray checkpoints, read with torch: epochs 1, 3 and 5.
    by_epoch = checkpoint_dirs(run_path)
    newest = max(line["epoch"] for line in kept if line["checkpoint"])
    best = max((line for line in kept if line["checkpoint"]), key=lambda line: line["score"])
    assert result.latest_checkpoint_uri == str(by_epoch[newest])
    assert result.best_checkpoint_uri == str(by_epoch[best["epoch"]])
    assert result.best_metrics["score"] == best["score"]
    assert result.final_metrics["loss"] == kept[-1]["loss"]
    # The second attempt (its rank 0's lines) began after the checkpoint it resumed from.
    second = [line for line in log if line["pid"] == log[-1]["pid"]]
    first = log[: len(log) - len(second)]
    resumed_at = second[0]["epoch"]  # = the report number of the epoch before it
    assert result.attempts[1].resumed_from_step == resumed_at
    assert result.attempts[0].steps_lost == sum(line["epoch"] >= resumed_at for line in first)


def test_show_and_export_read_the_ray_checkpoints(faulted, tmp_path, capsys):
    from flows import cli

    _, log, run_path = faulted
    kept = final_timeline(log)
    by_epoch = checkpoint_dirs(run_path)
    best = max((line for line in kept if line["checkpoint"]), key=lambda line: line["score"])

    assert cli.main(["show", str(run_path)]) == 0
    shown = capsys.readouterr().out
    assert f"steps:      {len(kept)}" in shown
    section = shown.split("\ncheckpoints\n", 1)[1].split("\n\n", 1)[0].splitlines()
    steps = [int(line.split()[0]) for line in section[1:]]
    reports = [n for n, line in enumerate(kept, 1) if line["checkpoint"]]
    assert steps == reports  # 2, 4, 6
    assert [line.split()[0] for line in section[1:] if line.rstrip().endswith("best")] == [
        str(kept.index(best) + 1)
    ]

    for option, epoch in (("--best", best["epoch"]), ("--latest", max(by_epoch))):
        out = tmp_path / f"{option[2:]}.pt"
        assert cli.main(["export", str(run_path), str(out), option]) == 0
        saved = torch.load(by_epoch[epoch] / "model.pt", weights_only=True)["model"]
        assert_same_weights(torch.load(out, weights_only=True), saved)
    out = tmp_path / "step.pt"
    assert cli.main(["export", str(run_path), str(out), "--step", "2"]) == 0
    saved = torch.load(by_epoch[1] / "model.pt", weights_only=True)["model"]
    assert_same_weights(torch.load(out, weights_only=True), saved)


def twice_run_epochs(log: list[dict[str, Any]]) -> dict[int, tuple[dict, dict]]:
    """The epochs the loop trained twice: the first time (uninterrupted since the start) and
    the last (after a resume from an earlier checkpoint), by epoch."""
    runs: dict[int, list[dict[str, Any]]] = {}
    for line in log:
        runs.setdefault(line["epoch"], []).append(line)
    return {epoch: (lines[0], lines[-1]) for epoch, lines in runs.items() if len(lines) > 1}


def assert_trained_alike(first: dict[str, Any], again: dict[str, Any]) -> None:
    """The weights an epoch left, the first time and again, are the same tensors bit for bit."""
    assert sorted(first["weights"]) == sorted(again["weights"])
    for name, values in first["weights"].items():
        same = torch.equal(torch.tensor(values), torch.tensor(again["weights"][name]))
        assert same, f"epoch {first['epoch']}: {name} differs after the resume"
    assert first["loss"] == again["loss"]


def test_a_resumed_loop_with_dropout_trains_as_if_never_interrupted(faulted):
    """The loop saves model, optimizer and epoch with its checkpoint, not its RNG (as Ray's
    guide does), and its dropout draws from torch's RNG. The first attempt trained epochs 2 and
    3 uninterrupted; the second trained them again from epoch 1's checkpoint: the same weights
    each time, because relaytrain saved the RNG with the checkpoint and restored it."""
    from trainer_core.checkpoint.run_directory import RunDirectory
    from trainer_core.storage.uris import resolve

    _, log, run_path = faulted
    again = twice_run_epochs(log)
    assert sorted(again) == [2, 3]
    for first, second in again.values():
        assert first["pid"] != second["pid"]  # two attempts' workers
        assert_trained_alike(first, second)
    attempts = RunDirectory(resolve(str(run_path))).read_attempts()
    assert [a.get("resume_exact") for a in attempts] == [None, True]


# -- finished, and continued ----------------------------------------------------------------------


def test_a_finished_run_continues_when_its_train_loop_config_asks_for_more(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    from flows.training import training
    from tests.prefect_api import task_runs

    spec = own_loop_spec(tmp_path, "more", num_epochs=3, checkpoint_every=1, report_epoch=True)
    log_path = tmp_path / "more.log.jsonl"
    first = training(spec, return_state=True).result()
    again = training(spec, return_state=True)
    assert "train" not in task_runs(again.state_details.flow_run_id)  # finished: stored result
    assert again.result().attempts == first.attempts
    assert len(loop_log(log_path)) == 3

    config = {**spec.train_loop_config, "num_epochs": 5}
    more = training(spec.model_copy(update={"train_loop_config": config}), return_state=True)
    result = more.result()
    log = loop_log(log_path)
    assert [line["epoch"] for line in log] == [0, 1, 2, 3, 4]  # continued, not started over
    assert first.steps_completed == 3 and first.epochs_completed == 3
    assert result.steps_completed == 5 and result.epochs_completed == 5
    assert [a.resumed_from_step for a in result.attempts] == [0, 3]
    assert result.goodput == 1.0


# -- a lost peer ----------------------------------------------------------------------------------


def test_a_lost_peer_is_an_infrastructure_failure_and_the_work_it_cost_is_counted(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """Rank 1 dies twice (two restarts in place allowed): first while rank 0 waits for it in an
    all-reduce (rank 0's error is a lost peer), then, in the group that resumed, while rank 0
    computes (Ray ends rank 0 when its controller finds rank 1 dead). Each is recovered in
    place on the infrastructure budget, not the loop's own failure; the epoch rank 0 reported
    and held back (its rows are batched) counts as computed, and as run again."""
    from flows.training import training

    spec = own_loop_spec(
        tmp_path,
        "peer",
        workers=2,
        num_epochs=6,
        checkpoint_every=2,  # after epochs 1, 3 and 5: the groups resume at 2, then 4
        peer_kills=[
            {"epoch": 3, "start": 0, "registered": 1, "rank_0_computing": False},
            {"epoch": 5, "start": 2, "registered": 2, "rank_0_computing": True},
        ],
        marker=str(tmp_path / "killed"),
        run_dir=str(tmp_path / "peer"),
    )
    spec = spec.model_copy(update={"retries": spec.retries.model_copy(update={"in_place": 2})})
    result = training(spec, return_state=True).result()
    assert (tmp_path / "killed-0").exists() and (tmp_path / "killed-1").exists()
    errors = [a.error_class for a in result.attempts] + [
        r.error_class for a in result.attempts for r in a.restarts
    ]
    assert "TrainingCodeError" not in errors, result.attempts
    assert len(result.attempts) == 1 and result.attempts[0].status == "completed"
    restarts = result.attempts[0].restarts
    assert [(r.reason, r.error_class) for r in restarts] == [
        ("infrastructure", "InfrastructureError")
    ] * 2
    log = loop_log(tmp_path / "peer.log.jsonl")
    kept = final_timeline(log)
    assert [line["epoch"] for line in log] == [0, 1, 2, 2, 3, 4, 4, 5]  # epochs 3, 5: no work
    assert result.steps_completed == len(kept) and result.steps_computed == len(log)
    # Epoch 2 trained again after the first restart, as the first group had trained it: rank
    # 1's dropout reaches rank 0's weights through DDP's gradients, so both ranks' RNG resumed.
    (first, second) = twice_run_epochs(log)[2]
    assert_trained_alike(first, second)


# -- what the loop says, and where it failed ------------------------------------------------------


def test_the_loops_output_and_its_failures_traceback_reach_the_flows_log(
    relaytrain_ray, relaytrain_prefect, tmp_path
):
    """What each rank prints reaches the flow's log, prefixed by its rank; the failure of rank
    1 names the function of the loop's own that raised, and its file."""
    from flows.training import training
    from tests.prefect_api import logs
    from trainer_core.spec.overrides import build_spec

    marker = f"marker-{os.getpid()}-{time.time_ns()}"
    spec = build_spec(
        {
            "run": {"name": "loud", "storage": str(tmp_path)},
            "scaling": {"num_workers": 2},
            "train_loop": "tests.integration.test_user_loop:loud_failing_loop",
            "train_loop_config": {"marker": marker},
            "retries": {"code": 0, "delay_s": 0, "jitter": 0},
        }
    )
    state = training(spec, return_state=True)
    assert state.is_failed(), state
    lines = logs(state.state_details.flow_run_id)
    printed = sorted(line for line in lines if marker in line)
    assert printed == [f"[rank 0] {marker} from the loop", f"[rank 1] {marker} from the loop"]
    failure = next(line for line in lines if line.startswith("attempt failed with"))
    assert "ValueError: no sample for rank 1" in failure, failure
    for frame in ("loud_failing_loop", "_prepare_batch", "_read_sample"):  # outermost first
        assert f'{__file__}", line' in failure and f"in {frame}\n" in failure, failure


# -- the example ----------------------------------------------------------------------------------


def test_a_step_that_does_not_grow_is_refused_naming_it_and_spends_no_retry(
    relaytrain_ray, tmp_path
):
    """A stock loop reporting a ``step`` that stays put (here: one per two epochs, reported
    every epoch) would collapse the history, one row per step, without a word."""
    from tests.recovery import run_dir_of
    from trainer_core.errors import SpecError
    from trainer_core.run.engine import run_attempt

    spec = own_loop_spec(tmp_path, "flat-step", num_epochs=4, checkpoint_every=2, step_per_epochs=2)
    with pytest.raises(SpecError, match=r"reported step 0 after step 0 .*'step'") as raised:
        run_attempt(spec)
    assert raised.value.field == "train_loop"
    (attempt,) = run_dir_of(spec).read_attempts()
    assert attempt["error_class"] == "SpecError" and attempt["error_budget"] == "none"
    assert len(loop_log(tmp_path / "flat-step.log.jsonl")) == 2  # stopped at the second report


def test_the_example_loop_fails_resumes_and_exports(relaytrain_ray, tmp_path):
    """examples/ray_loop.yaml (the stock loop of examples/ray_train_loop.py, one report and
    checkpoint an epoch) with a raised fault at its 3rd report, then run again: it resumes from
    its Ray checkpoint, the epochs it trained again stream live, and the newest checkpoint
    exports. (A user loop's Prefect retry: the ``faulted`` fixture.)"""
    import yaml

    from flows import cli
    from tests.recovery import fail_then_resume, run_dir_of
    from trainer_core.checkpoint.history import read_metrics_history
    from trainer_core.run.summary import build_result
    from trainer_core.spec.overrides import build_spec

    raw = yaml.safe_load((REPO / "examples" / "ray_loop.yaml").read_text())
    raw["run"].update({"name": "example", "storage": str(tmp_path)})
    raw["faults"] = [{"kind": "raise", "at_step": 3}]
    spec = build_spec(raw)
    events = fail_then_resume(spec)
    epochs = raw["train_loop_config"]["num_epochs"]
    run_dir = run_dir_of(spec)
    # epoch 2 onwards ran again after the resume, once each, and streamed while it ran
    assert [row["epoch"] for row in read_metrics_history(run_dir)] == list(range(epochs))
    assert [e["rows"][0]["epoch"] for e in events if e["kind"] == "metrics"] == [2, 3]
    assert [a["world_size"] for a in run_dir.read_attempts()] == [2, 2]
    result = build_result(spec, run_dir, spec.run.storage, "completed")
    assert result.steps_completed == epochs and result.epochs_completed == epochs
    # The fault fires in the 3rd report, after its epoch was trained: that epoch ran twice.
    assert result.steps_computed == epochs + 1
    by_epoch = checkpoint_dirs(tmp_path / "example")
    assert result.latest_checkpoint_uri == str(by_epoch[epochs - 1])
    out = tmp_path / "latest.pt"
    assert cli.main(["export", str(tmp_path / "example"), str(out), "--latest"]) == 0
    saved = torch.load(by_epoch[epochs - 1] / "model.pt", weights_only=True)["model"]
    assert_same_weights(torch.load(out, weights_only=True), saved)
