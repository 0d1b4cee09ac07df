"""Tasks of the retraining flow: find the champion, then compare, decide and maybe promote."""

from __future__ import annotations

import time
from typing import Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from tasks.naming import artifact_key
from trainer_core import storage
from trainer_core.checkpoint.registry import Champion, Registry, decide_promotion
from trainer_core.run.summary import TrainingResult
from trainer_core.spec.run_spec import RunSpec
from trainer_core.train import evaluate


class Comparison(BaseModel):
    model_config = ConfigDict(frozen=True)

    model_name: str
    metric: str
    challenger_checkpoint_uri: str | None
    challenger_metrics: dict[str, float]
    champion_checkpoint_uri: str | None
    champion_metrics: dict[str, float]
    promoted: bool
    reason: str


def _registry(spec: RunSpec, model_name: str) -> Registry:
    return Registry(storage.resolve(spec.run.storage), model_name)


@task(name="load-champion", cache_policy=NO_CACHE)
def load_champion(spec: RunSpec, model_name: str) -> tuple[Champion | None, bool]:
    """The current champion, and whether its weights can warm-start this spec's model.

    First, a spec whose data holds no rows out is refused: the comparison after training would
    have nothing to compare on."""
    evaluate.check_holdout(spec)
    logger = get_run_logger()
    champion = _registry(spec, model_name).champion()
    if champion is None:
        logger.info("no champion for %s yet: the challenger trains from scratch", model_name)
        return None, False
    fits, why = evaluate.compatible(spec, champion.checkpoint_uri)
    logger.info(
        "champion of %s is %s (%s); warm start: %s",
        model_name,
        champion.run_name,
        champion.checkpoint_uri,
        why,
    )
    return champion, fits


@task(name="compare-and-promote", cache_policy=NO_CACHE)
def compare_and_promote(
    spec: RunSpec,
    model_name: str,
    challenger: TrainingResult,
    champion: Champion | None,
    margin: float,
) -> Comparison:
    """Evaluate both on the same holdout; promote the challenger only if better by ``margin``."""
    logger = get_run_logger()
    metric, mode = _comparison_metric(spec)
    rows = evaluate.holdout(spec)
    challenger_uri = _best_checkpoint_uri(challenger)
    challenger_metrics = evaluate.evaluate(spec, challenger_uri, rows) if challenger_uri else {}
    champion_metrics: dict[str, float] = {}
    if champion is not None and evaluate.compatible(spec, champion.checkpoint_uri)[0]:
        champion_metrics = evaluate.evaluate(spec, champion.checkpoint_uri, rows)
    decision = decide_promotion(
        challenger_metrics.get(metric),
        champion_metrics.get(metric) if champion else None,
        metric=metric,
        mode=mode,
        margin=margin,
    )
    if decision.promote and challenger_uri:
        _registry(spec, model_name).promote(
            Champion(
                model_name=model_name,
                run_name=challenger.run_name,
                checkpoint_uri=challenger_uri,
                metric=metric,
                metrics=challenger_metrics,
                promoted_at=time.time(),
                fingerprint=spec.fingerprint(),
            )
        )
    logger.info("%s: %s", "promoted" if decision.promote else "kept the champion", decision.reason)
    comparison = Comparison(
        model_name=model_name,
        metric=metric,
        challenger_checkpoint_uri=challenger_uri,
        challenger_metrics=challenger_metrics,
        champion_checkpoint_uri=champion.checkpoint_uri if champion else None,
        champion_metrics=champion_metrics,
        promoted=decision.promote,
        reason=decision.reason,
    )
    create_markdown_artifact(
        markdown=_markdown(comparison, len(rows)),
        key=artifact_key(f"{model_name}-{challenger.run_name}", "comparison"),
        description=f"Challenger vs champion for {model_name}",
    )
    return comparison


def _comparison_metric(spec: RunSpec) -> tuple[str, Literal["min", "max"]]:
    """The holdout metric both models are compared on, and whether lower or higher wins: the
    spec's best_metric when it is a validation metric, else val_loss."""
    best = spec.checkpoint.best_metric
    metric = best if best.startswith("val_") else "val_loss"
    return metric, spec.checkpoint.best_mode if metric == best else "min"


def _best_checkpoint_uri(result: TrainingResult) -> str | None:
    """The best checkpoint of a finished run, as a URI on its storage."""
    if not result.best_checkpoint_uri:
        return None
    name = result.best_checkpoint_uri.rsplit("/", 1)[-1]
    return storage.join_uri(result.storage_uri, result.run_name, name)


def _markdown(c: Comparison, num_rows: int) -> str:
    keys = sorted(set(c.challenger_metrics) | set(c.champion_metrics))

    def row(name: str, uri: str | None, metrics: dict[str, float]) -> str:
        cells = " | ".join(f"{metrics[k]:.4f}" if k in metrics else "-" for k in keys)
        return f"| {name} | `{uri or '-'}` | {cells} |"

    return (
        "\n".join(
            [
                f"# {c.model_name}: {'challenger promoted' if c.promoted else 'champion kept'}",
                "",
                f"{c.reason}. Both evaluated on the same {num_rows} holdout rows.",
                "",
                f"| model | checkpoint | {' | '.join(keys)} |",
                f"|---|---|{'---|' * len(keys)}",
                row("challenger", c.challenger_checkpoint_uri, c.challenger_metrics),
                row("champion", c.champion_checkpoint_uri, c.champion_metrics),
            ]
        )
        + "\n"
    )
