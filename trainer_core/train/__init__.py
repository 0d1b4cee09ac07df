"""Training inside the Ray Train workers, and the model contract.

- ``loop``: the built-in per-worker loop (epochs, validation, checkpoints, faults).
- ``steps``: one optimizer step: accumulation over micro-batches, clipping, precision.
- ``metric_rows``: each step's loss averaged across ranks off the step, published, kept for
  the next checkpoint.
- ``worker``: what every training worker shares: fault injection, errors, winding down.
- ``user_loop``: a user's own Ray Train loop, run unchanged with relaytrain's bookkeeping.
- ``preemption``: answering a drain's notice with a checkpoint.
- ``workloads``: the built-in models, losses and metrics; the import-path contract for users'.
- ``validate``: the validation metrics, one definition for the loop (a rank's pass, in step
  with the others) and for ``evaluate``.
- ``evaluate``: committed checkpoints evaluated on the holdout, on the driver.

May import: ``errors``, ``storage``, ``spec``, ``data``, ``execution``, ``checkpoint``.
"""
