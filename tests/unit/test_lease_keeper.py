"""The lease keeper and release on a local disk (``trainer_core.run.lease``)."""

import threading
import time

from tasks.setup import Prepared, holding
from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import lease


def _keepers_renewing() -> list[threading.Thread]:
    """The keeper threads alive in this process (what could still write lock.json)."""
    return [t for t in threading.enumerate() if t.name == "relaytrain-lease" and t.is_alive()]


def _renewals(lease_file, count: int, interval_s: float) -> float:
    """Wait until lock.json's expiry has moved ``count`` times (renewals seen on disk); the
    seconds it took. A guard of 50 intervals per renewal only keeps a broken keeper from hanging
    the test."""
    started = time.monotonic()
    seen = lease_file.read_json()["expires_at"]
    for _ in range(count):
        deadline = time.monotonic() + 50 * interval_s
        while lease_file.read_json()["expires_at"] == seen:
            assert time.monotonic() < deadline, "the lease was not renewed"
            time.sleep(interval_s / 10)
        seen = lease_file.read_json()["expires_at"]
    return time.monotonic() - started


def _prepared(tmp_path, owner: str) -> Prepared:
    return Prepared(
        run_name="run",
        storage_uri=str(tmp_path),
        run_uri=str(tmp_path / "run"),
        lease_owner=owner,
        plan_reason="test",
        total_steps=None,
        resume_step=None,
    )


def test_release_stops_the_flows_keeper_after_the_train_tasks_keeper_ended(tmp_path, monkeypatch):
    """As the flow nests them: setup takes the lease, the flow's keeper (``holding``) renews it
    from setup to finalize, and each train attempt takes it again under a keeper of its own.
    After the attempt's keeper ended, the flow's keeps renewing (through a retry's delay), and
    finalize's ``release`` stops it: no keeper thread is left to renew the finished run, and
    over as many renewal intervals as three renewals took, lock.json stays deleted."""
    monkeypatch.setenv("RELAYTRAIN_LEASE_TTL_S", "0.3")  # renewed every 0.1 s
    location = storage.resolve(str(tmp_path)).child("run")
    lease_file = RunDirectory(location).lease_file
    owner = "flow-run-1"
    lease.acquire(location, owner=owner, settle_s=0)  # setup
    with holding(_prepared(tmp_path, owner)):
        held = lease.acquire(location, owner=owner, settle_s=0)  # the train task
        with lease.LeaseKeeper(location, held):
            _renewals(lease_file, 2, 0.1)
        three_renewals_s = _renewals(lease_file, 3, 0.1)  # the flow's keeper, in a delay
        lease.release(location, owner)  # finalize
        renewing = _keepers_renewing()
        time.sleep(three_renewals_s)
        assert not lease_file.exists(), lease_file.read_json()
        assert renewing == [], f"{len(renewing)} keeper(s) still renew the released lease"
    assert _keepers_renewing() == []


def test_a_released_lease_stays_released_while_nested_keepers_were_renewing(tmp_path):
    """finalize releases the run while the flow's keeper still renews it (it stops only when
    the flow leaves ``holding``). A renewal that read the lease just before the delete wrote it
    back just after (found by the suite on a local disk, where the delete is outside the
    renewal's compare-and-swap): the finished run stayed held for another TTL. With one keeper
    that was fixed, but the flow nests two (the train task's inside the flow's), and the inner
    one, ending first, unregistered the outer from ``release``. Both renewing every few
    milliseconds, nested as in the flow, released 300 times: never written back."""
    location = storage.resolve(str(tmp_path)).child("run")
    lease_file = RunDirectory(location).lease_file
    for round_ in range(300):
        owner = f"flow-{round_}"
        held = lease.acquire(location, owner=owner, ttl_s=0.006, settle_s=0)
        with lease.LeaseKeeper(location, held, ttl_s=0.006):  # the flow's
            with lease.LeaseKeeper(location, held, ttl_s=0.006):  # the train task's
                time.sleep(0.004)
            time.sleep(0.004)
            lease.release(location, owner)
            time.sleep(0.01)  # renewals that would write it back have had their time
            assert not lease_file.exists(), f"round {round_}: {lease_file.read_json()}"
