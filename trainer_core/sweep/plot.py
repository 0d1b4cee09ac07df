"""A sweep in one picture: every trial's metric against epochs (pruned trials marked where
they stopped, the best one drawn bold), and the metric against each value of the space."""

from __future__ import annotations

import json
from typing import Any

from trainer_core.sweep.result import SweepResult
from trainer_core.tracking.plots import figure_png, plt

#: At most this many parameter panels beside the curves.
MAX_PARAMETERS = 4


def sweep_png(result: SweepResult) -> bytes | None:
    """The sweep's PNG; None before any trial reported its metric."""
    trials = [t for t in result.trials if t.reports]
    if not trials:
        return None
    keys = list(trials[0].values)[:MAX_PARAMETERS]
    figure, axes = plt.subplots(
        1, 1 + len(keys), figsize=(4.2 * (1 + len(keys)), 3.6), dpi=100, squeeze=False
    )
    curves = axes[0][0]
    best = result.best.number if result.best else None
    for t in trials:
        epochs = sorted(int(e) for e in t.reports)
        values = [t.reports[e] for e in epochs]
        style: dict[str, Any] = {"lw": 2.4 if t.number == best else 1, "alpha": 0.9}
        (line,) = curves.plot(epochs, values, "o-", ms=3, label=f"t{t.number:03d}", **style)
        if t.status == "pruned":
            curves.plot(epochs[-1], values[-1], "x", color=line.get_color(), ms=9, mew=2)
        elif t.status == "failed":
            curves.plot(epochs[-1], values[-1], "s", color=line.get_color(), ms=7, mfc="none")
    curves.set_xlabel("epoch")
    curves.set_ylabel(result.metric)
    curves.set_title("each trial (x: pruned there; bold: best)", fontsize=9)
    curves.grid(alpha=0.3)
    if len(trials) <= 12:
        curves.legend(fontsize=7, ncol=2)
    for ax, key in zip(axes[0][1:], keys, strict=False):
        _parameter(ax, result, key)
    figure.suptitle(
        f"sweep {result.name}: {result.metric} ({result.direction}), "
        f"{result.sampler} sampler, {result.pruner} pruner",
        fontsize=10,
    )
    return figure_png(figure)


def _parameter(ax: Any, result: SweepResult, key: str) -> None:
    """The metric at each trial's last committed epoch against its value of ``key``."""
    points = [(t, t.values.get(key)) for t in result.trials if t.metric is not None]
    numeric = all(isinstance(v, int | float) and not isinstance(v, bool) for _, v in points)
    labels = sorted({json.dumps(v) for _, v in points}) if not numeric else []
    for t, value in points:
        x = value if numeric else labels.index(json.dumps(value))
        marker = {"pruned": "x", "failed": "s"}.get(t.status, "o")
        ax.plot(x, t.metric, marker, color="C3" if t.status == "completed" else "C7")
    if labels:
        ax.set_xticks(range(len(labels)), labels, rotation=20, fontsize=7)
    else:
        floats = [v for _, v in points if isinstance(v, float)]
        spread = len(floats) == len(points) and floats and min(floats) > 0
        if spread and max(floats) / min(floats) > 20:
            ax.set_xscale("log")
    ax.set_xlabel(key)
    ax.set_ylabel(f"{result.metric} (last epoch trained)")
    ax.grid(alpha=0.3)
