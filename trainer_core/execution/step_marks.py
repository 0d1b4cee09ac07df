"""Each rank's last completed step, kept where a SIGKILL cannot take it: a small file in its
node's temp directory, rewritten in place at every step.

A rank tells the driver its last step when a failure ends its group (``Relay.tell_last_step``),
and rank 0's metric rows say it up to the last report window. A rank killed outright says
nothing, and when it is the only rank, or every rank on a lost node, nobody else can. Its mark
outlives it: the write is a ``pwrite`` of 8 bytes into the page cache (no ``fsync``; a process's
death does not drop the page cache, only the node's would), about a microsecond a step. The
restarted group's ranks read the marks the ended group left on their node and tell the driver,
which records the step for the restart that ended that group (``live_state``); when the failure
ended the attempt instead, the next attempt's first group reads them, and the driver records
the step in the earlier attempt's record (``engine``).

Marks are named by a key the driver draws for each attempt (kept in its record), the group and
the rank, so another run on the node never reads them; a mark is removed when it is read or its
rank finishes, and marks older than a week (an attempt that ended with its group) are swept.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import sys
import tempfile
import time
from pathlib import Path

#: Where a node's marks live: one directory for every run of this user on the node.
DIRECTORY = Path(tempfile.gettempdir()) / f"relaytrain-steps-{os.getuid()}"
#: Marks older than this belong to attempts long ended.
STALE_S = 7 * 24 * 3600.0

_STEP = struct.Struct("<q")


class StepMark:
    """This rank's mark for worker group ``group`` of the attempt keyed ``key``."""

    def __init__(self, key: str, group: int, rank: int, directory: Path = DIRECTORY):
        directory.mkdir(parents=True, exist_ok=True)
        self.path = directory / f"{key}-g{group}-r{rank}"
        self.fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)

    def write(self, step: int) -> None:
        if self.fd is not None:
            try:
                os.pwrite(self.fd, _STEP.pack(step), 0)
            except OSError:  # a full temp dir: the mark stops, training goes on
                self.close()

    def close(self) -> None:
        """The rank finished: nobody will ask for its mark."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
            self.path.unlink(missing_ok=True)


def take_earlier(key: str, group: int, directory: Path = DIRECTORY) -> dict[int, int]:
    """The marks that attempt ``key``'s groups before ``group`` left on this node: each group's
    furthest step, by group. The marks read are removed (every rank of the new group on this
    node may ask: the first takes them), and so are stale ones of any attempt."""
    pattern = re.compile(rf"^{re.escape(key)}-g(\d+)-r\d+$")
    found: dict[int, int] = {}
    try:
        paths = list(directory.iterdir())
    except OSError:  # none yet, or not this user's to read
        return found
    now = time.time()
    for path in paths:
        match = pattern.match(path.name)
        if match is None:
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > STALE_S:
                    path.unlink()
            continue
        earlier = int(match.group(1))
        if earlier >= group:
            continue
        with contextlib.suppress(OSError):  # another rank took it first
            data = path.read_bytes()
            path.unlink()
            if len(data) == _STEP.size:
                found[earlier] = max(found.get(earlier, 0), _STEP.unpack(data)[0])
    return found


def take_all(key: str, directory: Path = DIRECTORY) -> dict[int, int]:
    """Every mark that attempt ``key``'s groups left on this node (an attempt that ended), by
    group; removed as they are read."""
    return take_earlier(key, sys.maxsize, directory)
