"""A Ray Train loop of a user's own fed by the spec's ``datasets`` (Ray Data): what each attempt
reads is the table as the run's first attempt found it (issue 63, item 2).

The loop below logs, one JSON line per epoch, the ``id`` of every row its shard gave it: the
loop's own account of what it trained on, which the tests hold against an uninterrupted run over
the original files (and those against the ids written on disk).

Ray workers import this module to run the loop: its top level imports no Prefect.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.integration.test_user_loop import final_timeline, loop_log

pytestmark = pytest.mark.integration

#: Three files of 40 rows: ids 0-119, each trained once an epoch.
FILES = {"part-0.parquet": range(0, 40), "part-1.parquet": range(40, 80)}
FILES["part-2.parquet"] = range(80, 120)
EPOCHS = 3


# -- the loop (run by Ray's workers) ----------------------------------------------------------


def ids_loop(config: dict[str, Any]) -> None:
    """A stock Ray Data loop: every epoch reads this worker's shard of ``train`` whole, logs
    the ids it got, and reports with a checkpoint (the epoch). On the first attempt, once
    epoch ``land["epoch"]`` has read its rows, it copies every file of ``land["from"]`` into
    ``land["into"]``, once (``land["marker"]``): what a table's writer leaves while the run goes
    on, before the fault at that epoch's report ends the attempt."""
    import ray.train

    start = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint:
        with checkpoint.as_directory() as folder:
            start = json.loads(Path(folder, "epoch.json").read_text())["epoch"] + 1
    shard = ray.train.get_dataset_shard("train")
    land = config.get("land")
    for epoch in range(start, config["num_epochs"]):
        batches = shard.iter_batches(batch_size=32, batch_format="numpy")
        ids = sorted(int(i) for batch in batches for i in batch["id"])
        with open(config["log"], "a") as log:
            log.write(json.dumps({"epoch": epoch, "ids": ids, "pid": os.getpid()}) + "\n")
        if land and epoch == land["epoch"] and not Path(land["marker"]).exists():
            for name in sorted(os.listdir(land["from"])):
                shutil.copyfile(os.path.join(land["from"], name), os.path.join(land["into"], name))
            Path(land["marker"]).write_text("landed")
        with tempfile.TemporaryDirectory() as tmp:
            Path(tmp, "epoch.json").write_text(json.dumps({"epoch": epoch}))
            ray.train.report(
                {"epoch": epoch, "rows": len(ids)},
                checkpoint=ray.train.Checkpoint.from_directory(tmp),
            )


# -- the table and the spec --------------------------------------------------------------------


def write_table(directory: Path, files: dict[str, range] = FILES) -> None:
    """Parquet files of ``id`` (int64) and ``x`` (float32), one per name."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, ids in files.items():
        table = pa.table(
            {
                "id": pa.array(list(ids), pa.int64()),
                "x": pa.array([i / 7 for i in ids], pa.float32()),
            }
        )
        pq.write_table(table, directory / name, row_group_size=16)


def what_writers_leave(scratch: Path) -> list[str]:
    """What lands in a table that other jobs write, prepared in ``scratch``: a Parquet file of
    the table's schema with new ids (1000 on: a row of it read would show in the loop's ids),
    one still being written (a valid file cut in half), one of another schema and a text file.
    Returns their names."""
    write_table(scratch, {"part-3.parquet": range(1000, 1040)})
    write_table(scratch / "whole", {"part-4.parquet": range(2000, 2040)})
    whole = (scratch / "whole" / "part-4.parquet").read_bytes()
    shutil.rmtree(scratch / "whole")
    (scratch / "part-4.parquet").write_bytes(whole[: len(whole) // 2])
    pq.write_table(
        pa.table({"user": pa.array(["a", "b", "c"]), "clicks": pa.array([1, 2, 3])}),
        scratch / "part-5.parquet",
    )
    (scratch / "README.txt").write_text("clicks by user, one file per hour\n")
    return sorted(os.listdir(scratch))


def ids_spec(root: Path, name: str, table: str, **sections: Any) -> Any:
    """One worker runs ``ids_loop`` for ``EPOCHS`` epochs over ``table`` (as the spec gives
    it); its log is ``{root}/{name}.log.jsonl``."""
    from trainer_core.spec.overrides import build_spec

    config = {"num_epochs": EPOCHS, "log": str(root / f"{name}.log.jsonl")}
    return build_spec(
        {
            "run": {"name": name, "storage": str(root / "runs")},
            "scaling": {"num_workers": 1},
            "train_loop": "tests.integration.test_ray_datasets:ids_loop",
            "train_loop_config": {**config, **sections.pop("train_loop_config", {})},
            "datasets": {"train": table},
            "checkpoint": {"keep_last": None},
            "retries": {"delay_s": 0, "jitter": 0},
            **sections,
        }
    )


def ids_by_epoch(log_path: Path) -> dict[int, list[int]]:
    """The ids the run trained on, by epoch: for each epoch, the last time the loop read it."""
    return {line["epoch"]: line["ids"] for line in final_timeline(loop_log(log_path))}


@pytest.fixture(scope="module")
def reference(relaytrain_ray, tmp_path_factory) -> dict[int, list[int]]:
    """The ids an uninterrupted run over the original files trained on, by epoch."""
    from trainer_core.run.engine import run_attempt

    root = tmp_path_factory.mktemp("ray-datasets-reference")
    write_table(root / "table")
    spec = ids_spec(root, "reference", str(root / "table"))
    assert run_attempt(spec).status == "completed"
    ids = ids_by_epoch(root / "reference.log.jsonl")
    # The oracle itself, against the files on disk: every row once an epoch.
    assert ids == {epoch: list(range(120)) for epoch in range(EPOCHS)}
    return ids


# -- the table grows between attempts --------------------------------------------------------------


def test_what_lands_in_the_table_between_attempts_is_counted_not_read(
    relaytrain_prefect, reference, tmp_path
):
    """Once the first attempt has read epoch 1's rows, a Parquet file of the table's schema, a
    half-written one, one of another schema and a text file land in the table; a fault at that
    epoch's report fails the attempt. The retry completes the run and trains on exactly the
    rows of the uninterrupted run; the train task's log names the four files as added."""
    from flows.training import training
    from tests.prefect_api import logs as flow_logs
    from tests.recovery import run_dir_of

    table = tmp_path / "table"
    write_table(table)
    landed = what_writers_leave(tmp_path / "scratch")
    marker = tmp_path / "landed"
    land = {"epoch": 1, "from": str(tmp_path / "scratch"), "into": str(table)}
    spec = ids_spec(
        tmp_path,
        "grown",
        str(table),
        train_loop_config={"land": {**land, "marker": str(marker)}},
        faults=[{"kind": "raise", "at_step": 2}],
    )

    state = training(spec, return_state=True)
    assert marker.exists(), "the files never landed"
    assert state.is_completed(), state.result(raise_on_failure=False)
    assert sorted(os.listdir(table)) == sorted([*FILES, *landed])  # still there at the end
    run_dir = run_dir_of(spec)
    assert [a["status"] for a in run_dir.read_attempts()] == ["failed", "completed"]
    log = loop_log(tmp_path / "grown.log.jsonl")
    retried = [line["epoch"] for line in log if line["pid"] == log[-1]["pid"]]
    assert retried and retried[-1] == EPOCHS - 1 and 1 in retried  # the retry read its rows
    assert ids_by_epoch(tmp_path / "grown.log.jsonl") == reference
    lines = flow_logs(state.state_details.flow_run_id)
    said = [line for line in lines if f"{len(landed)} file(s) added" in line]
    assert said and all(name in said[0] for name in landed), said


def test_a_relative_datasets_uri_from_another_directory_is_refused(relaytrain_ray, tmp_path):
    """``datasets.train: table`` (relative) trained from one working directory and failed at a
    fault; the run's next attempt from another directory that holds another ``table`` is
    refused with a SpecError naming both places and spends no attempt."""
    from tests.recovery import run_dir_of
    from trainer_core.errors import SpecError, TrainingCodeError
    from trainer_core.run.engine import run_attempt

    first, other = tmp_path / "checkout-a", tmp_path / "checkout-b"
    write_table(first / "table")
    write_table(other / "table", {"part-0.parquet": range(500, 540)})
    spec = ids_spec(tmp_path, "moved", "table", faults=[{"kind": "raise", "at_step": 2}])
    here = os.getcwd()
    try:
        os.chdir(first)
        with pytest.raises(TrainingCodeError):
            run_attempt(spec)
        os.chdir(other)
        with pytest.raises(SpecError) as raised:
            run_attempt(spec)
    finally:
        os.chdir(here)
    message = str(raised.value)
    assert raised.value.field == "datasets.train", message
    assert str(first / "table") in message and str(other / "table") in message, message
    assert len(run_dir_of(spec).read_attempts()) == 1  # no attempt spent
    assert all(line["ids"][0] < 500 for line in loop_log(tmp_path / "moved.log.jsonl"))
