"""Shared fixtures come from relaytrain's own pytest plugin (flows/pytest_plugin.py)."""

from __future__ import annotations

import os

import pytest

from flows.pytest_plugin import tiny_spec_dict as tiny_raw

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

__all__ = ["tiny_raw"]


@pytest.fixture(scope="session")
def ray_cluster(relaytrain_ray):
    return relaytrain_ray
