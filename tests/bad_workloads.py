"""Workloads users get wrong, for tests/integration/test_bad_input.py (importable by workers)."""

from __future__ import annotations

import torch
from torch import nn

from trainer_core.train.workloads import MLP

NOT_CALLABLE = 3


def raising_builder(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    raise ValueError("this builder is broken on purpose")


def not_a_module(num_inputs: int, num_outputs: int, **kwargs) -> object:
    return {"weights": [num_inputs, num_outputs]}


def two_argument_loop(config: dict, extra: int) -> None:
    """Not a Ray Train loop: those take no argument or one (config)."""


class NanAfter(MLP):
    """An MLP whose output becomes NaN from the ``nan_at_step``-th training step on."""

    def __init__(self, num_inputs: int, num_outputs: int, nan_at_step: int, **kwargs):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.nan_at_step = nan_at_step
        self.steps = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = super().forward(x)
        if self.training:
            self.steps += 1
            if self.steps >= self.nan_at_step:
                return output * float("nan")
        return output


def nan_after(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return NanAfter(num_inputs, num_outputs, **kwargs)


class NanGradientAt(MLP):
    """An MLP whose ``nan_gradient_at_step``-th backward pass makes a gradient NaN: the loss of
    that step is still finite, the weights after its update are not."""

    def __init__(self, num_inputs: int, num_outputs: int, nan_gradient_at_step: int, **kwargs):
        super().__init__(num_inputs, num_outputs, **kwargs)
        self.spare = nn.Parameter(torch.zeros(num_outputs))
        self.nan_gradient_at_step = nan_gradient_at_step
        self.backwards = 0
        self.spare.register_hook(self._gradient)

    def _gradient(self, grad: torch.Tensor) -> torch.Tensor:
        self.backwards += 1
        return grad * float("nan") if self.backwards == self.nan_gradient_at_step else grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + self.spare * 0


def nan_gradient_at(num_inputs: int, num_outputs: int, **kwargs) -> nn.Module:
    return NanGradientAt(num_inputs, num_outputs, **kwargs)
