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
    _plot_eval(ax, evals, "val_loss", label="val loss")
    ax.set_ylabel("loss")
    if losses and min(losses) > 0:
        ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=8)
    if has_accuracy:
        _plot_eval(axes[0][1], evals, "val_accuracy", color="C2")
        axes[0][1].set_ylabel("val accuracy")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()


def _plot_eval(ax: Any, evals: Sequence[dict[str, Any]], key: str, **style: Any) -> None:
    rows = [r for r in evals if key in r]
    if rows:
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], "o-", **style)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()
