"""Checkpoint bytes that rot at rest, after they were committed (and verified): a damaged
checkpoint is never resumed from, kept as the newest, published, exported or handed out again as
a finished run's best; nothing is deleted for being damaged. On the shared local Ray cluster."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flows import cli
from flows.pytest_plugin import tiny_spec_dict
from flows.training import training
from tests.conftest import ONE_WORKER, tiny_raw
from tests.recovery import assert_same_tensors, final_state, losses, run_dir_of
from trainer_core.errors import TrainingCodeError
from trainer_core.run.engine import run_attempt
from trainer_core.run.summary import finalize_run
from trainer_core.spec.overrides import build_spec

pytestmark = pytest.mark.integration


def flip_a_byte(path: Path) -> None:
    """A byte in the middle of ``path`` flipped: the same size, so only a digest can tell."""
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_damaged_newest_checkpoint_never_pushes_sound_ones_out(
    uninterrupted_one_worker, tmp_path, capsys
):
    """keep_last 1: attempt 1 fails at step 23 leaving only step 20, whose model.pt then rots.
    Attempt 2 cannot use it, starts fresh and commits 10 and 13 before failing at 17: they
    must stay (the damaged 20 is not "the newest"), so attempt 3 resumes from 13, the commit
    before the fault. The run ends as the uninterrupted one. Then the final checkpoint rots
    too: finalize publishes no damaged checkpoint, and export refuses, naming it."""
    raw = tiny_raw(
        tmp_path,
        "rot",
        scaling=ONE_WORKER,
        checkpoint={"keep_last": 1, "keep_best": 0},
        faults=[
            {"kind": "raise", "at_step": 23, "attempt": 1},
            {"kind": "raise", "at_step": 17, "attempt": 2},
        ],
    )
    spec = build_spec(raw)
    run_dir = run_dir_of(spec)
    with pytest.raises(TrainingCodeError):
        run_attempt(spec, attempt=1)
    assert [c.step for c in run_dir.scan().committed] == [20]
    flip_a_byte(tmp_path / "rot" / "checkpoint-000000020" / "model.pt")
    with pytest.raises(TrainingCodeError):
        run_attempt(spec, attempt=2)
    third = run_attempt(spec, attempt=3)
    assert third.resumed_from_step == 13
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
    assert losses(run_dir) == uninterrupted_one_worker["losses"]

    flip_a_byte(tmp_path / "rot" / "checkpoint-000000039" / "optimizer.pt")
    result = finalize_run(spec, run_dir, spec.run.storage, "completed")
    # The sound one left is 13 (attempt 3 resumed from it, so retention kept it).
    assert [c.step for c in run_dir.scan().committed] == [13]
    assert result.latest_checkpoint_uri.endswith("/checkpoint-000000013")
    assert result.best_checkpoint_uri.endswith("/checkpoint-000000013")
    assert (tmp_path / "rot" / "checkpoint-000000039" / "COMMITTED").exists()  # kept, not deleted
    capsys.readouterr()
    assert cli.main(["export", run_dir.uri, str(tmp_path / "out.pt"), "--step", "39"]) == 2
    assert "optimizer.pt does not match its manifest" in capsys.readouterr().err
    assert cli.main(["export", run_dir.uri, str(tmp_path / "out.pt"), "--latest"]) == 0
    assert "checkpoint-000000013" in capsys.readouterr().out


def test_a_finished_run_whose_checkpoints_rot_is_not_returned_as_it_was(
    relaytrain_prefect, uninterrupted_one_worker, tmp_path
):
    """A finished run's checkpoints were verified when it finalized; then bytes rot while no
    flow runs. Run again, the flow must not return the stored result naming them: first the
    best (not the newest) rots, and the rerun's best is the sound newest, trained nothing;
    then the newest rots too, and with no sound checkpoint left the rerun trains the run
    again, to the uninterrupted run's weights. The damaged directories stay for a person."""
    policy = {"keep_last": 1, "keep_best": 1, "best_metric": "val_loss", "best_mode": "max"}
    spec = build_spec(tiny_spec_dict(tmp_path, "flow-rot", checkpoint=policy, scaling=ONE_WORKER))
    first = training(spec)
    run_dir = run_dir_of(spec)
    newest = run_dir.checkpoint_location(39).uri
    assert first.best_checkpoint_uri != newest  # max of val_loss: an early checkpoint
    best_dir = Path(first.best_checkpoint_uri)
    flip_a_byte(best_dir / "model.pt")

    again = training(spec, return_state=True)
    result = again.result()
    assert result.best_checkpoint_uri == newest and result.steps_completed == 39
    assert result.steps_computed == 39  # nothing trained again
    assert (best_dir / "COMMITTED").exists()  # kept, not deleted
    out = tmp_path / "best.pt"
    assert cli.main(["export", run_dir.uri, str(out), "--best"]) == 0
    assert_same_tensors(torch.load(out, weights_only=True), final_state(run_dir)["model"])

    flip_a_byte(tmp_path / "flow-rot" / "checkpoint-000000039" / "model.pt")
    third = training(spec)
    assert not third.attempts[-1].resumed_from_step  # no sound checkpoint: from step 0
    assert third.steps_completed == 39 and third.steps_computed == 39 + 39
    assert third.best_checkpoint_uri == first.best_checkpoint_uri  # written again, sound
    assert cli.main(["export", run_dir.uri, str(out), "--best"]) == 0
    assert_same_tensors(final_state(run_dir), uninterrupted_one_worker["state"])
