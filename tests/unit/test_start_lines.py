"""What the train task logs when a worker group starts: a checkpoint the workers could not use
is named with why, at warning level, whether they resumed from an older one or started over
(the setup's line had named the newest committed checkpoint as the resume point)."""

from __future__ import annotations

import logging

from tasks.train import start_line

DAMAGED = {"step": 42, "reason": "model.pt: sha256 differs from the manifest's"}


def test_a_start_from_scratch_after_skipping_says_which_checkpoint_and_why():
    level, line = start_line({"kind": "fresh_start", "skipped": [DAMAGED], "world_size": 1})
    assert level == logging.WARNING
    assert "from scratch" in line and "42" in line and DAMAGED["reason"] in line


def test_a_resume_past_a_skipped_checkpoint_names_it_and_why():
    event = {"kind": "resumed", "step": 35, "skipped": [DAMAGED], "world_size": 2}
    level, line = start_line(event)
    assert level == logging.WARNING
    assert "from step 35" in line and "42" in line and DAMAGED["reason"] in line


def test_a_plain_start_is_information():
    assert start_line({"kind": "fresh_start", "skipped": []}) == (
        logging.INFO,
        "workers started from scratch",
    )
    level, line = start_line({"kind": "resumed", "step": 14, "skipped": [], "world_size": 1})
    assert (level, line) == (logging.INFO, "1 workers resumed from step 14")
