"""Checkpoints: the committed format, how the built-in loop saves and loads them, and what
reads them outside training.

- ``run_directory``: a run directory's layout (``RunDirectory``): its records, checkpoint
  commits with their manifests, discovery, retention applied, the lease's fence.
- ``files``: a checkpoint's name and files: digests, manifest entries, ``CheckpointInfo``.
- ``retention``: the ranking by a metric (the best checkpoint) and the retention plan.
- ``history``: the metrics history, written in segments, merged into a row per step.
- ``ray_checkpoints``: a user's own loop's checkpoints, which Ray Train names and keeps.
- ``manager``: the built-in loop's checkpoints in one object: what is saved, when, staged and
  written in the background; ``load`` through ``restore``.
- ``restore``: the newest checkpoint every rank can verify, restored into the live objects
  (whole state dicts or DCP, read once per node).
- ``staging``: stage state to memory, write it in the background.
- ``dcp_storage``: torch.distributed.checkpoint through the run's own storage.
- ``training_state``: what a checkpoint holds for resume to be exact; early stopping's state.
- ``optimizers``: the optimizer a spec names (a short name or an import path), built and
  checked.
- ``schedules``: the LR schedule: the built-in ``lr_schedule``, or a scheduler named by import
  path, stepped per step or per epoch.
- ``exports``: a model's whole weights from a checkpoint of any format.
- ``registry``: the model registry on storage (champion pointers).

May import: ``errors``, ``storage``, ``spec``, ``data``, ``execution``.
"""
