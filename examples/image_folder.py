"""Image classification from a folder of PNG files through a torch ``Dataset``, as a script
already has one (examples/image_folder.yaml: the Dataset form).

- ``digit_images(split, root)``: the map-style ``Dataset`` of ``root/<split>/<label>/<n>.png``,
  torchvision's ``ImageFolder`` layout. The folder is made on first use from the PNG-encoded
  handwritten digits the repo ships (``examples/data/digits_png.parquet``, 32x32 grey): one
  image in ten is the test set, one in ten the validation set. ``__getitem__`` decodes with
  Pillow and, for the training split, augments: a random 28x28 crop of the image padded by 2,
  and a random brightness and contrast jitter, each drawn from torch's global generator as
  torchvision's ``RandomCrop`` and ``ColorJitter`` draw (relaytrain seeds it from run.seed, the
  epoch and the index before every sample, so a sample gets the same crop on any worker count,
  in any loader process and after any resume). Other splits get the centre crop. A sample is
  the pair ``(image [1, 28, 28], label)``, as torchvision's datasets give.
- ``small_cnn(classes)``: two conv blocks and a linear head.

torchvision's transforms would do the crop and the jitter, but the torchvision wheels on PyPI
are built against CUDA PyTorch and do not load beside a CPU build: the same operations are
written here with torch, drawing their parameters from the same generator.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
from PIL import Image
from torch import nn
from torch.utils.data import Dataset

HERE = Path(__file__).resolve().parent
IMAGES = HERE / "data" / "digits_png.parquet"
#: Where the folder is made when ``root`` is not given (git-ignored).
DEFAULT_ROOT = HERE / "data" / "digit_images"
SPLITS = ("train", "validation", "test")
#: Pixels a side of what the model sees.
CROP = 28


def split_of(index: int) -> str:
    """Image ``index``'s split: one in ten test, one in ten validation, the rest training."""
    return {0: "test", 1: "validation"}.get(index % 10, "train")


def make_folder(root: Path) -> Path:
    """``root`` holding every split's PNG files, made from the shipped Parquet file when it is
    missing: written in a temporary directory beside it and renamed into place, so processes
    that make it at once (setup, each worker) never see half of it."""
    if root.exists():
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    table = pq.read_table(IMAGES)
    for index, (png, label) in enumerate(
        zip(table.column("image").to_pylist(), table.column("label").to_pylist(), strict=True)
    ):
        folder = staging / split_of(index) / str(label)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{index:04d}.png").write_bytes(png)
    try:
        os.rename(staging, root)
    except OSError:  # another process made it first
        for path in sorted(staging.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        staging.rmdir()
    return root


class DigitImages(Dataset):
    """``root/<split>/<label>/<n>.png`` as ``(image, label)`` samples, augmented when
    ``augment``."""

    def __init__(self, folder: Path, augment: bool):
        self.files = sorted(folder.glob("*/*.png"))
        self.labels = [int(path.parent.name) for path in self.files]
        self.augment = augment

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        with Image.open(self.files[index]) as image:
            pixels = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
        tensor = torch.from_numpy(pixels).unsqueeze(0)  # [1, 32, 32]
        if self.augment:
            tensor = random_crop(tensor, CROP, padding=2)
            tensor = jitter(tensor, brightness=0.2, contrast=0.2)
        else:
            tensor = center_crop(tensor, CROP)
        return tensor, self.labels[index]


def random_crop(image: torch.Tensor, size: int, padding: int) -> torch.Tensor:
    """torchvision's ``RandomCrop(size, padding)``: its corner drawn from torch's generator."""
    padded = nn.functional.pad(image, (padding,) * 4)
    height, width = padded.shape[-2:]
    top = int(torch.randint(0, height - size + 1, size=(1,)).item())
    left = int(torch.randint(0, width - size + 1, size=(1,)).item())
    return padded[..., top : top + size, left : left + size]


def center_crop(image: torch.Tensor, size: int) -> torch.Tensor:
    height, width = image.shape[-2:]
    top, left = (height - size) // 2, (width - size) // 2
    return image[..., top : top + size, left : left + size]


def jitter(image: torch.Tensor, brightness: float, contrast: float) -> torch.Tensor:
    """torchvision's ``ColorJitter(brightness, contrast)`` on a grey image: factors drawn
    uniformly from ``[1 - x, 1 + x]`` with torch's generator."""
    b = float(torch.empty(1).uniform_(1 - brightness, 1 + brightness))
    c = float(torch.empty(1).uniform_(1 - contrast, 1 + contrast))
    image = (image * b).clamp(0, 1)
    mean = image.mean()
    return ((image - mean) * c + mean).clamp(0, 1)


def digit_images(split: str = "train", root: str | None = None) -> DigitImages:
    """The ``split`` of the digit images (made under ``root`` on first use); the training
    split augmented."""
    if split not in SPLITS:
        raise ValueError(f"split {split!r} is not one of {SPLITS}")
    folder = make_folder(Path(root) if root else DEFAULT_ROOT) / split
    return DigitImages(folder, augment=split == "train")


def small_cnn(classes: int = 10, width: int = 16, dropout: float = 0.1) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(width, 2 * width, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Dropout(dropout),
        nn.Linear(2 * width * (CROP // 4) ** 2, classes),
    )
