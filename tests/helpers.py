"""Workloads for tests that need training to last long enough to be interrupted."""

import time

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
