"""What a user's Ray loop prints reaches the driver a line at a time (train.rank_output), and
the log records Ray Train's handlers write to the same stream stay in the worker's log."""

from __future__ import annotations

import io
import logging
import sys

from trainer_core.train.rank_output import rank_output


class Relay:
    def __init__(self) -> None:
        self.sent: dict[str, list[str]] = {"stdout": [], "stderr": []}

    def tell_output(self, stream: str, lines: list[str], wait_s: float | None = None) -> None:
        self.sent[stream] += lines


def test_prints_and_writes_travel_by_line_and_log_records_do_not(monkeypatch):
    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    relay = Relay()
    with rank_output(relay):  # type: ignore[arg-type]
        handler = logging.StreamHandler(sys.stderr)  # as Ray Train's: the stream of now
        print("epoch 1", "loss 0.5")
        sys.stdout.write("10%\r50%\r100%\n")  # a progress bar, as a terminal shows it last
        sys.stderr.write("careful\n")
        logging.getLogger("test_rank_output").addHandler(handler)
        logging.getLogger("test_rank_output").warning("a log record")
        print("no newline yet", end="")
    logging.getLogger("test_rank_output").removeHandler(handler)
    assert relay.sent == {
        "stdout": ["epoch 1 loss 0.5", "100%", "no newline yet"],
        "stderr": ["careful"],
    }
    assert sys.stdout is out and sys.stderr is err
    assert out.getvalue() == "epoch 1 loss 0.5\n10%\r50%\r100%\nno newline yet"  # still written
    assert err.getvalue() == "careful\na log record\n"
