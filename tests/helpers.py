"""Workloads for tests that need training to last long enough to be interrupted."""

import json
import os
import time
from pathlib import Path

from torch import nn

from trainer_core.workloads import MLP


class SlowMLP(MLP):
    def __init__(self, num_inputs: int, num_outputs: int, delay_s: float = 0.02, **kwargs):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.delay_s = delay_s

    def forward(self, x):
        if self.training:
            time.sleep(self.delay_s)
        return super().forward(x)


def slow_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return SlowMLP(num_inputs, num_outputs, **kwargs)


class RecordingMLP(MLP):
    """An MLP over features 1.. that records feature 0, each row's id, of every training
    forward pass in a worker: one JSON line ``{"rank", "world_size", "ids", "time"}`` a
    micro-batch, in ``log_dir/<pid>.jsonl`` (what a rank trained on, in order); each training
    forward pass first sleeps ``delay_s``."""

    def __init__(
        self, num_inputs: int, num_outputs: int, log_dir: str = "", delay_s: float = 0, **kwargs
    ):
        super().__init__(num_inputs - 1, num_outputs, **kwargs)
        self.log_dir = log_dir
        self.delay_s = delay_s

    def forward(self, x):
        import torch.distributed as dist

        if self.training and dist.is_initialized():
            time.sleep(self.delay_s)
            line = {
                "rank": dist.get_rank(),
                "world_size": dist.get_world_size(),
                "ids": [int(i) for i in x[:, 0].tolist()],
                "time": time.time(),
            }
            with open(Path(self.log_dir) / f"{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps(line) + "\n")
        return super().forward(x[:, 1:])


def recording_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return RecordingMLP(num_inputs, num_outputs, **kwargs)
