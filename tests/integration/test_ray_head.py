"""The watch's view of a head at an address (``ray_head.ConnectedHead``), against a real
`ray start --head` taken down and started again at its address: how Ray's GCS client sees a
head down and a new head, which the fault matrix's flow test meets only one of per run."""

from __future__ import annotations

import pytest

from tests.ray_start import RayStartHead
from trainer_core.execution.ray_head import ConnectedHead

pytestmark = pytest.mark.integration


def test_a_head_down_is_silence_and_a_restarted_head_another_cluster():
    import ray._raylet

    head = RayStartHead(num_cpus=0).start()
    try:
        gcs = ray._raylet.GcsClient(address=head.address)  # as the driver's, bound to its cluster
        watched = ConnectedHead("user-address", head.address, gcs, silence_s=60)
        assert watched.probe() is None  # alive
        head.kill()
        assert watched.probe() is None  # silent, not yet for long: Ray itself waits 60 s
        down = watched.confirm(patience_s=2)  # an attempt failed: silent 2 s is lost
        assert down is not None and "has not answered for" in down, down
        assert "the Ray cluster at user-address lost its head" in down
        head.start()  # the same address, a new cluster (no GCS fault tolerance)
        again = watched.probe()
        assert again is not None and "answers, but not as this run's cluster" in again, again
        assert "WrongClusterID" in again  # Ray's own word for it, passed on
    finally:
        head.stop()
