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


class OverflowingMLP(MLP):
    """An MLP whose training forward passes number ``at_forward`` to ``at_forward + times - 1``
    (counted from 1 in each worker process) on rank ``rank`` add 1e5 to its output: under fp16
    autocast that is beyond fp16's range (65504), so the output and the loss are inf, while the
    same sum in fp32 is finite."""

    def __init__(
        self,
        num_inputs: int,
        num_outputs: int,
        at_forward: int = 1,
        times: int = 1,
        rank: int = 0,
        **kwargs,
    ):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.at_forward, self.times, self.rank = at_forward, times, rank
        self.forwards = 0

    def forward(self, x):
        import torch.distributed as dist

        output = super().forward(x)
        if self.training and dist.is_initialized() and dist.get_rank() == self.rank:
            self.forwards += 1
            if self.at_forward <= self.forwards < self.at_forward + self.times:
                output = output + 1e5
        return output


def overflowing_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return OverflowingMLP(num_inputs, num_outputs, **kwargs)


class BatchNormMLP(nn.Module):
    """Linear, BatchNorm1d, ReLU, Linear: running statistics that each rank's training forward
    passes update from its own slice of the batch."""

    def __init__(self, num_inputs: int, num_outputs: int, hidden: int = 16):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(num_inputs, hidden),
            nn.BatchNorm1d(hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_outputs),
        )

    def forward(self, x):
        return self.net(x)


def batchnorm_mlp(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return BatchNormMLP(num_inputs, num_outputs, **kwargs)
