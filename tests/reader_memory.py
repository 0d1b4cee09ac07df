"""What a rank's data reader holds, measured: run as ``python -m tests.reader_memory
DATA_SECTION_JSON``, a fresh process scans the dataset, builds rank 0 of 1's ``RankStream`` as
a training worker does, reads one epoch of it, and prints its peak resident memory (VmHWM, MB)
before the first read and after the epoch, as JSON. VmHWM and not ``ru_maxrss``: Linux keeps
the latter across fork and exec, so a process started by a parent that holds more reports the
parent's size."""

from __future__ import annotations

import json
import sys

from trainer_core.data import footers, rank_stream
from trainer_core.spec.sections import DataSection


def peak_resident_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def read_one_epoch(data: DataSection) -> dict[str, float]:
    stream = rank_stream.RankStream(footers.scan(data), data, seed=0, world_size=1, rank=0)
    idle = peak_resident_mb()
    rows = 0
    ahead = stream.epoch(0)
    try:
        for _, _, batch in ahead:
            rows += len(batch)
    finally:
        ahead.close()
    return {"idle_mb": idle, "peak_mb": peak_resident_mb(), "rows": rows}


if __name__ == "__main__":
    print(json.dumps(read_one_epoch(DataSection.model_validate_json(sys.argv[1]))))
