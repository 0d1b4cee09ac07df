"""The lease keeper and release on a local disk (``trainer_core.run.lease``)."""

import time

from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import lease


def test_a_released_lease_stays_released_while_its_keeper_was_renewing(tmp_path):
    """finalize releases the run while the flow's keeper still renews it (the keeper stops
    only when the flow leaves ``holding``). A renewal that read the lease just before the
    delete wrote it back just after (found by the suite on a local disk, where the delete is
    outside the renewal's compare-and-swap): the finished run stayed held for another TTL. A
    keeper renewing every few milliseconds, released 300 times: never written back."""
    location = storage.resolve(str(tmp_path)).child("run")
    lease_file = RunDirectory(location).lease_file
    for round_ in range(300):
        held = lease.acquire(location, owner=f"flow-{round_}", ttl_s=0.006, settle_s=0)
        with lease.LeaseKeeper(location, held, ttl_s=0.006):  # renews every 2 ms
            time.sleep(0.004)
            lease.release(location, held.owner)
            time.sleep(0.01)  # renewals that would write it back have had their time
            assert not lease_file.exists(), f"round {round_}: {lease_file.read_json()}"
