"""Other work on a scenario's cluster (``crowd``): a Ray job of its own that holds every CPU of
the cluster but one in a placement group, as another team's job would, until it is freed. An
elastic command started meanwhile gets one worker, and grows once the CPUs are free."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tests.adversary.world import World

#: The job: it waits until it holds every CPU but one (those a command that just ended still
#: frees included), says how many it holds, and keeps them until its stdin closes.
HOLDER = """
import sys
import ray
ray.init(log_to_driver=False)
held = int(ray.cluster_resources().get("CPU", 0)) - 1
if held > 0:
    group = ray.util.placement_group([{"CPU": 1}] * held, strategy="PACK")
    ray.get(group.ready())
print(held, flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def crowded(world: World, marker: str) -> Iterator[int]:
    """The cluster's CPUs but one held for the block (their count yielded), freed after it:
    the holder's job ends, and Ray removes its placement group with it."""
    holder = subprocess.Popen(
        [world.python, "-c", HOLDER],
        env=world.env(marker, "local"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    held = False
    try:
        assert holder.stdout is not None
        line = holder.stdout.readline()  # once it holds them, or '' if it failed
        if not line.strip():
            raise RuntimeError("the crowd's holder ended without holding the cluster's CPUs")
        held = True
        yield int(line)
    finally:
        # Held: it reads its stdin, and ends when it closes. Stopped while it still waits for
        # the CPUs (Ctrl-C, a failed command): it reads nothing yet, so it is terminated.
        if not held and holder.poll() is None:
            holder.terminate()
        if holder.stdin is not None:
            with contextlib.suppress(OSError):
                holder.stdin.close()
        holder.wait()
