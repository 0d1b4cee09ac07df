"""A small ResNet on encoded images (examples/vision_resnet.yaml).

- ``build(**model.kwargs)``: HuggingFace ``transformers``' ResNet for image classification,
  built from a ``ResNetConfig`` (no weights downloaded). It takes ``pixel_values`` and returns
  an ``ImageClassifierOutputWithNoAttention``, whose ``logits`` the built-in classification
  loss reads.
- ``augment(row, rng)``: a row of ``examples/data/digits_png.parquet`` (``tools/
  make_image_parquet.py``): its PNG bytes decoded with Pillow, a random ``CROP`` x ``CROP``
  crop and a horizontal flip with probability 1/2, both drawn from ``rng`` (the same for the
  row at any worker count and after any resume, another each epoch), scaled to 0..1.
- ``center(row, rng)``: the validation rows' transform: the centre crop, no flip.

torchvision's ``transforms.v2`` would do the crop and the flip, but the torchvision wheels on
PyPI are built against CUDA PyTorch and do not load beside a CPU build; the two operations are
written here with numpy, their parameters drawn from ``rng`` as ``v2``'s are from torch's.
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import nn

#: Pixels a side of the crop the model sees.
CROP = 28


def build(
    channels: int = 1,
    classes: int = 10,
    width: int = 16,
    hidden_sizes: tuple[int, ...] = (16, 32),
    depths: tuple[int, ...] = (1, 1),
) -> nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(
        num_channels=channels,
        embedding_size=width,
        hidden_sizes=list(hidden_sizes),
        depths=list(depths),
        layer_type="basic",
        num_labels=classes,
    )
    return ResNetForImageClassification(config)


def decode(data: bytes) -> np.ndarray:
    """An encoded image (PNG, JPEG) as a ``[channels, height, width]`` uint8 array."""
    with Image.open(io.BytesIO(data)) as image:
        pixels = np.asarray(image)
    return pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)


def augment(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    pixels = decode(row["image"])
    top = int(rng.integers(0, pixels.shape[1] - CROP + 1))
    left = int(rng.integers(0, pixels.shape[2] - CROP + 1))
    crop = pixels[:, top : top + CROP, left : left + CROP]
    if rng.random() < 0.5:
        crop = crop[:, :, ::-1]
    return sample(crop, row["label"])


def center(row: dict[str, Any], rng: np.random.Generator) -> dict[str, Any]:
    pixels = decode(row["image"])
    top, left = (pixels.shape[1] - CROP) // 2, (pixels.shape[2] - CROP) // 2
    return sample(pixels[:, top : top + CROP, left : left + CROP], row["label"])


def sample(pixels: np.ndarray, label: int) -> dict[str, Any]:
    return {
        "pixel_values": np.ascontiguousarray(pixels, dtype=np.float32) / 255.0,
        "labels": np.int64(label),
    }


class MacroF1:
    """Macro-averaged F1 over the 10 digits, a stateful metric (``metrics:
    [examples.vision_resnet:MacroF1]``, recorded as ``val_MacroF1``): per-class true positive,
    false positive and false negative counts, added over batches and over ranks (``merge``),
    so the figure is that of every validation image, not a mean of per-batch F1s."""

    classes = 10

    def __init__(self) -> None:
        self.counts = torch.zeros(3, self.classes, dtype=torch.float64)

    def update(self, outputs: Any, batch: dict[str, torch.Tensor]) -> None:
        predicted = outputs.logits.argmax(dim=-1).cpu()
        labels = batch["labels"].cpu()
        one_hot = torch.eye(self.classes, dtype=torch.float64)
        right = one_hot[predicted] * one_hot[labels]
        self.counts[0] += right.sum(dim=0)  # true positives
        self.counts[1] += (one_hot[predicted] - right).sum(dim=0)  # false positives
        self.counts[2] += (one_hot[labels] - right).sum(dim=0)  # false negatives

    def merge(self, other: MacroF1) -> None:
        self.counts += other.counts

    def compute(self) -> float:
        tp, fp, fn = self.counts
        seen = (tp + fp + fn) > 0  # a class neither predicted nor present does not count
        f1 = 2 * tp[seen] / (2 * tp[seen] + fp[seen] + fn[seen])
        return float(f1.mean()) if bool(seen.any()) else 0.0
