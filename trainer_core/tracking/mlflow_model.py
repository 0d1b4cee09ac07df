"""The best checkpoint of a run of the built-in models as an MLflow pytorch model: the module
built from the spec, the checkpoint's weights (read as data, verified) loaded into it, logged
to the run's MLflow run with the checkpoint's URI as a tag. Whether to log it (a user's own
loop, a spec read only from storage) is ``mlflow_log.Tracker``'s to decide."""

from __future__ import annotations

from trainer_core.checkpoint.run_directory import RunDirectory
from trainer_core.spec.run_spec import RunSpec


def log_checkpoint_model(
    spec: RunSpec,
    run_dir: RunDirectory,
    tracking_uri: str,
    run_id: str,
    step: int,
    checkpoint_uri: str,
) -> str:
    """Log checkpoint ``step`` (at ``checkpoint_uri``) of ``run_dir`` as the model of MLflow run
    ``run_id``; its model URI. CheckpointCorruptError or SpecError when its weights cannot be
    read as data; FileNotFoundError when it is no longer committed."""
    import mlflow.pytorch
    import torch
    from mlflow.models import Model
    from mlflow.tracking._tracking_service.utils import _use_tracking_uri

    from trainer_core.checkpoint.exports import model_weights
    from trainer_core.train import evaluate, workloads

    assert spec.model is not None and spec.data is not None
    checkpoint = run_dir.read_committed(step)
    if checkpoint is None:
        raise FileNotFoundError(f"checkpoint {checkpoint_uri} is not committed any more")
    info = evaluate.describe(spec)
    model = workloads.build_model(
        spec.model, info.num_features, info.num_outputs, spec.data.columns_form
    )
    model.load_state_dict(model_weights(run_dir, checkpoint))
    model.eval()
    with _use_tracking_uri(tracking_uri):
        logged = Model.log(
            artifact_path=None,
            name="model",
            flavor=mlflow.pytorch,
            pytorch_model=model,
            run_id=run_id,
            step=step,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            # the module pickled whole: MLflow's 'pt2' export would fix the batch size to the
            # input example's; loading needs relaytrain's workloads importable
            serialization_format="pickle",
            tags={"relaytrain.checkpoint": checkpoint_uri},
        )
    return str(logged.model_uri)
