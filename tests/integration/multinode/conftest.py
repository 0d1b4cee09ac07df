"""The package's cluster: started once for its modules, stopped after them."""

from __future__ import annotations

import pytest

from tests.multinode import MultiNodeCluster


@pytest.fixture(scope="package")
def cluster(s3_server):
    """The cluster's nodes hold their own storage credentials, as a production cluster's would
    (relaytrain never ships credentials in a Ray job's runtime env); so does this process."""
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
