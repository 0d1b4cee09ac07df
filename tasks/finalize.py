"""finalize: best and latest checkpoints, retention, summary.json, artifacts, the result."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.artifacts import (
    create_image_artifact,
    create_link_artifact,
    create_markdown_artifact,
    create_table_artifact,
)
from prefect.cache_policies import NO_CACHE

from tasks.naming import artifact_key
from tasks.setup import Prepared
from trainer_core.checkpoint.history import read_metrics_history
from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.errors import LeaseHeldError, StorageError
from trainer_core.run import lease
from trainer_core.run.report import epoch_table, render_markdown
from trainer_core.run.summary import Status, TrainingResult, build_result, finalize_run
from trainer_core.spec.run_spec import RunSpec
from trainer_core.tracking import plots


@task(name="finalize", cache_policy=NO_CACHE)
def finalize(spec: RunSpec, prepared: Prepared, status: Status = "completed") -> TrainingResult:
    """Write the run summary, publish the artifacts, release the run, return the result.

    Only under the run's lease: when another flow holds it now, or held it since this flow's
    lease lapsed and wrote summary.json, nothing is written or deleted (retention,
    summary.json, MLflow, artifacts would act under or over that flow) and the result is read
    from the run directory as it stands."""
    logger = get_run_logger()
    owner = prepared.lease_owner
    run_dir = RunDirectory.of(prepared.storage_uri, prepared.run_name, lease_owner=owner)
    try:
        # ours still, or free again and nobody else's summary since setup: take it
        lease.acquire_to_finalize(run_dir.location, owner, prepared.summary_seen)
    except LeaseHeldError as e:
        logger.warning("finalize writes nothing: %s", e)
        return build_result(spec, run_dir, prepared.storage_uri, status)
    except StorageError as e:  # e.g. a full disk: ours still; the release below frees it
        logger.warning("could not renew the run's lease before finalize: %s", e)
    try:
        history = read_metrics_history(run_dir)  # once: TensorBoard, result, MLflow, artifacts
        result = finalize_run(spec, run_dir, prepared.storage_uri, status, history)
        publish(spec, prepared, result, history, run_dir)
    finally:  # a summary that cannot be written (e.g. a full disk) must not hold the run
        lease.release(run_dir.location, prepared.lease_owner)
    logger.info(
        "run %s %s: %s steps, best %s",
        result.run_name,
        result.status,
        result.steps_completed,
        result.best_checkpoint_uri,
    )
    return result


def publish(
    spec: RunSpec, prepared: Prepared, result: TrainingResult, history: list, run_dir: RunDirectory
) -> None:
    """The UI's view of the run. The curve is a PNG saved beside the run and embedded as a
    data: URL, which the UI's <img> renders without any file server."""
    name = prepared.run_name
    table = epoch_table(history, spec.ray_loop)
    bars = plots.run_step_time_png(history, f"{name}: where each step's time went")
    if bars is not None:
        run_dir.step_time_file.write_bytes(bars)
    if table:
        create_table_artifact(
            table=table,
            key=artifact_key(name, "metrics"),
            description=f"Metrics per epoch of {name}",
        )
    create_markdown_artifact(
        markdown=render_markdown(
            spec, result, prepared.plan_reason, plots.data_uri(bars) if bars else None
        ),
        key=artifact_key(name, "summary"),
        description=f"Run summary of {name}",
    )
    if result.best_checkpoint_uri:
        create_link_artifact(
            link=_link(result.best_checkpoint_uri),
            link_text=result.best_checkpoint_uri,
            key=artifact_key(name, "best-checkpoint"),
            description=f"Best checkpoint of {name} "
            f"({spec.checkpoint.best_metric}, "
            f"{spec.checkpoint.best_mode})",
        )
    if result.best_model_uri:
        create_link_artifact(
            link=_link(result.best_model_uri),
            link_text=result.best_model_uri,
            key=artifact_key(name, "best-model"),
            description=f"Best checkpoint's whole model of {name}: one "
            "torch.load(path, weights_only=True) file",
        )
    if history:
        png = plots.curve_png(history, f"{name}: loss and validation metrics")
        run_dir.curve_file.write_bytes(png)
        create_image_artifact(
            image_url=plots.data_uri(png),
            key=artifact_key(name, "loss-curve"),
            description=f"Loss curve of {name}",
        )


def _link(uri: str) -> str:
    return uri if "://" in uri else f"file://{uri}"
