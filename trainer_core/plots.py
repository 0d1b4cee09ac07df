"""The loss / metric curve of a run as PNG bytes (matplotlib, headless)."""

from __future__ import annotations

import base64
import io
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt


def curve_png(history: Sequence[dict[str, Any]], title: str) -> bytes:
    """Training loss per step, validation metrics at each epoch's end."""
    steps = [r["step"] for r in history if "loss" in r]
    losses = [r["loss"] for r in history if "loss" in r]
    evals = [r for r in history if any(k.startswith("val_") for k in r)]
    has_accuracy = any("val_accuracy" in r for r in evals)
    figure, axes = plt.subplots(
        1, 2 if has_accuracy else 1, figsize=(9 if has_accuracy else 6, 3.4), dpi=100, squeeze=False
    )
    ax = axes[0][0]
    ax.plot(steps, losses, lw=1, alpha=0.6, label="train loss (per step)")
    if any("val_loss" in r for r in evals):
        ax.plot(
            [r["step"] for r in evals if "val_loss" in r],
            [r["val_loss"] for r in evals if "val_loss" in r],
            "o-",
            label="val loss",
        )
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    if losses and min(losses) > 0:
        ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    if has_accuracy:
        acc = axes[0][1]
        acc.plot(
            [r["step"] for r in evals if "val_accuracy" in r],
            [r["val_accuracy"] for r in evals if "val_accuracy" in r],
            "o-",
            color="C2",
        )
        acc.set_xlabel("step")
        acc.set_ylabel("val accuracy")
        acc.grid(alpha=0.3)
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
