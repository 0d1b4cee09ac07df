"""A user's Ray loop's RNG states (train.loop_rng): saved with the checkpoint it reports,
restored when it reads that checkpoint back, and a resume that cannot be exact says why. The
oracle is the numbers the RNGs draw: after a restore, the ones drawn after the capture."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow.fs as pafs
import torch

from trainer_core.checkpoint.ray_checkpoints import RNG_FILE
from trainer_core.checkpoint.training_state import capture_rng, from_bytes, restore_rng
from trainer_core.train.loop_rng import NOT_READ, LoopRng, rng_payload, rng_to_resume


@dataclass
class Checkpoint:  # what the hooks read of a ray.train.Checkpoint
    path: str
    filesystem: pafs.FileSystem


def draws() -> tuple[float, float, torch.Tensor]:
    return random.random(), float(np.random.rand()), torch.rand(4)


def assert_same_draws(a: tuple, b: tuple) -> None:
    assert a[:2] == b[:2] and torch.equal(a[2], b[2])


def test_a_restored_rank_draws_what_it_would_have_drawn_and_the_resume_is_exact():
    torch.manual_seed(3)
    states = [capture_rng(), {"python": None}]  # rank 1's is not this test's
    expected = draws()
    draws()  # the RNGs move on (a fresh worker's seed and model init)
    resume = rng_to_resume(from_bytes(rng_payload(states)), 0, 2, "checkpoint_x")
    assert resume.exact and resume.note is None
    assert resume.state is not None
    restore_rng(resume.state)
    assert_same_draws(draws(), expected)


def test_a_checkpoint_without_rng_states_or_from_another_world_size_is_not_exact():
    missing = rng_to_resume(None, 0, 2, "checkpoint_x")
    assert (missing.state, missing.exact) == (None, False)
    assert "checkpoint_x" in (missing.note or "") and RNG_FILE in (missing.note or "")
    payload = from_bytes(rng_payload([capture_rng(), capture_rng()]))
    grown = rng_to_resume(payload, 2, 3, "checkpoint_x")
    assert (grown.state, grown.exact) == (None, False)
    assert "2 ranks" in (grown.note or "") and "on 3" in (grown.note or "")
    assert not rng_to_resume(payload, 0, 1, "checkpoint_x").exact


def test_a_report_saves_the_states_and_the_loops_read_restores_them(tmp_path: Path):
    told: list[tuple[bool, str | None]] = []
    folder = tmp_path / "checkpoint_1"
    folder.mkdir()
    checkpoint = Checkpoint(str(folder), pafs.LocalFileSystem())
    torch.manual_seed(5)
    LoopRng(0, 1, lambda *said: told.append(said)).save(checkpoint)  # one rank: no collective
    expected = draws()
    assert (folder / RNG_FILE).exists() and told == []

    resumed = LoopRng(0, 1, lambda *said: told.append(said))
    resumed.resumed_from = str(folder)
    resumed.restore(checkpoint)  # relaytrain's own read, before the loop runs: nothing
    assert told == []
    resumed.armed = True
    resumed.restore(checkpoint)
    assert_same_draws(draws(), expected)
    assert told == [(True, None)]
    resumed.restore(checkpoint)  # a later read restores nothing again
    assert len(told) == 1


def test_a_resumed_loop_that_reports_before_reading_its_checkpoint_says_so(tmp_path: Path):
    told: list[tuple[bool, str | None]] = []
    rng = LoopRng(0, 1, lambda *said: told.append(said))
    rng.resumed_from, rng.armed = str(tmp_path), True
    rng.save(None)
    assert told == [(False, NOT_READ)]


def test_an_inexact_resume_is_in_the_attempt_record_and_show(tmp_path: Path, capsys):
    """What the resumed group's rank 0 relays of its RNG reaches the attempt's record, and
    ``relaytrain show`` names an inexact resume in the attempt's row."""
    from tests.unit.test_show import relayed, row, run_directory, show
    from trainer_core.run import attempts
    from trainer_core.run.attempts import AttemptRecord

    run_dir, _ = run_directory(tmp_path, "inexact")
    note = rng_to_resume(None, 0, 1, "checkpoint_x").note
    for number, exact in ((1, True), (2, False)):
        live = relayed(
            [
                {"kind": "resumed", "time": 1.0, "step": 4, "group": 0, "world_size": 1},
                {"kind": "resume_rng", "exact": exact, "note": None if exact else note},
            ]
        )
        attempts.write(
            run_dir, AttemptRecord.opened(number, "resume", 4).completed(live.outcome(), 8)
        )
    first, second = attempts.read(run_dir)
    assert (first.resume_exact, first.resume_note) == (True, None)
    assert (second.resume_exact, second.resume_note) == (False, note)
    output = show(capsys, run_dir)
    assert "resume not exact" not in " ".join(row(output, "1"))
    assert f"resume not exact: no RNG states ({RNG_FILE})" in row(output, "2")[-1], output
