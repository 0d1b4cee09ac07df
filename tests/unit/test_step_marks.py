"""A rank's step mark outlives the rank's SIGKILL, and the restarted group takes exactly the
marks its attempt's earlier groups left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from trainer_core.execution import step_marks

KILLED = """
import os, signal, sys
from pathlib import Path
from trainer_core.execution.step_marks import StepMark
mark = StepMark("attempt-a", 0, int(sys.argv[2]), Path(sys.argv[1]))
for step in range(1, int(sys.argv[3]) + 1):
    mark.write(step)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_killed_ranks_mark_is_read_once_by_the_next_group(tmp_path):
    for rank, steps in ((0, 12), (1, 11)):
        killed = subprocess.run(
            [sys.executable, "-c", KILLED, str(tmp_path), str(rank), str(steps)]
        )
        assert killed.returncode == -signal.SIGKILL
    other = step_marks.StepMark("attempt-b", 0, 0, tmp_path)  # another attempt on the node
    other.write(40)
    later = step_marks.StepMark("attempt-a", 1, 0, tmp_path)  # the new group's own
    later.write(3)
    assert step_marks.take_earlier("attempt-a", 1, tmp_path) == {0: 12}
    assert step_marks.take_earlier("attempt-a", 1, tmp_path) == {}  # taken
    assert step_marks.take_earlier("attempt-a", 2, tmp_path) == {1: 3}
    assert step_marks.take_earlier("attempt-b", 1, tmp_path) == {0: 40}


def test_a_finished_rank_leaves_no_mark_and_stale_marks_are_swept(tmp_path):
    done = step_marks.StepMark("attempt-a", 0, 0, tmp_path)
    done.write(7)
    done.close()
    done.write(8)  # after close: nothing
    stale = step_marks.StepMark("attempt-old", 0, 0, tmp_path)
    stale.write(5)
    week_ago = time.time() - step_marks.STALE_S - 60
    os.utime(stale.path, (week_ago, week_ago))
    fresh = step_marks.StepMark("attempt-new", 0, 0, tmp_path)
    fresh.write(2)
    assert step_marks.take_earlier("attempt-a", 1, tmp_path) == {}
    assert sorted(p.name for p in tmp_path.iterdir()) == [fresh.path.name]
