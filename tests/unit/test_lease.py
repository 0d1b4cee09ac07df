"""The run's lease (``trainer_core.run.lease``): one holder at a time, taken over when its
holder died or let it expire, read again when torn, won by exactly one of racing flows, and
taken back by a finalize only over the summary its setup saw. (Its keeper:
test_lease_keeper.)"""

import contextlib
import os
import subprocess
import sys
import threading
import time

import pytest

from trainer_core import storage
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.run import lease


@pytest.fixture
def run_location(tmp_path):
    return storage.resolve(str(tmp_path / "run"))


def test_lease_is_exclusive_while_its_holder_lives(run_location):
    held = lease.acquire(run_location, owner="a", settle_s=0)
    assert lease.acquire(run_location, owner="a", settle_s=0).owner == "a"  # re-entrant
    with pytest.raises(lease.LeaseHeldError, match="held by a"):
        lease.acquire(run_location, owner="b", settle_s=0)
    lease.release(run_location, held.owner)
    assert lease.acquire(run_location, owner="b", settle_s=0).owner == "b"


def test_expired_or_dead_leases_are_taken_over(run_location):
    lease.acquire(run_location, owner="a", ttl_s=0.01, settle_s=0)
    time.sleep(0.05)
    assert lease.acquire(run_location, owner="b", settle_s=0).owner == "b"
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    record = run_location.child("lock.json").read_json()
    record.update(owner="gone", pid=int(dead.stdout), expires_at=time.time() + 3600)
    run_location.child("lock.json").write_json(record)
    assert lease.acquire(run_location, owner="c", settle_s=0).owner == "c"
    assert os.getpid() == lease.acquire(run_location, owner="c", settle_s=0).pid


def test_a_lease_read_mid_write_is_read_again_not_the_readers_error(run_location, monkeypatch):
    """A store that overwrites lock.json in place (the moto S3 server did, under a full suite's
    load) can be read mid-write: the workers' fence, renew, acquire and release read it again
    until it is whole, and call one that stays torn an outage (retried), never a parse error
    (which the workers would report as the training code's)."""
    from trainer_core.errors import StorageUnavailableError
    from trainer_core.storage import conditional_write, torn_reads

    held = lease.acquire(run_location, owner="a", settle_s=0)
    path = run_location.child("lock.json")
    whole = path.read_bytes()
    torn = whole[:-20] + b"\xa5" + whole  # a shorter write over a longer one, and a cut byte

    def heal_later() -> None:
        time.sleep(0.3)
        path.write_bytes(whole)

    for read in (
        lambda: RunDirectory(run_location).check_lease("a"),
        lambda: lease.renew(run_location, held),
        lambda: conditional_write.read(path),
        lambda: lease.release(run_location, "b"),  # not b's: nothing is deleted
    ):
        path.write_bytes(torn)
        healer = threading.Thread(target=heal_later)
        healer.start()
        read()
        healer.join()
    assert path.read_json()["owner"] == "a"
    monkeypatch.setattr(torn_reads, "TORN_READ_PATIENCE_S", 0.2)
    path.write_bytes(torn)
    with pytest.raises(StorageUnavailableError, match="stayed unreadable"):
        RunDirectory(run_location).check_lease("a")
    with pytest.raises(StorageUnavailableError, match="stayed unreadable"):
        lease.renew(run_location, held)


def test_renew_refuses_a_lease_taken_over(run_location):
    held = lease.acquire(run_location, owner="a", ttl_s=0.01, settle_s=0)
    time.sleep(0.05)
    lease.acquire(run_location, owner="b", settle_s=0)
    with pytest.raises(lease.LeaseHeldError, match="taken over"):
        lease.renew(run_location, held)


def _race(location, owners: int) -> list[str]:
    """``owners`` threads acquire the free lease at the same moment; the winners."""
    start = threading.Barrier(owners)
    won: list[str] = []

    def contend(name: str) -> None:
        start.wait()
        with contextlib.suppress(lease.LeaseHeldError):
            won.append(lease.acquire(location, owner=name, settle_s=0).owner)

    threads = [threading.Thread(target=contend, args=(f"flow-{i}",)) for i in range(owners)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return won


def test_of_flows_racing_for_a_free_lease_exactly_one_wins(tmp_path):
    """Compare-and-swap on a local disk: however the reads and writes of 8 racing acquires
    interleave, one owner wins and lock.json names it (20 races)."""
    for race in range(20):
        location = storage.resolve(str(tmp_path / f"run-{race}"))
        won = _race(location, 8)
        assert len(won) == 1, (race, won)
        assert location.child("lock.json").read_json()["owner"] == won[0]


def test_an_acquire_racing_its_own_keeper_keeps_the_lease(run_location, monkeypatch):
    """The train task re-acquires the lease the flow's keeper renews: when the renewal lands
    between the acquire's read and its write, the lease is still this owner's, not lost."""
    held = lease.acquire(run_location, owner="a", settle_s=0)
    real_write = lease.conditional_write.write
    calls = []

    def renewed_in_between(location, value, version):
        if not calls:  # the keeper renews after the acquire read the record
            calls.append(1)
            real_write(location, {**held.to_json(), "expires_at": time.time() + 60}, version)
        return real_write(location, value, version)

    monkeypatch.setattr(lease.conditional_write, "write", renewed_in_between)
    assert lease.acquire(run_location, owner="a", settle_s=0).owner == "a"
    assert run_location.child("lock.json").read_json()["owner"] == "a"


def test_a_finalize_whose_lease_lapsed_takes_it_back_only_over_the_summary_setup_saw(
    run_location,
):
    """This flow's lease lapsed and another flow took the run: when that flow wrote no
    summary, finalize takes the freed lease back; when it wrote one, finalize is refused (the
    lease stays free, the other summary's bytes as they were)."""
    summary = RunDirectory(run_location).summary_file
    for other_wrote in (False, True):
        lease.acquire(run_location, owner="this", ttl_s=0.01, settle_s=0)
        seen = lease.summary_version(run_location)  # setup
        time.sleep(0.02)
        lease.acquire(run_location, owner="other", settle_s=0)
        if other_wrote:
            summary.write_json({"schema": 1, "status": "completed", "owner": "other"})
        lease.release(run_location, "other")
        theirs = summary.read_bytes() if other_wrote else None
        if not other_wrote:
            assert lease.acquire_to_finalize(run_location, "this", seen).owner == "this"
            lease.release(run_location, "this")
            continue
        with pytest.raises(lease.LeaseHeldError, match=r"summary\.json was written since"):
            lease.acquire_to_finalize(run_location, "this", seen)
        assert summary.read_bytes() == theirs
        assert not RunDirectory(run_location).lease_file.exists()
