"""Training inside the Ray Train workers, and the model contract.

- ``builtin``: the built-in loop's entry point on each worker (the form's loop, its errors).
- ``loop``: the built-in per-worker loop (epochs, validation, checkpoints, faults).
- ``columns_loop``: the loop for the columns form: any model on batches of a transform.
- ``batch_workload``: the columns form's contract: the model call on a batch, summed losses
  and metrics with their counts.
- ``batch_checks``: the columns form's workload tried on a few real rows in setup.
- ``steps``: one optimizer step: accumulation over micro-batches, clipping, precision.
- ``metric_rows``: each step's loss averaged across ranks off the step, published, kept for
  the next checkpoint.
- ``faults``: the faults a spec injects, fired as each step begins.
- ``failure``: what an exception out of a worker means (a lost peer or the code's), and how
  a failing worker winds down.
- ``group_start``: where a worker group starts: its number, the checkpoints to resume from,
  this rank's stream of the pinned dataset.
- ``user_loop``: a user's own Ray Train loop, run unchanged with relaytrain's bookkeeping.
- ``loop_rng``: a user's Ray loop's RNG states, saved with its checkpoints and restored.
- ``ray_loop_data``: a user's Ray loop's torch Dataset (``dataloader``), read in the Dataset
  form's order and resumed where its checkpoint left it.
- ``own_loop``: the public API for a loop of the user's own (``train_loop_api: relaytrain``):
  the session (``session()``) a user's loop calls: setup, batches, reports.
- ``own_loop_data``: a session's data stream from its cursor, each batch's place in its
  optimizer step (``optimizer.grad_accumulation``), its validation rows.
- ``own_loop_checkpoints``: a session's restore, the optimizer steps it counts, what a
  checkpoint records and when one is due.
- ``own_loop_window``: where a session's report windows' time went, and stragglers.
- ``preemption``: answering a drain's notice with a checkpoint.
- ``workloads``: the built-in models, losses and metrics; the import-path contract for users'.
- ``validate``: the validation metrics, one definition for the loop (a rank's pass, in step
  with the others) and for ``evaluate``.
- ``evaluate``: committed checkpoints evaluated on the holdout, on the driver.

May import: ``errors``, ``storage``, ``spec``, ``data``, ``execution``, ``checkpoint``.
"""
