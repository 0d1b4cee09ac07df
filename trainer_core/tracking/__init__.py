"""What a run shows outside its directory: MLflow, TensorBoard, plots.

- ``mlflow_log``: one MLflow run per relaytrain run, continued across attempts, caught up
  when its server was away.
- ``mlflow_model``: the best checkpoint as an MLflow pytorch model.
- ``mlflow_state``: what relaytrain remembers of that MLflow run (``mlflow.json``).
- ``mlflow_server``: reaching the server without holding training up; the spec as params.
- ``tensorboard_log``: the run's TensorBoard event file from its metrics history.
- ``plots``: the loss and metric curve as PNG bytes.

May import: ``errors``, ``storage``, ``spec``, ``data``, ``execution``, ``checkpoint``,
``train``.
"""
