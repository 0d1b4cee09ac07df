"""The Ray seam: every Ray import of relaytrain's core lives in this package.

- ``cluster``: start or connect to Ray; capacity; lost, reclaimed and draining nodes.
- ``capacity``, ``data_capacity``: whether the worker group fits the cluster, and whether
  Ray Data's reads of a Ray loop's ``datasets`` get a CPU beside it (pure decisions).
- ``trainer``: the TorchTrainer of one attempt and ``fit``, which relays the workers' events.
- ``ray_trainer``: Ray Train's TorchTrainer as relaytrain runs it (its controller's handle
  kept, no helper actors it has no use for).
- ``controller``: what Ray Train's controller process runs of relaytrain's (kept free of torch):
  the failure and scaling policies, the process-group backend, the metrics relay actor.
- ``worker_start``: how the controller starts a group's worker processes (no runtime env of
  their own unless a setting they read needs one).
- ``classify``: what fit() raised, as an error that says what the orchestrator must do.
- ``worker_api``: what a training worker asks of Ray Train (its rank, device, the model's DDP
  wrapper, a drain's notice, reports of a user's own loop).
- ``worker_config``: what the driver hands every training worker (``train_loop_config``).
- ``worker_group``: what the ranks share while they train: collectives, rank 0's relay to the
  driver, the timings it reports.

May import: ``errors``, ``storage``, ``spec``, ``data``.

This package's ``__init__`` imports nothing: Ray Train's controller unpickles classes of
``controller`` and must not import torch with them.
"""
