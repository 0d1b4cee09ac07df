"""The package's cluster: started once for its modules, stopped after them.

Nothing here imports Ray at the top: pytest loads this conftest before tests/conftest.py's
``pytest_configure`` sets ``RAY_AUTH_MODE=token``, and Ray reads that when it is imported (then
this process started its own cluster without auth, and its flows sent the job server no token).
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="package")
def cluster(s3_server):
    """The cluster's nodes hold their own storage credentials, as a production cluster's would
    (relaytrain never ships credentials in a Ray job's runtime env); so does this process."""
    from tests.multinode import MultiNodeCluster

    with pytest.MonkeyPatch.context() as env:
        for key, value in s3_server.credential_env().items():
            env.setenv(key, value)
        cluster = MultiNodeCluster(num_workers=3, env=s3_server.credential_env())
        try:
            yield cluster
        finally:
            cluster.stop()


@pytest.fixture(scope="package")
def run_storage(s3_server) -> str:
    return s3_server.uri("multinode")
