"""Scheduled retraining: train a challenger on the newest data, promote it only if better.

Each schedule slot has a deterministic run name (``<model>-<slot time>``), so re-running a
failed nightly run resumes it, and two flow runs for one slot never train twice (the run's
lease, and a finished run returning its stored result).
"""

from __future__ import annotations

from datetime import UTC, datetime

from prefect import flow
from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict

from flows.training import training
from tasks import credentials
from tasks.retraining import Comparison, compare_and_promote, load_champion
from trainer_core.run.summary import TrainingResult
from trainer_core.spec.run_spec import RunSpec


class RetrainingResult(BaseModel):
    model_config = ConfigDict(frozen=True)

    training: TrainingResult
    comparison: Comparison
    warm_started_from: str | None


def slot_time() -> datetime:
    scheduled = flow_run.scheduled_start_time
    return scheduled if isinstance(scheduled, datetime) else datetime.now(UTC)


def slot_run_name(model_name: str, when: datetime) -> str:
    return f"{model_name}-{when.strftime('%Y%m%d-%H%M')}"


def _flow_run_name() -> str:
    slot = flow_run.parameters.get("slot")
    when = slot if isinstance(slot, datetime) else slot_time()
    return slot_run_name(str(flow_run.parameters.get("model_name", "model")), when)


@flow(name="retraining", flow_run_name=_flow_run_name, log_prints=True)
def retraining(
    spec: RunSpec, model_name: str, promote_margin: float = 0.0, slot: datetime | None = None
) -> RetrainingResult:
    """Challenger on this slot's data, warm-started from a compatible champion; compare; promote.

    ``slot`` defaults to the flow run's scheduled time; set it to backfill a past slot.
    """
    when = slot or slot_time()
    spec = spec.for_slot(when).with_run_name(slot_run_name(model_name, when))
    # The champion registry lives on run.storage too: its credentials hold for the whole flow.
    with credentials.using(spec.run.credentials):
        champion, fits = load_champion(spec, model_name)
        warm_start = champion.checkpoint_uri if champion is not None and fits else None
        if warm_start:
            spec = spec.model_copy(
                update={"run": spec.run.model_copy(update={"init_from": warm_start})}
            )
        challenger = training(spec)
        comparison = compare_and_promote(spec, model_name, challenger, champion, promote_margin)
    return RetrainingResult(
        training=challenger, comparison=comparison, warm_started_from=warm_start
    )
