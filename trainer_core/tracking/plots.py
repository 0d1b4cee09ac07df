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
    return figure_png(figure)


def _plot_eval(ax: Any, evals: Sequence[dict[str, Any]], key: str, **style: Any) -> None:
    rows = [r for r in evals if key in r]
    if rows:
        ax.plot([r["step"] for r in rows], [r[key] for r in rows], "o-", **style)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


#: A colour per part of the step time (``step_time.PARTS``), waits in warm colours.
PART_COLOURS = {
    "data_wait": "#d62728",
    "h2d": "#9467bd",
    "forward_backward": "#1f77b4",
    "allreduce_wait": "#ff7f0e",
    "optimizer": "#2ca02c",
    "checkpoint": "#8c564b",
    "validation": "#17becf",
    "other": "#7f7f7f",
}


def run_step_time_png(history: Sequence[dict[str, Any]], title: str) -> bytes | None:
    """``step_time_png`` of a run's metrics history; None when no window was measured."""
    from trainer_core import step_time

    rows = list(history)
    totals = step_time.per_rank(rows)
    if not totals:
        return None
    return step_time_png(totals, step_time.stragglers_seen(rows), title)


def step_time_png(
    per_rank: dict[tuple[int, int], tuple[int, list[float]]],
    stragglers: Sequence[dict[str, Any]],
    title: str,
) -> bytes:
    """A stacked bar per attempt and rank: milliseconds per step of each part of the step
    time (``step_time.per_rank``'s seconds over its steps); a straggler's bar is marked."""
    from trainer_core.step_time import LABELS, PARTS

    keys = list(per_rank)
    named = {(int(s["attempt"]), int(s["rank"])): s for s in stragglers}
    figure, ax = plt.subplots(figsize=(max(7.0, 4.0 + 0.8 * len(keys)), 3.8), dpi=100)
    bottoms = [0.0] * len(keys)
    for i, part in enumerate(PARTS):
        heights = [1000 * per_rank[k][1][1 + i] / max(per_rank[k][0], 1) for k in keys]
        ax.bar(
            range(len(keys)),
            heights,
            bottom=bottoms,
            color=PART_COLOURS[part],
            label=LABELS[part],
            width=0.7,
        )
        bottoms = [b + h for b, h in zip(bottoms, heights, strict=True)]
    for x, key in enumerate(keys):
        if key in named:
            ax.annotate(
                f"straggler\n{named[key]['ratio']:.1f}x",
                (x, bottoms[x]),
                ha="center",
                va="bottom",
                fontsize=8,
                color="#d62728",
            )
    ax.set_xticks(range(len(keys)), [f"attempt {a}\nrank {r}" for a, r in keys], fontsize=8)
    ax.set_ylabel("ms per step")
    ax.set_ylim(0, max(bottoms, default=1.0) * 1.25 or 1.0)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    ax.set_title(title, fontsize=10)
    return figure_png(figure)


def figure_png(figure: Any) -> bytes:
    """``figure`` laid out, as PNG bytes; the figure is closed."""
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    plt.close(figure)
    return buffer.getvalue()
