"""What ``relaytrain show RUN`` prints of a run directory: its attempts with each restart in
place, steps lost, epochs.

Each scenario's figures come from its own facts (a fault fires as a known step begins, a resume
starts after a known checkpoint), never from the summary's rules; the run directory is written
the way the engine writes it: the workers' events folded by ``LiveState``, the attempt
record's verbs, the metric segments and commits."""

from __future__ import annotations

import re
from typing import Any

from flows import cli
from flows.pytest_plugin import tiny_spec_dict
from trainer_core import storage
from trainer_core.checkpoint.history import write_metrics_segment
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import attempts
from trainer_core.run.attempts import AttemptRecord
from trainer_core.run.live_state import LiveState
from trainer_core.run.report import epoch_table
from trainer_core.run.summary import user_loop_progress
from trainer_core.spec.overrides import build_spec

#: The tiny spec's global batch of 32 over 560 samples: 17 full batches and a short one.
STEPS_PER_EPOCH = 18


def rows(first: int, last: int) -> list[dict[str, Any]]:
    """Rank 0's metric rows of steps ``first..last`` as the built-in loop writes them: the
    epoch as its index from 0 (stored data keeps its own indexing)."""
    return [
        {"step": s, "epoch": (s - 1) // STEPS_PER_EPOCH, "loss": 1.0 / s}
        for s in range(first, last + 1)
    ]


def relayed(events: list[dict[str, Any]]) -> LiveState:
    live = LiveState(step=0, resumed_from=0)
    for event in events:
        live.apply(event)
    return live


def run_directory(tmp_path, name: str) -> tuple[RunDirectory, Any]:
    spec = build_spec(tiny_spec_dict(tmp_path, name))
    run_dir = RunDirectory(storage.resolve(str(tmp_path)).child(name))
    run_dir.write_run_record(spec.model_dump(mode="json"), spec.identity(), spec.fingerprint(), {})
    return run_dir, spec


def commit(run_dir: RunDirectory, step: int, epochs_done: int) -> None:
    entry = run_dir.write_checkpoint_file(step, "model.pt", b"weights")
    run_dir.commit_checkpoint(step, [entry], {"epoch": epochs_done, "metrics": {"loss": 0.1}})


def show(capsys, run_dir: RunDirectory, *options: str) -> str:
    assert cli.main(["show", run_dir.uri, *options]) == 0
    return capsys.readouterr().out


def row(output: str, first_cell: str) -> list[str]:
    """The cells of the table row that begins with ``first_cell`` (cells are apart by two
    spaces or more; an empty cell is lost)."""
    for line in output.splitlines():
        cells = re.split(r"\s{2,}", line.strip())
        if cells[0] == first_cell:
            return cells
    raise AssertionError(f"no row {first_cell!r} in:\n{output}")


def restarted_in_place(tmp_path) -> RunDirectory:
    """Rank 1 is killed as step 23 begins, while rank 0 waits for it in step 23's all-reduce;
    rank 0 reported up to step 20 (every 5 steps) and says 22 as it winds down. Ray Train
    restarts the group in place: it resumes from the checkpoint at 20, 12.5 s after the
    failure, and completes the 3 epochs at step 54. Truth: 21 and 22 ran twice (2 steps
    lost); one attempt, one restart in place."""
    run_dir, _ = run_directory(tmp_path, "in-place")
    record = AttemptRecord.opened(1, "fresh start", 0)
    attempts.write(run_dir, record)
    live = relayed(
        [
            {"kind": "fresh_start", "time": 1.0, "group": 0, "world_size": 2},
            {"kind": "metrics", "group": 0, "rows": rows(1, 20)},
            {"kind": "last_step", "group": 0, "last_step": 22},
            {
                "kind": "restarting",
                "time": 100.0,
                "error_budget": "infrastructure",
                "error_class": "WorkerGroupError",
                "error_message": "rank 1 died",
            },
            {"kind": "resumed", "time": 112.5, "step": 20, "group": 1, "world_size": 2},
            {"kind": "metrics", "group": 1, "rows": rows(21, 54)},
        ]
    )
    attempts.write(run_dir, record.completed(live.outcome(), 54))
    write_metrics_segment(run_dir, 1, rows(1, 54))
    for step, epochs_done in ((20, 1), (54, 3)):
        commit(run_dir, step, epochs_done)
    return run_dir


def test_show_lists_each_restart_in_place_with_its_error_and_steps_lost(tmp_path, capsys):
    output = show(capsys, restarted_in_place(tmp_path))
    assert row(output, "1")[:4] == ["1", "completed", "0", "54"]
    restart = row(output, "1.1")
    assert restart[:5] == ["1.1", "restarted in place", "20", "22", "2"], output
    assert "infrastructure" in restart[-1] and "WorkerGroupError: rank 1 died" in restart[-1]
    # 1-22 then 21-54: 56 steps run for the 54 kept
    assert "goodput:    0.964 (54 steps kept of 56 computed)" in output


def section(output: str, title: str) -> str:
    """The lines of ``output`` under ``title``, to the next blank line."""
    return output.split(f"\n{title}\n", 1)[1].split("\n\n", 1)[0]


def test_show_numbers_epochs_from_1_as_the_logs_do(tmp_path, capsys):
    """The run's 54 steps are 3 epochs of 18: the train task logs "epoch 1/3 (step 18)" ..
    "epoch 3/3 (step 54)", and show's tables number them the same; a checkpoint says how many
    epochs were done when it was taken (step 20: one, step 54: three)."""
    output = show(capsys, restarted_in_place(tmp_path))
    epochs = section(output, "metrics per epoch")
    assert [row(epochs, n)[:2] for n in ("1", "2", "3")] == [["1", "18"], ["2", "36"], ["3", "54"]]
    assert "\n  0 " not in epochs, epochs
    checkpoints = section(output, "checkpoints")
    assert re.split(r"\s{2,}", checkpoints.splitlines()[0].strip())[:2] == ["step", "epochs done"]
    assert row(checkpoints, "20")[:2] == ["20", "1"] and row(checkpoints, "54")[:2] == ["54", "3"]
    assert "epochs 3/3" in output


def test_a_ray_loop_is_read_in_the_epoch_numbering_it_reports(tmp_path):
    """Two loops on Ray's API train 3 epochs, reporting once an epoch: one reports its
    ``for epoch in range(3)`` index, the other ``epoch + 1``. Each completed 3 epochs, and
    its table numbers them 1, 2, 3, as the built-in loop's does."""
    for first in (0, 1):
        history = [
            {"step": n, "epoch": n - 1 + first, "loss": 1.0 / n, "val_loss": 0.5} for n in (1, 2, 3)
        ]
        done, epochs, _ = user_loop_progress("completed", None, history)
        assert (done, epochs) == (3, 3), first
        table = epoch_table(history, ray_loop=True)
        assert [(r["epoch"], r["last_step"]) for r in table] == [(1, 1), (2, 2), (3, 3)], first
