"""What a person reads of a run: the per-epoch table and the markdown summary shown in the
Prefect UI (a summary artifact) and by ``relaytrain show``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer_core import step_time
from trainer_core.numbers import is_finite_number
from trainer_core.run import epochs
from trainer_core.run.summary import TrainingResult
from trainer_core.spec.run_spec import RunSpec


def epoch_table(history: Sequence[dict[str, Any]], ray_loop: bool = False) -> list[dict[str, Any]]:
    """One row per epoch, numbered from 1 (``run.epochs``; ``ray_loop``: the history is a loop
    on Ray's API's, in its own numbering): mean training loss, the epoch-end validation
    metrics, last lr."""
    first = epochs.first_epoch(history, ray_loop)
    by_epoch: dict[int, list[dict[str, Any]]] = {}
    for row in history:
        by_epoch.setdefault(int(row.get("epoch", first)), []).append(row)
    table = []
    for epoch in sorted(by_epoch):
        rows = by_epoch[epoch]
        losses = [r["loss"] for r in rows if is_finite_number(r.get("loss"))]
        entry: dict[str, Any] = {
            "epoch": epochs.number(epoch, first),
            "last_step": rows[-1]["step"],
            "train_loss": round(sum(losses) / len(losses), 6) if losses else None,
        }
        for key, value in rows[-1].items():
            if key.startswith("val_") and is_finite_number(value):
                entry[key] = round(float(value), 6)
        if is_finite_number(rows[-1].get("lr")):
            entry["lr"] = float(rows[-1]["lr"])
        table.append(entry)
    return table


def render_markdown(
    spec: RunSpec,
    result: TrainingResult,
    plan_reason: str | None = None,
    step_time_image: str | None = None,
) -> str:
    """The run summary a person reads in the UI (``step_time_image``: the URL of the
    step-time bars, shown under "Where the time went")."""
    lines = [
        f"# Run `{result.run_name}`: {result.status}",
        "",
        *_setup_lines(spec),
        *_progress_lines(spec, result, plan_reason),
        "",
        "## Attempts",
        "",
        "| # | status | resumed from | last step | steps lost | seconds | error: decision |",
        "|---|---|---|---|---|---|---|",
        *_attempt_rows(result),
        "",
        *time_lines(result, step_time_image),
        "## Checkpoints",
        "",
        f"- best: `{result.best_checkpoint_uri}` {_metrics(result.best_metrics)}",
        f"- latest: `{result.latest_checkpoint_uri}` {_metrics(result.final_metrics)}",
        "",
        "## Tracking",
        "",
        f"- TensorBoard: `tensorboard --logdir {result.run_uri}` (event files in the run "
        "directory, one value per step across attempts)",
    ]
    if result.mlflow is not None:
        lines.append(f"- {result.mlflow.describe()}")
    if result.best_model_uri or result.latest_model_uri:
        lines += [
            "",
            "Whole model, one `torch.load(path, weights_only=True)` file:",
            f"- best: `{result.best_model_uri}`",
            f"- latest: `{result.latest_model_uri}`",
        ]
    return "\n".join(lines) + "\n"


def time_lines(result: TrainingResult, image: str | None = None) -> list[str]:
    """ "Where the time went": goodput, the parts of a step (mean over ranks), the stragglers
    and the advice; nothing when no step was measured."""
    account = result.time
    if account is None:
        return []
    share = f"{account.productive_share:.0%}" if account.productive_share is not None else "-"
    r = account.restarts
    lines = [
        "## Where the time went",
        "",
        f"- productive training: {account.productive_s:.1f} s of {account.wall_s:.1f} s wall "
        f"time ({share}); start-up, restore and finishing {account.overhead_s:.1f} s",
        f"- waiting for data {account.data_wait_s:.1f} s, blocked on checkpoints "
        f"{account.checkpoint_blocked_s:.1f} s, validation {account.validation_s:.1f} s",
        f"- lost to restarts: {r.total_s:.1f} s (detection {r.detection_s:.1f} s, new worker "
        f"groups {r.new_group_s:.1f} s, steps recomputed {r.recompute_s:.1f} s)",
        "",
        f"Per step, mean over ranks, {account.steps_measured} steps measured:",
        "",
        "| part | ms per step | share |",
        "|---|---|---|",
        *(
            f"| {step_time.LABELS[name]} | {1000 * seconds:.2f} | "
            f"{account.shares.get(name, 0.0):.1%} |"
            for name, seconds in account.per_step_s.items()
        ),
        "",
    ]
    for s in account.stragglers:
        lines.append(
            f"- straggler: rank {s['rank']} on node {s['node']} (attempt {s['attempt']}), "
            f"{s['ratio']:.2f}x its peers' median in {s['windows']} windows from step "
            f"{s['from_step']}"
        )
    lines += [f"- advice: {line}" for line in account.advice]
    if account.stragglers or account.advice:
        lines.append("")
    if image:
        lines += [f"![where each step's time went, per attempt and rank]({image})", ""]
    return lines


def _setup_lines(spec: RunSpec) -> list[str]:
    """What was trained, how: the workload, the batch and optimizer, the loss and metrics."""
    workload = spec.train_loop or (
        f"{spec.model.name} on {spec.data.dataset}" if spec.model and spec.data else "?"
    )
    lines = [
        f"- workload: `{workload}`, {_workers(spec)} DDP worker(s)"
        + (f", {spec.schedule.epochs} epochs" if spec.schedule else "")
    ]
    if spec.data and spec.schedule:
        optimizer = spec.optimizer
        accumulation = optimizer.grad_accumulation
        lines.append(
            f"- global batch {spec.data.batch_size}"
            + (f" x {accumulation} per optimizer step" if accumulation > 1 else "")
            + f", {optimizer.describe()}, schedule {spec.schedule.describe()}"
            + (
                f", gradients clipped to norm {optimizer.clip_grad_norm}"
                if optimizer.clip_grad_norm
                else ""
            )
            + (f", {spec.precision}" if spec.precision != "fp32" else "")
        )
        if spec.loss or spec.metrics:
            lines.append(f"- loss `{spec.loss or 'built-in'}`; metrics {spec.metrics}")
    return lines


def _progress_lines(spec: RunSpec, result: TrainingResult, plan_reason: str | None) -> list[str]:
    """The checkpoint policy, how far the run got and at what cost, where it lives."""
    lines = [
        f"- checkpoints every {spec.checkpoint.every} steps; keep last "
        f"{spec.checkpoint.keep_last}, best {spec.checkpoint.keep_best} by "
        f"`{spec.checkpoint.best_metric}` ({spec.checkpoint.best_mode})",
        f"- steps completed: {result.steps_completed}; epochs: {result.epochs_completed}",
    ]
    if result.goodput is not None:
        lines.append(
            f"- goodput: {result.goodput:.3f} ({result.steps_completed} steps kept of "
            f"{result.steps_computed} computed)"
        )
    if result.stop_reason:
        lines.append(f"- stopped early: {result.stop_reason}")
    lines += [
        f"- run directory: `{result.run_uri}` ({result.storage_bytes / 1e6:.2f} MB)",
        f"- wall time: {result.wall_time_s:.1f} s",
    ]
    if plan_reason:
        lines.append(f"- plan: {plan_reason}")
    return lines


#: The columns of ``attempt_rows``, in order.
ATTEMPT_COLUMNS = ("#", "status", "resumed from", "last step", "steps lost", "seconds", "reason")


def attempt_rows(result: TrainingResult) -> list[dict[str, str]]:
    """A row per attempt, and under it one per restart in place or resize within it
    (``1.1``, ``1.2``, ...: what Ray Train restarted without a new attempt), with its error and
    the steps it lost: what the summary's table and ``relaytrain show`` list."""
    rows = []
    for a in result.attempts:
        error = ""
        if a.error_class:
            error = f"{a.error_class}: {_one_line(a.error_message, 70)}"
            if a.retry_decision:
                error += f": {_one_line(a.retry_decision, 60)}"
        if a.resume_exact is False:  # the rest of the note is in the log and attempts.jsonl
            note = f"resume not exact: {_one_line(a.resume_note, 100)}"
            error = f"{error}; {note}" if error else note
        rows.append(
            _attempt_row(
                str(a.attempt),
                a.status,
                a,
                "" if a.duration_s is None else f"{a.duration_s:.1f}",
                error,
            )
        )
        for number, r in enumerate(a.restarts, 1):
            back = "" if r.recovery_s is None else f"{r.recovery_s:.1f} s to resume"
            what = "restarted in place"
            before, after = r.world_size_before, r.world_size_after
            if before and after and before != after:  # a resize, not the same group again
                what = f"{before} → {after} workers"
            why = f"{r.error_class}: {_one_line(r.error_message, 70)}" if r.error_class else ""
            if r.reason:
                why = f"{r.reason}: {why}" if why else r.reason
            rows.append(_attempt_row(f"{a.attempt}.{number}", what, r, back, why))
    return rows


def _attempt_row(number: str, status: str, figures: Any, seconds: str, why: str) -> dict[str, str]:
    cells = (
        number,
        status,
        _dash(figures.resumed_from_step),
        _dash(figures.last_step),
        _dash(figures.steps_lost),
        seconds,
        why,
    )
    return dict(zip(ATTEMPT_COLUMNS, cells, strict=True))


def _attempt_rows(result: TrainingResult) -> list[str]:
    return ["| " + " | ".join(row.values()) + " |" for row in attempt_rows(result)]


def _workers(spec: RunSpec) -> str:
    scaling = spec.scaling
    if scaling.elastic:
        return f"{scaling.min_workers} to {scaling.max_workers} (elastic)"
    return str(scaling.num_workers)


def _metrics(metrics: dict[str, Any]) -> str:
    shown = {
        k: round(v, 4) for k, v in metrics.items() if k in ("step", "loss") or k.startswith("val_")
    }
    return ", ".join(f"{k}={v}" for k, v in shown.items())


def _one_line(text: str | None, limit: int = 160) -> str:
    flat = " ".join((text or "").split()).replace("|", "/")
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


def _dash(value: Any) -> str:
    return "-" if value is None else str(value)
