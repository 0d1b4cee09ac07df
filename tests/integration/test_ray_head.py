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


def test_a_flow_whose_ray_address_answers_nothing_is_refused_up_front(relaytrain_prefect, tmp_path):
    """`RAY_ADDRESS` naming a port where no cluster listens (a typo, a cluster not started):
    the flow's command fails within seconds with an error naming the address and the fix, no
    train task and no run directory. Before, ``ray.init`` retried the silent GCS for about a
    quarter of an hour (20 tries of 40 s)."""
    import os
    import subprocess
    import sys

    import yaml
    from prefect.settings import PREFECT_API_URL

    from tests.conftest import ONE_WORKER, tiny_raw
    from tests.net import free_port
    from tests.recovery import REPO, run_dir_of
    from trainer_core.spec.overrides import build_spec

    raw = tiny_raw(tmp_path, "no-cluster-there", scaling=ONE_WORKER)
    spec_file = tmp_path / "spec.yaml"
    spec_file.write_text(yaml.safe_dump(raw))
    address = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "RAY_ADDRESS": address}
    done = subprocess.run(
        [sys.executable, "-m", "flows.training", "--config", str(spec_file)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,  # a quarter of an hour before the fix
    )
    output = done.stdout + done.stderr
    assert done.returncode != 0, output
    assert f"no Ray cluster answers at RAY_ADDRESS={address!r}" in output, output
    assert "ray start --head" in output
    assert not run_dir_of(build_spec(raw)).location.exists()  # nothing of the run written


DRIVER = """
import os, sys, threading, time
# Ray's bound for a silent GCS as a client made before ray.init reads it (the value at import):
# 3 s here instead of Ray's 60, so that a client left with it ends the driver within the test.
os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"] = "3"
import ray
del os.environ["RAY_gcs_rpc_server_reconnect_timeout_s"]
from trainer_core.execution import cluster, ray_head

@ray.remote(num_cpus=0)
def forever():
    time.sleep(3600)

def ask_the_gcs():  # as Ray's own driver-side code does (internal KV, no timeout)
    gcs = ray._private.worker.global_worker.gcs_client
    while True:
        gcs.internal_kv_get(b"relaytrain-probe", None)
        time.sleep(0.2)

with cluster.ray_cluster():
    ref = forever.remote()
    threading.Thread(target=ask_the_gcs, daemon=True).start()
    print("connected", flush=True)
    try:
        ray.get(ref)
    except BaseException as e:  # what Ray raises as the watch leaves the cluster
        print("the call returned:", type(e).__name__, flush=True)
print("lost:", ray_head.lost(), flush=True)
"""


def test_a_driver_blocked_on_a_silent_head_leaves_it_after_the_silence(tmp_path):
    """The watch's own path (no attempt failed to ask it sooner): a driver blocked in a call to
    a cluster at an address whose head is gone, the head not back. The GCS silent for
    ``SILENCE_S``, the watch leaves the cluster: the call returns, the loss names the address,
    and the process lives on past Ray's bound for a silent GCS (relaytrain raises it for its
    driver).

    That bound holds for every GCS client of the driver, the one ``ray.init`` makes before its
    core worker too (``worker.gcs_client``, Ray's internal KV), which reads Ray's settings as
    they were when ``ray`` was imported: a call on it pending when the head died ended a CI
    flow 60 s later (``Failed to connect to GCS within 600 seconds``, though it waited 60)."""
    import os
    import subprocess
    import sys

    from tests.recovery import REPO

    head = RayStartHead(num_cpus=1).start()
    env = {**os.environ, "RAY_ADDRESS": head.address, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen(
        [sys.executable, "-c", DRIVER],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert driver.stdout is not None
        seen = []
        while not seen or seen[-1].strip() != "connected":  # past Ray's own lines
            seen.append(driver.stdout.readline())
            assert seen[-1], "".join(seen)
        head.kill()
        output, _ = driver.communicate(timeout=240)
    finally:
        head.stop()
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output
    assert "the call returned:" in output, output
    lost = [line for line in output.splitlines() if line.startswith("lost:")]
    assert lost and f"the Ray cluster at {head.address} lost its head" in lost[0], output
    assert "has not answered for" in lost[0]
    assert "Failed to connect to GCS within" not in output  # Ray did not end it first


ENDED_FIT = """
import sys, threading
import ray
from ray.util.placement_group import placement_group
from trainer_core.execution import cluster, ray_head, trainer

class Ended:  # a fit() that has ended (its group failed with the head): nothing to abort
    def fit(self):
        return None
    def abort(self):
        pass

with cluster.ray_cluster():
    group = placement_group([{"CPU": 1}])
    ray.get(group.ready())
    fitting = trainer._Fitting(Ended(), None, lambda event: None, "ended")
    fitting.placement_groups.append(group)
    fitting.thread.start()
    fitting.thread.join()
    print("connected", flush=True)
    sys.stdin.readline()  # the head killed
    fitting._end(finished=True)
    print("ended", flush=True)
print("lost:", ray_head.lost(), flush=True)
"""


def test_a_fit_that_ended_as_its_head_died_leaves_the_cluster_before_cleaning_up(tmp_path):
    """The end of a fit whose cluster's head (at an address) went down as it ended, the watch
    not yet sure (the head silent under ``SILENCE_S``): the head is asked at once, and the dead
    cluster left, before the clean-up's Ray calls (removing the placement groups a dead
    controller left) block on the silent GCS. Before, the fault matrix's address test hung
    there under load: the clean-up's ``placement_group_table`` waited on the dead GCS past the
    watch's leaving (up to Ray's reconnect bound, which relaytrain raises to 600 s)."""
    import os
    import subprocess
    import sys

    from tests.recovery import REPO

    head = RayStartHead(num_cpus=1).start()
    env = {**os.environ, "RAY_ADDRESS": head.address, "PYTHONPATH": str(REPO)}
    driver = subprocess.Popen(
        [sys.executable, "-c", ENDED_FIT],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert driver.stdout is not None and driver.stdin is not None
        seen = []
        while not seen or seen[-1].strip() != "connected":  # past Ray's own lines
            seen.append(driver.stdout.readline())
            assert seen[-1], "".join(seen)
        head.kill()
        output, _ = driver.communicate("killed\n", timeout=240)  # 600 s before the fix
    finally:
        head.stop()
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == 0, output
    assert "ended" in output.splitlines(), output
    lost = [line for line in output.splitlines() if line.startswith("lost:")]
    assert lost and f"the Ray cluster at {head.address} lost its head" in lost[0], output
