"""Code that a tampered run.json names (tests/planted.py): importing it touches the file that
``RELAYTRAIN_TEST_SENTINEL`` names, the proof that something imported what storage named."""

import os
from pathlib import Path

if os.environ.get("RELAYTRAIN_TEST_SENTINEL"):
    Path(os.environ["RELAYTRAIN_TEST_SENTINEL"]).touch()


def build(*args, **kwargs):
    raise RuntimeError("tests.evil_import ran")


loss = metric = build
