"""torchvision.datasets' ``MNIST`` and ``FashionMNIST``, called as a script calls them, giving a
tiny map-style Dataset of 28x28 grey digits instead of the download.

The images are the handwritten digits the repo ships as PNG files
(``examples/data/digits_png.parquet``, 32x32, the UCI set examples/image_folder.py makes its
folder from), cut to MNIST's 28x28 by their centre: the first ``TRAIN_SAMPLES`` are the
training set, the next ``TEST_SAMPLES`` the test set. Kept tiny so that the tests that train on
it take seconds. A sample is ``(transform(PIL image, mode L), int label)``, as torchvision's.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from PIL import Image
from torch.utils.data import Dataset

IMAGES = Path(__file__).resolve().parents[3] / "examples" / "data" / "digits_png.parquet"
TRAIN_SAMPLES = 256
TEST_SAMPLES = 64
#: MNIST's side.
SIDE = 28


class MNIST(Dataset):
    """``root``, ``download`` and ``target_transform`` are taken and not used (nothing is
    read from or written to ``root``)."""

    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        download: bool = False,
    ):
        start, count = (0, TRAIN_SAMPLES) if train else (TRAIN_SAMPLES, TEST_SAMPLES)
        table = pq.read_table(IMAGES).slice(start, count)
        self.data = np.stack([_centre(png) for png in table.column("image").to_pylist()])
        self.targets = [int(label) for label in table.column("label").to_pylist()]
        self.transform = transform
        self.target_transform = target_transform

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = Image.fromarray(self.data[index])  # uint8 [H, W]: mode L
        target: Any = self.targets[index]
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class FashionMNIST(MNIST):
    """The same digits: what stands in is the shape of the data (28x28 grey, 10 classes)."""


def _centre(png: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(png)) as image:
        pixels = np.asarray(image.convert("L"), dtype=np.uint8)
    top, left = (pixels.shape[0] - SIDE) // 2, (pixels.shape[1] - SIDE) // 2
    return np.ascontiguousarray(pixels[top : top + SIDE, left : left + SIDE])
