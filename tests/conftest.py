"""Shared fixtures come from relaytrain's own pytest plugin (flows/pytest_plugin.py)."""

from __future__ import annotations

import os

import pytest

from flows.pytest_plugin import tiny_spec_dict as tiny_raw
from tests import ray_auth
from tests.gcs import GCSFS_ENV as GCS_CLIENT_ENV

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
# gcsfs against the GCS emulator (tests/gcs.py): read at gcsfs's import, in every process, so
# set before the session's Ray cluster starts.
os.environ.update(GCS_CLIENT_ENV)

#: ``scaling`` for a test whose assertions do not depend on how many ranks train: a 1-worker
#: attempt costs about half the CPU of a 2-worker one (no DDP wrapper, one process fewer).
#: What needs two ranks (faults on rank 1, sharding, reshards, the bit-exact 2-worker
#: reference) keeps the tiny spec's 2.
ONE_WORKER = {"num_workers": 1}

__all__ = ["ONE_WORKER", "tiny_raw"]

#: The longest integration modules of phase 2, started first under ``make test``'s 2 xdist
#: processes (tools/test.sh, ``--no-loadscope-reorder``) so that no long module starts last while
#: the other process idles; ordered by the seconds each took there (setup, call and teardown of
#: its tests, ``--durations=0``), the other process busy beside it. Re-measure before reordering.
LONGEST_FIRST = (  # 2026-11-28, each module whole to one process (--dist loadfile)
    "tests/integration/test_adversary_seeds.py",  # new 2026-12-05: about 370 s alone
    "tests/integration/test_columns.py",  # 366
    "tests/integration/test_engine.py",  # 315
    "tests/integration/test_fault_matrix.py",  # 177 + 83 + 68 (2026-11-29: heads lost)
    "tests/integration/test_flow.py",  # 258
    "tests/integration/test_growing_table.py",  # test_streaming.py's 233 until 2026-12-04
    "tests/integration/test_sweep.py",  # new 2026-12-07: about 190 s alone
    "tests/integration/test_fsdp.py",  # 185
    "tests/integration/test_brought_scripts.py",  # new 2026-12-05: 165 s, 253 s at load 7-22
    "tests/integration/test_storage_faults.py",  # 175
    "tests/integration/test_training_options.py",  # 157
    "tests/integration/test_user_loop.py",  # 149
    "tests/integration/test_schedule.py",  # 111
    "tests/integration/test_lease.py",  # 108
    "tests/integration/test_bench_smoke.py",  # 92
    "tests/integration/test_torch_dataset.py",  # new 2026-12-04, about 130 s alone
    "tests/integration/test_ray_loop_data.py",  # new 2026-12-05, about 117 s alone
    "tests/integration/test_command.py",  # new 2026-12-04, about 145 s under load
    "tests/integration/test_own_loop.py",  # 89
    "tests/integration/test_streaming.py",  # the rest of its 233 (2026-12-04)
    "tests/integration/test_ray_datasets.py",  # new 2026-12-04, about 45 s alone
)


#: Ray's log monitor, on every node of the session's clusters, globs the log directory every
#: 0.1 s while it watches fewer than 1,000 files: 165 s of the full suite's 4266 s of CPU
#: (2026-11-28, sampled by process). Nothing reads what it publishes (relaytrain's clusters run
#: with ``log_to_driver=False``; job logs come from the job's own file), so here it looks for
#: new log files every 5 s: 0.24 s of CPU against 0.68 s over six attempts.
LOG_MONITOR = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0", "LOG_NAME_UPDATE_INTERVAL_S": "5"}


def pytest_configure(config: pytest.Config) -> None:
    """Every Ray cluster of the session in token auth, with one token: what Ray 2.60 turns on
    for a new local cluster (``ray.init`` sets ``RAY_AUTH_MODE=token`` in its own process,
    makes ``~/.ray/auth_token`` if missing, and its children inherit both). Set here, before any
    cluster starts, in the xdist controller (its workers inherit it) or the one process, so a
    process that starts no session cluster (the multi-node module's, under xdist) and its
    children agree with the one that does, and no two workers race to write the token. The
    log monitor's settings (``LOG_MONITOR``) reach every cluster the same way."""
    ray_auth.token_mode()
    for key, value in LOG_MONITOR.items():
        os.environ.setdefault(key, value)
    if not hasattr(config, "workerinput"):
        ray_auth.ensure_token()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest modules first. Under ``make test``'s xdist (``--dist loadfile``) each module
    is one unit of work, handed whole to one process in this order, so that its module fixtures
    (a training run, a tracking server) are built once."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


@pytest.fixture(scope="session")
def ray_cluster(relaytrain_ray):
    return relaytrain_ray


def reference_run(root, **sections) -> dict:
    """An uninterrupted tiny run every recovery test of its shape must reproduce bit for bit: its
    result, final parameters and optimizer state, per-step losses, and every checkpoint's
    recorded and evaluated metrics by step (``measure_checkpoints``), which any run of the
    tiny spec commits too."""
    from trainer_core.spec.overrides import build_spec

    # Every checkpoint kept, so each one's weights can be evaluated (tests/recovery.py).
    raw = tiny_raw(root, "reference", checkpoint={"keep_last": None}, **sections)
    return reference_of(build_spec(raw))


def reference_of(spec) -> dict:
    """``spec`` run once, uninterrupted, and what its run directory holds (``reference_run``)."""
    from tests.recovery import final_state, losses, measure_checkpoints, run_dir_of
    from trainer_core.run.engine import run_attempt

    events: list = []
    result = run_attempt(spec, on_event=events.append)
    assert result.status == "completed"
    assert any(e["kind"] == "metrics" for e in events)  # streamed while fit() ran
    run_dir = run_dir_of(spec)
    return {
        "result": result,
        "state": final_state(run_dir),
        "losses": losses(run_dir),
        "checkpoints": measure_checkpoints(spec, run_dir),
    }


def once_per_session(tmp_path_factory, name: str, make):
    """``make(directory)``, once for the whole session: under xdist, the first process to ask
    makes it in a directory of the session's shared temporary root, and the others wait for it
    and read what it saved, instead of training it again."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return make(tmp_path_factory.mktemp(name))
    import torch
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp().parent  # the session's, above each process's own
    saved = root / f"{name}.pt"
    with FileLock(f"{saved}.lock"):
        if saved.exists():
            return torch.load(saved, weights_only=False)
        directory = root / name
        directory.mkdir()
        value = make(directory)
        torch.save(value, saved)
        return value


@pytest.fixture(scope="session")
def uninterrupted(relaytrain_ray, tmp_path_factory):
    """The tiny spec's reference run, on its 2 DDP workers (``reference_run``)."""
    return once_per_session(tmp_path_factory, "reference", reference_run)


@pytest.fixture(scope="session")
def uninterrupted_one_worker(relaytrain_ray, tmp_path_factory):
    """The reference of the tests that train the tiny spec on ``ONE_WORKER``: its bits differ
    from 2 workers' (each rank draws its own dropout)."""
    return once_per_session(
        tmp_path_factory, "reference-1w", lambda root: reference_run(root, scaling=ONE_WORKER)
    )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto, IAM auth enforced) on loopback for the session, with
    a bucket and a trainer user whose generated key pair the tests use (tests/s3.py)."""
    from tests.s3 import moto_s3

    with moto_s3(tmp_path_factory.mktemp("moto")) as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server(tmp_path_factory):
    """A real GCS-compatible server (fake-gcs-server) on loopback, with a bucket and a
    service-account key file generated for it (tests/gcs.py)."""
    from tests.gcs import fake_gcs

    with fake_gcs(tmp_path_factory.mktemp("gcs")) as server:
        yield server


@pytest.fixture
def s3(s3_server, monkeypatch):
    """The S3 server, with the trainer's credentials in this process's environment."""
    for key, value in s3_server.credential_env().items():
        monkeypatch.setenv(key, value)
    return s3_server
