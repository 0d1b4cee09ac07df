"""The runs the multi-node tests start."""

from __future__ import annotations

import threading

from flows.training import training
from tests.conftest import tiny_raw
from tests.multinode import MultiNodeCluster


def slow_raw(storage: str, name: str, cluster: MultiNodeCluster, delay_s: float = 0.25) -> dict:
    """The uninterrupted reference's spec (SlowMLP is the same MLP, only slower) on the cluster."""
    return tiny_raw(
        storage,
        name,
        model={
            "name": "tests.helpers:slow_mlp",
            "kwargs": {"hidden": [16, 16], "dropout": 0.1, "delay_s": delay_s},
        },
        scaling={
            "num_workers": 2,
            "placement_strategy": "SPREAD",
            "job_address": cluster.job_address,
        },
        retries={"infrastructure": 2, "code": 0, "delay_s": 1, "jitter": 0},
    )


def run_flow_in_thread(spec):
    box: dict = {}
    thread = threading.Thread(
        target=lambda: box.setdefault("state", training(spec, return_state=True))
    )
    thread.start()
    return thread, box
