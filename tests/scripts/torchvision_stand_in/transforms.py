"""torchvision.transforms' ``Compose``, ``ToTensor`` and ``Normalize``, computing what
torchvision's compute on a grey (mode ``L``) image."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch


class Compose:
    """Each transform in turn, as ``torchvision.transforms.Compose``."""

    def __init__(self, transforms: Sequence[Callable[[Any], Any]]):
        self.transforms = list(transforms)

    def __call__(self, image: Any) -> Any:
        for transform in self.transforms:
            image = transform(image)
        return image


class ToTensor:
    """A grey PIL image (or an ``[H, W]`` uint8 array) to a float ``[1, H, W]`` tensor in
    ``[0, 1]``: torchvision's ``to_tensor``, its pixels divided by 255."""

    def __call__(self, image: Any) -> torch.Tensor:
        pixels = torch.from_numpy(np.array(image, dtype=np.uint8, copy=True))
        return pixels.unsqueeze(0).to(dtype=torch.get_default_dtype()).div(255)


class Normalize:
    """``(x - mean) / std`` per channel, as torchvision's ``normalize`` (not in place)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = list(mean)
        self.std = list(std)

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        mean = torch.as_tensor(self.mean, dtype=tensor.dtype).view(-1, 1, 1)
        std = torch.as_tensor(self.std, dtype=tensor.dtype).view(-1, 1, 1)
        return tensor.sub(mean).div(std)
